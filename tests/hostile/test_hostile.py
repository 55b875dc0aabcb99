"""Hostile inputs, round 2: every case ends in one clear line and a non-zero exit, or
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

ROOT = Path(__file__).resolve().parents[2]
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


def _communicate(p: subprocess.Popen, timeout: float, hang: str) -> tuple:
    """p's (stdout, stderr); past the timeout p is killed and the hang counted and failed."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        TALLY["hang"] += 1
        raise AssertionError(hang) from None


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
    one = tiny.tokenize(unit, add_bos=False, special=True)
    assert one.count(tiny.tokenize("<|im_start|>", add_bos=False, special=True)[0]) == 1
    t0 = time.perf_counter()
    many = tiny.tokenize(unit * 40000, add_bos=False, special=True)
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
    ids = {s: tiny.tokenize(s, add_bos=False, special=True) for s in specials}
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
                want += ids[seg] if seg in ids else tiny.tokenize(seg, add_bos=False, special=False)
        bad += tiny.tokenize(text, add_bos=False, special=True) != want
    TALLY["clean"] += 200 - bad
    TALLY["wrong"] += bad
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
    from clover_testkit import fuzz

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
    _clean_error(_clover("run", "-m", fifo, "-p", "x", "-n", "1"), "not a regular file")
    _clean_error(_run([CLI, "-m", fifo, "-p", "x", "-n", "1"]), "not a regular file")
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


# ----------------------------------------------------------------------------- RPC (patch 0005)

class _Silent:
    """A loopback listener that accepts, reads and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class _Http:
    """python's http.server on a loopback port (it answers an RPC hello with an HTTP error, or waits
    for the end of a request line that never comes)."""

    def __init__(self, folder: Path) -> None:
        import functools

        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
        handler.log_message = lambda *a, **k: None  # type: ignore[method-assign]
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _cli_rpc(model: Path, endpoint: str, env: dict, n: int = 4, timeout: float = BOUND) -> subprocess.CompletedProcess:
    return _run([CLI, "-m", model, "-p", "hello", "-n", n, "-t", "1", "-c", "256", "-ngl", "4", "--rpc", endpoint],
                timeout, env)


@pytest.mark.needs_libclover
@pytest.mark.parametrize("kind", ["silent", "http"])
def test_rpc_to_a_listener_that_is_not_an_rpc_server(tiny_artifacts, tmp_path, kind: str) -> None:
    """The load hung past 60 s (the README promises 10 s) in clover run, Clover(), clover serve and
    clover-cli: now an error within GGML_RPC_TIMEOUT (2 s here) through clover-cli and clover run."""
    lst = _Silent() if kind == "silent" else _Http(tmp_path)
    ep = f"127.0.0.1:{lst.port}"
    try:
        t0 = time.monotonic()
        _clean_error(_cli_rpc(tiny_artifacts["f32"], ep, {"GGML_RPC_TIMEOUT": "2"}), f"RPC server {ep}")
        t1 = time.monotonic()
        _clean_error(_clover("run", "-m", tiny_artifacts["f32"], "-p", "hello", "-n", "4", "-t", "1", "-ngl", "4",
                             "--rpc", ep, env={"GGML_RPC_TIMEOUT": "2"}), f"RPC server {ep}")
        t2 = time.monotonic()
    finally:
        lst.close()
    assert t1 - t0 < 2 + 5 and t2 - t1 < 2 + 10, (t1 - t0, t2 - t1)


@pytest.mark.needs_libclover
def test_rpc_silent_listener_default_limit_and_sigint(tiny_artifacts) -> None:
    """The default limit is the README's 10 s; with no limit (GGML_RPC_TIMEOUT=0) Ctrl-C ends
    clover-cli's load at once (it ignored SIGINT there)."""
    lst = _Silent()
    ep = f"127.0.0.1:{lst.port}"
    try:
        t0 = time.monotonic()
        _clean_error(_cli_rpc(tiny_artifacts["f32"], ep, {"GGML_RPC_TIMEOUT": ""}), "within 10 s")
        assert time.monotonic() - t0 < 10 + 5
        p = subprocess.Popen([str(CLI), "-m", str(tiny_artifacts["f32"]), "-p", "hi", "-n", "4", "-t", "1", "-ngl", "4",
                              "--rpc", ep], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                             env={**os.environ, "GGML_RPC_TIMEOUT": "0"})
        deadline = time.monotonic() + 20
        while len(lst.conns) == 0 and time.monotonic() < deadline:  # it is waiting for the handshake
            time.sleep(0.05)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = _communicate(p, 10, "clover-cli ignored SIGINT during an RPC handshake")
        ok = p.returncode == 130 and err.strip() == "error: interrupted"
        TALLY["clean" if ok else "wrong"] += 1
        assert ok, (p.returncode, err)
    finally:
        lst.close()


