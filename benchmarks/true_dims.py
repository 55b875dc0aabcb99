"""The 35B-A3B dimensions, sliced: write, convert to Q4_K_M in one step, decode,
parity, and a projection for the full 40 layers on this machine.

The checkpoint is preset ``35b-a3b-slice`` (clover_testkit.true_dims: every real width, 4 layers =
3 GDN + 1 attention, the real vocabulary of 248,320 entries, bf16, about 8.8 GB). Parts, each
leaving its numbers in WORK/true_dims.json so they can run (and be repeated) separately:

* ``write``: the checkpoint, in a fresh process (wall time, peak RSS);
* ``convert``: ``python -m clover_convert SRC OUT --outtype q4_k_m`` (what ``clover convert``
  runs), in a fresh process: wall time, peak RSS of the converter (VmHWM) and of its children
  (the loader check), the output's size per tensor type;
* ``decode``: a fresh process loads the Q4_K_M file (RSS after loading and after decoding) and
  measures, with ``--threads`` threads: generate at B = 1, 8, 32 and with draft-self (B = 8),
  tokens/s and forward passes, draft-self's text against B = 1's (lossless); the block pass
  time at B = 8 and 32 (a fully masked canvas); then, through llama.cpp's eval callback
  (clover_testkit.layer_parity.GraphProbe, a second context), the time of each layer of a
  1-token commit (= one B = 1 step) and of a block pass at B = 8 / 32, and the distinct experts
  each layer's MUL_MAT_ID touched per pass (fully masked canvas and canvas of real text);
* ``parity``: layer 0 (GDN) and layer 3 (attention) of the Q4_K_M file against the numpy
  reference of that layer (clover_testkit.layer_parity.layer_parity: 8 tokens committed, then a
  block pass at B = 8; the reference with the weights the file holds and with the checkpoint's);
* ``table``: prints everything, with the projection for 40 layers (10 slices: per token
  t_40 = t_4 + 9 x (the 4 layers' time); RAM = 10 x the slice's layer tensors + the rest).

Every timing part records ``uptime`` (other jobs share the 2 cores). Usage:

    .venv/bin/python benchmarks/true_dims.py --work /work/tmp-q [--part all|write|convert|decode|parity|table]
        [--threads 2] [--tokens 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB, GB = 1e6, 1e9
LAYERS_REAL = 40

CHILD = r"""
import json, resource, runpy, sys, time
kind, args = sys.argv[1], json.loads(sys.argv[2])
t0 = time.perf_counter()
if kind == "write":
    from clover_testkit.true_dims import write_true_dims
    write_true_dims(args["src"])
else:
    sys.argv = ["clover_convert", args["src"], args["out"], "--outtype", "q4_k_m", "--force", "--no-progress",
                "-t", str(args["threads"])]
    try:
        runpy.run_module("clover_convert", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
dt = time.perf_counter() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "peak_rss": hwm, "children_rss": children}))
"""


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def load(work: Path) -> dict:
    p = work / "true_dims.json"
    return json.loads(p.read_text()) if p.exists() else {}


def save(work: Path, key: str, value: object) -> None:
    data = load(work)
    data.setdefault(key, []).append(value)
    (work / "true_dims.json").write_text(json.dumps(data, indent=1))


def child(kind: str, **args: object) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([*PY, "-c", CHILD, kind, json.dumps(args)], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{kind} failed: {r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall"] = time.perf_counter() - t0
    return out


def part_write(a: argparse.Namespace) -> None:
    src = a.work / "slice"
    up = uptime()
    out = child("write", src=str(src))
    out.update(uptime=up, bytes=sum(p.stat().st_size for p in src.glob("*.safetensors")))
    save(a.work, "write", out)
    print(f"write: {out['wall']:.1f} s, peak RSS {out['peak_rss'] / MB:.0f} MB, {out['bytes'] / GB:.2f} GB")


def gguf_sizes(path: Path) -> dict:
    """Bytes per tensor type, and bytes of the layer tensors vs the rest."""
    import gguf

    r = gguf.GGUFReader(str(path))
    per_type: dict[str, int] = {}
    layer_types: dict[str, int] = {}
    layers = other = 0
    experts = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        per_type[t.tensor_type.name] = per_type.get(t.tensor_type.name, 0) + n
        if t.name.startswith("blk."):
            layers += n
            experts += n if "_exps" in t.name else 0
            layer_types[t.tensor_type.name] = layer_types.get(t.tensor_type.name, 0) + n
        else:
            other += n
    return {"per_type": per_type, "layer_types": layer_types, "layers": layers, "experts": experts, "other": other,
            "file": path.stat().st_size}


def part_convert(a: argparse.Namespace) -> None:
    src, out = a.work / "slice", a.work / "slice-q4_k_m.gguf"
    if out.exists():
        out.unlink()
    os.sync()
    up = uptime()
    res = child("convert", src=str(src), out=str(out), threads=a.threads)
    res.update(uptime=up, uptime_after=uptime(), threads=a.threads, sizes=gguf_sizes(out))
    save(a.work, "convert", res)
    print(f"convert: {res['wall']:.1f} s, peak RSS {res['peak_rss'] / MB:.0f} MB "
          f"(children {res['children_rss'] / MB:.0f} MB), output {res['sizes']['file'] / GB:.2f} GB; {up}")


def _rss() -> dict:
    """RSS, its peak, and its two parts: anonymous memory (buffers the loader filled, e.g. weights
    repacked for the CPU's kernels) and file pages (the mapped GGUF; reclaimable)."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    st = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(keys)}
    return {"rss": st["VmRSS"], "hwm": st["VmHWM"], "anon": st["RssAnon"], "file": st["RssFile"]}


PROMPT = ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
          "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n")
