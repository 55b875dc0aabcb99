"""The default model's targets (issue: a model confident in parallel), measured on one or more
checkpoints side by side; counts only, no timings (those need a quiet machine:
benchmarks/draft_self.py and `clover demo`).

* tokens per forward at threshold 0.9, greedy, B = 8 / 16 / 32, on the 8 held-out prompts
  (train.evaluate.prompts: the first 64 tokens of each held-out stdlib file), 128 new tokens;
* draft-self at B = 8 / 16: tokens per verification and per forward, and whether the output
  equals B = 1's; with --draft-steps, for drafts of S passes too (0: the threshold rule);
* perplexity of the causal path (`Clover.perplexity`, llama-perplexity's method, -c 256) on Python
  code outside the training set: click's core.py (an installed library, not the stdlib);
* distinct 4-grams of the B = 1 greedy outputs (share of the 4-grams that are distinct), the
  measure of loops.

    python -m train.targets models/clover-default train/runs/vA/export ... [--draft-steps 1,2,0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


NEW_TOKENS = 128
PROMPT_LEN = 64


def ood_text() -> str:
    """Python code the model never saw: click's core.py (a dependency of clover-cpp)."""
    import click.core

    return Path(click.core.__file__).read_text()


def distinct_4grams(seqs: list[list[int]]) -> float:
    grams = [tuple(s[i:i + 4]) for s in seqs for i in range(len(s) - 3)]
    return len(set(grams)) / max(1, len(grams))


def measure(model: Path, data: Path, threads: int, draft_steps: tuple[int, ...] = (1,)) -> dict:
    from clover_convert import convert
    from clover_cpp import Clover
    from train.evaluate import prompts

    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "m-f16.gguf"
        convert(str(model), str(gguf), outtype="f16", force=True, progress=False)
        ps = prompts(data, 8, PROMPT_LEN)
        res: dict = {}
        with Clover(gguf, n_ctx=1024, n_threads=threads) as m:
            def run(**kw):
                return [m.generate(p, max_tokens=NEW_TOKENS, stop_at_eos=False, reuse_prefix=False, **kw) for p in ps]

            base = run(block_size=1)
            n_total = sum(len(r.tokens) for r in base)
            res["distinct_4grams_B1"] = distinct_4grams([r.tokens for r in base])
            for B in (8, 16, 32):
                rs = run(block_size=B, threshold=0.9)
                res[f"tpf_B{B}"] = n_total / sum(r.stats.n_decode_forwards for r in rs)
            for B in (8, 16):
                for S in draft_steps:
                    rs = run(block_size=B, threshold=0.9, draft_self=True, draft_steps=S)
                    key = f"draft_self_B{B}" + ("" if S == 1 else f"_S{S}")
                    res[f"{key}_tok_per_verification"] = n_total / sum(r.stats.n_verifications for r in rs)
                    res[f"{key}_tok_per_forward"] = n_total / sum(r.stats.n_decode_forwards for r in rs)
                    res[f"{key}_same_as_B1"] = sum(r.tokens == b.tokens for r, b in zip(rs, base)) / len(ps)
            res["ppl_click_core_c256"] = m.perplexity(ood_text(), n_ctx=256).ppl
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="HF checkpoint folders (the first is the baseline)")
    ap.add_argument("--data", default="train/runs/data")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-steps", default="1", help="draft-self's passes per draft to measure, comma-separated "
                    "(0: the threshold rule; default 1, draft-self's default)")
    ap.add_argument("--json", help="also write the table as JSON here")
    a = ap.parse_args(argv)
    try:
        steps = tuple(int(x) for x in a.draft_steps.split(","))
    except ValueError:
        ap.error(f"--draft-steps: a comma-separated list of integers, not {a.draft_steps!r}")
    rows = {m: measure(Path(m), Path(a.data), a.threads, steps) for m in a.models}
    base = rows[a.models[0]]
    keys = list(base)
    print("| metric | " + " | ".join(a.models) + " |")
    print("|---|" + "---|" * len(a.models))
    for k in keys:
        cells = []
        for m in a.models:
            v = rows[m][k]
            rel = "" if m == a.models[0] or not base[k] else f" ({v / base[k]:.2f}x)"
            cells.append(f"{v:.3f}{rel}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
