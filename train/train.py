"""Train a small Clover (block diffusion on a causal prefix, spec v2) on CPU.

Objective (spec v2, "causal-shift": the logits at t predict the token at t+1): a batch of N
windows of T tokens; one block size B per step (drawn from --block-sizes) and one offset
o ~ U{1..B} (never 0: a decode block always has a non-empty prompt before it).

* AR loss: the clean window run causally (train/model.py's clean stream: each token a block
  of one, exactly what a commit computes); mean next-token cross-entropy over t = 0..T-2.
* Diffusion loss: decode blocks [o + bB, o + (b+1)B), b = 0..nb-2; in each, t ~ U(t_min, 1]
  and exactly max(1, round(t * B)) positions, drawn uniformly (the block start included),
  become the mask token; each block is a block pass against the clean memory before it.
  For every masked q after the block start p, the noisy logits at q-1 predict clean[q]
  (q = p is the clean stream's prediction at p-1, in the AR loss). Mean cross-entropy over
  those positions (no 1/t weight: the plain token mean has lower variance for a short run).
* Total: AR + diffusion + 0.01 x the Switch-style MoE load-balancing loss. log.csv: loss =
  AR + diffusion, ar_loss, diff_loss; held-out (every --eval-every steps, B = B0, fixed
  offsets and masks): heldout_ar, heldout_loss (the diffusion loss).

Reproducible from --seed (numpy PCG64 for data/masks/block sizes, torch seed for init);
resumable (--resume) from <out>/ckpt.pt: model, optimizer, step, rng state. Checkpoints
every --ckpt-every seconds; log in <out>/log.csv. --init-from starts a new stage (own seed,
warmup and cosine schedule) from the weights of an earlier run's ckpt.pt; --init-hf from a
Hugging Face checkpoint folder (e.g. the model trained for the retired in-place semantics).

    nice -n 10 python -m train.train --data train/runs/data --out train/runs/causal \
        --init-hf models/clover-default --steps 1000 --batch 16 --lr 1e-3 --warmup 30
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clover_testkit.reference import CloverConfig
from train.args import add_optimizer_args
from train.model import CloverTorch

PRESETS = {
    # the default model: 4 layers (3 GDN + 1 full attention), 8 experts top-2
    "default": dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, full_attention_interval=4,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, linear_conv_kernel_dim=4, linear_conv_lookahead=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    partial_rotary_factor=0.25, rope_theta=10000.0, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256, norm_topk_prob=True, rms_norm_eps=1e-6,
                    block_size=32, mask_token_id=4095, eos_token_id=4092, tie_word_embeddings=False),
    # for tests
    "test": dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, full_attention_interval=2,
                 linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_conv_kernel_dim=4, linear_conv_lookahead=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5,
                 rope_theta=10000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                 shared_expert_intermediate_size=8, block_size=8, mask_token_id=49, eos_token_id=48),
}
AUX_WEIGHT = 0.01
EVAL_SEED = 1234


def mask_blocks(clean: np.ndarray, B: int, offset: int, mask_id: int, rng: np.random.Generator,
                t_min: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Mask the decode blocks [offset + bB, offset + (b+1)B), b = 0..nb-2, of every window:
    max(1, round(t*B)) random positions per block (its start included), t ~ U(t_min, 1] per
    block. Positions outside the blocks (before offset, after the last block) stay clean."""
    N, T = clean.shape
    nbn = T // B - 1
    t = t_min + (1.0 - t_min) * (1.0 - rng.random((N, nbn)))     # (t_min, 1]
    n_mask = np.maximum(1, np.rint(t * B)).astype(np.int64)
    ranks = np.argsort(rng.random((N, nbn, B)), axis=-1).argsort(axis=-1)   # random permutation ranks
    masked = np.zeros((N, T), dtype=bool)
    masked[:, offset:offset + nbn * B] = (ranks < n_mask[..., None]).reshape(N, nbn * B)
    return np.where(masked, mask_id, clean), masked


def diffusion_select(masked: np.ndarray, B: int, offset: int) -> np.ndarray:
    """The positions whose noisy logits are trained: q - 1 for every masked q that is not a
    block start (q > p; the logits at q - 1 predict clean[q]). q = p is the clean stream's
    (autoregressive) prediction, covered by the AR loss."""
    starts = np.zeros(masked.shape[1], dtype=bool)
    starts[offset::B] = True
    target = masked & ~starts
    sel = np.zeros_like(masked)
    sel[:, :-1] = target[:, 1:]
    return sel


def ar_loss(clean_logits: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the clean (causal) stream: logits at t vs clean[t+1]."""
    V = clean_logits.shape[-1]
    return F.cross_entropy(clean_logits[:, :-1].reshape(-1, V).float(), clean[:, 1:].reshape(-1))


def masked_loss(logits: torch.Tensor, clean: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the noisy logits at the selected positions (diffusion_select: q - 1)
    against the next clean token (clean[q]). logits: [n_selected, V] (forward_train with
    select=sel)."""
    if sel[:, -1].any():
        raise ValueError("the last position has no next token")
    if logits.shape[0] == 0:          # every masked position was a block start
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), clean[:, 1:][sel[:, :-1]])