TEXT = ("The model does not write one token at a time. It fills a block of masked positions in parallel, keeps "
        "the tokens it is confident about, and repeats until the block is done. Then the block is committed.")


def part_decode(a: argparse.Namespace) -> None:
    """In this process (started fresh by the caller): see the module doc."""
    import numpy as np

    from clover_cpp import Clover
    from clover_testkit.layer_parity import GraphProbe

    path = str(a.work / "slice-q4_k_m.gguf")
    res: dict = {"uptime": uptime(), "threads": a.threads, "tokens": a.tokens, "rss_start": _rss()}
    t0 = time.perf_counter()
    m = Clover(path, n_ctx=1024, n_threads=a.threads, block_size=8)
    res["load_s"] = time.perf_counter() - t0
    res["rss_loaded"] = _rss()
    prompt = m.tokenize(PROMPT, add_bos=False, special=True)
    text = m.tokenize(TEXT, add_bos=False, special=True)
    res["prompt_tokens"] = len(prompt)
    runs: dict = {}
    ref_tokens = None
    for name, kw in (("B=1", dict(block_size=1)), ("B=8", dict(block_size=8)), ("B=32", dict(block_size=32)),
                     ("draft-self B=8", dict(block_size=8, draft_self=True))):
        rows = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = m.generate(prompt, max_tokens=a.tokens, stop_at_eos=False, **kw)
            dt = time.perf_counter() - t0
            st = r.stats
            rows.append({"s": dt, "n": len(r.tokens), "tok_s": st.tokens_per_second, **{k: getattr(st, k) for k in (
                "t_prefill_ms", "t_decode_ms", "n_decode_forwards", "tokens_per_forward", "n_decode_passes",
                "n_verifications", "n_drafted", "n_accepted")}})
        if name == "B=1":
            ref_tokens = r.tokens
        if name.startswith("draft-self"):
            res["draft_self_equals_B1"] = r.tokens == ref_tokens
        runs[name] = rows
        print(f"  {name}: {[round(x['tok_s'], 2) for x in rows]} tok/s", flush=True)
    res["generate"] = runs
    passes: dict = {}
    for B in (8, 32):
        m.block_size = B
        m.reset()
        m.commit(prompt)
        ts = []
        for _ in range(2 * a.repeat + 1):
            t0 = time.perf_counter()
            m.block_logits([m.mask_token] * B)
            ts.append(time.perf_counter() - t0)
        passes[f"B={B}"] = ts[1:]  # the first one builds the graph
    res["block_pass_s"] = passes
    res["rss_decoded"] = _rss()
    m.close()

    # per layer and experts: a context created while the probe is installed
    names = ["attn_norm-0"] + [f"l_out-{i}" for i in range(4)] + ["result_output"]
    probe = GraphProbe(names, copy=False, experts=True)
    with probe.installed(), Clover(path, n_ctx=1024, n_threads=a.threads, block_size=32) as m2:
        m2.commit(prompt)

        def timed(fn, n: int) -> list[dict]:
            out = []
            for _ in range(n + 1):
                probe.clear()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                tt = dict(probe.times)
                lay = [tt[f"l_out-{i}"] - (tt["attn_norm-0"] if i == 0 else tt[f"l_out-{i - 1}"]) for i in range(4)]
                experts = [len(np.unique(ids)) for _, ids in probe.expert_ids]
                out.append({"total": t1 - t0, "layers": lay, "head": tt["result_output"] - tt["l_out-3"],
                            "before": tt["attn_norm-0"] - t0, "experts": experts})
            return out[1:]

        layers: dict = {}
        tok = [text[0]]
        layers["B=1 commit"] = timed(lambda: m2.commit(tok, logits=True), 4 * a.repeat)
        for B in (8, 32):
            m2.block_size = B
            layers[f"B={B} masked"] = timed(lambda: m2.block_logits([m2.mask_token] * B), 2 * a.repeat)
            canvas = (text * 4)[:B]
            layers[f"B={B} text"] = timed(lambda: m2.block_logits(canvas), 2 * a.repeat)
    if probe.error is not None:
        raise probe.error
    res["per_layer"] = layers
    res["uptime_after"] = uptime()
    save(a.work, "decode", res)
    print(json.dumps({k: v for k, v in res.items() if k != "generate"}, indent=1)[:3000])


