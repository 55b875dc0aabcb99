"""llama.cpp's own tools (build/bin, or $CLOVER_LLAMA_TOOLS_BIN) for the tests that hold Clover
to them: a tool by name (the test skips when it is not built), a run that must succeed, and the
default model as f16 (a module fixture)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("CLOVER_LLAMA_TOOLS_BIN") or REPO / "build" / "bin")
N_CTX = 512
PROMPT = "def main():"


def tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not built in {BIN} (./dev.sh setup builds llama.cpp's tools)")
    return path


def run_tool(args: list, **kw) -> subprocess.CompletedProcess:
    if "input" not in kw:
        kw["stdin"] = subprocess.DEVNULL
    res = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, (args[0], res.stdout[-2000:], res.stderr[-3000:])
    return res


# llama.cpp's tools print through common_log, whose writer thread is never joined at exit (upstream
# leaks the logger on purpose): on a busy machine the process can end before that thread has written
# the last lines, so llama-completion's text comes out cut short (seen under pytest -n 2) and
# llama-perplexity's final estimate goes missing. Run again when a line the tool logs after
# everything the test reads is absent.
LOGGER_TRIES = 5


def run_logged_tool(args: list, last_line: str) -> subprocess.CompletedProcess:
    for _ in range(LOGGER_TRIES):
        res = run_tool(args)
        if last_line in res.stdout + res.stderr:
            return res
    pytest.fail(f"{Path(args[0]).name} lost its last lines at exit {LOGGER_TRIES} times in a row "
                f"(no {last_line!r})")


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory) -> Path:
    """The default model (a trained one: greedy text, not random-weight noise), as f16."""
    from clover_convert import convert

    out = tmp_path_factory.mktemp("default") / "clover-default-f16.gguf"
    convert(REPO / "models" / "clover-default", out, outtype="f16", progress=False)
    return out
