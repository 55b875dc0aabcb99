"""GGUFs say which semantics their weights were trained for (clover.semantics): one made for the
retired in-place semantics (no key) or another value is refused by every front end with one line
that says how to get a current one, and plain llama.cpp refuses it too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from clover_convert import mapping

from clover_testkit import fuzz

ROOT = Path(__file__).resolve().parents[2]
KEY = mapping.KEY_SEMANTICS.format(arch="clover")


@pytest.fixture(scope="module", params=[None, "in-place"], ids=["missing", "in-place"])
def retired(request, tiny_artifacts, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("retired") / "old.gguf"
    if request.param is None:  # dropped
        return fuzz.rewrite_gguf(tiny_artifacts["f32"], dst, drop=(KEY,))
    return fuzz.rewrite_gguf(tiny_artifacts["f32"], dst, kv={KEY: request.param})


def test_the_converter_writes_the_key(tiny_artifacts):
    import gguf

    f = gguf.GGUFReader(str(tiny_artifacts["f32"])).fields[KEY]
    assert f.contents() == "causal-shift"


def test_python_refuses_a_retired_gguf(retired):
    from clover_cpp import Clover, CloverError

    with pytest.raises(CloverError, match="retired in-place semantics.*clover convert"):
        Clover(retired, n_ctx=64)


@pytest.mark.parametrize("tool", ["clover", "clover-cli", "llama-simple"])
def test_front_ends_refuse_a_retired_gguf(retired, tool):
    cmd = {"clover": [str(ROOT / ".venv" / "bin" / "clover"), "run", "-m", str(retired), "-p", "x", "-n", "1"],
           "clover-cli": [str(ROOT / "build" / "bin" / "clover-cli"), "-m", str(retired), "-p", "x", "-n", "1"],
           # llama.cpp's own example (its log is written at once; llama-completion's asynchronous
           # logger may exit before the loader's error line is out)
           "llama-simple": [str(ROOT / "build" / "bin" / "llama-simple"), "-m", str(retired), "-n", "1", "x"]}[tool]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode != 0
    assert "retired in-place semantics" in p.stderr, (p.returncode, p.stdout[-300:], p.stderr[-300:])
    if tool != "llama-simple":  # llama.cpp's own tools log more than one line
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
