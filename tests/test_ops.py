"""The clover graph uses only ggml ops that the CPU, CUDA and Metal backends all handle."""
import importlib.util
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent


def load_check_ops():
    spec = importlib.util.spec_from_file_location("check_ops", ROOT / "native" / "check_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_graph_ops_supported_by_every_backend(tiny_artifacts):
    check_ops = load_check_ops()
    ops = check_ops.graph_ops(tiny_artifacts["f16"], 8)
    # the ops that make Clover what it is must really be in the graph
    for op in ("GATED_DELTA_NET", "SSM_CONV", "PAD", "SOFT_MAX", "MUL_MAT_ID", "ROPE", "EXP"):
        assert op in ops
    assert check_ops.check(ops) == {"CUDA": [], "Metal": []}


def test_check_flags_an_unsupported_op():
    check_ops = load_check_ops()
    assert check_ops.check(["MUL_MAT", "NO_SUCH_OP"]) == {"CUDA": ["NO_SUCH_OP"], "Metal": ["NO_SUCH_OP"]}