def part_parity(a: argparse.Namespace) -> None:
    from clover_testkit.layer_parity import layer_parity
    from clover_testkit.true_dims import slice_tokenizer

    tok = slice_tokenizer()
    ids = tok.encode(PROMPT + TEXT, add_special_tokens=False).ids
    prompt, canvas = ids[:8], ids[8:16]
    out = []
    for layer in a.layers:
        t0 = time.perf_counter()
        r = layer_parity(a.work / a.gguf, a.work / "slice", layer, prompt, canvas,
                         n_threads=a.threads, sources=("gguf", "checkpoint"))
        r["seconds"], r["file"] = time.perf_counter() - t0, a.gguf
        out.append(r)
        print(json.dumps(r), flush=True)
    save(a.work, "parity", out)


def part_batching(a: argparse.Namespace) -> None:
    """The same positions' logits from a batched commit of 12 tokens and from 12 one-token commits
    (B = 1's path): what a different ubatch changes (draft-self verifies with batched commits)."""
    import numpy as np

    from clover_cpp import Clover

    with Clover(str(a.work / a.gguf), n_ctx=256, n_threads=a.threads, block_size=1) as m:
        toks = m.tokenize(PROMPT, add_bos=False, special=True)[:12]
        m.reset()
        bat = m.commit(toks, logits=True)
        m.reset()
        inc = np.stack([m.commit([t], logits=True)[0] for t in toks])
    rel = np.abs(inc - bat).max(axis=1) / np.abs(bat).max(axis=1)
    top = [int(x) for x in (np.argmax(inc, axis=1) != np.argmax(bat, axis=1)).nonzero()[0]]
    r = {"file": a.gguf, "median": float(np.median(rel)), "max": float(rel.max()), "argmax_differs": top,
         "uptime": uptime()}
    save(a.work, "batching", r)
    print(json.dumps(r))


def _min(xs: list[float]) -> float:
    return min(xs)


