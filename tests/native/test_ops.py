"""The clover graph uses only ggml ops that the CPU, CUDA, Metal and Vulkan backends all handle."""
import importlib.util
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
CHECK_OPS = ROOT / "native" / "scripts" / "check_ops.py"


def load_check_ops():
    spec = importlib.util.spec_from_file_location("check_ops", CHECK_OPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_graph_ops_supported_by_every_backend(tiny_artifacts):
    check_ops = load_check_ops()
    ops = check_ops.graph_ops(tiny_artifacts["f16"], 8)
    # the ops that make Clover what it is must really be in the graph
    for op in ("GATED_DELTA_NET", "SSM_CONV", "PAD", "SOFT_MAX", "MUL_MAT_ID", "ROPE", "EXP"):
        assert op in ops
    assert check_ops.check(ops) == {"CPU": [], "CUDA": [], "Metal": [], "Vulkan": []}


def test_check_flags_an_unsupported_op():
    check_ops = load_check_ops()
    # (the CPU's supports_op accepts every op it does not name: its switch's default)
    assert check_ops.check(["MUL_MAT", "NO_SUCH_OP"]) == {"CPU": [], "CUDA": ["NO_SUCH_OP"], "Metal": ["NO_SUCH_OP"],
                                                          "Vulkan": ["NO_SUCH_OP"]}


def test_case_bodies_are_read():
    """Each backend's answer is its case's body: a bare return true is "yes", a condition is
    "conditional" (with the code), a unary op missing from the UNARY case's switch is "NO"."""
    check_ops = load_check_ops()
    res = check_ops.table(["GATED_DELTA_NET", "SSM_CONV", "SILU", "TRUNC"])
    assert res["CPU"]["SILU"][0] == "yes"                      # the CPU's default
    assert res["Vulkan"]["GATED_DELTA_NET"][0] == "conditional"
    assert "S_v != 16" in res["Vulkan"]["GATED_DELTA_NET"][1]  # its head-size condition
    assert res["CUDA"]["SSM_CONV"] == ("conditional", "{ return op->src[0]->ne[1] % 128 == 0; }")


def test_command_line(tmp_path):
    import subprocess
    import sys

    run = lambda *a: subprocess.run([sys.executable, str(CHECK_OPS), *a],  # noqa: E731
                                    capture_output=True, text=True)
    ok = run("--ops", "MUL_MAT,SOFT_MAX")
    assert ok.returncode == 0 and "Vulkan : every op" in ok.stdout
    bad = run("--ops", "NO_SUCH_OP")
    assert bad.returncode == 1 and "CUDA   : NOT supported: NO_SUCH_OP" in bad.stdout
    missing = run(str(tmp_path / "none.gguf"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr


def test_export_writes_the_graph_nodes_as_test_backend_ops_cases(tiny_artifacts, tmp_path):
    """`clover-ops --export` writes every distinct node of the two graphs in the line format that
    llama.cpp's `test-backend-ops --test-file` reads (tests/test-export-graph-ops.cpp): op, type,
    ne[4], the op params (count first), the sources (count first; type, ne[4], nb[4] each), a name."""
    import subprocess

    cases = tmp_path / "graph.cases"
    res = subprocess.run([str(ROOT / "build" / "bin" / "clover-ops"), str(tiny_artifacts["f16"]), "8",
                          "--export", str(cases)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "MUL_MAT_ID" in res.stdout.split()           # the op list is printed as before
    lines = cases.read_text().splitlines()
    assert len(lines) >= 50 and len(set(lines)) == len(lines)
    i32 = 26                                             # GGML_TYPE_I32
    expert_products = 0
    for line in lines:
        words = line.split()
        n_params = int(words[6])
        n_src = int(words[7 + n_params])
        assert n_params == 16 and 1 <= n_src <= 10
        assert len(words) == 8 + n_params + 9 * n_src + 1   # and the node's name, one word
        src_types = [int(words[8 + n_params + 9 * s]) for s in range(n_src)]
        expert_products += n_src == 3 and src_types[2] == i32  # MUL_MAT_ID: weights, rows, expert ids
    assert expert_products >= 2                          # the routed experts' gate/up and down
