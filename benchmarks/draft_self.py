"""Draft-self vs block size 1 vs upstream autoregressive decoding, side by side in one run.

    .venv/bin/python benchmarks/draft_self.py [--threads 2] [--reps 3] [--out benchmarks/results-draft-self.txt]

On the default model (models/clover-default, converted to f16 as `clover demo` does) and the
`small` preset (random weights, f16, from make_baselines.py): greedy, stop_at_eos off, the same
prompt for every row; per configuration the median over --reps interleaved runs (every rep
runs every configuration once, so load changes on a shared machine hit all of them):

* tok/s (decode, libclover's t_decode_ms) of B = 1 (autoregressive), draft-self at B = 4, 8, 16
  (one pass per draft, riding on the previous verification; draft_steps = 1), draft-self
  B = 8 with two passes per draft, and block_size = "auto" (which may choose B = 1, block
  diffusion or draft-self: the mode it chose is printed);
* accepted drafted tokens per verification, tokens per verification, forwards per token
  (every llama_decode after the prompt's);
* upstream llama.cpp's autoregressive decode on the same GGUF: `llama-bench -p 0 -n N`.

Ratios are against B = 1 of the same run. Prints the report and writes it to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import run_all  # noqa: E402  (loadavg, busy_cores, cpu_name, llama_bench)

PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef main():\n")

CONFIGS = [  # (label, generate kwargs)
    ("B=1 (autoregressive)", dict(block_size=1, draft_self=False)),
    ("draft-self B=4", dict(block_size=4, draft_self=True, draft_steps=1)),
    ("draft-self B=8", dict(block_size=8, draft_self=True, draft_steps=1)),
    ("draft-self B=16", dict(block_size=16, draft_self=True, draft_steps=1)),
    ("draft-self B=8, 2 passes/draft", dict(block_size=8, draft_self=True, draft_steps=2)),
    ("auto (mode chosen)", dict(block_size="auto", draft_self=None)),
]


def measure(path: Path, prompt, n_new: int, threads: int, reps: int) -> dict:
    """Every rep runs each configuration once, then llama-bench once (-r 1): interleaved, so
    that a load change on the shared machine hits clover and upstream alike."""
    from clover_cpp import Clover

    rows: dict[str, list] = {label: [] for label, _ in CONFIGS}
    up: list[dict] = []
    with Clover(str(path), n_ctx=1024, n_threads=threads, block_size=1) as m:
        toks = m.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) else list(prompt)
        for label, kw in CONFIGS:  # warm-up (and auto's cost curve: cached or measured once)
            m.generate(toks, max_tokens=8, stop_at_eos=False, reuse_prefix=False, **kw)
        for rep in range(reps):
            # after llama-bench's process the first configuration ran ~25% slower (seen on this
            # machine): a short warm-up, and the order rotated so that no configuration is always first
            m.generate(toks, max_tokens=8, stop_at_eos=False, reuse_prefix=False, **CONFIGS[0][1])
            for label, kw in CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)]:
                r = m.generate(toks, max_tokens=n_new, stop_at_eos=False, reuse_prefix=False, **kw)
                rows[label].append(r.stats)
            try:
                up.append(run_all.llama_bench(path, threads, 1, p=0, n=n_new))
            except Exception as e:  # noqa: BLE001 - reported, the rest of the run stands
                up.append({"error": str(e)})
        n_prompt = len(toks)
    out = {}
    for label, stats in rows.items():
        s = stats[-1]
        out[label] = dict(
            tps=statistics.median(x.tokens_per_second for x in stats),
            tps_all=[round(x.tokens_per_second, 1) for x in stats],
            n_gen=s.n_generated, ver=s.n_verifications,
            acc_per_ver=s.n_accepted / s.n_verifications if s.n_verifications else None,
            tok_per_ver=s.n_generated / s.n_verifications if s.n_verifications else None,
            fwd_per_tok=s.n_decode_forwards / max(s.n_generated, 1),
            mode=s.mode, B=s.block_size,
            blocks=(s.n_blocks_ar, s.n_blocks_diffusion, s.n_blocks_draft_self))
    out["_n_prompt"] = n_prompt
    ok = [u for u in up if "avg_ts" in u]
    out["_upstream"] = ({"avg_ts": statistics.median(u["avg_ts"] for u in ok), "cmd": ok[0]["cmd"],
                         "all": [round(u["avg_ts"], 1) for u in ok]} if ok else None)
    out["_upstream_error"] = next((u["error"] for u in up if "error" in u), None)
    return out


def report(name: str, path: Path, res: dict, up: dict | None, n_new: int, lines: list[str]) -> None:
    ar = res["B=1 (autoregressive)"]["tps"]
    lines.append(f"## {name}: {path.name} (prompt {res['_n_prompt']} tokens, {n_new} new, greedy)")
    lines.append(f"{'configuration':34s} {'tok/s':>8s} {'vs B=1':>7s} {'vs AR':>7s} {'acc/ver':>8s} "
                 f"{'tok/ver':>8s} {'fwd/tok':>8s}  runs (tok/s) / auto's choice")
    up_tps = up["avg_ts"] if up else None
    for label, _ in CONFIGS:
        r = res[label]
        f = lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8s}"  # noqa: E731
        extra = str(r["tps_all"])
        if label.startswith("auto"):
            extra += (f"  chose B={r['B']} {r['mode']} (blocks: {r['blocks'][0]} autoregressive, "
                      f"{r['blocks'][1]} diffusion, {r['blocks'][2]} draft-self)")
        vs_up = f"{r['tps'] / up_tps:6.2f}x" if up_tps else "      -"
        lines.append(f"{label:34s} {r['tps']:8.1f} {r['tps'] / ar:6.2f}x "
                     f"{vs_up} {f(r['acc_per_ver'])} "
                     f"{f(r['tok_per_ver'])} {f(r['fwd_per_tok'])}  {extra}")
    if up:
        lines.append(f"{'upstream llama-bench (AR decode)':34s} {up_tps:8.1f} {up_tps / ar:6.2f}x {'1.00x':>7s}"
                     f"{'':27s}  {up['all']}  (llama-bench {up['cmd']})")
    elif res.get("_upstream_error"):
        lines.append(f"(llama-bench failed: {res['_upstream_error']})")
    best = max((res[l]["tps"], l) for l, _ in CONFIGS if l.startswith("draft-self"))
    lines.append(f"best draft-self: {best[1]} = {best[0] / ar:.2f}x B = 1"
                 + (f", {best[0] / up_tps:.2f}x upstream AR" if up_tps else ""))
    lines.append("")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens on the default model")
    ap.add_argument("--new-small", type=int, default=64, help="new tokens on the small preset")
    ap.add_argument("--no-small", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results-draft-self.txt"))
    a = ap.parse_args(argv)

    from clover_cpp.demo import default_cache_dir, demo_model

    lines: list[str] = []
    t0 = time.time()
    busy = run_all.busy_cores(2.0)
    lines.append(f"# draft-self benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    lines.append(f"# {run_all.cpu_name()}, {os.cpu_count()} cores, {a.threads} threads; "
                 f"load before: {busy:.2f} cores busy, loadavg {run_all.loadavg()} (a shared machine: "
                 f"ratios within this run are what count)")
    lines.append(f"# command: .venv/bin/python benchmarks/draft_self.py --threads {a.threads} --reps {a.reps}")
    lines.append("# acc/ver: accepted drafted tokens per verification (position 0 of a draft is the autoregressive "
                 "token itself and counts); tok/ver: output tokens per verification; fwd/tok: llama_decode calls "
                 "after the prompt's per output token")
    lines.append("")
    models = [("default model", demo_model(default_cache_dir(), log=lambda s: None)[0], PROMPT, a.new)]
    if not a.no_small:
        sys.path.insert(0, str(REPO / "benchmarks"))
        import make_baselines

        small = make_baselines.clover_gguf(make_baselines.DEFAULT_CACHE, "f16")
        models.append(("small preset (random weights)", small, list(range(5, 69)), a.new_small))
    for name, path, prompt, n_new in models:
        res = measure(Path(path), prompt, n_new, a.threads, a.reps)
        report(name, Path(path), res, res["_upstream"], n_new, lines)
    lines.append(f"# load after: {run_all.busy_cores(2.0):.2f} cores busy, loadavg {run_all.loadavg()}; "
                 f"{time.time() - t0:.0f} s")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
