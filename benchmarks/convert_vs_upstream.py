"""Converter throughput against upstream llama.cpp's convert_hf_to_gguf.py, in one run.

    .venv/bin/python benchmarks/convert_vs_upstream.py [--preset small] [--keep DIR] [--repeat N]

Writes a bf16 Clover checkpoint of the preset, and from it a Qwen3.5-MoE checkpoint of the
same shapes (upstream's closest architecture: the same tensors less Clover's memory gate,
lookahead taps and block calibration; `model_type: qwen3_5_moe`). Converts both to f16, each
in a fresh process: ours with `clover_convert`, upstream's with the pinned tree's
`convert_hf_to_gguf.py` (torch needed; its tokenizer check is told the fixture tokenizer is
Qwen2's, which it is in form). Prints source MB/s, wall time and peak RSS of each, and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from clover_testkit.qwen35moe import UPSTREAM, UPSTREAM_RUNNER, qwen35moe_checkpoint  # noqa: E402

MB = 1e6


def timed(cmd: list[str], output: Path) -> tuple[float, float, int]:
    """Wall seconds until the child has exited and its output is on disk (ours and the copy
    fsync, upstream does not: a sync after it charges everyone the same write-back), and the
    child's peak RSS (bytes). It starts with no dirty pages left from the run before (their
    write-back would be charged to this one) and without the previous output, whose pages the
    kernel would otherwise free only at the end of an in-place run (upstream truncates its
    output first, a temp-and-rename writer replaces it last)."""
    output.unlink(missing_ok=True)
    os.sync()
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    exited = time.perf_counter() - t0
    os.sync()
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd[:4])} ...\n{p.stderr[-3000:]}")
    return dt, exited, int(p.stderr.strip().splitlines()[-1]) * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=22,
                    help="layers of the preset (small has 8: 22 make a ~2.6 GB bf16 checkpoint, 1.3B parameters)")
    ap.add_argument("--keep", type=Path, help="reuse (and keep) the checkpoints in this folder")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the three runs (single runs swing by 2x here)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from clover_testkit.checkpoints import write_checkpoint

    root = args.keep or Path(tempfile.mkdtemp(prefix="clover-convert-vs-"))
    tag = f"{args.preset}-L{args.layers}"
    clover, qwen = root / f"{tag}-bf16", root / f"{tag}-qwen35moe-bf16"
    if not (clover / "config.json").exists():
        write_checkpoint(clover, args.preset, dtype="bf16", config_overrides={"num_hidden_layers": args.layers})
    if not (qwen / "config.json").exists():
        qwen35moe_checkpoint(clover, qwen)
    size = {d: sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (clover, qwen)}
    ours = [sys.executable, "-m", "clover_convert", str(clover), str(root / "ours.gguf"), "--outtype", "f16",
            "--force", "--no-progress"]
    theirs = [sys.executable, "-c", UPSTREAM_RUNNER, str(UPSTREAM.parent), str(UPSTREAM), str(qwen),
              "--outtype", "f16", "--no-mtp", "--outfile", str(root / "upstream.gguf")]
    # the floor: the same bytes copied (page cache to a new file) and fsynced
    copy = [sys.executable, "-c", "import os, shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2]); "
            "f = open(sys.argv[2], 'rb+'); os.fsync(f.fileno())", str(clover / "model.safetensors"),
            str(root / "copy.bin")]
    print(f"preset {args.preset} with {args.layers} layers, bf16 -> f16, each in a fresh process (wall time "
          f"includes Python start-up and ends with the output on disk), on {os.cpu_count()} cores:")
    ratios, ratios_exit = [], []
    for rnd in range(1, args.repeat + 1):
        rows = {}
        for name, cmd, d, output in (("copy of the bytes", copy, clover, root / "copy.bin"),
                                     ("clover_convert", ours, clover, root / "ours.gguf"),
                                     ("convert_hf_to_gguf.py", theirs, qwen, root / "upstream.gguf")):
            dt, exited, rss = timed(cmd, output)
            rows[name] = (size[d] / MB / dt, dt, rss, size[d], size[d] / MB / exited)
        print(f" round {rnd} of {args.repeat}:")
        for name, (mbs, dt, rss, sz, mbs_exit) in rows.items():
            print(f"  {name:<22} {sz / MB:8.1f} MB source in {dt:6.2f} s = {mbs:6.1f} MB/s ({mbs_exit:6.1f} MB/s to "
                  f"the process's exit), peak RSS {rss / MB:7.1f} MB")
        o, t, c = (rows[k] for k in ("clover_convert", "convert_hf_to_gguf.py", "copy of the bytes"))
        ratios.append(o[0] / t[0])
        ratios_exit.append(o[4] / t[4])
        print(f"  ours / upstream: {ratios[-1]:.2f}x the MB/s ({ratios_exit[-1]:.2f}x to the process's exit); "
              f"ours / copy: {o[0] / c[0]:.2f}x")
    print(f"ours / upstream over {args.repeat} rounds: median {statistics.median(ratios):.2f}x, range "
          f"{min(ratios):.2f}-{max(ratios):.2f}x (target >= 4x); to the process's exit: median "
          f"{statistics.median(ratios_exit):.2f}x")
    (root / "copy.bin").unlink(missing_ok=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