@pytest.mark.needs_libclover
@pytest.mark.skipif(not RPC_SERVER.exists(), reason="ggml-rpc-server is not built (GGML_RPC=OFF)")
def test_rpc_server_stopped_mid_generation(tiny_artifacts) -> None:
    """An rpc-server stopped with SIGSTOP mid-generation hung both CLIs (only SIGKILL ended
    them): keepalive probes are answered by the kernel. Now the reply wait runs out."""
    from clover_testkit.rpc import RpcServer

    srv = RpcServer(RPC_SERVER)
    try:
        p = subprocess.Popen([str(CLI), "-m", str(tiny_artifacts["f32"]), "-p", "hello", "-n", "4000", "-t", "1",
                              "-c", "4096", "--block-size", "1", "--ignore-eos", "-ngl", "4", "--rpc", srv.endpoint],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "GGML_RPC_TIMEOUT": "2"})
        assert p.stdout is not None
        first = p.stdout.read(len("hello") + 8)  # the prompt's echo, then 8 bytes generated: mid-generation
        os.kill(srv.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = _communicate(p, 30, "clover-cli hung on a stopped rpc-server")
        dt = time.monotonic() - t0
        res = subprocess.CompletedProcess(p.args, p.returncode, (first + out).decode(errors="replace"),
                                          err.decode(errors="replace"))
        _clean_error(res, f"RPC server {srv.endpoint}: no reply within 2 s")
        assert len(first) == len("hello") + 8 and dt < 2 + 8, (first, dt)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()


@pytest.mark.needs_libclover
@pytest.mark.parametrize("ep", ["127.0.0.1:50052:7", "::1:50052", "host:port:7", "127.0.0.1:5x", "127.0.0.1:+5"])
def test_rpc_endpoint_with_two_ports_is_refused(tiny_artifacts, ep: str) -> None:
    from clover_cpp import Clover, CloverError

    t0 = time.monotonic()
    with pytest.raises(CloverError, match="(is not|not a) HOST:PORT"):
        Clover(tiny_artifacts["f32"], n_gpu_layers=-1, rpc_servers=ep)
    TALLY["clean"] += 1
    assert time.monotonic() - t0 < 5


# ----------------------------------------------------------------------------- allocation failure

_ALLOC_SCRIPT = r"""
import resource, sys
lim = int(sys.argv[2]) << 20
if lim:
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
from clover_cpp import Clover, CloverError
n_ctx, B = int(sys.argv[3]), int(sys.argv[4])
try:
    m = Clover(sys.argv[1], n_ctx=n_ctx, n_threads=1, block_size=32)
    print("small", len(m.generate("def add(a, b):", max_tokens=8, stop_at_eos=False).tokens))
    try:
        m.generate("def add(a, b):", max_tokens=8, block_size=B, stop_at_eos=False)
        print("big ok")
    except CloverError as e:
        print("big error:", e)
    print("small again", len(m.generate("def add(a, b):", max_tokens=8, stop_at_eos=False).tokens))
except CloverError as e:
    print("error:", e)
"""


@pytest.mark.needs_libclover
@pytest.mark.parametrize("limit_mb,n_ctx,B", [(1500, 16384, 8192), (0, 1 << 21, 1 << 20), (1500, 4096, 2048)])
def test_allocation_failure_is_an_error(tiny_artifacts, limit_mb: int, n_ctx: int, B: int) -> None:
    """block_size = n_ctx = 8192 on the server under a memory limit aborted the process (GGML_ASSERT(ctx->
    mem_buffer != NULL): llama.cpp's scheduler buffer grows ~0.8 MB a token); a huge block size
    did even without one. Now an error, and the context keeps working at its old block size."""
    p = _run([sys.executable, "-c", _ALLOC_SCRIPT, tiny_artifacts["f32"], limit_mb, n_ctx, B], timeout=120)
    lines = p.stdout.splitlines()
    ok = p.returncode == 0 and lines[:1] == ["small 8"] and lines[-1:] == ["small again 8"] and \
        len(lines) == 3 and lines[1].startswith("big error: failed to create the llama.cpp context") and \
        "out of memory" in lines[1]
    TALLY["clean" if ok else "wrong"] += 1
    assert ok, (p.returncode, p.stdout, p.stderr[-1500:])


@pytest.mark.needs_libclover
def test_cli_allocation_failure_is_one_line(tiny_artifacts) -> None:
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1500 << 20, 1500 << 20))

    try:
        p = subprocess.run([str(CLI), "-m", str(tiny_artifacts["f32"]), "-p", "hi", "-n", "4", "-t", "1", "-c", "8192",
                            "--block-size", "8192"], capture_output=True, text=True, timeout=BOUND, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        TALLY["hang"] += 1
        raise
    if p.returncode < 0:
        TALLY["crash"] += 1
    _clean_error(p, "out of memory")


# ----------------------------------------------------------------------------- Ctrl-C while convert starts

_EARLY = r"""
import os, sys
sys.argv = ["clover", "convert", sys.argv[1], sys.argv[2], "--force", "--no-progress"]
import clover_cpp.cli as cli
os.write(1, b"R")
cli.main()
"""


def test_convert_ctrl_c_while_it_starts(tiny_artifacts, tmp_path) -> None:
    """Ctrl-C in the first ~70 ms of `clover convert` (numpy, gguf and safetensors loading)
    printed a traceback, or a RecursionError from a half-imported numpy. Once the command's
    module runs, SIGINT at any moment ends in `error: interrupted` (130) or a finished run."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_artifacts["ckpt"], ck)
    seen = Counter()
    for i in range(16):
        p = subprocess.Popen([sys.executable, "-c", _EARLY, str(ck), str(tmp_path / "o.gguf")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.read(1) == "R"
        time.sleep(0.03 * i)
        p.send_signal(signal.SIGINT)
        _, err = _communicate(p, BOUND, f"clover convert ignored SIGINT {0.03 * i:.2f} s after it started")
        ok = (p.returncode == 130 and err.strip() == "error: interrupted") or \
            (p.returncode in (0, -signal.SIGINT) and "Traceback" not in err and err.strip().startswith("wrote "))
        # (-SIGINT after "wrote": the run had finished; Python's own exit was interrupted)
        TALLY["clean" if ok else "wrong"] += 1
        assert ok, (0.03 * i, p.returncode, err[-1500:])
        seen[p.returncode] += 1
    assert seen[130] >= 1, seen  # some were interrupted (not all finished first)


# ----------------------------------------------------------------------------- calibration cache

_AUTO_SCRIPT = r"""
import sys
from clover_cpp import Clover
with Clover(sys.argv[1], n_ctx=512, n_threads=1) as m:
    print(len(m.generate("def add(a, b):", max_tokens=4, block_size="auto", stop_at_eos=False).tokens))
"""


@pytest.mark.needs_libclover
def test_calibration_cache_fifo(tiny_artifacts, tmp_path) -> None:
    """A FIFO in place of the calibration cache entry hung every auto generation: now the entry
    is measured again (with a warning) and replaced by a regular file."""
    env = {"CLOVER_CACHE_DIR": str(tmp_path)}
    p = _run([sys.executable, "-c", _AUTO_SCRIPT, tiny_artifacts["f32"]], env=env)
    entries = list(tmp_path.glob("calibration-*.txt"))
    assert p.returncode == 0 and p.stdout.split() == ["4"] and len(entries) == 1, p.stderr
    _fifo(entries[0])
    p = _run([sys.executable, "-c", _AUTO_SCRIPT, tiny_artifacts["f32"]], env=env)
    ok = p.returncode == 0 and p.stdout.split() == ["4"] and "calibration cache" in p.stderr and entries[0].is_file()
    TALLY["clean" if ok else "wrong"] += 1
    assert ok, (p.returncode, p.stdout, p.stderr[-1000:])


# ----------------------------------------------------------------------------- the counts

def test_zz_tally() -> None:
    """Runs last (file order): prints the counts of every case above (pytest -s) for the closing
    note; none may have crashed, hung, lost data or given a wrong result."""
    print(f"\nhostile cases: {sum(TALLY.values())} - " + ", ".join(f"{k} {TALLY[k]}" for k in
                                                                  ("clean", "crash", "hang", "loss", "wrong")))
    assert TALLY["crash"] == TALLY["hang"] == TALLY["loss"] == TALLY["wrong"] == 0, dict(TALLY)
