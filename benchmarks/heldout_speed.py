"""Tokens per second of the default model's decoding modes on the 8 held-out prompts (train.targets'
prompts: 64 tokens each, 128 new, greedy): decode tok/s (prefill excluded, as draft_self.py and
llama-bench's tg count) and wall tok/s of the whole calls, the median of --reps rounds in which the
modes take turns prompt by prompt, and each mode's ratio to B = 1 paired per round with its range;
for auto, the blocks of each mode it chose. Refuses a busy machine (run_all.busy_cores).

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
        # a second context measures the cost curve (calibrate renews the curve `auto` learns from and
        # would make every round's auto start over)
        with Clover(gguf, n_ctx=1024, n_threads=a.threads) as m, Clover(gguf, n_ctx=256, n_threads=a.threads) as cal:
            def gen(p, **kw):
                t = time.perf_counter()
                r = m.generate(p, max_tokens=128, stop_at_eos=False, reuse_prefix=False, **kw)
                return r, time.perf_counter() - t

            for p in ps:  # warm-up
                gen(p, block_size=1)
            # per round and mode: each prompt's result and wall seconds; the modes take turns prompt by
            # prompt, so a change of this machine's speed (it flips between ~1,400 and ~2,500 tok/s of
            # B = 1 with nothing else running) falls on every mode of a round alike
            rounds: list[dict[str, list]] = []
            # per round, draft-self B = 8's forward (a commit of 8 and the next canvas of 8): the cost
            # curve's fused step of 8 (libclover's clock, the fastest of 10 over two sweeps) and a block pass of 16 as
            # Python sees it (the median of 5, the call and the logits' copy included)
            fused8: list[float] = []
            pass16: list[float] = []
            for _ in range(a.reps):
                rd: dict[str, list] = {name: [] for name, _ in MODES}
                for p in ps:
                    for name, kw in MODES:
                        rd[name].append(gen(p, **kw))
                rounds.append(rd)
                m.block_size = 16
                m.commit(ps[0])
                ms = []
                for _ in range(5):
                    t = time.perf_counter()
                    m.block_logits(ps[0][:16])
                    ms.append(time.perf_counter() - t)
                pass16.append(statistics.median(ms))
                fused8.append(cal.calibrate(fused=True)[8][1] / 1e3)

    def speed(rd: dict, name: str) -> float:
        return sum(r.stats.n_generated for r, _ in rd[name]) / (sum(r.stats.t_decode_ms for r, _ in rd[name]) / 1e3)

    def wall_speed(rd: dict, name: str) -> float:
        return sum(r.stats.n_generated for r, _ in rd[name]) / sum(w for _, w in rd[name])

    outs = {name: [r for r, _ in rounds[-1][name]] for name, _ in MODES}  # the last round's outputs
    print("# decode tok/s (libclover's t_decode_ms, the prompts' prefill excluded): the median of the rounds; the"
          " ratio to B=1: the median of the rounds' paired ratios [their range]; wall: tok/s over the whole"
          " generate calls (prefill included); tok/fwd: tokens per decode forward")
    for name, _ in MODES:
        runs = [speed(rd, name) for rd in rounds]
        ratios = [speed(rd, name) / speed(rd, "B=1") for rd in rounds]
        walls = [wall_speed(rd, name) / wall_speed(rd, "B=1") for rd in rounds]
        rs = outs[name]
        same = sum(r.tokens == b.tokens for r, b in zip(rs, outs["B=1"]))
        tpf = sum(r.stats.n_generated for r in rs) / max(1, sum(r.stats.n_decode_forwards for r in rs))
        blocks = [sum(getattr(r.stats, f"n_blocks_{k}") for r in rs) for k in ("ar", "diffusion", "draft_self")]
        chose = f"  blocks ar/diffusion/draft-self {blocks[0]}/{blocks[1]}/{blocks[2]}" if name == "auto" else ""
        print(f"{name:16s} {statistics.median(runs):8.1f} tok/s {statistics.median(ratios):5.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]  runs {[round(x) for x in runs]}  "
              f"wall {statistics.median(walls):4.2f}x  tok/fwd {tpf:4.2f}  "
              f"distinct 4-grams {distinct_4grams([r.tokens for r in rs]):.3f}  same as B=1 {same}/8{chose}")
    ds = outs["draft-self B=8"]
    per_ver = sum(r.stats.n_generated for r in ds) / max(1, sum(r.stats.n_verifications for r in ds))
    # against one forward per verification, paired per round: the round's cost of that forward beside its
    # draft-self speed
    def vs_ideal(costs: list[float]) -> str:
        r = [speed(rd, "draft-self B=8") * t / per_ver for rd, t in zip(rounds, costs)]
        return f"{1e3 * statistics.median(costs):.2f} ms: {statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"

    print(f"# draft-self B=8: {per_ver:.2f} tokens per verification; tok/s against one forward per verification "
          f"(target >= 0.8), that forward from the cost curve (fused step of 8) {vs_ideal(fused8)}; "
          f"from a block pass of 16 timed in Python {vs_ideal(pass16)}")
    print(f"# load after: {run_all.loadavg()}")


if __name__ == "__main__":
    main()
