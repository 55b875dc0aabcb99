"""`clover serve`'s connections and request bodies under attack.

* a request head trickled at 1 byte/s stayed open forever (uvicorn has no head deadline): now
  408 and closed after ``Limits.header_timeout``; connections that send nothing are closed too;
* half-open connections used up the process's fds (and /health with them): a cap on open
  connections and on connections per client address (503 and closed past it), /health answers
  from another address meanwhile, and the places come back when the connections go;
* a body under --max-body holding millions of token ids was refused only after it was parsed
  (1.2 GB): now counted before parsing;
* lone surrogates (``stop``, ``content``) and tool-call arguments nested 100,000 deep: 400s
  naming the field (they were accepted, or 500s);
* a chunk size of 5,000 hex digits: 400 and one log line (it logged a traceback).

The server runs in a child process (serve() with small limits), on loopback addresses."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

LIMITS = dict(header_timeout=1.5, max_connections=24, max_connections_per_client=8, body_timeout=2.0,
              max_body_bytes=8 * 2**20)


class Serve:
    """serve() in a child with LIMITS; its log (stdout and stderr) read at the end."""

    def __init__(self, gguf: Path, **extra) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        code = (f"from clover_cpp.server import serve, Limits; serve({str(gguf)!r}, port={self.port}, n_ctx=512, "
                f"n_threads=1, limits=Limits(**{dict(LIMITS, **extra)!r}))")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the server did not come up")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    s = Serve(tiny_artifacts["f32"])
    yield s
    s.stop()


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed s within seconds (reading what it sent meanwhile)."""
    s.settimeout(0.2)
    data, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, data
        if not chunk:
            return True, data
        data += chunk
    return False, data


def _health(port: int, source: str) -> int:
    with _connect(port, source) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        closed, data = _closed_within(s, 10)
    return int(data.split(b" ", 2)[1]) if data else 0


def _trickle(s: socket.socket, data: bytes, gap: float, seconds: float) -> tuple[bool, bytes, float]:
    """Send data a byte every gap seconds for up to seconds; (closed by the server, what it sent, when)."""
    t0 = time.monotonic()
    got = b""
    s.settimeout(gap)
    for b in data:
        if time.monotonic() - t0 > seconds:
            return False, got, time.monotonic() - t0
        try:
            s.sendall(bytes([b]))
            chunk = s.recv(65536)
            if not chunk:
                return True, got, time.monotonic() - t0
            got += chunk
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True, got, time.monotonic() - t0
    return False, got, time.monotonic() - t0


def test_a_trickled_head_is_cut_off(server) -> None:
    s = _connect(server.port)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    closed, data, when = _trickle(s, head, 0.3, LIMITS["header_timeout"] + 5)
    s.close()
    assert closed and when < LIMITS["header_timeout"] + 2, when
    assert data.startswith(b"HTTP/1.1 408") and b"header_timeout" in data, data[:200]


def test_a_silent_connection_is_closed(server) -> None:
    s = _connect(server.port)
    closed, data = _closed_within(s, LIMITS["header_timeout"] + 4)
    s.close()
    assert closed and data == b""


