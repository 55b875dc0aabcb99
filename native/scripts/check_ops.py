#!/usr/bin/env python3
"""Check that every ggml op of the clover graph is handled by the CPU, CUDA, Metal and Vulkan backends.

The op list comes from the built graph itself (clover-ops runs one causal commit and one commit
fused with a block pass with an eval callback, which visits every op; draft-self runs these two
graphs too, a verification being a causal commit and a draft a block pass). Each backend's
answer is read from its own supports_op in the pinned ggml sources:

    CPU     ggml-cpu/ggml-cpu.cpp       ggml_backend_cpu_device_supports_op
    CUDA    ggml-cuda/ggml-cuda.cu      ggml_backend_cuda_device_supports_op
    Metal   ggml-metal/ggml-metal-device.m  ggml_metal_device_supports_op
    Vulkan  ggml-vulkan/ggml-vulkan.cpp ggml_backend_vk_device_supports_op

For an op, the `case GGML_OP_X:` (`GGML_UNARY_OP_X` / `GGML_GLU_OP_X` inside the UNARY / GLU
case) is found in that function and its body read up to the next case of the same switch:
"yes" when it is `return true;`, "conditional" when it returns a condition (types, shapes: the
conditions are printed with --verbose; the runtime check of a built backend is the Vulkan tests'
scheduler check, tests/vulkan), "NO" when it is `return false;` or the case is absent and the
switch's default refuses. The CPU's switch accepts every op it does not name (`default: return
true`). Exits 1 when some backend answers NO for some op.

    python native/scripts/check_ops.py MODEL.gguf [--block-size 8] [--clover-ops build/bin/clover-ops] [-v]
    python native/scripts/check_ops.py --ops ADD,MUL_MAT,...      # a given op list (no build needed)
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GGML = ROOT / "third_party" / "llama.cpp" / "ggml" / "src"

# ops that only re-describe memory: every backend accepts them unconditionally
LAYOUT_OPS = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}
UNARY_OPS = {"ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK",
             "SILU", "HARDSWISH", "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "FLOOR",
             "CEIL", "ROUND", "TRUNC"}
GLU_OPS = {"REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK"}

BACKENDS = {
    "CPU": (GGML / "ggml-cpu" / "ggml-cpu.cpp", "static bool ggml_backend_cpu_device_supports_op("),
    "CUDA": (GGML / "ggml-cuda" / "ggml-cuda.cu", "static bool ggml_backend_cuda_device_supports_op("),
    "Metal": (GGML / "ggml-metal" / "ggml-metal-device.m", "bool ggml_metal_device_supports_op("),
    "Vulkan": (GGML / "ggml-vulkan" / "ggml-vulkan.cpp", "static bool ggml_backend_vk_device_supports_op("),
}

YES, COND, NO = "yes", "conditional", "NO"


def graph_ops(model: Path, block_size: int = 8, exe: Path = ROOT / "build" / "bin" / "clover-ops") -> list[str]:
    if not exe.is_file():
        raise SystemExit(f"error: {exe} is not built (./dev.sh setup builds it)")
    res = subprocess.run([str(exe), str(model), str(block_size)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"error: clover-ops failed: {res.stderr.strip()}")
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def function_body(path: Path, signature: str) -> str:
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing (the patched tree: python native/scripts/setup_llama.py)")
    text = path.read_text(errors="replace")
    try:
        start = text.index(signature)
        end = text.index("\n}\n", start)
    except ValueError:
        raise SystemExit(f"error: {signature.strip('(')} not found in {path}: the pinned ggml changed") from None
    # comments out: a commented-out case must not count
    body = re.sub(r"//[^\n]*", "", text[start:end])
    return re.sub(r"/\*.*?\*/", "", body, flags=re.S)


def case_label(op: str) -> str:
    if op in UNARY_OPS:
        return f"GGML_UNARY_OP_{op}"
    if op in GLU_OPS:
        return f"GGML_GLU_OP_{op}"
    return f"GGML_OP_{op}"


LABEL = re.compile(r"\b(case\s+[A-Z0-9_]+\s*:|default\s*:)")


def case_body(body: str, label: str) -> str | None:
    """The statements that run for `case label:` (after any labels that fall through with it), up
    to the next case or default of the same switch; None when the label is absent."""
    m = re.search(rf"\bcase\s+{label}\s*:", body)
    if not m:
        return None
    i = m.end()
    while True:  # labels stacked on the same body
        nxt = re.match(r"\s*(case\s+[A-Z0-9_]+\s*:|default\s*:)", body[i:])
        if not nxt:
            break
        i += nxt.end()
    depth, j = 0, i
    while j < len(body):
        c = body[j]
        if c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:
                break  # the end of the switch
            depth -= 1
        elif depth == 0 and LABEL.match(body, j) and body[j - 1] in " \t\n{;}":
            break
        j += 1
    return body[i:j]


def default_answer(body: str) -> str:
    """What the outer switch's default says (the last default of the function)."""
    m = list(re.finditer(r"default\s*:\s*(?:\{\s*)?return\s+(true|false)\s*;", body))
    return YES if m and m[-1].group(1) == "true" else NO


