"""An in-process `clover serve` app on a loopback port, over the tiny model, with a scripted
generate() where a test needs output the tiny model would never write (tool-call markup) or a
generation that will not stop (the watchdog). Used by test_server_tools.py and
test_server_hostile.py; holds no tests itself."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clover_cpp import Clover, GenerationResult, GenerationStats


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


def tool_gguf(tiny_gguf: Path, dst: Path) -> Path:
    """The tiny GGUF with the Qwen tool-calling chat template (clover_testkit.chat_templates)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import fuzz  # noqa: PLC0415 - tests/fuzz.py: the one GGUF rewriter

    from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE

    return fuzz.rewrite_gguf(tiny_gguf, dst, kv={"tokenizer.chat_template": QWEN_TOOLS_TEMPLATE})
