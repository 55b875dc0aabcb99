#!/usr/bin/env python3
"""Check that every ggml op of the clover graph is handled by the CPU, CUDA and Metal backends.

The op list comes from the built graph itself (build/bin/clover-ops runs one commit and one
block pass with an eval callback, on the CPU backend, which thereby runs every op). For CUDA
and Metal, which are not compiled here, the check reads each backend's supports_op in the
pinned ggml sources.
An op counts as handled when its `case GGML_OP_X` / `GGML_UNARY_OP_X` / `GGML_GLU_OP_X`
appears in that function; conditions inside a case (types, sizes) are printed for review.

    python native/check_ops.py MODEL.gguf [--block-size 8]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGML = ROOT / "third_party" / "llama.cpp" / "ggml" / "src"

# ops that only re-describe memory: every backend accepts them unconditionally
LAYOUT_OPS = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}
UNARY_OPS = {"ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK",
             "SILU", "HARDSWISH", "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "FLOOR",
             "CEIL", "ROUND", "TRUNC"}
GLU_OPS = {"REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK"}

BACKENDS = {
    "CUDA": (GGML / "ggml-cuda" / "ggml-cuda.cu", "static bool ggml_backend_cuda_device_supports_op("),
    "Metal": (GGML / "ggml-metal" / "ggml-metal-device.m", "bool ggml_metal_device_supports_op("),
}


def graph_ops(model: Path, block_size: int) -> list[str]:
    exe = ROOT / "build" / "bin" / "clover-ops"
    res = subprocess.run([str(exe), str(model), str(block_size)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"error: clover-ops failed: {res.stderr.strip()}")
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def function_body(path: Path, signature: str) -> str:
    text = path.read_text(errors="replace")
    start = text.index(signature)
    end = text.index("\n}\n", start)
    return text[start:end]


def case_label(op: str) -> str:
    if op in UNARY_OPS:
        return f"GGML_UNARY_OP_{op}"
    if op in GLU_OPS:
        return f"GGML_GLU_OP_{op}"
    return f"GGML_OP_{op}"


def check(ops: list[str]) -> dict[str, list[str]]:
    """backend -> ops that its supports_op does not name."""
    missing: dict[str, list[str]] = {}
    for backend, (path, signature) in BACKENDS.items():
        body = function_body(path, signature)
        gaps = []
        for op in ops:
            if op in LAYOUT_OPS:
                continue
            if not re.search(rf"case\s+{case_label(op)}\s*:", body):
                gaps.append(op)
        missing[backend] = gaps
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--block-size", type=int, default=8)
    args = ap.parse_args(argv)
    ops = graph_ops(args.model, args.block_size)
    print(f"{len(ops)} ops in the clover graph: {' '.join(ops)}")
    print("CPU   : all executed (clover-ops ran the graph on the CPU backend)")
    missing = check(ops)
    for backend, gaps in missing.items():
        print(f"{backend:6s}: " + ("all handled" if not gaps else "NOT handled: " + " ".join(gaps)))
    return 1 if any(missing.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
