"""The GPU measurements of benchmarks/gpu.sh (also runs on the CPU): per model, the cost
curve of a block pass and of a fused commit + pass against upstream qwen35moe batched passes
of the same dimensions, upstream autoregressive decode, and tokens/s per block size.

    python benchmarks/gpu_sweep.py --model small=PATH.gguf --model default=PATH.gguf --out FILE
Environment: CLOVER_NGL (layers on the GPU, -1 = all), CLOVER_NGL_UPSTREAM, CLOVER_BIN_DIR.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_baselines  # noqa: E402
import native_bench as nb  # noqa: E402
from run_all import llama_bench  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32)
QUICK = os.environ.get("CLOVER_GPU_QUICK") == "1"   # the script's own check: fewer sizes, shorter runs
if QUICK:
    SIZES = (1, 4)
NEW = 32 if QUICK else 128


def sweep(name: str, path: Path, threads: int, lines: list[str]) -> None:
    from clover_cpp import Clover

    ngl = int(os.environ.get("CLOVER_NGL", "0"))
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp) / "qwen35moe-twin.gguf"
        make_baselines.qwen35moe_from_clover(path, twin)
        up = {n: llama_bench(twin, threads, 3, p=n) for n in sorted(set(SIZES) | {2 * b for b in SIZES})}
        tg = llama_bench(twin, threads, 3, n=NEW)
    with Clover(path, n_threads=threads, n_gpu_layers=ngl, n_ctx=2048) as m:
        curve = m.calibrate(fused=True)
        lines.append(f"## {name}: {path.name} (n_gpu_layers {ngl}, {threads} threads)")
        lines.append("cost of one denoising step (ms, best of 10, candidates included) vs upstream batched pass")
        lines.append(f"{'B':>4} {'pass':>8} {'up n=B':>8} {'fused 2B':>9} {'up n=2B':>8}")
        for B, (ms, msf) in curve.items():
            if B not in up or 2 * B not in up:  # (the quick check measures fewer sizes upstream)
                continue
            lines.append(f"{B:>4} {ms:>8.2f} {up[B]['min_s'] * 1e3:>8.2f} {msf:>9.2f} {up[2 * B]['min_s'] * 1e3:>8.2f}")
        ar = NEW / tg["min_s"]
        lines.append(f"upstream autoregressive decode (llama-bench -n {NEW}): {ar:.1f} tok/s")
        prompt = "def parse(self, text):\n    " if name == "default" else list(range(10, 74))
        rows = []
        for B in SIZES:
            for th, S in ((1.0, max(1, B // 4)), (1.0, 1), (0.9, 0)):
                if th == 1.0 and B == 1 and S != 1:
                    continue
                m.generate(prompt, max_tokens=16, block_size=B, threshold=th, max_steps=S, stop_at_eos=False)
                r = max((m.generate(prompt, max_tokens=NEW, block_size=B, threshold=th, max_steps=S,
                                    stop_at_eos=False) for _ in range(2)), key=lambda x: x.stats.tokens_per_second)
                rows.append((B, th, S, r.stats))
        r = m.generate(prompt, max_tokens=NEW, block_size="auto", stop_at_eos=False)
        rows.append(("auto", 0.9, 0, r.stats))
        base = next(s for B, th, S, s in rows if B == 1 and th == 1.0).tokens_per_second
        lines.append(f"tokens/s, {NEW} new tokens (threshold 1.0 with step cap S = exactly B/S tokens per step; "
                     f"0.9 = the model's own confidence)")
        lines.append(f"{'B':>5} {'thr':>4} {'S':>3} {'tok/fwd':>8} {'tok/s':>9} {'vs B=1':>7} {'vs AR':>6}")
        for B, th, S, s in rows:
            lines.append(f"{B!s:>5} {th:>4} {S:>3} {s.tokens_per_forward:>8.2f} {s.tokens_per_second:>9.1f} "
                         f"{s.tokens_per_second / base:>6.2f}x {s.tokens_per_second / ar:>5.2f}x")
        lines.append("")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH.gguf")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    lines = [f"clover GPU sweep, {time.strftime('%Y-%m-%d %H:%M')}", ""]
    for spec in a.model:
        name, path = spec.split("=", 1)
        sweep(name, Path(path), a.threads, lines)
        print("\n".join(lines), flush=True)
    a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
