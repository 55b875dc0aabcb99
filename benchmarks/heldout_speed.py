"""Tokens per second of the default model's decoding modes on the 8 held-out prompts (train.targets'
prompts: 64 tokens each, 128 new, greedy), median of --reps interleaved rounds, beside B = 1 in the
same run; refuses a busy machine (run_all.busy_cores).

    .venv/bin/python benchmarks/heldout_speed.py [--model models/clover-default] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = [("B=1", dict(block_size=1)),
         ("B=8", dict(block_size=8, threshold=0.9)),
         ("B=16", dict(block_size=16, threshold=0.9)),
         ("B=32", dict(block_size=32, threshold=0.9)),
         ("draft-self B=8", dict(block_size=8, threshold=0.9, draft_self=True)),
         ("auto", dict(block_size="auto"))]


def main() -> None:
    from run_all import busy_cores

    from clover_convert import convert
    from clover_cpp import Clover
    from train.evaluate import prompts
    from train.targets import distinct_4grams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/clover-default"))
    ap.add_argument("--data", default=str(ROOT / "train/runs/data"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    busy = busy_cores()
    if busy > 0.5:
        sys.exit(f"error: the machine is busy ({busy:.2f} cores in use); timings need a quiet machine")
    print(f"# load before: {os.getloadavg()}; command: {' '.join(sys.argv)}")
    ps = prompts(Path(a.data), 8, 64)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "m-f16.gguf"
        convert(a.model, str(gguf), outtype="f16", force=True, progress=False)
        with Clover(gguf, n_ctx=1024, n_threads=a.threads) as m:
            def run(**kw):
                t = time.perf_counter()
                rs = [m.generate(p, max_tokens=128, stop_at_eos=False, reuse_prefix=False, **kw) for p in ps]
                return sum(len(r.tokens) for r in rs) / (time.perf_counter() - t), rs

            run(block_size=1)  # warm-up
            speeds: dict[str, list[float]] = {n: [] for n, _ in MODES}
            outs: dict[str, list] = {}
            for _ in range(a.reps):
                for name, kw in MODES:
                    s, outs[name] = run(**kw)
                    speeds[name].append(s)
    b1 = statistics.median(speeds["B=1"])
    for name, _ in MODES:
        med, rs = statistics.median(speeds[name]), outs[name]
        same = sum(r.tokens == b.tokens for r, b in zip(rs, outs["B=1"]))
        print(f"{name:16s} {med:8.1f} tok/s  {med / b1:5.2f}x B=1  runs {[round(x) for x in speeds[name]]}  "
              f"distinct 4-grams {distinct_4grams([r.tokens for r in rs]):.3f}  same as B=1 {same}/8")
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
