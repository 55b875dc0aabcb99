"""The first run of a file at block size auto measures its cost curve (seconds to minutes of
silence on a large model): the command lines say so in one line on stderr, once, and
not when the curve comes from the disk cache or the block size is fixed; the library says it
only at verbosity 1 and up (a quiet library prints nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

NOTICE = "clover: measuring the cost curve of block size auto (once per model file and machine; kept in {})"


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL, env={**os.environ, "CLOVER_CACHE_DIR": str(cache)})
    assert p.returncode == 0, p.stderr
    return p


def _clover_run(gguf: Path, cache: Path, *flags: str) -> list[str]:
    p = _run(["-m", "clover_cpp.cli", "run", "-m", str(gguf), "-p", "def f(x):", "-n", "8", "-t", "1", *flags], cache)
    return [ln for ln in p.stderr.splitlines() if ln.startswith("clover:")]


def test_the_command_line_says_it_measures_once_then_not(tiny_artifacts, tmp_path: Path) -> None:
    gguf, cache = tiny_artifacts["f32"], tmp_path / "cache"
    assert _clover_run(gguf, cache, "--block-size", "1") == []  # no auto: nothing measured
    assert _clover_run(gguf, cache) == [NOTICE.format(cache)]
    assert _clover_run(gguf, cache) == []  # from the disk cache


def test_clover_cli_says_it_measures_once_then_not(tiny_artifacts, tmp_path: Path) -> None:
    cli = Path(__file__).resolve().parents[2] / "build" / "bin" / "clover-cli"
    if not cli.exists():
        pytest.skip("clover-cli is built by ./dev.sh setup")
    gguf, cache = tiny_artifacts["f32"], tmp_path / "cache"

    def notices() -> list[str]:
        p = subprocess.run([str(cli), "-m", str(gguf), "-p", "def f(x):", "-n", "8", "-t", "1"], capture_output=True,
                           text=True, timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "CLOVER_CACHE_DIR": str(cache)})
        assert p.returncode == 0, p.stderr
        return [ln for ln in p.stderr.splitlines() if ln.startswith("clover: measuring")]

    assert notices() == [NOTICE.format(cache)]
    assert notices() == []


@pytest.mark.parametrize("verbose", [False, True])
def test_the_library_says_it_only_when_verbose(tiny_artifacts, tmp_path: Path, verbose: bool) -> None:
    code = (f"from clover_cpp import Clover\nwith Clover({str(tiny_artifacts['f32'])!r}, n_ctx=256, n_threads=1, "
            f"verbose={verbose}) as m:\n    m.generate('def f(x):', max_tokens=8)\n")
    p = _run(["-c", code], tmp_path / "cache")
    notices = [ln for ln in p.stderr.splitlines() if ln.startswith("clover: measuring")]
    assert notices == ([NOTICE.format(tmp_path / "cache")] if verbose else []), p.stderr
