"""The block expert coreset on the 35B-A3B slice at Q4_K_M, one thread (issue 36): counts and times.

The slice (clover_testkit.true_dims: the release's widths, 256 experts top-8 + shared, vocabulary
248,320, 4 of the 40 layers, random weights) is written as a bf16 checkpoint, converted and
quantized to Q4_K_M in --work (kept there: later runs start from the GGUF). Then, at 1 thread,
for B = 8 and B = 32 block passes on a "mask" canvas (all masks after a prompt: a block's first
pass) and a "text" canvas (the prompt's next B tokens: a nearly denoised block), with the coreset
off, C = 3k (24: the smallest bound of 3x a B = 1 step's expert bytes) and C = k (8):

* distinct routed experts per MoE layer (libclover's count: Clover(expert_stats=True));
* the routed-expert bytes that means, relative to a B = 1 step (k experts a layer);
* the pass's time relative to a B = 1 step's (a one-row canvas), median of --reps, measured on a
  context without the counting (it stops the graph after each MoE layer).

    .venv/bin/python benchmarks/coreset_slice.py [--work DIR] [--reps 5] [--out FILE] [--force]
    .venv/bin/python benchmarks/coreset_slice.py --smoke   # the tiny preset (E = 8, k = 2), seconds

A busy machine is refused (other processes using more than half a core, benchmarks/run_all.py's
busy_cores): the times would be noise; --force runs anyway and says so. --smoke only checks the
script: its times are no measurement. Needs ~20 GB free in --work while the slice is built (8 GB
checkpoint, 8 GB GGUF; both removed once the Q4_K_M file, ~2.5 GB, is written).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import run_all  # noqa: E402  (busy_cores, loadavg, cpu_name)
from gpu_slice import Lines  # noqa: E402  (the report, printed as it comes)

TEXT = ("The river ran past the old mill, where the miller's daughter kept the accounts and "
        "counted the sacks of grain that came down from the hills every autumn. ") * 8
BUSY_CORES = 0.5


def build(preset: str, work: Path, log) -> Path:
    """The preset's checkpoint -> GGUF -> Q4_K_M in work (reused when there); the intermediates go."""
    from clover_convert import convert
    from clover_cpp.quant import quantize
    from clover_testkit.checkpoints import write_checkpoint

    q4 = work / f"{preset}-q4_k_m.gguf"
    if q4.exists():
        return q4
    work.mkdir(parents=True, exist_ok=True)
    ckpt, full = work / f"{preset}-ckpt", work / f"{preset}-f16.gguf"
    t0 = time.time()
    log(f"writing the {preset} checkpoint (random weights) in {ckpt}")
    write_checkpoint(ckpt, preset=preset, dtype="bf16" if preset == "35b-a3b-slice" else "f32")
    log(f"converting to {full.name}")
    convert(ckpt, full, outtype="f16", progress=False)
    shutil.rmtree(ckpt)
    log(f"quantizing to {q4.name}")
    quantize(full, q4, "Q4_K_M", n_threads=os.cpu_count() or 1, warn=lambda line: None)
    full.unlink()
    log(f"built in {time.time() - t0:.0f} s")
    return q4


def median_ms(f, reps: int) -> float:
    f()  # (warm-up: the graph of this shape, the pages of these experts)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(gguf: Path, reps: int, lines: list[str]) -> None:
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=512, n_threads=1, block_size=1) as base:
        meta = base.metadata
        k, E = (int(meta[f"{meta['general.architecture']}.expert_{key}"]) for key in ("used_count", "count"))
        coresets = [None] + [c for c in (3 * k, k) if c < E]
        toks = base.tokenize(TEXT, add_bos=True)
        prompt, after, mask = toks[:24], toks[24:], base.mask_token
        base.commit(prompt)
        b1_ms = median_ms(lambda: base.block_logits(after[:1]), reps)
        lines += [f"E = {E} experts, k = {k} per token; a B = 1 step (a one-row canvas): {b1_ms:.1f} ms, "
                  f"{k} experts a layer", "",
                  "| B | canvas | C | experts / layer | expert bytes x B = 1 | pass ms | time x B = 1 |",
                  "|---|---|---|---|---|---|---|"]
        for B in (8, 32):
            # a context of block size B per B (the canvas's temperature depends on it); the times
            # on one without the counting, which stops the graph after each MoE layer
            counted, timed = base.new_context(block_size=B, expert_stats=True), base.new_context(block_size=B)
            try:
                for m in (counted, timed):
                    m.commit(prompt)
                for kind in ("mask", "text"):
                    canvas = [mask] * B if kind == "mask" else after[:B]
                    for C in coresets:
                        counted.coreset = timed.coreset = C
                        counted.expert_stats()
                        counted.block_logits(canvas)
                        s = counted.expert_stats()
                        ms = median_ms(lambda: timed.block_logits(canvas), reps)
                        lines.append(f"| {B} | {kind} | {'off' if C is None else C} | {s.experts_per_pass:.2f} | "
                                     f"{s.expert_bytes_ratio:.2f} | {ms:.1f} | {ms / b1_ms:.2f} |")
            finally:
                counted.close()
                timed.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "clover-cpp" / "coreset-slice"),
                    help="where the Q4_K_M slice is built and kept")
    ap.add_argument("--reps", type=int, default=5, help="timed passes per cell (median)")
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset in a temporary folder: checks the script")
    ap.add_argument("--force", action="store_true", help="time on a busy machine anyway (flagged)")
    a = ap.parse_args(argv)

    busy = run_all.busy_cores(2.0)
    if busy > BUSY_CORES and not (a.force or a.smoke):
        print(f"error: the machine is busy ({busy:.2f} cores used by other processes, loadavg {run_all.loadavg()}): "
              "pass times would be noise; run on a quiet machine (or --force)", file=sys.stderr)
        return 1
    lines = Lines()
    lines += [f"# benchmarks/coreset_slice.py{' --smoke' if a.smoke else ''}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              f"# {run_all.cpu_name()}, 1 thread; before: {busy:.2f} cores busy, loadavg {run_all.loadavg()}"
              + ("; SMOKE RUN (the tiny preset): the times are no measurement" if a.smoke else "")
              + ("; BUSY MACHINE: the times are noise" if busy > BUSY_CORES else "")]
    log = lambda s: print(f"[coreset_slice] {s}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        gguf = build("tiny", Path(tmp), log) if a.smoke else build("35b-a3b-slice", Path(a.work), log)
        lines.append(f"# model: {gguf.name} ({gguf.stat().st_size / 2**30:.2f} GiB)")
        measure(gguf, max(1, a.reps), lines)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