def classify(stmts: str) -> str:
    s = " ".join(stmts.split()).strip("{} ;")
    s = re.sub(r"^\{\s*|\s*\}$", "", s).strip()
    if re.fullmatch(r"return true;?", s) or s in ("break", "break;"):
        return YES
    if re.fullmatch(r"return false;?", s):
        return NO
    return COND


def answer(body: str, op: str, backend: str) -> tuple[str, str]:
    """(yes / conditional / NO, the case's code condensed) of one backend for one op."""
    if op in LAYOUT_OPS:
        return YES, ""
    stmts = case_body(body, case_label(op))
    if stmts is None:
        # a unary / glu op absent from the inner switch of case GGML_OP_UNARY / GLU: that
        # switch's default (it refuses, on every backend that has one)
        outer = "GGML_OP_UNARY" if op in UNARY_OPS else "GGML_OP_GLU" if op in GLU_OPS else None
        if outer and re.search(rf"\bcase\s+{outer}\s*:", body):
            return NO, f"no case {case_label(op)} in case {outer}"
        d = default_answer(body)
        return d, f"no case {case_label(op)}: the default returns {'true' if d == YES else 'false'}"
    return classify(stmts), " ".join(stmts.split())


def table(ops: list[str]) -> dict[str, dict[str, tuple[str, str]]]:
    """backend -> op -> (answer, code)."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for backend, (path, signature) in BACKENDS.items():
        body = function_body(path, signature)
        out[backend] = {op: answer(body, op, backend) for op in ops}
    return out


def check(ops: list[str]) -> dict[str, list[str]]:
    """backend -> the ops its supports_op refuses (answers NO)."""
    return {b: [op for op, (a, _) in res.items() if a == NO] for b, res in table(ops).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, nargs="?")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--clover-ops", type=Path, default=ROOT / "build" / "bin" / "clover-ops")
    ap.add_argument("--ops", help="comma-separated op names instead of a model's graph")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each conditional case's code")
    args = ap.parse_args(argv)
    if args.ops:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    elif args.model:
        if not args.model.is_file():
            print(f"error: {args.model}: no such file", file=sys.stderr)
            return 2
        ops = graph_ops(args.model, args.block_size, args.clover_ops)
    else:
        print("error: give MODEL.gguf or --ops", file=sys.stderr)
        return 2
    ops = sorted(set(ops))
    res = table(ops)
    shown = [op for op in ops if op not in LAYOUT_OPS]
    print(f"{len(ops)} ops in the clover graph ({len(ops) - len(shown)} layout-only: always supported)")
    names = list(BACKENDS)
    width = max(map(len, shown)) if shown else 4
    print(f"{'op':{width}s}  " + "  ".join(f"{b:11s}" for b in names))
    for op in shown:
        print(f"{op:{width}s}  " + "  ".join(f"{res[b][op][0]:11s}" for b in names))
    failed = {b: [op for op in shown if res[b][op][0] == NO] for b in names}
    if args.verbose:
        for b in names:
            for op in shown:
                a, code = res[b][op]
                if a != YES:
                    print(f"\n{b} {op} ({a}): {code[:600]}")
    print()
    for b in names:
        n_cond = sum(res[b][op][0] == COND for op in shown)
        print(f"{b:7s}: " + ("NOT supported: " + " ".join(failed[b]) if failed[b] else
                             f"every op ({n_cond} on conditions of type or shape)"))
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