def train_losses(model: CloverTorch, clean: np.ndarray, B: int, offset: int, mask_id: int,
                 rng: np.random.Generator, t_min: float = 0.05):
    """(AR loss, diffusion loss, aux) of one batch of clean windows: masks drawn from rng."""
    noisy, masked = mask_blocks(clean, B, offset, mask_id, rng, t_min)
    sel = torch.as_tensor(diffusion_select(masked, B, offset))
    ct = torch.as_tensor(clean)
    cl, nl, aux = model.forward_train(ct, torch.as_tensor(noisy), B, offset, select=sel)
    return ar_loss(cl, ct), masked_loss(nl, ct, sel), aux


def parse_block_sizes(s: str) -> tuple[list[int], list[float]]:
    sizes, probs = [], []
    for part in s.split(","):
        b, _, p = part.partition(":")
        sizes.append(int(b))
        probs.append(float(p) if p else 1.0)
    tot = sum(probs)
    return sizes, [p / tot for p in probs]


def lr_at(step: int, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def heldout_windows(data: Path, T: int, max_windows: int) -> np.ndarray:
    held = np.load(data / "heldout.npy").astype(np.int64)
    n = len(held) // T
    w = held[: n * T].reshape(n, T)
    if n > max_windows:
        w = w[np.linspace(0, n - 1, max_windows).round().astype(int)]
    return w


@torch.no_grad()
def heldout_loss(model: CloverTorch, windows: np.ndarray, B: int, mask_id: int, batch: int = 8
                 ) -> tuple[float, float]:
    """(AR loss, diffusion loss) on held-out windows: the mean next-token CE of the clean
    (causal) stream over every position, and the mean CE of the block passes' next-token
    predictions at the masked positions after each block start; offsets and masks from a
    fixed seed (the same every call)."""
    rng = np.random.default_rng(EVAL_SEED)
    ar = dl = 0.0
    n_ar = n_dl = 0
    for s in range(0, len(windows), batch):
        clean = windows[s:s + batch]
        offset = int(rng.integers(1, B + 1))
        noisy, masked = mask_blocks(clean, B, offset, mask_id, rng)
        sel = diffusion_select(masked, B, offset)
        ct = torch.as_tensor(clean)
        cl, nl, _ = model.forward_train(ct, torch.as_tensor(noisy), B, offset, select=torch.as_tensor(sel))
        ar += float(F.cross_entropy(cl[:, :-1].reshape(-1, cl.shape[-1]).float(), ct[:, 1:].reshape(-1),
                                    reduction="sum"))
        n_ar += ct[:, 1:].numel()
        dl += float(F.cross_entropy(nl.float(), ct[:, 1:][torch.as_tensor(sel[:, :-1])], reduction="sum"))
        n_dl += int(sel.sum())
    return ar / n_ar, dl / max(1, n_dl)


def optimizer_step(model: CloverTorch, opt: torch.optim.Optimizer, total: torch.Tensor, clip: float) -> None:
    """One update on the total loss, gradients clipped to norm clip (0 = off)."""
    opt.zero_grad(set_to_none=True)
    total.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def heldout_if_due(model: CloverTorch, windows: np.ndarray, cfg: CloverConfig, a: argparse.Namespace,
                   step: int) -> tuple[str, str]:
    """The held-out (AR, diffusion) losses as log fields every --eval-every steps and at the
    last step, else ('', '')."""
    if a.eval_every and (step % a.eval_every == 0 or step == a.steps):
        ar, dl = heldout_loss(model, windows, cfg.block_size, cfg.mask_token_id)
        return f"{ar:.4f}", f"{dl:.4f}"
    return "", ""


ADAMW = dict(betas=(0.9, 0.95), eps=1e-8)  # every optimizer of train/ (train.distill's too)


def make_optimizer(model: CloverTorch, a: argparse.Namespace) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.p.items():
        (decay if p.ndim >= 2 and "conv1d" not in name and "block_calib" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, **ADAMW)


def save_ckpt(path: Path, model, opt, step: int, rng: np.random.Generator, a, elapsed: float) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                "args": vars(a), "config": model.cfg.to_dict(), "elapsed": elapsed}, tmp)
    os.replace(tmp, path)


def load_ckpt(path: Path, model, opt, rng: np.random.Generator) -> tuple[int, float]:
    """Restore save_ckpt's model, optimizer and rng states; (step, elapsed seconds)."""
    st = torch.load(path, weights_only=False)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    rng.bit_generator.state = st["rng"]
    torch.set_rng_state(st["torch_rng"])
    print(f"resumed from {path} at step {st['step']}", flush=True)
    return st["step"], st.get("elapsed", 0.0)