def _med(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def part_table(a: argparse.Namespace) -> None:
    d = load(a.work)
    print(f"35b-a3b-slice: hidden 2048, 256 experts top-8 + shared (512), attention 16/2 heads x 256, GDN 16/32 "
          f"heads x 128, vocab 248,320; 4 layers (3 GDN + 1 attention); {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GB:.1f} GB RAM")
    for w in d.get("write", []):
        print(f"write bf16 checkpoint: {w['wall']:.1f} s, peak RSS {w['peak_rss'] / MB:.0f} MB, "
              f"{w['bytes'] / GB:.2f} GB  [{w['uptime']}]")
    sizes = None
    for c in d.get("convert", []):
        sizes = c["sizes"]
        print(f"convert bf16 -> Q4_K_M one step (-t {c['threads']}): {c['wall']:.1f} s, peak RSS {c['peak_rss'] / MB:.0f} MB"
              f" (converter), {c['children_rss'] / MB:.0f} MB (largest child: loader check); output "
              f"{sizes['file'] / GB:.3f} GB  [before: {c['uptime']}] [after: {c['uptime_after']}]")
    if sizes:
        print("  bytes per type: " + ", ".join(f"{k} {v / MB:.0f} MB" for k, v in sorted(sizes["per_type"].items())))
    for r in d.get("batching", []):
        print(f"{r['file']}: logits of a 12-token batched commit vs 12 one-token commits, max |difference| / max "
              f"|logit| per row: median {r['median']:.2e}, max {r['max']:.2e}; rows whose argmax differs "
              f"{r['argmax_differs']}")
    for p in d.get("parity", []):
        for r in p:
            print(f"parity {r.get('file', 'slice-q4_k_m.gguf')} layer {r['layer']} ({r['type']}): commit of {r['n_commit']} tokens / block pass B={r['B']}, "
                  f"max |reference| {r['gguf']['scale']:.2f}")
            for src, what in (("gguf", "the file's weights (dequantized)"), ("checkpoint", "the bf16 checkpoint's")):
                g = r[src]
                print(f"  reference with {what}: max abs {g['commit']['max_abs']:.4f} / {g['block_pass']['max_abs']:.4f},"
                      f" rms rel {g['commit']['rms_rel']:.4f} / {g['block_pass']['rms_rel']:.4f}, routing flips "
                      f"{g['commit'].get('routing_flips', '?')} / {g['block_pass'].get('routing_flips', '?')} tokens; "
                      f"per-row rms rel (commit) {g['commit'].get('row_rms_rel', '?')}")
    for run, r in enumerate(d.get("decode", []), 1):
        print(f"decode run {run} ({r['threads']} threads, {r['tokens']} tokens, prompt {r['prompt_tokens']}) "
              f"[before: {r['uptime']}] [after: {r['uptime_after']}]")
        ld, dd = r["rss_loaded"], r["rss_decoded"]
        print(f"  load {r['load_s']:.2f} s; RSS loaded {ld['rss'] / MB:.0f} MB (anonymous {ld.get('anon', 0) / MB:.0f}"
              f" MB, file {ld.get('file', 0) / MB:.0f} MB), after decoding {dd['rss'] / MB:.0f} MB (anonymous "
              f"{dd.get('anon', 0) / MB:.0f} MB, file {dd.get('file', 0) / MB:.0f} MB; peak {dd['hwm'] / MB:.0f} MB)")
        print("  | mode | decode tok/s (each run) | ms per token | forwards | tokens per forward | "
              "drafted / accepted |\n  |---|---|---|---|---|---|")
        for name, rows in r["generate"].items():
            speeds = ", ".join(f"{x['tok_s']:.2f}" for x in rows)
            x = rows[-1]
            print(f"  | {name} | {speeds} | {x['t_decode_ms'] / x['n']:.0f} | {x['n_decode_forwards']} | "
                  f"{x['tokens_per_forward']:.2f} | {x['n_drafted']} / {x['n_accepted']} |")
        print(f"  draft-self output == B = 1 output: {r.get('draft_self_equals_B1')}")
        print("  block pass, fully masked canvas (best of the runs): " + ", ".join(
            f"{k} {_min(v) * 1e3:.0f} ms" for k, v in r["block_pass_s"].items()))
        print("  | pass (eval callback on; best of the runs) | total ms | layer 0 / 1 / 2 (GDN) / 3 (attn) ms | head ms | "
              "distinct experts per layer |\n  |---|---|---|---|---|")
        for name, rows in r["per_layer"].items():
            lay = [_min([x["layers"][i] for x in rows]) * 1e3 for i in range(4)]
            print(f"  | {name} | {_min([x['total'] for x in rows]) * 1e3:.0f} | {' / '.join(f'{v:.1f}' for v in lay)} | "
                  f"{_min([x['head'] for x in rows]) * 1e3:.1f} | {rows[-1]['experts']} |")
    gguf = a.work / "slice-q4_k_m.gguf"
    if sizes and gguf.exists():
        sizes = gguf_sizes(gguf)
    for run, r in enumerate(d.get("decode", []), 1):
        if not sizes:
            break
        best = lambda rows, i: _min([x["layers"][i] for x in rows])  # noqa: E731
        pl = r["per_layer"]
        lay1 = sum(best(pl["B=1 commit"], i) for i in range(4))
        head1 = _min([x["head"] + x["before"] for x in pl["B=1 commit"]])
        gen1 = _min([x["t_decode_ms"] / x["n"] for x in r["generate"]["B=1"]]) / 1e3
        t40, t40p = gen1 + 9 * lay1, head1 + 10 * lay1
        print(f"projection from decode run {run} ({r['threads']} thread(s); best of its runs), 40 layers = 10 slices, weights in RAM:")
        print(f"  B = 1: {gen1 * 1e3:.0f} ms per token on 4 layers (generate), of which the 4 layers {lay1 * 1e3:.1f} ms "
              f"-> {t40 * 1e3:.0f} ms = {1 / t40:.2f} tok/s; from the per-layer run alone (embedding + head "
              f"{head1 * 1e3:.0f} ms + 10 x {lay1 * 1e3:.1f} ms) {t40p * 1e3:.0f} ms = {1 / t40p:.2f} tok/s")
        for B in (8, 32):
            tp = _min(r["block_pass_s"][f"B={B}"])
            lm = sum(best(pl[f"B={B} masked"], i) for i in range(4))
            lt = sum(best(pl[f"B={B} text"], i) for i in range(4))
            print(f"  block pass B = {B}: {tp * 1e3:.0f} ms on 4 layers (fully masked canvas; its layers {lm * 1e3:.0f} ms,"
                  f" a canvas of text {lt * 1e3:.0f} ms) -> {(tp + 9 * lm) * 1e3:.0f} ms on 40 (text canvas "
                  f"{(tp + 9 * lt) * 1e3:.0f} ms): break-even with B = 1 at {(tp + 9 * lm) / t40:.1f} tokens per pass")
        anon = r["rss_loaded"].get("anon", 0)
        lt_ = sizes["layer_types"]
        print(f"  RAM: the Q4_K_M file for 40 layers {(sizes['other'] + 10 * sizes['layers']) / GB:.1f} GB "
              f"({sizes['other'] / GB:.2f} GB embedding + head, 10 x {sizes['layers'] / GB:.2f} GB of layers; experts "
              f"{10 * sizes['experts'] / GB:.1f} GB). Loaded here: {anon / GB:.2f} GB anonymous (the CPU backend's "
              f"repacked copies of the layers' Q4_K tensors, {lt_.get('Q4_K', 0) / GB:.2f} GB in the file) + the mapped"
              f" file; for 40 layers about {(10 * lt_.get('Q4_K', 0) + anon - lt_.get('Q4_K', 0)) / GB:.1f} GB anonymous"
              f" (10 x the repacked layers + this run's buffers) + {(10 * lt_.get('Q6_K', 0) + sizes['other']) / GB:.1f}"
              f" GB of mapped Q6_K layers, head and embedding")


PY: list[str] = [sys.executable]


def main() -> None:
    global PY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="folder for the checkpoint, the GGUF and the results")
    ap.add_argument("--part", default="all", choices=["all", "write", "convert", "decode", "parity", "batching", "table"])
    ap.add_argument("--gguf", default="slice-q4_k_m.gguf", help="the file in WORK that parity and batching read")
    ap.add_argument("--layers", type=lambda v: [int(x) for x in v.split(",")], default=[0, 3],
                    help="parity: the layers compared (comma-separated)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--python", default=None, help="interpreter command for the child processes (default: this one)")
    a = ap.parse_args()
    if a.python:
        PY = a.python.split()
    a.work.mkdir(parents=True, exist_ok=True)
    parts = ["write", "convert", "decode", "parity", "batching", "table"] if a.part == "all" else [a.part]
    for p in parts:
        if p == "write" and (a.work / "slice" / "config.json").exists() and a.part == "all":
            continue
        if p == "decode" and a.part == "all":  # a fresh process: its RSS is the model's
            subprocess.run([*PY, str(Path(__file__).resolve()), "--work", str(a.work), "--part", "decode",
                            "--threads", str(a.threads), "--tokens", str(a.tokens), "--repeat", str(a.repeat)],
                           check=True, cwd=ROOT)
            continue
        globals()[f"part_{p}"](a)


if __name__ == "__main__":
    main()
