"""Train a small Clover (block diffusion, BD3-LM / SDAR style) on CPU.

Objective: a batch of N windows of T tokens; one block size B per step (drawn from
--block-sizes); for every sequence and block, t ~ U(t_min, 1] and exactly
max(1, round(t * B)) positions of the block, drawn uniformly, become the mask token.
Block b's noisy pass reads the memory of the clean blocks < b (train/model.py). Loss:
cross-entropy on the masked positions only, averaged over all masked tokens of the batch
(no 1/t weight: the plain token mean has lower variance for a short run; the 1/t weight
of the NELBO would give blocks with few masks up to 20x the weight), plus 0.01 x the
Switch-style MoE load-balancing loss.

Reproducible from --seed (numpy PCG64 for data/masks/block sizes, torch seed for init);
resumable (--resume) from <out>/ckpt.pt: model, optimizer, step, rng state. Checkpoints
every --ckpt-every seconds; log in <out>/log.csv. --init-from starts a new stage (own seed,
warmup and cosine schedule) from the weights of an earlier run's ckpt.pt.

    nice -n 10 python -m train.train --data train/runs/data --out train/runs/default --steps 2400
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


def mask_blocks(clean: np.ndarray, B: int, mask_id: int, rng: np.random.Generator,
                t_min: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Mask max(1, round(t*B)) random positions of every block, t ~ U(t_min, 1] per block."""
    N, T = clean.shape
    nb = T // B
    t = t_min + (1.0 - t_min) * (1.0 - rng.random((N, nb)))       # (t_min, 1]
    n_mask = np.maximum(1, np.rint(t * B)).astype(np.int64)
    ranks = np.argsort(rng.random((N, nb, B)), axis=-1).argsort(axis=-1)   # random permutation ranks
    masked = (ranks < n_mask[..., None]).reshape(N, T)
    return np.where(masked, mask_id, clean), masked


def masked_loss(logits: torch.Tensor, clean: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the masked positions only (logits [N, T, V], or [n_masked, V]
    when they were computed at the masked positions only)."""
    if logits.dim() == 2:
        return F.cross_entropy(logits.float(), clean[masked])
    sel = masked.reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1])[sel].float(), clean.reshape(-1)[sel])


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
def heldout_loss(model: CloverTorch, windows: np.ndarray, B: int, mask_id: int, batch: int = 8) -> float:
    """Mean masked-token CE on held-out windows, masks from a fixed seed (same every call)."""
    rng = np.random.default_rng(EVAL_SEED)
    tot, cnt = 0.0, 0
    for s in range(0, len(windows), batch):
        clean = windows[s:s + batch]
        noisy, masked = mask_blocks(clean, B, mask_id, rng)
        sel = torch.as_tensor(masked)
        logits, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), B, select=sel)
        tot += float(F.cross_entropy(logits.float(), torch.as_tensor(clean)[sel], reduction="sum"))
        cnt += int(masked.sum())
    return tot / cnt


def optimizer_step(model: CloverTorch, opt: torch.optim.Optimizer, total: torch.Tensor, clip: float) -> None:
    """One update on the total loss, gradients clipped to norm clip (0 = off)."""
    opt.zero_grad(set_to_none=True)
    total.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def heldout_if_due(model: CloverTorch, windows: np.ndarray, cfg: CloverConfig, a: argparse.Namespace,
                   step: int) -> str:
    """The held-out loss as a log field every --eval-every steps and at the last step, else ''."""
    if a.eval_every and (step % a.eval_every == 0 or step == a.steps):
        return f"{heldout_loss(model, windows, cfg.block_size, cfg.mask_token_id):.4f}"
    return ""


def make_optimizer(model: CloverTorch, a: argparse.Namespace) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.p.items():
        (decay if p.ndim >= 2 and "conv1d" not in name and "block_calib" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=a.lr, betas=(0.9, 0.95), eps=1e-8)


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
                         ["step", "elapsed_s", "tokens_seen", "block_size", "lr", "loss", "aux", "heldout_loss"])
    losses: list[float] = []
    t_last_ck = time.time()
    t_start = time.time() - elapsed
    last = a.stop_after if a.stop_after else a.steps
    while step < last:
        B = int(rng.choice(sizes, p=probs))
        offs = rng.integers(0, len(tokens) - T, size=a.batch)
        clean = tokens[offs[:, None] + np.arange(T)[None, :]]
        noisy, masked = mask_blocks(clean, B, cfg.mask_token_id, rng, a.t_min)
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        sel = torch.as_tensor(masked)
        logits, aux = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), B, select=sel)
        loss = masked_loss(logits, torch.as_tensor(clean), sel)
        optimizer_step(model, opt, loss + AUX_WEIGHT * aux, a.clip)
        step += 1
        losses.append(loss.item())
        hl = heldout_if_due(model, windows, cfg, a, step)
        el = time.time() - t_start
        log.writerow([step, f"{el:.1f}", step * a.batch * T, B, f"{lr:.3e}", f"{loss.item():.4f}",
                      f"{aux.item():.4f}", hl])
        logf.flush()
        if step % 10 == 0 or hl:
            print(f"step {step} B={B} loss {loss.item():.4f} aux {aux.item():.3f} lr {lr:.2e} "
                  f"{el:.0f}s" + (f" heldout {hl}" if hl else ""), flush=True)
        if time.time() - t_last_ck >= a.ckpt_every or step == last:
            save_ckpt(ck, model, opt, step, rng, a, el)
            t_last_ck = time.time()
    logf.close()
    return losses


if __name__ == "__main__":
    main()
