"""`clover serve` against hostile requests: one request never takes the server down.

* the battery: bodies that are not UTF-8, nest deep, are not objects, hold NaN; a
  Content-Length larger than the body and a body that trickles in (408 within
  --body-timeout); bodies over --max-body (413, declared or chunked); more than --max-messages
  messages; prompts far over the context (refused untokenized, /health answering meanwhile);
  block sizes out of range; a subnormal temperature; token ids past 2**32; unknown routes.
  Every answer has OpenAI's error shape, and afterwards a normal request succeeds;
* a generation that makes no progress: /health answers 503 while it lasts, the watchdog
  cancels it and its request gets a clean error, then the server serves again;
* SIGTERM ends the process: with a generation in flight, and with one that ignores being
  cancelled (within the hard deadline).

Loopback servers, bounded in count and time; temporary folders only."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clover_testkit.server_harness import InProcessServer, ScriptedClover, Server
from clover_testkit.server_harness import post as _post

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

LIMITS = ("--body-timeout", "1", "--max-body", "65536", "--max-messages", "100", "--stuck-timeout", "3",
          "--parallel", "1", "-t", "1")


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f32"]


@pytest.fixture(scope="module")
def server(gguf):
    s = Server(gguf, *LIMITS)
    yield s
    s.stop()


def _shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


def _raw(port: int, head: bytes, parts: list[bytes], gap: float = 0.0, timeout: float = 10) -> tuple[int, bytes, float]:
    """Sends head and then parts (gap seconds apart) on a raw socket; (status, body, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for p in parts:
                time.sleep(gap)
                s.sendall(p)
        except OSError:  # the server answered and closed while we were still sending
            pass
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1], time.monotonic() - t0


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _head(length: int | None, chunked: bool = False) -> bytes:
    h = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if chunked:
        h += b"Transfer-Encoding: chunked\r\n"
    if length is not None:
        h += b"Content-Length: %d\r\n" % length
    return h + b"\r\n"


def test_hostile_battery_then_a_normal_request(server, local_tokens) -> None:
    url = server.url
    # not UTF-8, deep, not an object, NaN, wrong types
    assert "UTF-8" in _shape(_post(server, "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400)["message"]
    assert "deeper" in _shape(_post(server, "/v1/completions", b"[" * 20000 + b"]" * 20000), 400)["message"]
    deep = '{"prompt": "x", "stop": ' + "[" * 100 + "]" * 100 + "}"
    assert "deeper" in _shape(_post(server, "/v1/completions", deep), 400)["message"]
    for body in (b"[1, 2]", b"null", b'"x"', b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x",}'):
        _shape(_post(server, "/v1/completions", body), 400)
    # a Content-Length larger than the body, and a body that trickles in: 408 within --body-timeout
    status, body, took = _raw(server.port, _head(1000), [b'{"prompt": "x"'])
    assert status == 408 and json.loads(body)["error"]["code"] == "body_timeout" and took < 4
    status, body, took = _raw(server.port, _head(200), [b" "] * 20, gap=0.2)
    assert status == 408 and took < 6
    # over --max-body: declared (refused before a byte is read), or chunked (once it passes the limit)
    status, body, took = _raw(server.port, _head(10**9), [])
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    chunk = b"x" * 30000
    status, body, _ = _raw(server.port, _head(None, chunked=True), [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 4)
    assert status == 413
    # more messages than --max-messages; a chat far over the context is refused untokenized
    many = [{"role": "user", "content": "x"}] * 101
    assert _shape(_post(server, "/v1/chat/completions", {"messages": many}), 400)["param"] == "messages"
    huge = [{"role": "user", "content": "<|im_start|>user\nx<|im_end|>\n" * 2000}]  # 60 kB of special tokens
    t0 = time.monotonic()
    err = _shape(_post(server, "/v1/chat/completions", {"messages": huge}), 400)
    assert err["code"] == "context_length_exceeded" and time.monotonic() - t0 < 5
    # a chat that must be tokenized to know it does not fit: on a thread, /health answers
    long = [{"role": "user", "content": "<|im_start|>x<|im_end|>" * 400}]
    res: list[httpx.Response] = []
    th = threading.Thread(target=lambda: res.append(_post(server, "/v1/chat/completions", {"messages": long})))
    th.start()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    th.join(30)
    assert _shape(res[0], 400)["code"] == "context_length_exceeded"
    # block sizes, max_tokens and token ids out of range
    for bs in (1000, 1024, 0, -1, 2**40, "big"):
        assert _shape(_post(server, "/v1/completions", {"prompt": "x", "block_size": bs}), 400)["param"] == "block_size"
    for ids in ([2**32 + 5], [-1], [2**70]):
        assert _shape(_post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1}), 400)["param"] == "prompt"
    _shape(httpx.post(url + "/detokenize", json={"tokens": [2**32 + 5]}), 400)
    # a subnormal temperature ends (output, or the watchdog's clean error) within --stuck-timeout
    t0 = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 1e-310,
                                          "block_size": 8})
    assert time.monotonic() - t0 < 3 + 5
    if r.status_code != 200:
        assert _shape(r, 500)["code"] == "generation_stuck"
    # unknown routes and methods, the same shape
    _shape(httpx.get(url + "/v2/anything"), 404)
    _shape(httpx.put(url + "/v1/completions"), 405)
    # the server is fine: health, and a normal request gives the local model's tokens
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = _post(server, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
                                          "block_size": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == local_tokens
    metrics = httpx.get(url + "/metrics").text
    assert "clover_contexts_busy 0" in metrics and "clover_queue_depth 0" in metrics


@pytest.fixture(scope="module")
def local_tokens(gguf) -> str:
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=1024, n_threads=1) as m:
        return m.generate("def add(a, b):", max_tokens=8, block_size=4, stop_at_eos=False).text


