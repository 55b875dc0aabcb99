"""Block diffusion at the release's real widths on a GPU: `benchmarks/gpu.sh slice` writes the
35b-a3b-slice checkpoint (clover_testkit.true_dims: hidden 2048, 256 experts top-8 + shared,
vocab 248,320; 4 of the 40 layers; random weights), converts it to an f16 GGUF and runs this.

    python benchmarks/gpu_slice.py SLICE.gguf BIN_DIR N_GPU_LAYERS OUT [--new 64]

Random weights are never confident, so block diffusion is measured the way gpu.sh's table 3 is:
threshold 1.0 with a step cap of B / k unmasks exactly k tokens per step, whatever the weights.
Printed: B = 1 against upstream llama-bench (tg) on the same file, then tok/s, ms per step and
llama.cpp graph reuse for B x k, and each cell's speed-up over B = 1; then the cost of a block
pass with the block expert coreset at C = 64 / 24 / 8 against full routing.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORESETS = (0, 64, 24, 8)


def main() -> None:
    gguf, bin_dir, ngl, out = sys.argv[1:5]
    new = int(sys.argv[sys.argv.index("--new") + 1]) if "--new" in sys.argv else 64
    # libclover before numpy (see gpu.sh: numpy 2.5's OpenBLAS first crashed llama-common's initialisers)
    ctypes.CDLL(os.environ["CLOVER_LIB_PATH"])
    sys.path.insert(0, str(ROOT))
    from clover_cpp import Clover

    t0 = time.time()
    lines = Lines([f"benchmarks/gpu_slice.py: {Path(gguf).name} ({os.path.getsize(gguf) / 2**30:.1f} GiB), "
             f"n_gpu_layers {ngl}, {new} new tokens per run", ""])
    up = subprocess.run([str(Path(bin_dir) / "llama-bench"), "-m", gguf, "-p", "0", "-n", str(new),
                         "-ngl", "99" if int(ngl) else "0", "-r", "3", "-o", "json"],
                        capture_output=True, text=True, timeout=300)
    try:
        tg = json.loads(up.stdout)[0]["avg_ts"]
    except (ValueError, IndexError, KeyError):
        tg = float("nan")
        lines.append(f"llama-bench printed no result: {(up.stderr + up.stdout)[-300:]!r}")
    prompt = "def parse(self, text):\n    return text.split()\n\ndef main():\n    "
    with Clover(gguf, n_ctx=1024, n_gpu_layers=int(ngl)) as m:
        def run(**kw):
            m.generate(prompt, max_tokens=8, stop_at_eos=False, **kw)
            return max((m.generate(prompt, max_tokens=new, stop_at_eos=False, **kw) for _ in range(3)),
                       key=lambda r: r.stats.tokens_per_second)

        ar_run = run(block_size=1)
        ar = ar_run.stats
        # the masked rows' greedy candidates are spread over the context's threads at this vocabulary:
        # one thread must give the same tokens
        kw = dict(max_tokens=32, block_size=16, threshold=0.9, max_steps=4, stop_at_eos=False)
        many = m.generate(prompt, **kw).tokens
        m.set_n_threads(1)
        one = m.generate(prompt, **kw).tokens
        m.set_n_threads(os.cpu_count() or 1)
        lines.append(f"block diffusion B = 16, the rows' candidates on {os.cpu_count()} threads vs 1: "
                     f"{'same tokens' if many == one else 'DIFFERENT tokens'}")
        lines += [f"B = 1: {ar.tokens_per_second:.1f} tok/s ({1e3 / ar.tokens_per_second:.2f} ms a token); "
                  f"upstream llama-bench tg{new}, same file: {tg:.1f} tok/s (ratio {ar.tokens_per_second / tg:.2f})", "",
                  "tok/s, speed-up over B = 1, ms per step, graphs reused / forwards: every step unmasks exactly k tokens",
                  f"  {'B':>3} {'k':>3} {'tok/s':>9} {'x B=1':>6} {'ms/step':>8} {'reused':>8}"]
        for B in (8, 16, 32, 64):
            for k in sorted({1, 2, 4, 8, B}):
                s = run(block_size=B, threshold=1.0, max_steps=B // k).stats
                step_ms = s.t_decode_ms / max(1, s.n_decode_forwards)
                lines.append(f"  {B:>3} {k:>3} {s.tokens_per_second:>9.1f} {s.tokens_per_second / ar.tokens_per_second:>6.2f} "
                             f"{step_ms:>8.2f} {s.n_graphs_reused:>4}/{s.n_decode_forwards:<3}")
        # the block expert coreset (spec/model.md "MoE"): a block pass reads C experts per layer, not
        # the union of its rows' (up to 256 at B = 32); one pass a block (k = B), ms per pass
        lines += ["", "block expert coreset: ms per block pass (k = B, one pass a block) by C (0 = off)",
                  f"  {'B':>3} " + " ".join(f"{'C=' + str(c):>9}" for c in CORESETS)]
        for B in (8, 32):
            cells = []
            for c in CORESETS:
                st = run(block_size=B, threshold=1.0, max_steps=1, coreset=c).stats
                cells.append(f"{st.t_decode_ms / max(1, st.n_decode_forwards):>9.2f}")
            lines.append(f"  {B:>3} " + " ".join(cells))
    lines += ["", f"wall time {time.time() - t0:.0f} s"]
    Path(out).write_text("\n".join(lines) + "\n")


class Lines(list):
    """The report's lines, each printed as it comes (a run stopped by its time limit keeps them)."""

    def __init__(self, first=()):
        super().__init__()
        self += first

    def append(self, line):
        print(line, flush=True)
        super().append(line)

    def __iadd__(self, more):
        for line in more:
            self.append(line)
        return self


if __name__ == "__main__":
    main()
