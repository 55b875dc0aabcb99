"""``clover serve``: an OpenAI-compatible HTTP server over libclover.

FastAPI (request models and validation through pydantic), sse-starlette (server-sent events)
and uvicorn: the stack llama-cpp-python's own server is built on. ``--parallel N`` keeps N
decoding contexts over one loaded model; a request takes a free one (preferring the context
whose committed memory is a prefix of its prompt, so a conversation's earlier turns are not
prefilled again), waits in a bounded queue when all are busy, and gets 503 when the queue is
full. A client that disconnects cancels its generation at the next denoising step.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from .model import Clover, CloverError, GenerationResult

try:
    import anyio
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from pydantic import BaseModel, ConfigDict, Field
    from sse_starlette.sse import EventSourceResponse
except ImportError as e:  # pragma: no cover - exercised by users without the extra
    raise ImportError(f"clover serve needs the server extra: pip install 'clover-cpp[server]' ({e})") from None


# ----------------------------------------------------------------------------- request bodies

class _Knobs(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI's names, Clover's extra knobs)."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI clients add some

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Clover's own knobs
    block_size: Union[int, Literal["auto"], None] = None
    threshold: float = Field(default=0.9, ge=0.0, le=1.0)
    max_steps: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    draft_self: bool = False  # lossless self-speculative decoding (the output of block_size 1)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[_TextPart], None] = None


class ChatRequest(_Knobs):
    messages: list[_Message] = Field(min_length=1)


class CompletionRequest(_Knobs):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False


# ----------------------------------------------------------------------------- errors

class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ----------------------------------------------------------------------------- contexts

@dataclass
class _Slot:
    model: Clover
    memory: list[int] = field(default_factory=list)  # the committed tokens after its last request

    def reuse(self, prompt: list[int]) -> int:
        n = len(self.memory)
        return n if n and prompt[:n] == self.memory else 0


class Pool:
    """N contexts over one model; ``acquire`` waits for a free one in a bounded queue."""

    def __init__(self, base: Clover, n: int, max_queue: int) -> None:
        self.slots = [_Slot(base)] + [_Slot(base.new_context()) for _ in range(n - 1)]
        self.free = list(self.slots)
        self.max_queue = max_queue
        self.waiting = 0
        self._cond = asyncio.Condition()

    async def acquire(self, tokens_for: Any) -> tuple[_Slot, list[int]]:
        """A free context and the prompt's tokens for it (``tokens_for(slot)``), preferring the
        context that already holds the longest part of the prompt."""
        async with self._cond:
            if not self.free and self.waiting >= self.max_queue:
                raise APIError(503, "the server is busy: every context is in use and the queue is full",
                               "server_error", "queue_full")
            self.waiting += 1
            try:
                await self._cond.wait_for(lambda: bool(self.free))
            finally:
                self.waiting -= 1
            best: tuple[int, _Slot, list[int]] | None = None
            for s in self.free:
                toks = tokens_for(s)
                if best is None or s.reuse(toks) > best[0]:
                    best = (s.reuse(toks), s, toks)
            assert best is not None
            self.free.remove(best[1])
            return best[1], best[2]

    async def release(self, slot: _Slot) -> None:
        async with self._cond:
            self.free.append(slot)
            self._cond.notify()

    def close(self) -> None:
        for s in self.slots[1:]:
            s.model.close()


@dataclass
class Metrics:
    requests: int = 0
    errors: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    decode_passes: int = 0
    decode_forwards: int = 0    # passes + commits that rode on no pass (B = 1: one per token)
    decode_seconds: float = 0.0

    def add(self, r: GenerationResult, n_prompt: int) -> None:
        s = r.stats
        self.prompt_tokens += n_prompt
        self.reused_tokens += s.n_reused
        self.completion_tokens += len(r.tokens)
        self.decode_passes += s.n_decode_passes
        self.decode_forwards += s.n_decode_forwards
        self.decode_seconds += s.t_decode_ms / 1000.0


# ----------------------------------------------------------------------------- the app

def create_app(model: Clover, parallel: int = 1, api_key: str | None = None, max_queue: int = 64,
               model_name: str | None = None) -> FastAPI:
    """The ASGI app serving ``model`` (which the app then owns) with ``parallel`` contexts."""
    name = model_name or model.metadata("general.name") or model.model_path.stem
    created = int(time.time())
    state: dict[str, Any] = {}
    metrics = Metrics()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["pool"] = Pool(model, parallel, max_queue)
        try:
            yield
        finally:
            state["pool"].close()

    app = FastAPI(title="clover serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        metrics.errors += 1
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.errors += 1
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON").response()
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return APIError(400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", param=where or None).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                "invalid_request_error", "invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "clover-cpp"}]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        pool: Pool = state["pool"]
        tpf = metrics.completion_tokens / metrics.decode_forwards if metrics.decode_forwards else 0.0
        lines = [
            ("requests_total", metrics.requests), ("errors_total", metrics.errors),
            ("cancelled_total", metrics.cancelled), ("prompt_tokens_total", metrics.prompt_tokens),
            ("prompt_tokens_reused_total", metrics.reused_tokens),
            ("completion_tokens_total", metrics.completion_tokens),
            ("decode_passes_total", metrics.decode_passes), ("decode_forwards_total", metrics.decode_forwards),
            ("tokens_per_forward", round(tpf, 4)),
            ("decode_seconds_total", round(metrics.decode_seconds, 4)),
            ("contexts", len(pool.slots)), ("contexts_busy", len(pool.slots) - len(pool.free)),
            ("queue_depth", pool.waiting),
        ]
        return PlainTextResponse("".join(f"clover_{k} {v}\n" for k, v in lines))

    def gen_kwargs(req: _Knobs, n_prompt: int) -> dict[str, Any]:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        room = model.n_ctx - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt ({n_prompt} tokens) does not fit the context ({model.n_ctx} tokens)",
                           code="context_length_exceeded", param="messages")
        max_tokens = req.max_tokens if req.max_tokens is not None else max(1, room - 64)
        if req.block_size is not None and req.block_size != "auto" and req.block_size < 1:
            raise APIError(400, f"block_size must be >= 1 or 'auto', got {req.block_size}", param="block_size")
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        return dict(max_tokens=max_tokens, block_size=req.block_size or "auto", threshold=req.threshold,
                    max_steps=req.max_steps, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                    seed=seed, stop=stop, stop_at_eos=not req.ignore_eos, draft_self=req.draft_self)

    async def run(request: Request, req: _Knobs, tokens_for: Any, chat_text: str | None,
                  stop_tokens: Sequence[int], make_chunk: Any, make_final: Any) -> Any:
        pool: Pool = state["pool"]
        kw = gen_kwargs(req, len(tokens_for(pool.slots[0])))
        metrics.requests += 1
        slot, prompt = await pool.acquire(tokens_for)
        cancel = threading.Event()

        def generate(stream_: bool) -> Any:
            return slot.model.generate(prompt, stream=stream_, stop_tokens=stop_tokens, _chat_text=chat_text,
                                       on_step=lambda *a: cancel.is_set(), **kw)

        def done(r: GenerationResult | None) -> None:
            if r is not None:
                metrics.add(r, len(prompt))
                slot.memory = (prompt + r.tokens)[:slot.model.n_committed]
            else:
                slot.memory = []

        if not req.stream:
            async def watch() -> None:
                while not cancel.is_set():
                    if await request.is_disconnected():
                        cancel.set()
                        metrics.cancelled += 1
                    await asyncio.sleep(0.05)
            watcher = asyncio.create_task(watch())
            result = None
            try:
                result = await asyncio.to_thread(generate, False)
            except CloverError as e:
                raise APIError(400, e.message) from None
            finally:
                cancel.set()
                watcher.cancel()
                done(result)
                await pool.release(slot)
            return JSONResponse(make_final(result))

        try:
            it = await asyncio.to_thread(generate, True)
        except CloverError as e:
            await pool.release(slot)
            raise APIError(400, e.message) from None

        def next_piece() -> str | None:
            try:
                return next(it)
            except StopIteration:
                return None

        async def events() -> AsyncIterator[dict[str, str]]:
            import json
            finished = False
            try:
                yield {"data": json.dumps(make_chunk(None, None))}
                while (piece := await asyncio.to_thread(next_piece)) is not None:
                    yield {"data": json.dumps(make_chunk(piece, None))}
                finished = True
                yield {"data": json.dumps(make_chunk("", it.result))}
                if (req.stream_options or {}).get("include_usage"):
                    yield {"data": json.dumps(make_chunk(None, it.result, usage_only=True))}
                yield {"data": "[DONE]"}
            except CloverError as e:
                metrics.errors += 1
                yield {"data": json.dumps({"error": {"message": e.message, "type": "server_error"}})}
            finally:
                # a client that went away cancels this task: the clean-up must still run
                with anyio.CancelScope(shield=True):
                    if not finished:
                        metrics.cancelled += 1
                    cancel.set()
                    await asyncio.to_thread(it.close)
                    done(it.result)
                    await pool.release(slot)

        return EventSourceResponse(events(), ping=600)

    def finish_reason(r: GenerationResult) -> str:
        return "length" if r.stats.finish_reason == "max_tokens" else "stop"

    def usage(r: GenerationResult) -> dict[str, Any]:
        n_prompt = r.stats.n_prompt
        return {"prompt_tokens": n_prompt, "completion_tokens": len(r.tokens),
                "total_tokens": n_prompt + len(r.tokens),
                "prompt_tokens_details": {"cached_tokens": r.stats.n_reused}}

    def clover_stats(r: GenerationResult) -> dict[str, Any]:
        s = r.stats
        return {"block_size": s.block_size, "tokens_per_forward": round(s.tokens_per_forward, 4),
                "decode_passes": s.n_decode_passes, "reused_prompt_tokens": s.n_reused,
                "tokens_per_second": round(s.tokens_per_second, 2)}

    def tokenize_prompt(text: str) -> list[int]:
        try:
            return model.tokenize(text, add_special=True, parse_special=True)
        except CloverError as e:
            raise APIError(400, e.message) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        messages = []
        for m in req.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(p.text for p in m.content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        try:
            text = model.format_chat(messages)
        except CloverError as e:
            raise APIError(400, e.message, param="messages") from None
        def tokens_for(slot: _Slot) -> list[int]:
            try:
                return slot.model.chat_tokens(text)
            except CloverError as e:
                raise APIError(400, e.message) from None
        cid, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(piece: str | None, r: GenerationResult | None, usage_only: bool = False) -> dict[str, Any]:
            base = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": name}
            if usage_only:
                return {**base, "choices": [], "usage": usage(r)}
            if piece is None:
                return {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]}
            if r is None:
                return {**base, "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                             "finish_reason": None}]}
            return {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": finish_reason(r)}], "clover": clover_stats(r)}

        def final(r: GenerationResult) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion", "created": now, "model": name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                                 "logprobs": None, "finish_reason": finish_reason(r)}],
                    "usage": usage(r), "clover": clover_stats(r)}

        return await run(request, req, tokens_for, text, model._stop_tokens(), chunk, final)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request (n = 1)", param="prompt")
            p = p[0]
        if isinstance(p, str):
            prompt = tokenize_prompt(p)
        else:
            prompt = [int(t) for t in p]
            bad = [t for t in prompt if not 0 <= t < model.n_vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {model.n_vocab})",
                               param="prompt")
        cid, now = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        echo = model.detokenize(prompt) if req.echo else ""

        def chunk(piece: str | None, r: GenerationResult | None, usage_only: bool = False) -> dict[str, Any]:
            base = {"id": cid, "object": "text_completion", "created": now, "model": name}
            if usage_only:
                return {**base, "choices": [], "usage": usage(r)}
            if r is None:
                return {**base, "choices": [{"index": 0, "text": echo if piece is None else piece,
                                             "logprobs": None, "finish_reason": None}]}
            return {**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                         "finish_reason": finish_reason(r)}], "clover": clover_stats(r)}

        def final(r: GenerationResult) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": 0, "text": echo + r.text, "logprobs": None,
                                 "finish_reason": finish_reason(r)}],
                    "usage": usage(r), "clover": clover_stats(r)}

        return await run(request, req, lambda slot: prompt, None, (), chunk, final)

    return app


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8080, parallel: int = 1,
          api_key: str | None = None, n_ctx: int = 4096, n_threads: int | None = None, n_gpu_layers: int = 0,
          max_queue: int = 64, log_level: str = "warning", flash_attn: bool | None = None,
          rpc_servers: str | None = None, tensor_split: list[float] | None = None,
          override_tensor: str | None = None) -> None:
    """Load the model and serve it until interrupted."""
    if n_threads is None:
        # the contexts share the cores, less one for the HTTP side: ggml's threads spin at their
        # barriers, so one preempted by the server's own threads stalls the others (measured on
        # 2 cores, --parallel 1: 17.6 req/s with 1 thread, 11.3 with 2, and 2.9 with 2 clients)
        n_threads = max(1, ((os.cpu_count() or 1) - 1) // parallel)
    model = Clover(model_path, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                   rpc_servers=rpc_servers, tensor_split=tensor_split, override_tensor=override_tensor)
    app = create_app(model, parallel=parallel, api_key=api_key, max_queue=max_queue)
    try:
        # uvicorn.Server, not uvicorn.run (which swallows it): after the graceful shutdown, the
        # Ctrl-C comes back as KeyboardInterrupt and the command exits 130 as the others do
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=5)).run()
    finally:
        model.close()
