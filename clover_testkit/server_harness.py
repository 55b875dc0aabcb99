"""The servers the tests talk to: `clover serve` as a subprocess (Server) and create_app in
process under uvicorn (InProcessServer), with a scripted generate() (ScriptedClover) where a test
needs output the tiny model would never write (tool-call markup) or a generation that will not
stop (the watchdog). httpx and openai (the test extra) are imported where used."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clover_cpp import Clover, GenerationResult, GenerationStats


class Server:
    """`clover serve -m GGUF ARGS...` in a subprocess on a free loopback port, up once /health answers."""

    def __init__(self, gguf: Path, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from clover_cpp.cli import main; main()", "serve", "-m", str(gguf),
             "--port", str(self.port), "-c", "1024", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        import httpx

        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"clover serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("clover serve did not come up")

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=5).text
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}

    def client(self, **kw):
        import openai

        kw.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def post(server, path: str, body, headers=None) -> Any:
    """POST body (JSON, or bytes / text sent as they are) to server.url + path: the httpx.Response."""
    import httpx

    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


class ScriptedStream:
    """What Clover.generate(stream=True) returns: pieces, then .result."""

    def __init__(self, pieces: list[str], result: GenerationResult) -> None:
        self._it: Iterator[str] = iter(pieces)
        self._result = result
        self.result: GenerationResult | None = None

    def __iter__(self) -> "ScriptedStream":
        return self

    def __next__(self) -> str:
        try:
            return next(self._it)
        except StopIteration:
            self.result = self._result
            raise

    def close(self) -> None:
        if self.result is None:
            self.result = self._result

    def __enter__(self) -> "ScriptedStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ScriptedClover:
    """A real Clover (tokenizer, template, properties) whose generate() writes ``script(prompt
    text)`` in pieces of ``piece`` characters, or calls ``hook(on_step)`` first when set."""

    def __init__(self, real: Clover, script: Callable[[str], str], piece: int = 3) -> None:
        self._real, self.script, self.piece = real, script, piece
        self.hook: Callable[[Any], None] | None = None
        self.prompts: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def generate_chat(self, text: str, **kw: Any) -> Any:
        return self.generate(self._real.chat_tokens(text), **kw)

    def generate(self, prompt: Any, stream: bool = False, on_step: Any = None, **kw: Any) -> Any:
        if self.hook is not None:
            self.hook(on_step)
        text_in = self._real.detokenize_text(prompt, special=True) if not isinstance(prompt, str) else prompt
        self.prompts.append(text_in)
        text = self.script(text_in)
        toks = self._real.tokenize(text, add_bos=False, special=True)
        stats = GenerationStats(n_prompt=len(prompt), n_generated=len(toks), finish_reason="eos", block_size=1,
                                tokens_per_forward=1.0, n_decode_forwards=len(toks), seed=kw.get("seed"))
        result = GenerationResult(text=text, tokens=toks, stats=stats)
        if not stream:
            return result
        return ScriptedStream([text[i:i + self.piece] for i in range(0, len(text), self.piece)], result)


class InProcessServer:
    """create_app(model) under uvicorn on a thread, on a free loopback port."""

    def __init__(self, model: Any, **create_kw: Any) -> None:
        import uvicorn

        from clover_cpp.server import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(model, **create_kw)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the in-process server did not start"
            time.sleep(0.02)

    def client(self, **kw: Any) -> Any:
        import openai

        kw.setdefault("timeout", 30)
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
