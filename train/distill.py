"""Self-distillation: make a Clover confident where its own greedy answer is determined.

1. ``trajectories``: prompts cut from the *training* split, continued greedily at B = 1 by
   the native engine (libclover): the model's own deterministic answers.
2. ``finetune``: train/train.py's objective (spec v2: the AR loss of the causal clean stream
   plus the diffusion loss of decode blocks at a random offset, t ~ U(t_min, 1] of each block
   masked, each block denoised against the clean memory before it, the logits at q-1
   predicting the masked q) on a mix of trajectory windows and original data windows, plus a
   certainty term on the trajectory windows (as in dParallel's certainty forcing): on the
   masked positions the model already predicts correctly (argmax = the target), the entropy
   of its prediction is minimised, so that what it gets right it also says with confidence.
   With ``--rounds N`` the training is on-policy: at the start of each round after the first,
   the current weights are exported and make a new trajectory set (the model moves, and its
   own B = 1 answers move with it); a block size of 1 in ``--block-sizes`` trains the B = 1
   prediction on the trajectories too, so that the sequential answer stays the one the
   parallel decode is taught. ``--draft-frac`` makes a share of the steps draft-self's task
   (blocks of ``--draft-block`` masked whole: every position drafted in one pass, scored by
   whether its argmax is the B = 1 token), and ``--kl`` adds KL(causal || block pass) on the
   trajectory rows, so that the block pass learns the B = 1 distribution, not only its argmax.

Deterministic from --seed (numpy PCG64 for prompts / data / masks, torch seed); resumable
(--resume) from <out>/ckpt.pt; a log in <out>/log.csv with the held-out masked-token loss.
train.export turns the run into an HF checkpoint (models/clover-default).

    python -m train.distill trajectories --model models/clover-default --data train/runs/data \\
        --out train/runs/traj --prompts 512
    python -m train.distill finetune --init models/clover-default --traj train/runs/traj \\
        --data train/runs/data --out train/runs/distill --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from train.args import add_optimizer_args

PROMPT_LEN = 64
NEW_TOKENS = 128


def _progress(done: int, total: int, t0: float, what: str) -> None:
    """A one-line progress bar on stderr."""
    frac = done / max(total, 1)
    el = time.time() - t0
    eta = el / frac - el if frac > 0 else 0.0
    bar = "#" * int(30 * frac)
    sys.stderr.write(f"\r{what} [{bar:<30}] {done}/{total} {el:.0f}s eta {eta:.0f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------- 1. trajectories
def trajectories(model: Path, data: Path, out: Path, n_prompts: int, seed: int, threads: int) -> Path:
    """Greedy B = 1 continuations (NEW_TOKENS, EOS ignored) of n_prompts windows of PROMPT_LEN
    tokens from the training split; saved as int16 [n, PROMPT_LEN + NEW_TOKENS] in out/traj.npy
    (resumable: finished rows are kept in out/traj.partial.npy)."""
    from clover_convert import convert
    from clover_cpp import Clover

    out.mkdir(parents=True, exist_ok=True)
    gguf = out / "model-f32.gguf"
    if not gguf.is_file():
        convert(str(model), str(gguf), outtype="f32", force=True, progress=False)
    tokens = np.load(data / "train.npy")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - PROMPT_LEN, size=n_prompts)
    part = out / "traj.partial.npy"
    rows = list(np.load(part)) if part.is_file() else []
    t0 = time.time()
    with Clover(gguf, n_ctx=PROMPT_LEN + NEW_TOKENS + 64, n_threads=threads, block_size=1) as m:
        for i in range(len(rows), n_prompts):
            prompt = tokens[starts[i]:starts[i] + PROMPT_LEN].astype(int).tolist()
            r = m.generate(prompt, max_tokens=NEW_TOKENS, block_size=1, stop_at_eos=False)
            rows.append(np.asarray(prompt + r.tokens, dtype=np.int16))
            if (i + 1) % 32 == 0 or i + 1 == n_prompts:
                np.save(part, np.stack(rows))
            _progress(i + 1, n_prompts, t0, "trajectories")
    arr = np.stack(rows)
    np.save(out / "traj.npy", arr)
    (out / "meta.json").write_text(json.dumps({"model": str(model), "prompts": n_prompts, "seed": seed,
                                               "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                                               "seconds": round(time.time() - t0, 1)}, indent=1) + "\n")
    part.unlink(missing_ok=True)
    return out / "traj.npy"


# ----------------------------------------------------------------------------- 2. fine-tuning
def certainty_loss(logits, target):
    """Mean entropy of the predictions that are already right (dParallel's certainty forcing)."""
    import torch

    right = logits.argmax(-1) == target
    if not bool(right.any()):
        return logits.new_zeros(())
    logp = torch.log_softmax(logits[right], -1)
    return -(logp.exp() * logp).sum(-1).mean()


def order_loss(logits, target, block_of: np.ndarray, is_first: np.ndarray, margin: float = 0.05):
    """Confidence in decoding order, on suffix-masked blocks: a later masked position whose
    candidate is wrong must be less sure of it than the block's first masked position (the
    sequential prediction) is of its target, by a margin. When no position reaches the
    threshold, the decode unmasks the most confident one; this makes that the first one, the
    step a sequential decode would take, unless a later one is right.
    logits [M, V] and target [M] at the masked positions; block_of [M] the block of each
    (-1: not taking part); is_first [M] the block's first masked position."""
    import torch

    is_first = is_first & (block_of >= 0)
    fidx = np.full(int(block_of.max()) + 1 if len(block_of) else 0, -1)
    fidx[block_of[is_first]] = np.nonzero(is_first)[0]
    later = (block_of >= 0) & ~is_first
    if not later.any():
        return logits.new_zeros(())
    p = torch.softmax(logits.float(), -1)
    conf, pred = p.max(-1)
    p_first = p.gather(1, target[:, None])[:, 0][torch.as_tensor(fidx[block_of[later]])]
    wrong = (pred[later] != target[later]).float()
    return (torch.relu(conf[later] - p_first + margin) * wrong).sum() / max(1, int(later.sum()))


def curriculum(sizes: list[int], probs: list[float], t_min: float, frac: float
               ) -> tuple[list[int], list[float], float]:
    """The block sizes (with their renormalised probabilities) and the masked-share floor at
    training progress frac in [0, 1]: easy (small blocks, few masks allowed) first, the full task
    from half-way on (d3LLM's progressive window and noise schedule)."""
    ramp = min(1.0, 2.0 * frac)
    cap = min(sizes) * (max(sizes) / min(sizes)) ** ramp
    keep = [i for i, b in enumerate(sizes) if b <= cap * (1 + 1e-9)]
    tot = sum(probs[i] for i in keep)
    return [sizes[i] for i in keep], [probs[i] / tot for i in keep], 0.05 + (t_min - 0.05) * ramp


def mask_suffix(clean: np.ndarray, B: int, offset: int, mask_id: int, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """Mask the last n ~ U{1..B} positions of every decode block [offset + bB, offset + (b+1)B),
    b = 0..nb-2 (train.mask_blocks' blocks): the block's known tokens are a prefix, as when a
    decode agrees with the sequential one (the first masked position is then the B = 1
    prediction, and the model learns how sure it may be of the ones after it)."""
    N, T = clean.shape
    nbn = T // B - 1
    n_mask = rng.integers(1, B + 1, size=(N, nbn))
    masked = np.zeros((N, T), dtype=bool)
    masked[:, offset:offset + nbn * B] = (np.arange(B)[None, None, :] >= B - n_mask[..., None]).reshape(N, nbn * B)
    return np.where(masked, mask_id, clean), masked


def mask_whole(clean: np.ndarray, B: int, offset: int, mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Mask every decode block (mask_suffix's blocks) whole: a draft-self draft, all B positions
    drafted in one pass after the committed text."""
    N, T = clean.shape
    masked = np.zeros((N, T), dtype=bool)
    masked[:, offset:offset + (T // B - 1) * B] = True
    return np.where(masked, mask_id, clean), masked


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trajectories", help="greedy B = 1 continuations of training prompts")
    t.add_argument("--model", default="models/clover-default")
    t.add_argument("--data", default="train/runs/data")
    t.add_argument("--out", default="train/runs/traj")
    t.add_argument("--prompts", type=int, default=512)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2)
    f = sub.add_parser("finetune", help="block-diffusion fine-tuning on trajectories + data, certainty term")
    f.add_argument("--init", default="models/clover-default", help="HF checkpoint folder to start from")
    f.add_argument("--traj", default="train/runs/traj")
    f.add_argument("--data", default="train/runs/data")
    f.add_argument("--out", default="train/runs/distill")
    f.add_argument("--seed", type=int, default=3)
    f.add_argument("--steps", type=int, default=600, help="total optimizer steps (sets the cosine schedule)")
    f.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) after this step")
    f.add_argument("--batch", type=int, default=8)
    f.add_argument("--traj-frac", type=float, default=0.5, help="share of each batch from the trajectories")
    f.add_argument("--certainty", type=float, default=0.5, help="weight of the certainty term")
    f.add_argument("--block-sizes", default="16:0.3,32:0.7")
    f.add_argument("--t-min", type=float, default=0.3, help="trajectory blocks: most positions masked")
    f.add_argument("--traj-mask", choices=("random", "suffix"), default="random",
                   help="trajectory blocks: random positions masked (as train.train), or a suffix of "
                        "each block, the states a left-to-right consistent decode passes through")
    f.add_argument("--order", type=float, default=0.0,
                   help="weight of the decoding-order term (order_loss; with --traj-mask suffix)")
    f.add_argument("--draft-frac", type=float, default=0.0,
                   help="share of steps that train draft-self's draft: block size --draft-block, every "
                        "trajectory block wholly masked (the state of a draft made in one pass)")
    f.add_argument("--draft-block", type=int, default=8)
    f.add_argument("--kl", type=float, default=0.0,
                   help="weight of KL(causal || block pass) on the trajectory rows' masked positions: the "
                        "block pass learns the B = 1 distribution, not only its argmax")
    f.add_argument("--rounds", type=int, default=1,
                   help="on-policy rounds: the trajectories are made again from the current weights "
                        "at the start of every round after the first (steps / rounds each)")
    f.add_argument("--round-prompts", type=int, default=512, help="prompts per regenerated trajectory set")
    f.add_argument("--curriculum", action="store_true",
                   help="progressive schedule: over the first half of the steps the largest block size "
                        "grows from the smallest of --block-sizes to the largest, and the least masked "
                        "share of a trajectory block from 0.05 to --t-min")
    f.add_argument("--ar-rows", choices=("all", "data"), default="all",
                   help="rows whose causal next-token loss is trained: all of the batch, or only the "
                        "real-text rows (the anchor that keeps B = 1 a model of real text, not of its own "
                        "greedy loops)")
    f.add_argument("--train-only", choices=("all", "block"), default="all",
                   help="parameters trained: all, or only those a block pass reads and a commit never "
                        "does (block_only_parameters, the canvas FFN among them): B = 1 output and "
                        "perplexity stay bit-identical")
    f.add_argument("--canvas-ffn", type=int, default=0,
                   help="give the model a canvas FFN of this width (spec/model.md): added when --init has "
                        "none, widened when --init's is narrower; what is new starts as no change "
                        "(down_proj = 0)")
    add_optimizer_args(f, lr=5e-4, warmup=20, threads=2)
    return ap


def block_only_parameters(model, mask_id: int) -> list:
    """Freeze all but what only a block pass reads (spec/model.md), and return those: the GDN
    look-ahead taps (a commit sees nothing ahead), the canvas FFN when the model has one (block-pass
    rows only), the block softmax's calibration theta, phi
    (a commit's block of one gives o_blk = v whatever tau is) and the mask token's embedding row
    (commits hold real tokens; the other rows' gradient is zeroed). The causal path, hence the
    B = 1 output and the perplexity, stays bit-identical."""
    import torch

    trained = []
    for name, p in model.p.items():
        block = name.endswith(("conv1d_lookahead__weight", "block_calib")) or "__canvas_ffn__" in name
        if name == "model__embed_tokens__weight":
            row = torch.zeros(p.shape[0], 1)
            row[mask_id] = 1.0
            p.register_hook(lambda g, row=row: g * row)
            block = True
        p.requires_grad_(block)
        if block:
            trained.append(p)
    return trained


def finetune(a: argparse.Namespace) -> list[float]:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from clover_testkit.reference import CloverConfig
    from train.model import CloverTorch
    from train.train import (ADAMW, AUX_WEIGHT, ar_loss, diffusion_select, heldout_if_due, heldout_loss,
                             heldout_windows, load_ckpt, lr_at, make_optimizer, mask_blocks, masked_loss,
                             open_log, optimizer_step, parse_block_sizes, save_ckpt)

    torch.set_num_threads(a.threads)
    out, data, init = Path(a.out), Path(a.data), Path(a.init)
    out.mkdir(parents=True, exist_ok=True)
    cfg = CloverConfig.from_dict(json.loads((init / "config.json").read_text()))
    if a.canvas_ffn:
        if a.canvas_ffn < cfg.canvas_ffn_intermediate_size:
            raise SystemExit(f"error: --canvas-ffn {a.canvas_ffn} is narrower than --init's canvas FFN "
                             f"({cfg.canvas_ffn_intermediate_size}); it can only grow")
        cfg = dataclasses.replace(cfg, canvas_ffn_intermediate_size=a.canvas_ffn)
    torch.manual_seed(a.seed)
    model = CloverTorch(cfg, seed=a.seed)
    model.load_hf({k: v.float() for k, v in load_file(str(init / "model.safetensors")).items()},
                  grow_canvas_ffn=True)
    if a.train_only == "block":
        # no weight decay: it would shrink the embedding's real-token rows too
        opt = torch.optim.AdamW(block_only_parameters(model, cfg.mask_token_id), lr=a.lr, weight_decay=0.0,
                                **ADAMW)
    else:
        opt = make_optimizer(model, a)
    rng = np.random.default_rng(a.seed)
    step, elapsed = 0, 0.0
    ck = out / "ckpt.pt"
    if a.resume and ck.is_file():
        step, elapsed = load_ckpt(ck, model, opt, rng)
    (out / "config.json").write_text(run_config_json(init, cfg))
    (out / "args.json").write_text(json.dumps(vars(a), indent=1) + "\n")
    rounds = max(1, a.rounds)
    round_len = -(-a.steps // rounds)
    traj = load_round_traj(a, out, step // round_len)
    tokens = np.load(data / "train.npy").astype(np.int64)
    T = traj.shape[1]
    sizes, probs = parse_block_sizes(a.block_sizes)
    if any(T % b for b in sizes):
        raise SystemExit(f"trajectory length {T} must be a multiple of every block size")
    windows = heldout_windows(data, 256, a.eval_windows)
    logf, log = open_log(out / "log.csv", a.resume, step,
                         ["step", "elapsed_s", "block_size", "lr", "loss", "certainty", "aux", "heldout_loss",
                          "offset", "ar_loss", "heldout_ar"])
    if step == 0:
        h_ar, h0 = heldout_loss(model, windows, cfg.block_size, cfg.mask_token_id)
        log.writerow([0, "0.0", "", "", "", "", "", f"{h0:.4f}", "", "", f"{h_ar:.4f}"])
        print(f"step 0 heldout ar {h_ar:.4f} diff {h0:.4f}", flush=True)
    n_traj = max(1, int(round(a.batch * a.traj_frac)))
    n_data = a.batch - n_traj
    losses: list[float] = []
    t_last_ck, t_start = time.time(), time.time() - elapsed
    last = a.stop_after if a.stop_after else a.steps
    while step < last:
        if step and step % round_len == 0 and step // round_len < rounds:
            # on-policy: the next round trains on what the current weights generate
            save_ckpt(ck, model, opt, step, rng, a, time.time() - t_start)
            traj = load_round_traj(a, out, step // round_len)
        now_sizes, now_probs, t_min = (curriculum(sizes, probs, a.t_min, step / a.steps) if a.curriculum
                                       else (sizes, probs, a.t_min))
        draft_step = a.draft_frac > 0 and rng.random() < a.draft_frac
        B = a.draft_block if draft_step else int(rng.choice(now_sizes, p=now_probs))
        offset = int(rng.integers(1, B + 1))
        rows = traj[rng.integers(0, len(traj), size=n_traj)]
        offs = rng.integers(0, len(tokens) - T, size=n_data)
        clean = np.concatenate([rows, tokens[offs[:, None] + np.arange(T)[None, :]]], 0)
        noisy, masked = mask_blocks(clean, B, offset, cfg.mask_token_id, rng, t_min)
        if a.traj_mask == "suffix":
            noisy[:n_traj], masked[:n_traj] = mask_suffix(clean[:n_traj], B, offset, cfg.mask_token_id, rng)
        if draft_step:
            noisy[:n_traj], masked[:n_traj] = mask_whole(clean[:n_traj], B, offset, cfg.mask_token_id)
        sel_np = diffusion_select(masked, B, offset)   # q - 1 for the masked q after each block start
        is_traj = np.zeros_like(masked)
        is_traj[:n_traj] = True
        lr = lr_at(step, argparse.Namespace(steps=a.steps, warmup=a.warmup, lr=a.lr, min_lr_frac=a.min_lr_frac))
        for g in opt.param_groups:
            g["lr"] = lr
        sel = torch.as_tensor(sel_np)
        ct = torch.as_tensor(clean)
        clean_logits, logits, aux = model.forward_train(ct, torch.as_tensor(noisy), B, offset, select=sel)
        target = ct[:, 1:][sel[:, :-1]]
        dl = masked_loss(logits, ct, sel)
        # the trajectories teach the block passes; the causal path's loss stays on real text when asked
        ar = ar_loss(clean_logits, ct) if a.ar_rows == "all" or n_data == 0 else \
            ar_loss(clean_logits[n_traj:], ct[n_traj:])
        loss = ar + dl
        on_traj = torch.as_tensor(is_traj)[sel]
        cert = certainty_loss(logits[on_traj], target[on_traj])
        total = loss + a.certainty * cert + AUX_WEIGHT * aux
        if a.kl:   # KL(causal || block pass), the causal logits a fixed teacher
            teacher = torch.log_softmax(clean_logits[sel][on_traj].detach().float(), -1)
            student = torch.log_softmax(logits[on_traj].float(), -1)
            total = total + a.kl * F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        if a.order:
            r, c = np.nonzero(sel_np)   # the logits' rows: position c predicts the masked c + 1
            q = c + 1
            blk = (q - offset) // B
            is_first = ~masked[r, q - 1]   # the block's first masked position after its start
            block_of = np.where(r < n_traj, r * (T // B) + blk, -1)
            has_first = np.zeros(n_traj * (T // B) + 1, dtype=bool)
            has_first[block_of[is_first & (block_of >= 0)]] = True
            block_of = np.where((block_of >= 0) & has_first[block_of], block_of, -1)
            total = total + a.order * order_loss(logits, target, block_of, is_first)
        optimizer_step(model, opt, total, a.clip)
        step += 1
        losses.append(loss.item())
        h_ar, hl = heldout_if_due(model, windows, cfg, a, step)
        el = time.time() - t_start
        log.writerow([step, f"{el:.1f}", B, f"{lr:.3e}", f"{loss.item():.4f}", f"{cert.item():.4f}",
                      f"{aux.item():.4f}", hl, offset, f"{ar.item():.4f}", h_ar])
        logf.flush()
        if step % 10 == 0 or hl:
            print(f"step {step} B={B} o={offset} ar {ar.item():.4f} diff {dl.item():.4f} certainty {cert.item():.3f} "
                  f"lr {lr:.2e} {el:.0f}s" + (f" heldout ar {h_ar} diff {hl}" if hl else ""), flush=True)
        if time.time() - t_last_ck >= a.ckpt_every or step == last:
            save_ckpt(ck, model, opt, step, rng, a, el)
            t_last_ck = time.time()
    logf.close()
    return losses


def load_round_traj(a: argparse.Namespace, out: Path, r: int) -> np.ndarray:
    """Round r's trajectories: --traj for round 0; later rounds' are made from the run's
    checkpoint (out/ckpt.pt) at the round's first step, in out/round<r>/, kept there so that a
    resumed run reuses them."""
    if r == 0:
        return np.load(Path(a.traj) / "traj.npy").astype(np.int64)
    d = out / f"round{r}"
    if not (d / "traj" / "traj.npy").is_file():
        export_weights(out, Path(a.init), d / "model")
        print(f"round {r}: trajectories from the current weights", flush=True)
        trajectories(d / "model", Path(a.data), d / "traj", a.round_prompts, a.seed + r, a.threads)
    return np.load(d / "traj" / "traj.npy").astype(np.int64)


# ----------------------------------------------------------------------------- 3. export + quick check
def run_config_json(init: Path, cfg) -> str:
    """init's config.json, with the run's canvas FFN width when it added one."""
    d = json.loads((init / "config.json").read_text())
    if cfg.canvas_ffn_intermediate_size:
        d["canvas_ffn_intermediate_size"] = cfg.canvas_ffn_intermediate_size
    return json.dumps(d, indent=2) + "\n"


def export_weights(run: Path, init: Path, out: Path) -> None:
    """The run's weights as an HF checkpoint (matrices bf16, the rest f32, as train.export),
    tokenizer / generation config copied from the checkpoint it started from, its config.json
    with the run's canvas FFN width (run_config_json)."""
    import shutil

    from train.export import load_run, write_weights

    model = load_run(run)[0]
    config = run_config_json(init, model.cfg)
    write_weights(model, out)
    (out / "config.json").write_text(config)
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (init / f).is_file() and init.resolve() != out.resolve():
            shutil.copyfile(init / f, out / f)


def quick_eval(model: Path, data: Path, work: Path, threads: int, new: int = 128) -> dict:
    """On the held-out prompts (first 64 tokens of each held-out file), greedy, threshold 0.9:
    tokens per forward (generated / the forwards after the prompt's), agreement with the same
    model's B = 1 output and tokens/s at B = 4, 8, 16, 32; draft-self (whose output is B = 1's)
    at B = 4, 8, 16: tokens per verification, accepted share of the drafts, tokens/s; B = 1's
    tokens/s, each the fastest of 2 runs."""
    import time

    from clover_convert import convert
    from clover_cpp import Clover
    from train.evaluate import prompts

    work.mkdir(parents=True, exist_ok=True)
    gguf = work / f"{model.name}-f16.gguf"
    convert(str(model), str(gguf), outtype="f16", force=True, progress=False)
    ps = prompts(data, 8, PROMPT_LEN)
    res = {}
    with Clover(gguf, n_ctx=512, n_threads=threads) as m:
        def runs(**kw):
            best, out = float("inf"), None
            for _ in range(2):
                t0 = time.perf_counter()
                rs = [m.generate(p, max_tokens=new, stop_at_eos=False, reuse_prefix=False, **kw) for p in ps]
                dt = sum(r.stats.t_decode_ms for r in rs) / 1e3
                if dt < best:
                    best, out = dt, rs
            return out, sum(len(r.tokens) for r in out) / best

        base, tps1 = runs(block_size=1)
        res["B1"] = {"tok_s": tps1}
        n_total = sum(len(r.tokens) for r in base)
        for B in (4, 8, 16, 32):
            rs, tps = runs(block_size=B, threshold=0.9)
            same = sum(int(np.sum(np.asarray(r.tokens) == np.asarray(b.tokens))) for r, b in zip(rs, base))
            res[f"B{B}"] = {"tpf": n_total / sum(r.stats.n_decode_forwards for r in rs), "agree": same / n_total,
                            "tok_s": tps, "vs_B1": tps / tps1}
        for B in (4, 8, 16):
            rs, tps = runs(block_size=B, threshold=0.9, draft_self=True)
            # B = 1's output up to float near-ties (a batched commit rounds differently from one-by-one ones)
            res[f"draft_self_B{B}"] = {"same_output": sum(r.tokens == b.tokens for r, b in zip(rs, base)) / len(ps),
                "tok_per_verification": n_total / sum(r.stats.n_verifications for r in rs),
                "accepted": sum(r.stats.n_accepted for r in rs) / sum(r.stats.n_drafted for r in rs),
                "tpf": n_total / sum(r.stats.n_decode_forwards for r in rs), "tok_s": tps, "vs_B1": tps / tps1}
    return res


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
    e = sub.add_parser("export", help="a run's weights as an HF checkpoint folder")
    e.add_argument("--run", required=True)
    e.add_argument("--init", default="models/clover-default")
    e.add_argument("--out", required=True)
    q = sub.add_parser("quick-eval", help="tokens per forward, agreement and speed at threshold 0.9, draft-self")
    q.add_argument("--model", required=True)
    q.add_argument("--data", default="train/runs/data")
    q.add_argument("--work", default="train/runs/quick-eval")
    q.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.cmd == "trajectories":
        trajectories(Path(a.model), Path(a.data), Path(a.out), a.prompts, a.seed, a.threads)
    elif a.cmd == "finetune":
        finetune(a)
    elif a.cmd == "export":
        export_weights(Path(a.run), Path(a.init), Path(a.out))
    else:
        print(json.dumps(quick_eval(Path(a.model), Path(a.data), Path(a.work), a.threads)))


if __name__ == "__main__":
    main()
