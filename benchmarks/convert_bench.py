"""Converter throughput and peak memory on the ``small`` preset.

Generates the ``small`` synthetic checkpoint in bf16 into a temporary folder, converts it
to f16 and to q8_0, each in a fresh subprocess, and prints per conversion:

* source MB/s read (source tensor bytes / wall time of the conversion call), and its ratio to
  copying the same bytes (page cache to page cache, fsynced): the floor for f16;
* peak RSS of the converting process (its /proc/self/status VmHWM, which also counts
  touched pages of the memory-mapped source; ru_maxrss as a fallback);
* the largest output tensor and the ratio peak RSS / largest tensor.

Target: peak RSS < 2 x largest tensor + 300 MB.

    .venv/bin/python benchmarks/convert_bench.py [--keep DIR] [--outtypes f16,q8_0]

Note: the source was just written, so it is read from the page cache; MB/s measures
the conversion, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from clover_convert import convert
src, out, outtype = sys.argv[1:4]
t0 = time.perf_counter()
plan = convert(src, out, outtype=outtype, progress=False, force=True)
dt = time.perf_counter() - t0
hwm = None
try:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
except OSError:
    pass
if hwm is None:
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
big = plan.largest_tensor()
print(json.dumps({
    "seconds": dt, "src_bytes": plan.src_bytes, "out_bytes": plan.total_bytes, "peak_rss": hwm,
    "largest_name": big.name, "largest_bytes": big.nbytes, "largest_type": big.qtype.name,
    "params": plan.total_params,
}))
"""

MB = 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", type=Path, help="use (and keep) this folder instead of a temporary one")
    ap.add_argument("--outtypes", default="f16,q8_0")
    args = ap.parse_args()

    from clover_testkit.checkpoints import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="clover-convert-bench-") as tmp:
        root = args.keep or Path(tmp)
        src = root / "small-bf16"
        if not (src / "config.json").exists():
            t0 = time.perf_counter()
            write_checkpoint(src, "small", dtype="bf16")
            print(f"generated small preset (bf16) in {time.perf_counter() - t0:.1f} s: {src}")
        src_size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        print(f"source: {src_size / MB:.1f} MB of safetensors")
        # the floor: copying the same bytes (read from the page cache, written, fsynced), as the
        # converter's f16 output is about the source's size
        os.sync()  # each timing starts with no dirty pages of the previous step to write back
        t0 = time.perf_counter()
        for i, f in enumerate(sorted(src.glob("*.safetensors"))):
            dst = root / f"copy-{i}.bin"
            shutil.copyfile(f, dst)
            with open(dst, "rb+") as fh:
                os.fsync(fh.fileno())
        copy_s = time.perf_counter() - t0
        for f in root.glob("copy-*.bin"):
            f.unlink()
        print(f" copy: the same bytes copied and fsynced in {copy_s:.2f} s = {src_size / MB / copy_s:.1f} MB/s")
        ok = True
        for outtype in args.outtypes.split(","):
            out = root / f"small-{outtype}.gguf"
            os.sync()
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), outtype],
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                print(f"{outtype}: conversion failed:\n{p.stderr}")
                return 1
            r = json.loads(p.stdout.strip().splitlines()[-1])
            target = 2 * r["largest_bytes"] + 300 * MB
            passed = r["peak_rss"] < target
            ok &= passed
            print(
                f"{outtype:>5}: {r['params'] / 1e6:.0f}M params, {r['src_bytes'] / MB:.1f} MB read in "
                f"{r['seconds']:.2f} s = {r['src_bytes'] / MB / r['seconds']:.1f} MB/s source, "
                f"{copy_s / r['seconds']:.2f}x the copy "
                f"({r['out_bytes'] / MB:.1f} MB written; process wall {wall:.2f} s); "
                f"peak RSS {r['peak_rss'] / MB:.1f} MB; largest tensor {r['largest_name']} "
                f"{r['largest_type']} {r['largest_bytes'] / MB:.1f} MB; "
                f"peak/largest {r['peak_rss'] / r['largest_bytes']:.2f}; "
                f"target < {target / MB:.1f} MB: {'PASS' if passed else 'FAIL'}"
            )
            if not args.keep:
                out.unlink(missing_ok=True)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
