"""`clover serve`'s start: a port in use is one line and exit status 1 before the model
loads (it used to print the banner, load the model, then fail); the banner comes once the port
is bound and the model loaded, with the port bound (``--port 0``: the one the system chose);
``--alias NAME`` is the model's id in the API (llama-server's --alias); ``--access-log`` gives
uvicorn's line per request (on stdout, as uvicorn writes it); the first request of block size
auto says on stderr that it measures the cost curve."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

BANNER = re.compile(r"clover serve: (http://127\.0\.0\.1:(\d+)/v1) \(1 context\(s\)\); Ctrl-C to stop")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from clover_cpp.cli import main; main()", "serve", *args]


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a model that does not exist: had it been loaded first, its error would come instead
        p = subprocess.run(_cli("-m", str(tmp_path / "missing.gguf"), "--port", str(port)), capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], p.stderr


def test_an_address_this_machine_lacks_is_one_line(tmp_path: Path) -> None:
    p = subprocess.run(_cli("-m", str(tmp_path / "missing.gguf"), "--host", "192.0.2.1", "--port", "8080"),
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # (TEST-NET-1)
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error: cannot listen on 192.0.2.1:8080: "), p.stderr


class _Serving:
    """`clover serve --port 0 ARGS` until the banner (stderr); stop() returns its stderr, stdout."""

    def __init__(self, gguf: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(_cli("-m", str(gguf), "--port", "0", "-c", "512", "-t", "1", *args),
                                     stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        deadline = time.time() + 60
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"clover serve exited: {''.join(self.lines)}")
            self.lines.append(line)
            if m := BANNER.search(line):
                self.url, self.port = m.group(1), int(m.group(2))
                return
        raise RuntimeError("no banner")

    def stop(self) -> tuple[str, str]:
        self.proc.terminate()
        out, err = self.proc.communicate(timeout=20)
        return "".join(self.lines) + err, out


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f32"]


def test_the_banner_names_the_bound_port_and_alias_names_the_model(gguf: Path, tmp_path: Path) -> None:
    s = _Serving(gguf, "--alias", "my-model", env={"CLOVER_CACHE_DIR": str(tmp_path)})
    try:
        assert s.port != 0
        # the port is bound before the banner: the first request is answered, no retry needed
        models = httpx.get(s.url + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        assert httpx.get(s.url + "/models/my-model", timeout=30).json()["id"] == "my-model"
        assert httpx.get(s.url + f"/models/{gguf.stem}", timeout=30).status_code == 404
        r = httpx.post(s.url + "/completions", json={"model": "my-model", "prompt": "a", "max_tokens": 2},
                       timeout=60).json()
        assert r["model"] == "my-model"
    finally:
        err, out = s.stop()
    assert "GET /v1/models" not in err + out  # no access log unless asked
    # the first request of block size auto measured the cost curve (the notice of the command lines)
    assert err.count("clover: measuring the cost curve of block size auto") == 1, err


def test_access_log(gguf: Path) -> None:
    s = _Serving(gguf, "--access-log")
    try:
        assert httpx.get(s.url + "/models", timeout=30).status_code == 200
        assert httpx.get(s.url + "/models/nope", timeout=30).status_code == 404
    finally:
        _, log = s.stop()
    assert re.search(r'"GET /v1/models HTTP/1\.1" 200', log), log
    assert re.search(r'"GET /v1/models/nope HTTP/1\.1" 404', log), log


def test_an_empty_alias_is_refused(gguf: Path) -> None:
    p = subprocess.run(_cli("-m", str(gguf), "--port", "0", "--alias", " "), capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 1 and p.stderr.splitlines() == ["error: --alias: the model's name must not be empty"]