def test_a_kept_alive_connection_has_the_head_deadline_too(server) -> None:
    s = _connect(server.port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")  # the answer; the connection stays open
    closed, _, when = _trickle(s, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 20, 0.3,
                               LIMITS["header_timeout"] + 5)
    s.close()
    assert closed and when < LIMITS["header_timeout"] + 2, when


def test_connections_per_client_are_capped_and_health_answers(server) -> None:
    n = LIMITS["max_connections_per_client"]
    socks = [_connect(server.port, "127.0.0.2") for _ in range(n)]
    extra = _connect(server.port, "127.0.0.2")
    closed, data = _closed_within(extra, 3)
    extra.close()
    assert closed and data.startswith(b"HTTP/1.1 503") and b"too_many_connections" in data, data[:300]
    assert _health(server.port, "127.0.0.3") == 200  # another address is served meanwhile
    for s in socks:
        s.close()
    time.sleep(0.3)
    assert _health(server.port, "127.0.0.2") == 200  # the places came back


def test_open_connections_are_capped(server) -> None:
    per, total = LIMITS["max_connections_per_client"], LIMITS["max_connections"]
    socks = [_connect(server.port, f"127.0.1.{i // per + 1}") for i in range(total)]
    time.sleep(0.2)
    extra = _connect(server.port, "127.0.2.1")
    closed, data = _closed_within(extra, 3)
    extra.close()
    for s in socks:
        s.close()
    assert closed and data.startswith(b"HTTP/1.1 503"), data[:300]
    time.sleep(0.3)
    assert _health(server.port, "127.0.2.1") == 200


def test_half_open_connections_are_closed_in_time(server) -> None:
    """The issue's case: many connections that send nothing; the server closes them itself."""
    socks = [_connect(server.port, f"127.0.3.{i // 8 + 1}") for i in range(20)]
    t0 = time.monotonic()
    assert all(_closed_within(s, LIMITS["header_timeout"] + 4)[0] for s in socks)
    assert time.monotonic() - t0 < LIMITS["header_timeout"] + 6
    for s in socks:
        s.close()
    assert _health(server.port, "127.0.3.1") == 200


def test_millions_of_token_ids_are_refused_before_parsing(server) -> None:
    ids = ",".join(["1"] * 4_000_000)  # 8 MB: the 4.19M
    body = ('{"prompt": [' + ids + '], "max_tokens": 1}').encode()
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and "JSON values" in r.json()["error"]["message"], r.text[:300]
    r = httpx.post(server.url + "/detokenize", content=('{"tokens": [' + ids + ']}').encode(), timeout=60)
    assert r.status_code == 400
    # strings do not count: a prompt of commas is text
    r = httpx.post(server.url + "/tokenize", json={"content": "," * 400_000}, timeout=60)
    assert r.status_code in (200, 400) and "JSON values" not in r.text


def test_json_values_is_an_upper_bound() -> None:
    from clover_cpp.server.types import json_values

    for doc in ([1, 2, 3], {"a": [1, {"b": "x,y,[z]"}], "c": "\\\",,,["}, [[[]]], "a\\\\", ["\\", ","], {}):
        raw = json.dumps(doc).encode()

        def count(x) -> int:  # noqa: ANN001
            return 1 + sum(count(c) for c in (x.values() if isinstance(x, dict) else x)) \
                if isinstance(x, (dict, list)) else 1
        assert count(doc) <= json_values(raw) <= count(doc) + raw.count(b"{") + 1, (doc, json_values(raw))
    # linear on the inputs that make a naive string pattern quadratic
    for raw in (b'["' + b'\\"' * 2_000_000 + b']', b'"' * 4_000_000, b'["\\' + b'\\' * 3_000_001):
        t0 = time.monotonic()
        json_values(raw)
        assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("field,body", [
    ("stop", {"prompt": "a", "max_tokens": 1, "stop": ["\ud800"]}),
    ("stop", {"prompt": "a", "max_tokens": 1, "stop": "x\udfff"}),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, field: str, body: dict) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate as a \\u escape
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text[:300]


@pytest.mark.parametrize("path", ["/apply-template", "/v1/chat/completions"])
def test_surrogate_content_and_deep_tool_arguments_are_400s(server, path: str) -> None:
    extra = {"max_tokens": 1} if "chat" in path else {}
    msg = {"role": "user", "content": "hi \udc80"}
    r = httpx.post(server.url + path, content=json.dumps({"messages": [msg], **extra}).encode(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"], r.text[:300]
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    r = httpx.post(server.url + path, json={"messages": msgs, **extra}, timeout=30)
    assert r.status_code == 400 and "nest deeper" in r.json()["error"]["message"], r.text[:300]
    # a valid emoji pair is text
    r = httpx.post(server.url + path, content=json.dumps({"messages": [{"role": "user", "content": "\U0001f600"}],
                                                          **extra}).encode(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]


def test_a_bad_chunk_size_logs_one_line(tiny_artifacts) -> None:
    s = Serve(tiny_artifacts["f32"])
    try:
        with _connect(s.port) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n" + b"1" * 5000 + b"\r\nabc\r\n0\r\n\r\n")
            _, data = _closed_within(c, 10)
        assert data.startswith(b"HTTP/1.1 400"), data[:200]
        time.sleep(0.5)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    finally:
        log = s.stop()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert log.count("Invalid HTTP request received") == 1, log[-3000:]
