"""Clover-side measurements through libclover (clover_cpp._native), used by run_all.py.

Each function loads nothing itself: it takes a ``Model`` (one loaded clover GGUF) and
returns plain dicts. Times are wall-clock (time.perf_counter) around the C calls; the
model is loaded once and every measured call is preceded by an unmeasured warm-up.

    .venv/bin/python benchmarks/native_bench.py MODEL.gguf [--threads 2] [--section cost|tps|depth|e2e]

prints the raw numbers of one section (run_all.py prints the full report with baselines).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from clover_cpp import _native as N  # noqa: E402


class CloverError(RuntimeError):
    pass


def _check(rc: int, err, what: str) -> None:
    if rc != N.CLOVER_OK:
        raise CloverError(f"{what}: {N.lib().clover_status_str(rc).decode()} ({err.value.decode(errors='replace')})")


def _tokens(n: int, vocab: int, seed: int, avoid: tuple[int, ...] = ()) -> list[int]:
    """Deterministic pseudo-random token ids in [0, vocab), none of `avoid`."""
    out, x = [], (seed * 2654435761 + 12345) & 0xFFFFFFFF
    while len(out) < n:
        x = (1103515245 * x + 12345) & 0x7FFFFFFF
        t = (x >> 8) % vocab
        if t not in avoid:
            out.append(t)
    return out


class Model:
    def __init__(self, path: str | Path, n_threads: int = 2) -> None:
        self.L = N.lib()
        self.path = Path(path)
        self.n_threads = n_threads
        err, el = N.err_buffer()
        mp = self.L.clover_model_default_params()
        mp.n_gpu_layers = int(os.environ.get("CLOVER_NGL", "0"))  # benchmarks/gpu.sh offloads every layer
        self.m = self.L.clover_model_load(str(self.path).encode(), ctypes.byref(mp), err, el)
        if not self.m:
            raise CloverError(f"load {path}: {err.value.decode(errors='replace')}")
        self.n_vocab = self.L.clover_n_vocab(self.m)
        self.mask = self.L.clover_mask_token(self.m)
        self.eos = self.L.clover_eos_token(self.m)
        self.ctx = None
        self.ctx_key = None

    def close(self) -> None:
        if self.ctx:
            self.L.clover_context_free(self.ctx)
            self.ctx = None
        if self.m:
            self.L.clover_model_free(self.m)
            self.m = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def context(self, block_size: int, n_ctx: int):
        """A context with this block size and at least n_ctx positions (reused when it fits)."""
        key = (block_size, n_ctx)
        if self.ctx is not None and self.ctx_key == key:
            self.L.clover_reset(self.ctx)
            return self.ctx
        if self.ctx is not None:
            self.L.clover_context_free(self.ctx)
            self.ctx = None
        p = self.L.clover_context_default_params()
        p.n_ctx = n_ctx
        p.n_threads = self.n_threads
        p.block_size = block_size
        err, el = N.err_buffer()
        c = self.L.clover_context_new(self.m, ctypes.byref(p), err, el)
        if not c:
            raise CloverError(f"context (B={block_size}, n_ctx={n_ctx}): {err.value.decode(errors='replace')}")
        self.ctx, self.ctx_key = c, key
        return c

    def tokens(self, n: int, seed: int) -> list[int]:
        return _tokens(n, self.n_vocab, seed, avoid=(self.mask, self.eos))

    # ------------------------------------------------------------------ primitives
    def block_pass_seconds(self, ctx, toks: list[int], logits) -> float:
        arr = N.as_int32_array(toks)
        err, el = N.err_buffer()
        t0 = time.perf_counter()
        rc = self.L.clover_block_pass(ctx, arr, len(toks), logits, err, el)
        dt = time.perf_counter() - t0
        _check(rc, err, "clover_block_pass")
        return dt

    def commit(self, ctx, toks: list[int]) -> float:
        """Seconds of clover_commit: the tokens processed causally at the end of the memory (any
        number of them, one llama_decode per ubatch), as the prompt of a generation is."""
        arr = N.as_int32_array(toks)
        err, el = N.err_buffer()
        t0 = time.perf_counter()
        rc = self.L.clover_commit(ctx, arr, len(toks), err, el)
        dt = time.perf_counter() - t0
        _check(rc, err, "clover_commit")
        return dt

    def generate(self, prompt: list[int], block_size: int, max_steps: int, max_tokens: int,
                 threshold: float = 1.0) -> dict:
        n_ctx = len(prompt) + _round_up(max_tokens, block_size)  # decode blocks start right after the prompt
        ctx = self.context(block_size, max(n_ctx, 64))
        gp = self.L.clover_generate_default_params()
        gp.block_size = block_size
        gp.threshold = threshold
        gp.max_steps = max_steps
        gp.temperature = 0.0
        gp.max_tokens = max_tokens
        gp.stop_at_eos = 0
        out = (ctypes.c_int32 * max_tokens)()
        n_out = ctypes.c_int32()
        st = N.clover_stats()
        arr = N.as_int32_array(prompt)
        err, el = N.err_buffer()
        t0 = time.perf_counter()
        rc = self.L.clover_generate(ctx, arr, len(prompt), ctypes.byref(gp), out, max_tokens,
                                    ctypes.byref(n_out), ctypes.byref(st), err, el)
        wall = time.perf_counter() - t0
        _check(rc, err, "clover_generate")
        return {
            "wall_s": wall,
            "n_generated": st.n_generated,
            "n_steps": st.n_steps,
            "n_commits": st.n_commits,
            "n_blocks": st.n_blocks,
            "n_forward": st.n_forward,
            "tokens_per_forward": st.tokens_per_forward,
            "t_prefill_s": st.t_prefill_ms / 1e3,
            "t_decode_s": st.t_decode_ms / 1e3,
            "tokens_per_second": st.tokens_per_second,
            "finish": N.FINISH_REASONS.get(st.finish_reason, str(st.finish_reason)),
        }


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _summary(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "mean_s": statistics.fmean(samples),
            "min_s": min(samples), "samples_s": samples}


# ---------------------------------------------------------------------- 1. cost curve
def cost_curve(model: Model, ns=(1, 2, 4, 8, 16, 32), reps: int = 3) -> dict[int, dict]:
    """Latency of one block pass of n tokens (context block size n, empty memory)."""
    out = {}
    for n in ns:
        ctx = model.context(n, max(64, 2 * n))
        logits = (ctypes.c_float * (n * model.n_vocab))()
        toks = model.tokens(n, seed=n)
        model.block_pass_seconds(ctx, toks, logits)  # warm-up (graph allocation, page faults)
        out[n] = _summary([model.block_pass_seconds(ctx, toks, logits) for _ in range(reps)])
    return out


# ---------------------------------------------------------------------- 2. tokens/s vs B
def schemes(block_sizes=(1, 4, 8, 16, 32), ks=("B", 4)) -> list[tuple[int, int, int]]:
    """(B, k, max_steps): threshold 1.0 never fires (a softmax probability of exactly 1.0
    does not occur with random weights), so with the step cap S = B/k step s unmasks exactly
    ceil(masked/(S-s)) = k tokens: k = B (S = 1, one step per block) and k = 4 (S = B/4)."""
    out = []
    for B in block_sizes:
        for k in ks:
            kk = B if k == "B" else int(k)
            if kk > B or B % kk:
                continue
            if (B, kk, B // kk) not in out:
                out.append((B, kk, B // kk))
    return out


def expected_passes(max_new: int, B: int, k: int) -> int | None:
    """Block passes of a generation of max_new tokens with exactly k unmasked per step (a
    scheme above), where that is known: blocks start right after the prompt, and a step runs a
    pass only while a masked position q > 0 is left (position 0 takes L_last). B = 1: none
    (autoregressive decoding). k >= 2: every step has k >= 2 masked positions, so every one of
    the B/k steps of each block passes. k = 1 < B: the last step passes or not depending on
    whether position 0 is the last one left (unknown)."""
    if max_new % B:
        return None  # positions past the budget stay masked: fewer steps in the last block
    if B == 1:
        return 0
    return max_new // B * (B // k) if k >= 2 else None


def tokens_per_second(model: Model, prompt_len: int = 64, max_new: int = 128,
                      cases=None, reps: int = 1) -> list[dict]:
    prompt = model.tokens(prompt_len, seed=7)
    res = []
    for B, k, S in cases or schemes():
        # warm-up: one short generation with this block size (context creation, graphs)
        model.generate(prompt, B, S, max_tokens=min(max_new, 2 * B))
        runs = [model.generate(prompt, B, S, max_tokens=max_new) for _ in range(reps)]
        best = max(runs, key=lambda r: r["tokens_per_second"])
        r = dict(best, B=B, k=k, max_steps=S, runs_tps=[x["tokens_per_second"] for x in runs])
        r["expected_steps"] = expected_passes(max_new, B, k)
        res.append(r)
    return res


# ---------------------------------------------------------------------- 3. depth
def depth_latency(model: Model, depths=(128, 1024, 4096), B: int = 32, reps: int = 3) -> dict[int, dict]:
    """Latency of one B-token block pass after `depth` committed (random) tokens."""
    depths = sorted(depths)
    ctx = model.context(B, _round_up(depths[-1] + 2 * B, 256))
    logits = (ctypes.c_float * (B * model.n_vocab))()
    toks = model.tokens(depths[-1] + B, seed=3)
    block = [model.mask] * B  # a fully masked block, as at the first step of a decode block
    out, done = {}, 0
    for d in depths:
        t_commit = model.commit(ctx, toks[done:d]) if d > done else 0.0
        done = d
        model.block_pass_seconds(ctx, block, logits)  # warm-up
        r = _summary([model.block_pass_seconds(ctx, block, logits) for _ in range(reps)])
        r["commit_s"] = t_commit
        out[d] = r
    return out


# ---------------------------------------------------------------------- 4. end to end
def end_to_end(model: Model, prompt: list[int], max_new: int = 256, B: int = 32,
               tokens_per_step: int = 4, reps: int = 1) -> dict:
    """clover_generate wall time (the prompt's commit included), best of reps."""
    S = B // tokens_per_step
    model.generate(prompt[: 2 * B], B, S, max_tokens=B)  # warm-up
    runs = [model.generate(prompt, B, S, max_tokens=max_new) for _ in range(reps)]
    r = min(runs, key=lambda x: x["wall_s"])
    r.update(B=B, k=tokens_per_step, max_steps=S, n_prompt=len(prompt), runs_wall_s=[x["wall_s"] for x in runs])
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="clover-side raw numbers (see run_all.py for the report)")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--section", choices=["cost", "tps", "depth", "e2e"], default="cost")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    with Model(a.model, a.threads) as m:
        if a.section == "cost":
            r = cost_curve(m, (1, 4, 32) if a.quick else (1, 2, 4, 8, 16, 32), reps=1 if a.quick else 3)
        elif a.section == "tps":
            r = tokens_per_second(m, max_new=32 if a.quick else 128,
                                  cases=schemes((1, 32)) if a.quick else None)
        elif a.section == "depth":
            r = depth_latency(m, (128, 512) if a.quick else (128, 1024, 4096), reps=1 if a.quick else 3)
        else:
            r = end_to_end(m, m.tokens(256, seed=11), max_new=64 if a.quick else 256)
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