def open_log(path: Path, resume: bool, step: int, header: list[str]):
    """(file, csv writer) of a run's log; on resume, rows logged after the checkpoint's step
    by a run that was killed are dropped first."""
    new = not (resume and path.is_file())
    if not new:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(r for r in rows if not r[0].isdigit() or int(r[0]) <= step)
    logf = open(path, "w" if new else "a", newline="")
    log = csv.writer(logf)
    if new:
        log.writerow(header)
    return logf, log


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="train/runs/data")
    ap.add_argument("--out", default="train/runs/default")
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2400, help="total optimizer steps (sets the cosine schedule)")
    ap.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) after this step")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--block-sizes", default="4:0.1,8:0.15,16:0.25,32:0.5",
                    help="block sizes and their probabilities, one per step")
    ap.add_argument("--t-min", type=float, default=0.05)
    add_optimizer_args(ap, lr=2e-3, warmup=100, threads=1)
    ap.add_argument("--init-from", default="",
                    help="start from the weights of this ckpt.pt (fresh optimizer and schedule): "
                         "a second stage after an earlier run")
    ap.add_argument("--init-hf", default="",
                    help="start from the weights of this Hugging Face checkpoint folder (e.g. "
                         "models/clover-default; same shapes as --preset), fresh optimizer and schedule")
    return ap


def run_argv(args: dict, keep: tuple[str, ...] = ()) -> list[str]:
    """Command-line arguments that recreate a run's args.json: every option that differs from
    its default, and those named in `keep`. Never --resume (a resumed run logs and ends as
    an uninterrupted one)."""
    defaults = vars(build_parser().parse_args([]))
    out: list[str] = []
    for k, v in args.items():
        if k == "resume" or k not in defaults or (v == defaults[k] and k not in keep):
            continue
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def main(argv: list[str] | None = None) -> list[float]:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    out, data = Path(a.out), Path(a.data)
    out.mkdir(parents=True, exist_ok=True)
    cfg = CloverConfig.from_dict(PRESETS[a.preset])
    torch.manual_seed(a.seed)
    model = CloverTorch(cfg, seed=a.seed)
    opt = make_optimizer(model, a)
    rng = np.random.default_rng(a.seed)
    step, elapsed = 0, 0.0
    ck = out / "ckpt.pt"
    if a.init_from and not (a.resume and ck.is_file()):
        model.load_state_dict(torch.load(a.init_from, weights_only=False)["model"])
        print(f"weights from {a.init_from}", flush=True)
    if a.init_hf and not (a.resume and ck.is_file()):
        from clover_convert.safetensors_io import CheckpointReader
        with CheckpointReader(a.init_hf) as rd:
            model.load_hf({n: rd.read_f32(n) for n in rd.names()})
        print(f"weights from {a.init_hf}", flush=True)
    if a.resume and ck.is_file():
        step, elapsed = load_ckpt(ck, model, opt, rng)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    (out / "args.json").write_text(json.dumps(vars(a), indent=1) + "\n")
    tokens = np.load(data / "train.npy").astype(np.int64)
    sizes, probs = parse_block_sizes(a.block_sizes)
    T = a.seq_len
    if any(T % b for b in sizes):
        raise SystemExit("--seq-len must be a multiple of every block size")
    windows = heldout_windows(data, T, a.eval_windows)
    logf, log = open_log(out / "log.csv", a.resume, step,
                         ["step", "elapsed_s", "tokens_seen", "block_size", "lr", "loss", "aux", "heldout_loss",
                          "offset", "ar_loss", "diff_loss", "heldout_ar"])
    losses: list[float] = []
    t_last_ck = time.time()
    t_start = time.time() - elapsed
    last = a.stop_after if a.stop_after else a.steps
    while step < last:
        B = int(rng.choice(sizes, p=probs))
        offset = int(rng.integers(1, B + 1))
        offs = rng.integers(0, len(tokens) - T, size=a.batch)
        clean = tokens[offs[:, None] + np.arange(T)[None, :]]
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        ar, dl, aux = train_losses(model, clean, B, offset, cfg.mask_token_id, rng, a.t_min)
        loss = ar + dl
        optimizer_step(model, opt, loss + AUX_WEIGHT * aux, a.clip)
        step += 1
        losses.append(loss.item())
        h_ar, h_dl = heldout_if_due(model, windows, cfg, a, step)
        el = time.time() - t_start
        log.writerow([step, f"{el:.1f}", step * a.batch * T, B, f"{lr:.3e}", f"{loss.item():.4f}",
                      f"{aux.item():.4f}", h_dl, offset, f"{ar.item():.4f}", f"{dl.item():.4f}", h_ar])
        logf.flush()
        if step % 10 == 0 or h_ar:
            print(f"step {step} B={B} o={offset} ar {ar.item():.4f} diff {dl.item():.4f} aux {aux.item():.3f} "
                  f"lr {lr:.2e} {el:.0f}s" + (f" heldout ar {h_ar} diff {h_dl}" if h_ar else ""), flush=True)
        if time.time() - t_last_ck >= a.ckpt_every or step == last:
            save_ckpt(ck, model, opt, step, rng, a, el)
            t_last_ck = time.time()
    logf.close()
    return losses


if __name__ == "__main__":
    main()
