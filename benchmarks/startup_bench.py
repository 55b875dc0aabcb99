"""Time to first token of `clover run` on the default model, measured from process start.

    .venv/bin/python benchmarks/startup_bench.py [--runs 7]

Spawns `.venv/bin/clover run` (a fresh Python process each time: imports, libclover load,
GGUF load, context, prefill, the first denoising steps) and times the first byte of the
generated text on stdout; the cost curve of block size auto is measured once beforehand (it
is cached on disk, as it is for users after their first run). Prints the median and range.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLOVER = REPO / ".venv" / "bin" / "clover"


def first_token_s(model: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([str(CLOVER), "run", "-m", str(model), "-p", "def fib(n):", "-n", "16", "--no-stats"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout is not None
    p.stdout.read(1)
    t = time.perf_counter() - t0
    p.communicate()
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from clover_convert import convert

    model = Path(tempfile.mkdtemp(prefix="clover-startup-")) / "clover-default-f16.gguf"
    convert(REPO / "models" / "clover-default", model, outtype="f16", progress=False)
    first_token_s(model)  # the block-size cost curve: measured once, then read from the disk cache
    times = [first_token_s(model) for _ in range(args.runs)]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import clover_cpp.cli"], check=True)
    imports = time.perf_counter() - t0
    print(f"clover run, default model (f16), time to first token over {args.runs} runs: median "
          f"{statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f}); "
          f"of which starting Python and importing clover_cpp.cli: {imports:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
