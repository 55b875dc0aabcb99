"""Constrained decoding's cost: the JSON schema over the 10 prompts that tests/runtime/test_grammar.py
decodes (clover_testkit.schema_prompts), greedy, up to 200 tokens each, at block size 1 and with
draft-self (B = 4, 8, 16), and the same prompts unconstrained (64 tokens), on one thread.

    .venv/bin/python benchmarks/grammar.py MODEL.gguf [THREADS]

Prints, per setting: tokens, seconds, tokens/s, decode forwards, tokens per forward and, for
draft-self, verifications and accepted / drafted tokens.
"""
from __future__ import annotations

import argparse
import sys
import time

from clover_cpp import Clover, CloverError
from clover_testkit.schema_prompts import PROMPTS, RF_SCHEMA


def run(m: Clover, label: str, max_tokens: int, **kw) -> None:
    t = time.perf_counter()
    n = fw = ver = acc = dr = 0
    for p in PROMPTS:
        r = m.generate(p, max_tokens=max_tokens, **kw)
        n += len(r.tokens)
        fw += r.stats.n_decode_forwards
        ver += r.stats.n_verifications
        acc += r.stats.n_accepted
        dr += r.stats.n_drafted
    dt = time.perf_counter() - t
    ds = f", {ver} verifications, {acc}/{dr} drafted tokens accepted" if ver else ""
    print(f"{label:34s} {n:4d} tok {dt:6.2f} s {n / dt:7.1f} tok/s, {fw} forwards ({n / max(fw, 1):.2f} tok/forward){ds}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL.gguf")
    ap.add_argument("threads", metavar="THREADS", type=int, nargs="?", default=1)
    a = ap.parse_args()
    try:
        m = Clover(a.model, n_ctx=1024, n_threads=a.threads, block_size=8)
    except CloverError as e:
        sys.exit(f"grammar.py: {e}")
    with m:
        m.generate("x", max_tokens=4)  # warm-up
        run(m, "schema, B = 1", 200, block_size=1, response_format=RF_SCHEMA)
        for B in (4, 8, 16):
            run(m, f"schema, draft-self B = {B}", 200, block_size=B, draft_self=True, response_format=RF_SCHEMA)
        run(m, "free, B = 1", 64, block_size=1)
        run(m, "free, draft-self B = 8", 64, block_size=8, draft_self=True)


if __name__ == "__main__":
    main()
