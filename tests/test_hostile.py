"""Hostile inputs, round 2 (issue 28): every case ends in one clear line and a non-zero exit, or
in a correct result, within a bound, and never loses data.

* the tokenizer's special-token pass: linear in the number of special tokens (patch 0007);
* quantize: no output may be any shard of a split input; importance data validated against the
  model; a thread count out of range; inputs the loader refuses are not quantized;
* FIFOs (and other non-regular files) in place of every file read or written: refused up front;
* convert: a tokenizer.json with two strings on one id;
* RPC (patch 0005): a listener that is not an rpc-server, one that never answers, a server
  stopped with SIGSTOP mid-generation: an error within GGML_RPC_TIMEOUT; `HOST:PORT:N` refused;
* allocation failures (huge n_ctx, block size): an error, never SIGABRT.

Everything happens in tmp_path and on 127.0.0.1; every case runs under a timeout (a child
process, or a thread joined with one). TALLY counts the cases by outcome (clean / crash / hang /
loss / wrong) and the last test prints it (pytest -s) for the closing note.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(os.environ.get("CLOVER_CLI_PATH", ROOT / "build" / "bin" / "clover-cli"))
RPC_SERVER = Path(os.environ.get("CLOVER_RPC_SERVER_PATH", ROOT / "build" / "bin" / "ggml-rpc-server"))
BOUND = 60  # seconds: no case may take longer (a hang)

TALLY: Counter[str] = Counter()

pytestmark = pytest.mark.xdist_group("hostile")  # the tally test reads what the others counted


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _run(args: list, timeout: float = BOUND, env: dict | None = None) -> subprocess.CompletedProcess:
    """A front end in a child process: a hang is a timeout (counted), a signal a crash."""
    try:
        p = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace",
                           timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        TALLY["hang"] += 1
        raise AssertionError(f"{args}: no answer within {timeout} s (a hang)") from None
    if p.returncode < 0 or p.returncode > 128:
        TALLY["crash"] += 1
        raise AssertionError(f"{args}: killed by a signal (exit {p.returncode}): {p.stderr[-800:]}")
    return p


def _clover(*args, timeout: float = BOUND, env: dict | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "clover_cpp.cli", *args], timeout, env)


def _clean_error(p: subprocess.CompletedProcess, match: str = "") -> None:
    """One line `error: ...` (warnings before it allowed), a non-zero exit, no traceback."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("warning")]
    ok = p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr \
        and re.search(match, lines[0]) is not None
    TALLY["clean" if ok else "wrong"] += 1
    assert ok, f"exit {p.returncode}, stderr: {p.stderr[-1500:]}"


def _no_loss(before: dict[Path, str]) -> None:
    changed = [p for p, d in before.items() if not p.exists() or _digest(p) != d]
    if changed:
        TALLY["loss"] += 1
    assert not changed, f"changed or removed: {changed}"


# ----------------------------------------------------------------------------- tokenizer (0007)

@pytest.fixture(scope="module")
def tiny(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1) as m:
        yield m


@pytest.mark.needs_libclover
def test_special_token_pass_is_linear(tiny) -> None:
    """40k chat turns (1.3 MB, 80k special tokens): 11.6 s before patch 0007 (the pass walked the
    fragment list from its front for every match); now well under 2 s, with the tokens of one
    turn repeated (a special token ends each turn, so the turns tokenize independently)."""
    unit = "<|im_start|>user\nx<|im_end|>\n"
    one = tiny.tokenize(unit)
    assert one.count(tiny.tokenize("<|im_start|>")[0]) == 1
    t0 = time.perf_counter()
    many = tiny.tokenize(unit * 40000)
    dt = time.perf_counter() - t0
    ok = many == one * 40000 and dt < 2.0
    TALLY["clean" if ok else ("hang" if dt >= 2.0 else "wrong")] += 1
    assert many == one * 40000
    assert dt < 2.0, f"{dt:.2f} s"


@pytest.mark.needs_libclover
def test_special_token_pass_equals_segment_oracle(tiny) -> None:
    """Random texts of special tokens (several kinds, adjacent, at both ends) and plain text: the
    tokens equal those of the text split at the special tokens, each plain segment tokenized
    alone (the fragments the pass must produce), for 200 texts."""
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    ids = {s: tiny.tokenize(s) for s in specials}
    assert all(len(v) == 1 for v in ids.values())
    plain = ["a", " b", "hello world", "\n", "  ", "x<|im", "end|>", "def f():\n    return 1"]
    rng = np.random.default_rng(7)
    bad = 0
    for _ in range(200):
        parts = [str(rng.choice(specials + plain)) for _ in range(int(rng.integers(1, 30)))]
        text = "".join(parts)
        want: list[int] = []
        for seg in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
            if seg:
                want += ids[seg] if seg in ids else tiny.tokenize(seg, parse_special=False)
        bad += tiny.tokenize(text) != want
    TALLY["clean" if not bad else "wrong"] += 200 - bad if not bad else bad
    assert bad == 0
