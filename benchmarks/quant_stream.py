"""One-step quantizing conversion vs the two-step path, and what each quant type costs in quality.

Part 1 (--part convert): the converter benchmark's checkpoint (preset small with --layers 22:
1.3B parameters, a ~2.6 GB bf16 checkpoint; fewer layers with --layers), converted to TYPE
(default Q4_K_M)

* two-step: ``clover convert --outtype f16`` then ``clover quantize`` (the intermediate file is
  deleted at the end, as a user would);
* one-step: ``clover convert --outtype q4_k_m`` (clover_convert.quantize_stream).

Each step runs in a fresh process; printed: wall time, peak RSS (VmHWM) of each process, and
the peak disk use of the output folder (its allocated blocks, sampled every 20 ms: a sparse
file counts what it really holds). The page cache is synced before each timed run.

Part 2 (--part kld): the default model (models/clover-default) converted to f16 and, in one
step, to Q8_0, Q6_K, Q5_K_M, Q4_K_M and IQ4_XS three times: without an importance matrix, with
one from causal commits only, and with one from commits + block passes (``clover imatrix`` on
training-set stdlib files, CALIB below); ``clover kld`` of each against the f16 file on held-out
Python (the model card's held-out stdlib files), causal path and block passes.

    .venv/bin/python benchmarks/quant_stream.py [--part convert|kld|all] [--layers 22] [--threads 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MB = 1e6

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
kind, args = sys.argv[1], json.loads(sys.argv[2])
if kind == "convert":
    from clover_convert import convert
    convert(args["src"], args["out"], outtype=args["outtype"], progress=False, force=True)
elif kind == "quantize":
    from clover_cpp.quant import quantize
    quantize(args["src"], args["out"], args["qtype"], n_threads=args["threads"], force=True)
else:
    from clover_convert.quantize_stream import convert_quantized
    convert_quantized(args["src"], args["out"], args["qtype"], n_threads=args["threads"], force=True, progress=False)
dt = time.perf_counter() - t0
hwm = 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        hwm = int(line.split()[1]) * 1024
import resource
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "peak_rss": hwm, "children_rss": children}))
"""


