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


# ----------------------------------------------------------------------------- quantize: outputs, imatrix

@pytest.fixture(scope="module")
def split_model(tiny_artifacts, tmp_path_factory) -> list[Path]:
    """The tiny f32 model converted as three shards (NAME-0000i-of-00003.gguf)."""
    from clover_convert import convert

    d = tmp_path_factory.mktemp("split")
    plan = convert(tiny_artifacts["ckpt"], d / "tiny.gguf", outtype="f32", split_max_size="500K", progress=False)
    shards = [Path(p) for p in plan.shard_paths]
    assert len(shards) >= 3 and shards[1].name.endswith("-00002-of-%05d.gguf" % len(shards))
    return shards


@pytest.mark.needs_libclover
@pytest.mark.parametrize("which", [0, 1, 2])
def test_quantize_never_overwrites_a_shard_of_its_input(split_model, which: int) -> None:
    before = {p: _digest(p) for p in split_model}
    _clean_error(_clover("quantize", split_model[0], split_model[which], "Q8_0", "--force"), "is one of the inputs")
    _no_loss(before)


def test_convert_never_overwrites_its_input(tiny_artifacts, tmp_path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], ck)
    before = {p: _digest(p) for p in ck.iterdir()}
    for name in ("model.safetensors", "config.json"):
        _clean_error(_clover("convert", ck, ck / name, "--force"), "is one of the inputs")
    _no_loss(before)


def _write_imatrix(path: Path, model: Path, *, value=None, only: int | None = None, rename: bool = False,
                   short: bool = False, counts: float = 256.0) -> Path:
    """A GGUF importance matrix for the 2D/3D weights of model (llama-imatrix's format); value
    replaces every sum (0, -1, nan), only keeps the first N entries, rename gives names no tensor
    has, short drops one value per entry."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "imatrix")
    w.add_type("imatrix")
    w.add_uint32("imatrix.chunk_count", 4)
    n = 0
    for t in gguf.GGUFReader(model).tensors:
        if not (t.name.endswith(".weight") and len(t.shape) >= 2 and t.name != "token_embd.weight"):
            continue
        if only is not None and n >= only:
            break
        n_per_row, n_mat = int(t.shape[0]), int(np.prod(t.shape[2:])) if len(t.shape) > 2 else 1
        s = rng.uniform(0.01, 10, (n_mat, n_per_row - (1 if short else 0))).astype(np.float32)
        if value is not None:
            s[:] = value
        name = ("nosuch." if rename else "") + t.name
        w.add_tensor(f"{name}.in_sum2", s)
        w.add_tensor(f"{name}.counts", np.full((n_mat, 1), counts, np.float32))
        n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.needs_libclover
@pytest.mark.parametrize("case,match", [
    (dict(value=0.0), "every importance value is zero"),
    (dict(value=-1.0), "negative"),
    (dict(value=float("nan")), "NaN or infinite"),
    (dict(value=float("inf")), "NaN or infinite"),
    (dict(counts=0.0), "every count is zero"),
    (dict(counts=-3.0), "negative"),
    (dict(rename=True), "name no tensor"),
    (dict(short=True), "values, but the tensor"),
])
def test_quantize_refuses_bad_importance_data(tiny_artifacts, tmp_path, case, match) -> None:
    """An all-zero imatrix exited 0 and wrote a model that printed only spaces (weights' relative
    RMS error 0.98); one whose names match nothing was ignored silently."""
    im = _write_imatrix(tmp_path / "im.gguf", tiny_artifacts["f32"], **case)
    out = tmp_path / "out.gguf"
    _clean_error(_clover("quantize", tiny_artifacts["f32"], out, "Q4_K_M", "--imatrix", im), match)
    assert not out.exists() and not list(tmp_path.glob(".out.gguf.*"))


@pytest.mark.needs_libclover
def test_quantize_warns_of_weights_without_importance_data(tiny_artifacts, tmp_path) -> None:
    im = _write_imatrix(tmp_path / "im.gguf", tiny_artifacts["f32"], only=3)
    out = tmp_path / "out.gguf"
    p = _clover("quantize", tiny_artifacts["f32"], out, "Q4_K_M", "--imatrix", im)
    ok = p.returncode == 0 and out.is_file() and re.search(r"warning: im.gguf has no data for \d+ weight tensors",
                                                           p.stderr) is not None
    TALLY["clean" if ok else "wrong"] += 1
    assert ok, p.stderr


@pytest.mark.needs_libclover
def test_quantize_thread_count_and_output_that_is_the_imatrix(tiny_artifacts, tmp_path) -> None:
    """-t 100000 made llama.cpp's quantizer abort (std::system_error from thread creation)."""
    src = tiny_artifacts["f32"]
    _clean_error(_clover("quantize", src, tmp_path / "o.gguf", "Q8_0", "-t", "100000"), "threads must be")
    im = _write_imatrix(tmp_path / "im.gguf", src)
    before = {im: _digest(im)}
    _clean_error(_clover("quantize", src, im, "Q8_0", "--imatrix", im, "--force"), "is one of the inputs")
    _no_loss(before)


