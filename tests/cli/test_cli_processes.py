"""The ``clover`` command as real processes: --help, a run, its errors, and Ctrl-C while each
tool is busy (exit status 130, one line)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clover_testkit.cli_runs import REPO, clover_process, files  # noqa: F401

needs_lib = pytest.mark.needs_libclover


# ----------------------------------------------------------------------------- real processes


def test_subprocess_help() -> None:
    p = clover_process(["--help"])
    assert p.returncode == 0 and "convert" in p.stdout and "demo" in p.stdout


@needs_lib
def test_subprocess_run(files) -> None:
    p = clover_process(["run", "-m", files["model"], "-p", "hello world", "-n", "16", "-t", "1", "--no-visual"])
    assert p.returncode == 0, p.stderr
    assert "\x1b[" not in p.stdout and p.stdout.endswith("\n") and len(p.stdout) > len("hello world\n")
    # (the first run of a file on a machine says first that it measures the cost curve)
    stats = [ln for ln in p.stderr.splitlines() if not ln.startswith("clover: measuring the cost curve")]
    assert stats and stats[0].startswith("[clover]") and "Traceback" not in p.stderr
    # stdout is a pipe: plain text even without --no-visual
    q = clover_process(["run", "-m", files["model"], "-p", "hello world", "-n", "16", "-t", "1"])
    assert q.returncode == 0 and q.stdout == p.stdout


def test_subprocess_errors(files) -> None:
    p = clover_process(["run", "-m", files["junk"], "-p", "x"])
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr
    p = clover_process(["run", "-m", files["model"], "-p", "x", "--threshold", "2"])
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stderr.startswith("error: ")


# ----------------------------------------------------------------------------- Ctrl-C
@needs_lib
def test_ctrl_c_exits_130_with_one_line(files, tmp_path) -> None:
    """Ctrl-C while each tool is busy (generating, waiting for a chat line, serving, benchmarking):
    exit status 130 and the single line 'error: interrupted', no traceback, no ctypes noise."""
    import select
    import signal
    import time

    g = str(files["model"])
    py = [sys.executable, "-m", "clover_cpp.cli"]
    long_run = ["-m", g, "-p", "hi", "-n", "4000", "-c", "8192", "--ignore-eos", "--block-size", "1", "-t", "1"]
    cmds = {
        "run": py + ["run", "--no-stats"] + long_run,
        "run --visual": py + ["run", "--visual", "--no-stats"] + long_run,
        "clover-cli": [str(REPO / "build" / "bin" / "clover-cli")] + long_run,
        "chat": py + ["chat", "-m", g, "-t", "1"],
        "serve": py + ["serve", "-m", g, "--port", "0", "-t", "1"],
        "bench": py + ["bench", "-m", g, "-n", "3000", "-t", "1"],
    }
    t0 = time.monotonic()
    procs = {k: subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
             for k, c in cmds.items()}
    for k, p in procs.items():  # busy: the generators have printed text, the server its address
        if k not in ("chat", "bench"):
            assert select.select([p.stderr if k == "serve" else p.stdout], [], [], 60)[0], k
    time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))  # chat and bench print nothing while busy
    for p in procs.values():
        p.send_signal(signal.SIGINT)
    for k, p in procs.items():
        _, err = p.communicate(timeout=60)
        text = err.decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("clover serve:", "[block"))]
        assert p.returncode == 130, (k, p.returncode, text[-500:])
        assert lines == ["error: interrupted"], (k, text[-500:])
