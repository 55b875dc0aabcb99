"""Tokens per second of the default model's decoding modes on the 8 held-out prompts (train.targets'
prompts: 64 tokens each, 128 new, greedy), median of --reps interleaved rounds, beside B = 1 in the
same run: decode tok/s (prefill excluded, as draft_self.py and llama-bench's tg count) and wall tok/s
of the whole calls; for auto, the blocks of each mode it chose. Refuses a busy machine
(run_all.busy_cores).

    .venv/bin/python benchmarks/heldout_speed.py [--model models/clover-default] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
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
    import run_all

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
    if not (Path(a.data) / "heldout.npy").is_file():
        sys.exit(f"error: no held-out tokens in {a.data}: run python -m train.data --out {a.data} "
                 "--tokenizer models/clover-default/tokenizer.json")
    busy = run_all.busy_cores()
    if busy > 0.5:
        sys.exit(f"error: the machine is busy ({busy:.2f} cores in use); timings need a quiet machine")
    print(f"# load before: {run_all.loadavg()}; command: {' '.join(sys.argv)}")
    ps = prompts(Path(a.data), 8, 64)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "m-f16.gguf"
        convert(a.model, str(gguf), outtype="f16", force=True, progress=False)
        with Clover(gguf, n_ctx=1024, n_threads=a.threads) as m:
            def run(**kw):
                t = time.perf_counter()
                rs = [m.generate(p, max_tokens=128, stop_at_eos=False, reuse_prefix=False, **kw) for p in ps]
                wall = time.perf_counter() - t
                n = sum(r.stats.n_generated for r in rs)
                return n / (sum(r.stats.t_decode_ms for r in rs) / 1e3), n / wall, rs

            run(block_size=1)  # warm-up
            speeds: dict[str, list[float]] = {n: [] for n, _ in MODES}
            walls: dict[str, list[float]] = {n: [] for n, _ in MODES}
            outs: dict[str, list] = {}
            pass16: list[float] = []  # a block pass of 16 tokens: draft-self B = 8's forward (8 drafted + 8 masks)
            for _ in range(a.reps):
                for name, kw in MODES:
                    s, w, outs[name] = run(**kw)
                    speeds[name].append(s)
                    walls[name].append(w)
                m.block_size = 16
                m.commit(ps[0])
                for _ in range(5):
                    t = time.perf_counter()
                    m.block_logits(ps[0][:16])
                    pass16.append(time.perf_counter() - t)
    b1, b1_wall = statistics.median(speeds["B=1"]), statistics.median(walls["B=1"])
    print("# decode tok/s (libclover's t_decode_ms, the prompts' prefill excluded), its ratio to B=1, the runs;"
          " wall: tok/s over the whole generate calls (prefill included); tok/fwd: tokens per decode forward")
    for name, _ in MODES:
        med, wall, rs = statistics.median(speeds[name]), statistics.median(walls[name]), outs[name]
        same = sum(r.tokens == b.tokens for r, b in zip(rs, outs["B=1"]))
        tpf = sum(r.stats.n_generated for r in rs) / max(1, sum(r.stats.n_decode_forwards for r in rs))
        blocks = [sum(getattr(r.stats, f"n_blocks_{k}") for r in rs) for k in ("ar", "diffusion", "draft_self")]
        chose = f"  blocks ar/diffusion/draft-self {blocks[0]}/{blocks[1]}/{blocks[2]}" if name == "auto" else ""
        print(f"{name:16s} {med:8.1f} tok/s {med / b1:5.2f}x  runs {[round(x) for x in speeds[name]]}  "
              f"wall {wall:6.1f} ({wall / b1_wall:4.2f}x)  tok/fwd {tpf:4.2f}  "
              f"distinct 4-grams {distinct_4grams([r.tokens for r in rs]):.3f}  same as B=1 {same}/8{chose}")
    ds = outs["draft-self B=8"]
    per_ver = sum(r.stats.n_generated for r in ds) / max(1, sum(r.stats.n_verifications for r in ds))
    ideal = per_ver / statistics.median(pass16)
    got = statistics.median(speeds["draft-self B=8"])
    print(f"# draft-self B=8: {per_ver:.2f} tokens per verification, a block pass of 16 {1e3 * statistics.median(pass16):.2f} ms "
          f"(median of {len(pass16)}, Python call included): at one forward per verification {ideal:.0f} tok/s; "
          f"measured {got:.0f} = {got / ideal:.2f}x of that (target >= 0.8)")
    print(f"# load after: {run_all.loadavg()}")


if __name__ == "__main__":
    main()