@pytest.mark.needs_libclover
@pytest.mark.parametrize("kv", [{"clover.diffusion.block_size": 0}, {"clover.block_count": 1000}])
def test_quantize_refuses_inputs_the_loader_refuses(tiny_artifacts, tmp_path, kv) -> None:
    """quantize read only the header (gguf-py): a file `clover run` refuses became a quantized
    file that it refuses too; now libclover's loader checks the input (and the output) first."""
    sys.path.insert(0, str(Path(__file__).parent))
    import fuzz

    bad = fuzz.rewrite_gguf(tiny_artifacts["f32"], tmp_path / "bad.gguf", kv=kv)
    out = tmp_path / "out.gguf"
    _clean_error(_clover("quantize", bad, out, "Q8_0"), "")
    assert not out.exists() and not list(tmp_path.glob(".out.gguf.*"))


# ----------------------------------------------------------------------------- FIFOs

def _fifo(path: Path) -> Path:
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "chat_template.jinja"])
def test_convert_refuses_a_fifo_input(tiny_artifacts, tmp_path, name: str) -> None:
    """`clover convert` with model.safetensors as a FIFO hung, deaf to SIGINT and SIGTERM."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], ck)
    _fifo(ck / name)
    out = tmp_path / "out.gguf"
    _clean_error(_clover("convert", ck, out), "FIFO")
    assert not out.exists()


@pytest.mark.needs_libclover
def test_fifos_in_place_of_model_imatrix_and_output(tiny_artifacts, tmp_path) -> None:
    src = tiny_artifacts["f32"]
    fifo = _fifo(tmp_path / "fifo.gguf")
    _clean_error(_clover("inspect", fifo), "FIFO")
    _clean_error(_clover("quantize", fifo, tmp_path / "o.gguf", "Q8_0"), "FIFO")
    _clean_error(_clover("quantize", src, tmp_path / "o.gguf", "Q4_K_M", "--imatrix", fifo), "FIFO")
    _clean_error(_clover("quantize", src, fifo, "Q8_0", "--force"), "not a regular file")
    ck = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], ck)
    _clean_error(_clover("convert", ck, fifo, "--force"), "not a regular file")
    assert fifo.exists() and not fifo.is_file()  # still the FIFO: nothing replaced it


@pytest.mark.needs_libclover
def test_split_input_with_a_fifo_shard(split_model, tmp_path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    for p in split_model:
        shutil.copy(p, d / p.name)
    _fifo(d / split_model[1].name)
    _clean_error(_clover("quantize", d / split_model[0].name, tmp_path / "o.gguf", "Q8_0"), "FIFO")


# ----------------------------------------------------------------------------- convert: tokenizer.json

@pytest.mark.parametrize("how", ["vocab", "added", "two_ids"])
def test_convert_refuses_a_tokenizer_with_two_strings_on_one_id(tiny_artifacts, tmp_path, how: str) -> None:
    """Two strings on one id converted (the token silently renamed)."""
    import json

    ck = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], ck)
    tj = json.loads((ck / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    first = next(iter(vocab))
    if how == "vocab":
        vocab["zzz-duplicate"] = vocab[first]
    elif how == "added":
        tj["added_tokens"].append({"id": vocab[first], "content": "<|other|>", "special": True})
    else:
        top = max([*vocab.values(), *(a["id"] for a in tj["added_tokens"])])
        tj["added_tokens"].append({"id": top + 1, "content": tj["added_tokens"][0]["content"], "special": True})
    (ck / "tokenizer.json").write_text(json.dumps(tj))
    out = tmp_path / "out.gguf"
    _clean_error(_clover("convert", ck, out), "two (strings|ids)")
    assert not out.exists()