def test_a_stuck_generation_fails_health_and_is_stopped(gguf) -> None:
    """A generation that reports no progress: /health 503 while it lasts (a load balancer takes
    the server out), the watchdog cancels it; one that ignores the cancel keeps /health 503
    until it ends; then the request gets a clean 500 and the server serves again."""
    from clover_cpp import Clover
    from clover_cpp.server import Limits

    release = threading.Event()
    with Clover(gguf, n_ctx=256, n_threads=1) as real:
        model = ScriptedClover(real, lambda prompt: "ok")
        model.hook = lambda on_step: release.wait(20)  # never calls on_step: no progress, deaf to cancel
        s = InProcessServer(model, limits=Limits(stuck_after=0.5))
        try:
            res: list[httpx.Response] = []
            th = threading.Thread(target=lambda: res.append(httpx.post(s.url + "/v1/completions",
                                                                       json={"prompt": "x"}, timeout=30)))
            th.start()
            deadline = time.monotonic() + 10
            while (h := httpx.get(s.url + "/health", timeout=5)).status_code == 200:
                assert time.monotonic() < deadline, "/health never noticed the stuck generation"
                time.sleep(0.05)
            assert h.status_code == 503 and h.json()["status"] == "stuck" and h.headers["retry-after"]
            time.sleep(1.0)
            assert httpx.get(s.url + "/health", timeout=5).status_code == 503  # still stuck: still 503
            release.set()
            th.join(20)
            assert _shape(res[0], 500)["code"] == "generation_stuck"
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            assert "clover_stuck_total 1" in httpx.get(s.url + "/metrics").text
            model.hook = None
            r = s.client().completions.create(model="x", prompt="x", max_tokens=2)
            assert r.choices[0].text == "ok"
        finally:
            release.set()
            s.stop()


def _serve(gguf: Path, code: str = "") -> tuple[subprocess.Popen, str]:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    prog = code + "\nfrom clover_cpp.cli import main\nmain()\n"
    p = subprocess.Popen([sys.executable, "-c", prog, "serve", "-m", str(gguf), "--port", str(port), "-c", "1024",
                          *LIMITS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert p.poll() is None and time.monotonic() < deadline, "clover serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            time.sleep(0.1)


def _in_flight(url: str, busy_text: str = "clover_contexts_busy 1") -> None:
    def go() -> None:
        try:
            httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 900, "block_size": 64,
                                                      "threshold": 1.0, "ignore_eos": True}, timeout=60)
        except httpx.HTTPError:
            pass
    threading.Thread(target=go, daemon=True).start()
    deadline = time.monotonic() + 20
    while busy_text not in httpx.get(url + "/metrics", timeout=5).text:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("stuck", [False, True], ids=["generating", "deaf-to-cancel"])
def test_sigterm_ends_the_process(gguf, stuck: bool) -> None:
    from clover_cpp.server import HARD_EXIT_AFTER

    # deaf-to-cancel: generate() blocks and never looks at its callbacks (as a native loop that
    # cannot end would); the hard deadline still ends the process
    code = ("import threading\nimport clover_cpp as cm\n"
            "cm.Clover.generate = lambda self, *a, **k: threading.Event().wait(3600)\n") if stuck else ""
    p, url = _serve(gguf, code)
    try:
        _in_flight(url)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(HARD_EXIT_AFTER + 10 if stuck else 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"clover serve still runs {time.monotonic() - t0:.1f} s after SIGTERM")
        out = p.stdout.read()
        assert p.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), (p.returncode, out[-2000:])
        assert "Traceback" not in out, out[-3000:]
        if stuck:
            assert "did not stop" in out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_forty_thousand_messages_do_not_freeze_the_server(gguf) -> None:
    """The reproducer of round 2's hang (40k short chat messages, 1.3 MB, froze /health for 12 s), under
    the default limits: refused by --max-messages before any message is validated or rendered,
    and the event loop answers /health meanwhile."""
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=1024, n_threads=1) as m:
        s = InProcessServer(m)
        try:
            body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 40000}).encode()
            assert len(body) > 10**6
            res: list[httpx.Response] = []
            th = threading.Thread(target=lambda: res.append(httpx.post(
                s.url + "/v1/chat/completions", content=body, timeout=30,
                headers={"content-type": "application/json"})))
            t0 = time.monotonic()
            th.start()
            worst = 0.0
            while th.is_alive() and time.monotonic() - t0 < 20:
                t = time.monotonic()
                assert httpx.get(s.url + "/health", timeout=5).status_code == 200
                worst = max(worst, time.monotonic() - t)
            th.join(20)
            assert _shape(res[0], 400)["param"] == "messages" and time.monotonic() - t0 < 10
            assert worst < 1.0
        finally:
            s.stop()


def test_rss_stays_flat_over_200_requests(gguf) -> None:
    """200 completions, chats and refusals after a warm-up: the server's resident memory grows by
    at most 10% (a leak per request would show: the tiny model's process is ~100 MB)."""
    s = Server(gguf, "-t", "1")
    try:
        def some(n: int) -> None:
            for i in range(n):
                body = ({"prompt": f"def f{i}(x):", "max_tokens": 4} if i % 3 == 0 else
                        {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4} if i % 3 == 1 else
                        {"prompt": "x", "max_tokens": 4, "temperature": -1})  # (a 400)
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                r = httpx.post(s.url + path, json=body, timeout=60)
                assert r.status_code in (200, 400), r.text[:300]
        some(30)
        rss0 = s.rss_kb()
        some(200)
        assert s.rss_kb() <= 1.10 * rss0, (rss0, s.rss_kb())
    finally:
        s.stop()
