"""`clover serve` as llama-server: TLS with ``--ssl-key-file`` and
``--ssl-cert-file`` (both or neither; a file that is missing or not a matching PEM pair: one
line, exit 1, before the model loads), and ``/v1/embeddings`` with ``--embeddings`` (OpenAI's
shape, Clover.create_embedding's vectors; without the flag llama-server's 501)."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")
openai = pytest.importorskip("openai", reason="the test extra installs openai")

from clover_testkit.server_harness import Server  # noqa: E402


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from clover_cpp.cli import main; main()", "serve", *args]


def _self_signed(d: Path, name: str = "") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (the openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    key, cert = d / f"key{name}.pem", d / f"cert{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f32"]


@pytest.mark.parametrize("case", ["key-only", "cert-only", "missing", "junk", "mismatch"])
def test_bad_tls_options_are_one_line_before_the_model_loads(tmp_path: Path, case: str) -> None:
    key, cert = _self_signed(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    args = {"key-only": ["--ssl-key-file", str(key)], "cert-only": ["--ssl-cert-file", str(cert)],
            "missing": ["--ssl-key-file", str(key), "--ssl-cert-file", str(tmp_path / "nope.pem")],
            "junk": ["--ssl-key-file", str(key), "--ssl-cert-file", str(junk)],
            "mismatch": ["--ssl-key-file", str(_self_signed(tmp_path, "2")[0]), "--ssl-cert-file", str(cert)]}[case]
    # a model that does not exist: had it been loaded first, its error would come instead
    p = subprocess.run(_cli("-m", str(tmp_path / "missing.gguf"), "--port", "0", *args), capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    want = {"key-only": "--ssl-key-file needs --ssl-cert-file", "cert-only": "--ssl-cert-file needs --ssl-key-file",
            "missing": "No such file", "junk": "not a PEM certificate", "mismatch": "does not match"}[case]
    assert p.stderr.startswith("error: ") and want in p.stderr, p.stderr


def test_https_with_the_openai_client(gguf: Path, tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(_cli("-m", str(gguf), "--port", str(port), "-c", "512", "-t", "1", "--ssl-key-file",
                                 str(key), "--ssl-cert-file", str(cert)),
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ))
    try:
        banner = proc.stderr.readline()
        assert f"clover serve: https://127.0.0.1:{port}/v1 " in banner, banner
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as http:
            deadline = time.time() + 30
            while http.get(f"https://127.0.0.1:{port}/health").status_code != 200 and time.time() < deadline:
                time.sleep(0.1)
            client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="none", http_client=http,
                                   max_retries=0)
            r = client.completions.create(model="x", prompt="Hello", max_tokens=4, temperature=0)
            assert r.choices[0].finish_reason in ("length", "stop")
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.fixture(scope="module")
def embedding_server(gguf: Path):
    s = Server(gguf, "--embeddings", "-t", "1")
    yield s
    s.stop()


def test_embeddings_equal_create_embedding(embedding_server: Server, gguf: Path) -> None:
    from clover_cpp import Clover

    client = embedding_server.client()
    texts = ["Hello world", "a second, longer text to embed"]
    one = client.embeddings.create(model="x", input=texts[0])  # (the client asks for base64)
    many = client.embeddings.create(model="x", input=texts, encoding_format="float")
    with Clover(gguf, n_ctx=1024, n_threads=1, embedding=True) as m:
        want = m.create_embedding(texts)
        n_embd = m.n_embd()
    assert [d.index for d in many.data] == [0, 1]
    assert [d.embedding for d in many.data] == [d["embedding"] for d in want["data"]]
    assert one.data[0].embedding == pytest.approx(want["data"][0]["embedding"], rel=1e-6, abs=1e-7)  # (float32)
    assert many.usage.prompt_tokens == want["usage"]["prompt_tokens"] > 0
    assert len(many.data[0].embedding) == n_embd
    # token ids: embedded as the text they spell (they are its tokens, BOS as the model adds it)
    ids = httpx.post(embedding_server.url + "/tokenize", json={"content": texts[1]}, timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model="x", input=[ids, ids], encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [want["data"][1]["embedding"]] * 2
    one_list = client.embeddings.create(model="x", input=ids, encoding_format="float")
    assert one_list.data[0].embedding == want["data"][1]["embedding"]


def test_embeddings_refusals(embedding_server: Server) -> None:
    url = embedding_server.url + "/v1/embeddings"
    for body, param in (({"input": [[1, 2, 3], [10**9]]}, "input"), ({"input": []}, "input"), ({"input": "a", "dimensions": 3},
                        "dimensions"), ({"input": "a", "bogus": 1}, "bogus")):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_embeddings_need_the_flag(gguf: Path) -> None:
    s = Server(gguf, "-t", "1")
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "a"}, timeout=30)
        assert r.status_code == 501, r.text
        assert r.json()["error"] == {"message": "This server does not support embeddings. Start it with `--embeddings`",
                                     "type": "not_supported_error", "param": None, "code": None}
    finally:
        s.stop()
