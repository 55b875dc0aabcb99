"""Soak test (not a CI test): long and repeated generation on one object, watching memory.

    .venv/bin/python benchmarks/soak.py [--model M.gguf] [--calls 1000] [--tokens 10000] [--threads 2]

1. 10,000 tokens generated in one context (n_ctx 12,288, block size auto, EOS ignored).
2. 1,000 generate calls on one Clover object with random valid parameters (block size
   1..32 or auto, threshold, temperature, top-k/top-p, seed, stop strings, streaming or not,
   prompts that extend the previous one or not). Every greedy call with a fixed block size is
   compared with a second object that only ever serves that one call (reuse_prefix off).
Prints the RSS after call 100 and at the end (target: within 5%), errors (target 0) and
mismatches (target 0). Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


PROMPTS = ["def add(a, b):\n", "class Point:\n", "import os\n\n", "# sort a list\n", "for i in range(10):\n"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from clover_cpp import Clover, CloverError
    from clover_cpp.demo import default_cache_dir, demo_model

    model = Path(a.model) if a.model else demo_model(default_cache_dir())[0]
    rng = random.Random(a.seed)
    ok = True
    with Clover(model, n_ctx=a.tokens + 2048, n_threads=a.threads) as m:
        t0 = time.perf_counter()
        r = m.generate("def main():\n", max_tokens=a.tokens, stop_at_eos=False)
        dt = time.perf_counter() - t0
        print(f"1. {len(r.tokens)} tokens in one context: {dt:.1f} s ({len(r.tokens) / dt:.0f} tok/s), "
              f"{r.stats.n_block_switches} block-size switches, RSS {rss_mb():.0f} MB")
        ok &= len(r.tokens) == a.tokens
    with Clover(model, n_ctx=2048, n_threads=a.threads) as m, \
            Clover(model, n_ctx=2048, n_threads=a.threads) as fresh:
        errors = mismatches = compared = 0
        rss_at_100 = None
        prev: list[int] = []
        t0 = time.perf_counter()
        for i in range(a.calls):
            B = rng.choice([1, 2, 4, 8, 16, 32, "auto"])
            greedy = rng.random() < 0.5
            kw = dict(max_tokens=rng.randint(1, 64), block_size=B, threshold=rng.choice([0.5, 0.9, 1.0]),
                      temperature=0.0 if greedy else rng.uniform(0.2, 1.5), top_k=rng.choice([0, 5, 50]),
                      top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**32),
                      stop=rng.choice([[], ["\n\n"], ["return", ":"]]), stop_at_eos=rng.random() < 0.8)
            prompt = prev + m.tokenize(rng.choice(PROMPTS), add_bos=False, special=True) if prev and rng.random() < 0.5 and len(prev) < 1500 \
                else m.tokenize(rng.choice(PROMPTS), add_bos=True, special=True)
            try:
                if rng.random() < 0.3:
                    s = m.generate(prompt, stream=True, **kw)
                    text = "".join(s)
                    res = s.result
                    assert res is not None and res.text == text
                else:
                    res = m.generate(prompt, **kw)
                prev = prompt + res.tokens
                if greedy and B != "auto":
                    want = fresh.generate(prompt, reuse_prefix=False, **kw)
                    compared += 1
                    if want.tokens != res.tokens or want.text != res.text:
                        mismatches += 1
                        print(f"  mismatch at call {i}: {kw}", file=sys.stderr)
            except CloverError as e:
                errors += 1
                print(f"  error at call {i}: {e}", file=sys.stderr)
            if i + 1 == min(100, a.calls):
                rss_at_100 = rss_mb()
        rss_end = rss_mb()
        growth = (rss_end - rss_at_100) / rss_at_100 if rss_at_100 else 0.0
        print(f"2. {a.calls} calls in {time.perf_counter() - t0:.1f} s: errors {errors}, greedy calls compared with a "
              f"fresh object {compared}, mismatches {mismatches}; RSS after call 100 {rss_at_100:.0f} MB, at the end "
              f"{rss_end:.0f} MB ({growth * 100:+.1f}%, target within 5%)")
        ok &= errors == 0 and mismatches == 0 and abs(growth) <= 0.05
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
