"""The `clover` command for the tests: its runs through click's CliRunner, as a real process and in
a pseudo-terminal, the one-line user error they check for, and the model files they run on
(the tiny preset's, a junk file, a GGUF of another architecture)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from clover_cpp.cli import cli

REPO = Path(__file__).resolve().parent.parent
CLOVER_BIN = REPO / ".venv" / "bin" / "clover"
CLI_BIN = REPO / "build" / "bin" / "clover-cli"


@pytest.fixture(scope="session")
def files(tiny_artifacts, llama_gguf) -> dict[str, Path]:
    d = tiny_artifacts["dir"]
    junk = d / "junk.gguf"
    junk.write_bytes(np.random.default_rng(1).bytes(2048))
    return {"dir": d, "ck": tiny_artifacts["ckpt"], "model": tiny_artifacts["f32"], "junk": junk, "llama": llama_gguf}


def invoke(args: list[str], input: str | None = None):
    runner = CliRunner()
    return runner.invoke(cli, [str(a) for a in args], input=input, catch_exceptions=False)


def assert_user_error(res, *needles: str) -> None:
    assert res.exit_code == 1, res.output
    out = res.output
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for n in needles:
        assert n in lines[0], out


def in_a_terminal(cmd: list[str], timeout: float = 120, stdin: bytes | None = None, stderr: Any = None) -> bytes:
    """cmd's stdout when it is a terminal (a pseudo-terminal; stdin and stderr stay pipes or files:
    stdin gets the bytes given, stderr goes to the file given)."""
    import pty
    import select

    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=slave, stderr=stderr or subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE)
    os.close(slave)
    if stdin is not None:
        assert p.stdin is not None
        p.stdin.write(stdin)
        p.stdin.close()
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], timeout)
            if not r:
                raise AssertionError(f"no output for {timeout} s from {cmd}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        assert p.wait(timeout=timeout) == 0, cmd
    return out


def clover_process(args: list[str], **kw) -> subprocess.CompletedProcess:
    """`clover args` as a real process (the venv's script, else python -m clover_cpp.cli)."""
    exe = [str(CLOVER_BIN)] if CLOVER_BIN.exists() else [sys.executable, "-m", "clover_cpp.cli"]
    env = dict(os.environ)
    env.pop("CLOVER_DEBUG", None)
    return subprocess.run(exe + [str(a) for a in args], capture_output=True, text=True, timeout=120, env=env, **kw)