class DiskWatch:
    """Peak allocated bytes of the files in a folder, sampled every 20 ms."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        n = 0
        for p in self.folder.iterdir():
            try:
                n += p.stat().st_blocks * 512
            except FileNotFoundError:
                pass
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(0.02)

    def __enter__(self) -> "DiskWatch":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._used())


def child(kind: str, **args: object) -> dict:
    os.sync()
    t0 = time.perf_counter()
    r = subprocess.run([PY, "-c", CHILD, kind, json.dumps(args)], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{kind} failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall"] = time.perf_counter() - t0  # with the process's start-up and exit
    return out


def part_convert(args: argparse.Namespace) -> None:
    from clover_testkit.checkpoints import write_checkpoint

    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="clover-qbench-"))
    src = base / f"small-L{args.layers}"
    if not (src / "config.json").exists():
        write_checkpoint(src, "small", dtype="bf16", config_overrides={"num_hidden_layers": args.layers})
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    work = base / "out"
    work.mkdir(exist_ok=True)
    q = args.qtype
    print(f"preset small with {args.layers} layers ({src_bytes / MB:.1f} MB bf16 safetensors) -> {q}, "
          f"{os.cpu_count()} cores, quantizer threads {args.threads or 'all'}; each step a fresh process")
    for rnd in range(1, args.repeat + 1):
        for p in work.iterdir():
            p.unlink()
        with DiskWatch(work) as dw:
            a = child("convert", src=str(src), out=str(work / "m-f16.gguf"), outtype="f16")
            b = child("quantize", src=str(work / "m-f16.gguf"), out=str(work / f"two-{q}.gguf"), qtype=q,
                      threads=args.threads)
            (work / "m-f16.gguf").unlink()
        two = a["wall"] + b["wall"]
        two_disk = dw.peak
        two_size = (work / f"two-{q}.gguf").stat().st_size
        (work / f"two-{q}.gguf").unlink()
        with DiskWatch(work) as dw:
            c = child("one", src=str(src), out=str(work / f"one-{q}.gguf"), qtype=q, threads=args.threads)
        one_size = (work / f"one-{q}.gguf").stat().st_size
        (work / f"one-{q}.gguf").unlink()
        print(f" round {rnd}:")
        print(f"  two-step  convert f16 {a['wall']:6.2f} s (peak RSS {a['peak_rss'] / MB:6.1f} MB) + quantize "
              f"{b['wall']:6.2f} s (peak RSS {b['peak_rss'] / MB:6.1f} MB; its child, quantizer + loader check: "
              f"{b['children_rss'] / MB:6.1f} MB) = {two:6.2f} s, peak disk {two_disk / MB:8.1f} MB, "
              f"output {two_size / MB:.1f} MB")
        print(f"  one-step  convert {q} {c['wall']:6.2f} s (peak RSS {c['peak_rss'] / MB:6.1f} MB; its child, the "
              f"loader check: {c['children_rss'] / MB:6.1f} MB), peak disk {dw.peak / MB:8.1f} MB, "
              f"output {one_size / MB:.1f} MB")
        print(f"  one-step / two-step: {c['wall'] / two:.2f}x the time, {dw.peak / two_disk:.2f}x the peak disk")


HELD_OUT = ["re/_compiler.py", "importlib/util.py", "wsgiref/headers.py", "sqlite3/dbapi2.py"]
CALIB = ["argparse.py", "textwrap.py", "json/decoder.py"]  # in the default model's training set


def part_kld(args: argparse.Namespace) -> None:
    from clover_convert import convert
    from clover_convert.quantize_stream import convert_quantized
    from clover_cpp.kld import kl_divergence
    from clover_cpp.model import Clover

    src = ROOT / "models" / "clover-default"
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="clover-kld-"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / f).read_text(encoding="utf-8") for f in HELD_OUT if (stdlib / f).exists())
    f16 = base / "default-f16.gguf"
    convert(src, f16, outtype="f16", progress=False, force=True)
    from clover_cpp.imatrix import collect_imatrix, write_imatrix

    calib = "".join((stdlib / f).read_text(encoding="utf-8") for f in CALIB if (stdlib / f).exists())
    ims = {}
    for tag, ratios in (("causal", ()), ("causal+blocks", (1.0, 0.75, 0.5, 0.25))):
        t0 = time.perf_counter()
        coll, n = collect_imatrix(f16, calib, n_ctx=args.ctx, mask_ratios=ratios, max_chunks=args.chunks,
                                  n_threads=args.threads or None)
        ims[tag] = write_imatrix(coll, base / f"default-{tag}.imatrix.gguf", CALIB, n, args.ctx)
        print(f"imatrix ({tag}): {n} chunks of {args.ctx} tokens of {', '.join(CALIB)} in "
              f"{time.perf_counter() - t0:.1f} s")
    types = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "IQ4_XS+causal", "IQ4_XS+causal+blocks"]
    print(f"default model (models/clover-default) vs its f16 conversion, on held-out stdlib Python "
          f"({', '.join(HELD_OUT)}; {len(text)} chars), chunks of {args.ctx} tokens, {args.chunks} chunks")
    with Clover(f16, n_ctx=args.ctx, n_threads=args.threads or None) as mb:
        for q in types:
            qt, _, tag = q.partition("+")
            out = base / f"default-{q}.gguf"
            convert_quantized(src, out, qt, imatrix=ims[tag] if tag else None,
                              n_threads=args.threads, force=True, progress=False)
            t0 = time.perf_counter()
            with Clover(out, n_ctx=args.ctx, n_threads=args.threads or None) as mq:
                r = kl_divergence(mb, mq, text, n_ctx=args.ctx, max_chunks=args.chunks)
            print(f"\n{q} ({out.stat().st_size / MB:.2f} MB; f16 {f16.stat().st_size / MB:.2f} MB), "
                  f"{time.perf_counter() - t0:.1f} s:")
            print(r.format())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["convert", "kld", "all"], default="all")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--qtype", default="Q4_K_M")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", default=None, help="folder for the checkpoint and outputs (kept)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    if args.part in ("convert", "all"):
        part_convert(args)
    if args.part in ("kld", "all"):
        part_kld(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
