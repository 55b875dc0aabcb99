"""Constrained decoding's cost: the JSON schema of tests/runtime/test_grammar.py over its 10 prompts
(greedy, up to 200 tokens each) at block size 1 and with draft-self (B = 4, 8, 16), and the same
prompts unconstrained (64 tokens), on one thread.

    .venv/bin/python benchmarks/grammar.py MODEL.gguf [THREADS]

Prints, per setting: tokens, seconds, tokens/s, decode forwards, tokens per forward and, for
draft-self, verifications and accepted / drafted tokens.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

from test_grammar import PROMPTS, RF_SCHEMA  # noqa: E402

from clover_cpp import Clover  # noqa: E402


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
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with Clover(sys.argv[1], n_ctx=1024, n_threads=threads, block_size=8) as m:
        m.generate("x", max_tokens=4)  # warm-up
        run(m, "schema, B = 1", 200, block_size=1, response_format=RF_SCHEMA)
        for B in (4, 8, 16):
            run(m, f"schema, draft-self B = {B}", 200, block_size=B, draft_self=True, response_format=RF_SCHEMA)
        run(m, "free, B = 1", 64, block_size=1)
        run(m, "free, draft-self B = 8", 64, block_size=8, draft_self=True)


if __name__ == "__main__":
    main()
