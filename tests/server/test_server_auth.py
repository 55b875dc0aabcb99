"""`clover serve`'s API key: an empty key is refused at start-up (it used to turn
authentication off: a falsy test), ``$CLOVER_API_KEY`` set but empty too (click reads it as
absent); every endpoint but /health wants the key (docs/server.md lists them); the key is
compared in constant time (secrets.compare_digest)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clover_testkit.server_harness import Server

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

KEY = "sekret-Key_0123"

#: (method, path, body): every route of the app (docs/server.md's table)
ENDPOINTS = [
    ("GET", "/v1/models", None), ("GET", "/models", None), ("GET", "/v1/models/x", None), ("GET", "/props", None),
    ("GET", "/metrics", None), ("POST", "/tokenize", {"content": "a"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "a"}]}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("POST", "/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ("POST", "/completions", {"prompt": "a", "max_tokens": 1}),
    ("POST", "/v1/embeddings", {"input": "a"}), ("POST", "/embeddings", {"input": "a"}),
    ("GET", "/no/such/route", None),  # 401 before 404: the routes are not probed without the key
]


def _serve(gguf, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_cpp.cli", "serve", "-m", str(gguf), "--port", "1", *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("how", ["option", "blank", "env", "env-blank", "space", "control"])
def test_an_empty_or_unsendable_key_is_refused_at_start_up(tiny_artifacts, how: str) -> None:
    args, env = {"option": (["--api-key", ""], None), "blank": (["--api-key", "  "], None),
                 "env": ([], {"CLOVER_API_KEY": ""}), "env-blank": ([], {"CLOVER_API_KEY": " "}),
                 "space": (["--api-key", "two words"], None), "control": (["--api-key", "k\x01ey"], None)}[how]
    p = _serve(tiny_artifacts["f32"], *args, env=env)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error")]
    assert p.returncode == 1 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert ("empty" if how in ("option", "blank", "env", "env-blank") else "printable") in errors[0]


def test_create_app_refuses_an_empty_key(tiny_artifacts) -> None:
    from clover_cpp import Clover
    from clover_cpp.server import create_app

    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1) as m:
        with pytest.raises(ValueError, match="empty"):
            create_app(m, api_key="")


def test_check_api_key_compares_in_constant_time(monkeypatch) -> None:
    """The Guard compares with secrets.compare_digest (a timing side channel would leak the key)."""
    import asyncio
    import secrets

    from clover_cpp.server import asgi
    from clover_cpp.server.types import Limits

    calls = []
    real = secrets.compare_digest
    monkeypatch.setattr(asgi.secrets, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))

    async def app(scope, receive, send):  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(msg):  # noqa: ANN001
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    g = asgi.Guard(app, KEY, Limits(), on_error=lambda: None)
    for auth, status in ((f"Bearer {KEY}", 200), ("Bearer wrong", 401), ("", 401)):
        sent.clear()
        scope = {"type": "http", "path": "/props", "method": "GET", "headers": [(b"authorization", auth.encode())]}
        asyncio.run(g(scope, receive, send))
        assert sent[0]["status"] == status
    assert [b for _, b in calls] == [f"Bearer {KEY}".encode()] * 3


@pytest.fixture(scope="module")
def keyed(tiny_artifacts):
    s = Server(tiny_artifacts["f32"], "--api-key", KEY, "--parallel", "1", "-t", "1", "--embeddings")
    yield s
    s.stop()


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
def test_every_endpoint_but_health_wants_the_key(keyed, method: str, path: str, body) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer {KEY}"}):
        r = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers, r.text[:200])
    r = httpx.request(method, keyed.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == (404 if path.startswith(("/no/", "/v1/models/x")) else 200), (path, r.text[:300])


def test_health_needs_no_key(keyed) -> None:
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200


def _raw_get(port: int, path: str) -> tuple[int, bytes]:
    """GET path as written (httpx would remove the dot segments first)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_the_page_is_public_and_paths_do_not_slip_past_the_key(keyed) -> None:
    assert httpx.get(keyed.url + "/", timeout=10).status_code == 200  # the page's files hold no secret
    for path in ("/static/../props", "/static/%2e%2e/props", "//props", "/props/", "/health/../props", "/PROPS",
                 "/static/..%2fprops", "/health/x", "/static/../../props", "/./props", "/props?x=1"):
        status, data = _raw_get(keyed.port, path)
        assert status in (401, 404), (path, status, data[:300])
        assert b"chat_template" not in data and b"model_path" not in data, path
