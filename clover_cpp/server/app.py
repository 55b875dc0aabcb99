"""``clover serve``: an OpenAI-compatible HTTP server over libclover.

FastAPI, sse-starlette (server-sent events) and uvicorn: the stack llama-cpp-python's own
server is built on. ``--parallel N`` keeps N decoding contexts over one loaded model
(server_pool.py); a client that disconnects cancels its generation at the next denoising
step, streaming or not. Request bodies and their checks: server_types.py (a field is honoured
or refused with a 400 naming it); tool calls: server_tools.py; body limits and the API key:
server_asgi.py. Endpoints, fields and limits: docs/server.md.

Nothing slow runs on the event loop: chat templates are rendered and prompts tokenized on
worker threads, after a cheap bound (a prompt of more bytes than the context's tokens could
spell is refused untokenized), so ``/health`` answers while a huge request is being read.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _native as N
from .model import Clover, CloverError, GenerationResult
from . import server_format as fmt
from .server_asgi import Guard
from .server_pool import Metrics, Pool, Slot
from .server_tools import ToolPlan, ToolStream, plan
from .server_types import (
    INT32_MAX, APIError, ApplyTemplateRequest, ChatRequest, CompletionRequest, DetokenizeRequest, Limits,
    TokenizeRequest, _Knobs, parse_body, unsupported, validate)

try:
    import anyio
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from sse_starlette.sse import EventSourceResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - exercised by users without the extra
    raise ImportError(f"clover serve needs the server extra: pip install 'clover-cpp[server]' ({e})") from None

__all__ = ["Limits", "create_app", "serve"]

#: seconds after SIGTERM / SIGINT at which the process ends even if a generation will not stop
HARD_EXIT_AFTER = 10.0


@dataclass
class _State:
    pool: Pool | None = None
    max_piece: int = 1 << 20          # bytes of the longest token's text (set at startup)
    shutting_down: bool = False
    watchdog: asyncio.Task | None = None
    metrics: Metrics = field(default_factory=Metrics)


@dataclass
class _Job:
    """One generation request, as the endpoints hand it to ``_generate``."""

    req: _Knobs
    score: Callable[[Slot], int]               # how much of the prompt a slot's memory holds
    tokens_for: Callable[[Slot], list[int]]    # the prompt's tokens for that slot (on a thread)
    chat_text: str | None
    stop_tokens: Sequence[int]
    make_chunk: Callable[..., dict[str, Any]]
    make_final: Callable[[GenerationResult, Any], dict[str, Any]]
    tools: ToolPlan | None = None


def _api_error(e: CloverError, param: str | None = None) -> APIError:
    if e.status in (N.CLOVER_ERR_INVALID_ARG, N.CLOVER_ERR_CONTEXT_FULL):
        return APIError(400, e.message, param=param)
    return APIError(500, e.message, code="generation_failed")


def create_app(model: Clover, parallel: int = 1, api_key: str | None = None, max_queue: int = 64,
               model_name: str | None = None, limits: Limits | None = None) -> Any:
    """The ASGI app serving ``model`` (which the app then owns) with ``parallel`` contexts."""
    limits = limits or Limits()
    name = model_name or model.metadata("general.name") or model.model_path.stem
    created = int(time.time())
    st = _State()
    metrics = st.metrics
    template = model.chat_template

    from contextlib import asynccontextmanager

    async def watchdog() -> None:
        period = max(0.05, min(1.0, limits.stuck_after / 4))
        while True:
            await asyncio.sleep(period)
            for s in st.pool.stuck(limits.stuck_after) if st.pool else ():
                if not s.watchdog_fired and s.cancel is not None:
                    s.watchdog_fired = True
                    s.cancel.set()
                    metrics.stuck += 1

    def longest_piece() -> int:
        return max((len(model.token_to_piece(t, special=True)) for t in range(model.n_vocab)), default=1)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.max_piece = max(1, await asyncio.to_thread(longest_piece))
        st.pool = Pool(model, parallel, max_queue)
        st.watchdog = asyncio.create_task(watchdog())
        try:
            yield
        finally:
            st.shutting_down = True
            st.pool.cancel_all()
            st.watchdog.cancel()
            st.pool.close()

    app = FastAPI(title="clover serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.clover = st

    def error_response(e: APIError) -> JSONResponse:
        metrics.errors += 1
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(APIError(e.status_code, msg.get(e.status_code, str(e.detail)),
                                       code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:  # a bug: still the one shape
        return error_response(APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    def checked(raw: bytes, cls: type) -> Any:
        body = parse_body(raw, limits)
        msgs = body.get("messages")
        if isinstance(msgs, list) and len(msgs) > limits.max_messages:  # before validating each of them
            raise APIError(400, f"messages: at most {limits.max_messages} per request (--max-messages), "
                                f"got {len(msgs)}", param="messages")
        return validate(cls, body)

    async def body_of(request: Request, cls: type) -> Any:
        """The body, parsed and validated on a thread (a large one must not stall the loop)."""
        raw = await request.body()
        return await asyncio.to_thread(checked, raw, cls) if len(raw) > 65536 else checked(raw, cls)

    # ------------------------------------------------------------------ information

    @app.get("/health")
    async def health() -> JSONResponse:
        if st.shutting_down:
            return JSONResponse(APIError(503, "the server is shutting down", code="shutting_down").body(),
                                status_code=503)
        stuck = st.pool.stuck(limits.stuck_after) if st.pool else []
        if stuck:
            e = APIError(503, f"context(s) {[s.index for s in stuck]} made no progress for over "
                              f"{limits.stuck_after:g} s", code="generation_stuck")
            return JSONResponse({**e.body(), "status": "stuck"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    def model_card() -> dict[str, Any]:
        size = model.model_path.stat().st_size if model.model_path.exists() else None
        return {"id": name, "object": "model", "created": created, "owned_by": "clover-cpp",
                "meta": {"n_vocab": model.n_vocab, "n_ctx_train": model.n_ctx_train, "n_ctx": model.n_ctx,
                         "train_block_size": model.train_block_size, "size": size,
                         "architecture": model.metadata("general.architecture")}}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != name:
            raise APIError(404, f"no model '{model_id}' (this server serves '{name}')", code="model_not_found",
                           param="model")
        return model_card()

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return {"model": name, "model_path": str(model.model_path), "n_ctx": model.n_ctx,
                "n_ctx_train": model.n_ctx_train, "n_vocab": model.n_vocab,
                "block_size": "auto", "train_block_size": model.train_block_size,
                "mode": "block-diffusion",
                "modes": {"block-diffusion": "block_size 'auto' or 1..max_block_size, threshold, max_steps",
                          "draft-self": "draft_self: true (the output of block_size 1, verified)",
                          "auto": "draft_self: 'auto' with block_size 'auto': B = 1, block diffusion or draft-self "
                                  "per block (the reply's clover.mode)"},
                "parallel": parallel, "queue_size": max_queue, "chat_template": template,
                "limits": {"max_body_bytes": limits.max_body_bytes, "max_messages": limits.max_messages,
                           "body_timeout_s": limits.body_timeout, "max_block_size": limits.max_block_size,
                           "stuck_timeout_s": limits.stuck_after, "max_stop": limits.max_stop}}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        assert st.pool is not None
        return PlainTextResponse(metrics.prometheus(st.pool), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ tokenizer and template

    def fits_bytes(text: str, param: str) -> None:
        """Refuse, untokenized, a text whose tokens cannot fit the context: every token spells
        at most max_piece bytes (x2: a normalising tokenizer)."""
        n = len(text.encode("utf-8", "replace"))
        if n > 2 * st.max_piece * model.n_ctx:
            raise APIError(400, f"the prompt ({n} bytes) cannot fit the context ({model.n_ctx} tokens)",
                           code="context_length_exceeded", param=param)

    async def tokenize(text: str, param: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        fits_bytes(text, param)
        try:
            return await asyncio.to_thread(model.tokenize, text, add_special, parse_special)
        except CloverError as e:
            raise _api_error(e, param) from None

    @app.post("/tokenize")
    async def tokenize_ep(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = await body_of(request, TokenizeRequest)
        toks = await tokenize(req.content, "content", req.add_special, req.parse_special)
        if not req.with_pieces:
            return {"tokens": toks}
        return {"tokens": [{"id": t, "piece": model.token_to_piece(t, special=True).decode("utf-8", "replace")}
                           for t in toks]}

    @app.post("/detokenize")
    async def detokenize_ep(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = await body_of(request, DetokenizeRequest)
        check_ids(req.tokens, "tokens")
        return {"content": await asyncio.to_thread(model.detokenize, req.tokens)}

    def check_ids(ids: list[int], param: str) -> None:
        n = model.n_vocab
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {n})", param=param)

    async def render(req: ChatRequest | ApplyTemplateRequest) -> tuple[str, ToolPlan]:
        if len(req.messages) > limits.max_messages:
            raise APIError(400, f"messages: at most {limits.max_messages} per request (--max-messages), "
                                f"got {len(req.messages)}", param="messages")
        tp = plan(req.tools, req.tool_choice, req.parallel_tool_calls, template)
        msgs = [m.for_template() for m in req.messages]
        kw = {"tools": tp.tools} if tp.active else {}
        try:
            text = await asyncio.to_thread(model.format_chat, msgs, **kw)
        except CloverError as e:
            raise APIError(400, e.message, param="messages") from None
        return text + tp.prefill, tp

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        text, _ = await render(await body_of(request, ApplyTemplateRequest))
        return {"prompt": text}

    # ------------------------------------------------------------------ generation

    def constraints(req: _Knobs, tools: ToolPlan | None = None) -> dict[str, Any]:
        """logprobs, response_format and grammar as Clover.generate takes them (a constrained
        request decodes autoregressively or with draft-self: stats.grammar_mode)."""
        req.check_neutral()
        rf = req.response_format.for_runtime() if req.response_format is not None else None
        if rf is not None and req.grammar:
            raise APIError(400, "grammar and response_format: give one", param="grammar")
        forced = tools.grammar if tools is not None else None
        if forced and (rf is not None or req.grammar):
            raise APIError(400, "tool_choice forces a call: grammar and response_format cannot apply too",
                           param="tool_choice")
        return {"logprobs": req.n_logprobs(), "grammar": req.grammar or forced, "response_format": rf}

    def gen_kwargs(req: _Knobs, n_prompt: int, param: str, tools: ToolPlan | None) -> dict[str, Any]:
        room = model.n_ctx - n_prompt
        if room < 1:
            raise APIError(400, f"the prompt ({n_prompt} tokens) does not fit the context ({model.n_ctx} tokens)",
                           code="context_length_exceeded", param=param)
        mt, mct = req.max_tokens, req.max_completion_tokens
        if mt is not None and mct is not None and mt != mct:
            raise APIError(400, f"max_tokens ({mt}) and max_completion_tokens ({mct}) disagree",
                           param="max_completion_tokens")
        max_tokens = mct if mct is not None else mt
        which = "max_completion_tokens" if mct is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = max(1, room - 64)
        elif max_tokens > room:
            raise APIError(400, f"the prompt ({n_prompt} tokens) + {which} ({max_tokens}) exceed the context "
                                f"({model.n_ctx} tokens)", code="context_length_exceeded", param=which)
        B = req.block_size
        if isinstance(B, int):
            top = min(limits.max_block_size, model.n_ctx)
            if not 1 <= B <= top:
                raise APIError(400, f"block_size must be 'auto' or in [1, {top}] (--max-block-size, n_ctx), got {B}",
                               param="block_size")
        seed = req.seed if req.seed not in (None, -1) else secrets.randbits(63)
        return dict(max_tokens=max_tokens, block_size=B or "auto", threshold=req.threshold,
                    max_steps=req.max_steps, temperature=req.temperature, top_k=min(req.top_k, INT32_MAX),
                    top_p=req.top_p, seed=seed, stop=req.stops(limits), stop_at_eos=not req.ignore_eos,
                    draft_self=req.draft_self, **constraints(req, tools))

    def constraint_param(req: _Knobs) -> str | None:
        return "grammar" if req.grammar else "response_format" if req.response_format is not None else None

    def token_bytes(t: int) -> bytes:
        return model.token_to_piece(t, special=True)

    def chat_logprobs(r: GenerationResult) -> dict[str, Any] | None:
        return fmt.chat_logprobs(r, token_bytes)

    def completion_logprobs(r: GenerationResult, offset: int) -> dict[str, Any] | None:
        return fmt.completion_logprobs(r, token_bytes, offset)

    async def wait_disconnect(request: Request, cancel: threading.Event, left: list[bool]) -> None:
        """Sets ``cancel`` when the client goes away (the body has been read: the next ASGI
        message is the disconnect)."""
        while not cancel.is_set():
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                left.append(True)
                cancel.set()
                metrics.cancelled += 1
                return

    async def generate(request: Request, job: _Job, param: str) -> Any:
        assert st.pool is not None
        req = job.req
        if st.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        metrics.requests += 1
        slot = await st.pool.acquire(job.score)
        cancel = threading.Event()
        slot.start(cancel)
        released = False

        async def finish(r: GenerationResult | None, prompt: list[int]) -> None:
            nonlocal released
            if released:
                return
            released = True
            if r is not None:
                metrics.add(r, len(prompt))
                slot.memory = (prompt + r.tokens)[:slot.model.n_committed]
                slot.chat_text = (job.chat_text + r.text) if job.chat_text is not None else ""
            else:
                slot.memory, slot.chat_text = [], ""
            await st.pool.release(slot)

        def failed() -> APIError | None:
            if slot.watchdog_fired:
                return APIError(500, f"the generation made no progress for {limits.stuck_after:g} s and was "
                                     "stopped (--stuck-timeout)", code="generation_stuck")
            if st.shutting_down:
                return APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
            return None

        try:
            try:
                prompt = await asyncio.to_thread(job.tokens_for, slot)
            except CloverError as e:
                raise _api_error(e, param) from None
            kw = gen_kwargs(req, len(prompt), param, job.tools)
        except BaseException:
            await finish(None, [])
            raise
        seed = kw["seed"]

        def run(stream: bool) -> Any:
            return slot.model.generate(prompt, stream=stream, stop_tokens=job.stop_tokens, _chat_text=job.chat_text,
                                       on_step=lambda canvas, n_masked, start: slot.step(n_masked, start),
                                       on_block=lambda text, toks: slot.block(), **kw)

        if not req.stream:
            left: list[bool] = []
            watcher = asyncio.create_task(wait_disconnect(request, cancel, left))
            result = None
            try:
                result = await asyncio.to_thread(run, False)
            except CloverError as e:
                raise _api_error(e, constraint_param(req)) from None
            except asyncio.CancelledError:
                if not st.shutting_down:
                    raise
                # uvicorn gave up waiting at shutdown: answer (if anyone listens), do not log a traceback
                raise APIError(503, "the server is shutting down", code="shutting_down") from None
            finally:
                cancel.set()
                watcher.cancel()
                await finish(result, prompt)
            if (e := failed()) is not None:
                raise e
            return JSONResponse(job.make_final(result, seed))

        try:
            it = await asyncio.to_thread(run, True)
        except CloverError as e:
            await finish(None, prompt)
            raise _api_error(e, constraint_param(req)) from None

        def next_piece() -> str | None:
            try:
                return next(it)
            except StopIteration:
                return None

        async def events() -> AsyncIterator[dict[str, str]]:
            ended = False
            ts = ToolStream(job.tools) if job.tools is not None and job.tools.active else None
            try:
                yield {"data": json.dumps(job.make_chunk(None))}
                while (piece := await asyncio.to_thread(next_piece)) is not None:
                    for ev in (ts.feed(piece) if ts else [("content", piece)]):
                        yield {"data": json.dumps(job.make_chunk(ev))}
                for ev in (ts.finish() if ts else []):
                    yield {"data": json.dumps(job.make_chunk(ev))}
                ended = True
                if (e := failed()) is not None:
                    metrics.errors += 1
                    yield {"data": json.dumps(e.body())}
                    return
                yield {"data": json.dumps(job.make_chunk(("end", (it.result, ts, seed))))}
                if (req.stream_options and req.stream_options.include_usage):
                    yield {"data": json.dumps(job.make_chunk(("usage", it.result)))}
                yield {"data": "[DONE]"}
            except CloverError as e:
                metrics.errors += 1
                yield {"data": json.dumps(_api_error(e).body())}
            finally:
                # a client that went away cancels this task: the clean-up must still run
                with anyio.CancelScope(shield=True):
                    if not ended:
                        metrics.cancelled += 1
                    cancel.set()
                    await asyncio.to_thread(it.close)
                    await finish(it.result, prompt)

        return EventSourceResponse(events(), ping=600)

    def message_of(r: GenerationResult, tp: ToolPlan | None) -> tuple[dict[str, Any], str]:
        if tp is None or not tp.active:
            return {"role": "assistant", "content": r.text}, fmt.finish_reason(r)
        ts = ToolStream(tp)
        ts.feed(r.text)
        ts.finish()
        content, calls = ts.message()
        if not calls:
            return {"role": "assistant", "content": content}, fmt.finish_reason(r)
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req: ChatRequest = await body_of(request, ChatRequest)
        text, tp = await render(req)
        constraints(req, tp)  # refused fields: before anything is tokenized
        fits_bytes(text, "messages")
        cid, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        base = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": name}

        def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def chunk(ev: tuple[str, Any] | None) -> dict[str, Any]:
            if ev is None:
                return choice({"role": "assistant", "content": ""})
            kind, v = ev
            if kind == "content":
                return choice({"content": v})
            if kind == "call":
                i, call = v
                return choice({"tool_calls": [{"index": i, **call}]})
            if kind == "usage":
                return {**base, "choices": [], "usage": fmt.usage(v)}
            r, ts, seed = v
            finish = "tool_calls" if ts is not None and ts.calls else fmt.finish_reason(r)
            end = choice({}, finish)
            end["choices"][0]["logprobs"] = chat_logprobs(r)  # streamed: all of them with the last chunk
            return {**end, "clover": fmt.clover_stats(r, seed)}

        def final(r: GenerationResult, seed: int) -> dict[str, Any]:
            msg, finish = message_of(r, tp)
            return {"id": cid, "object": "chat.completion", "created": now, "model": name,
                    "choices": [{"index": 0, "message": msg, "logprobs": chat_logprobs(r), "finish_reason": finish}],
                    "usage": fmt.usage(r), "clover": fmt.clover_stats(r, seed)}

        def score(slot: Slot) -> int:
            return len(slot.chat_text) if slot.chat_text and text.startswith(slot.chat_text) else 0

        job = _Job(req, score, lambda slot: slot.model.chat_tokens(text), text, model._stop_tokens(), chunk, final, tp)
        return await generate(request, job, "messages")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = await body_of(request, CompletionRequest)
        constraints(req)
        if req.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not supported")
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request (n = 1)", param="prompt")
            p = p[0]
        if isinstance(p, str):
            prompt = await tokenize(p, "prompt")
        else:
            if len(p) > model.n_ctx:
                raise APIError(400, f"the prompt ({len(p)} tokens) does not fit the context ({model.n_ctx} tokens)",
                               code="context_length_exceeded", param="prompt")
            prompt = list(p)
            check_ids(prompt, "prompt")
        cid, now = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        echo = await asyncio.to_thread(model.detokenize, prompt) if req.echo else ""
        base = {"id": cid, "object": "text_completion", "created": now, "model": name}

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        def chunk(ev: tuple[str, Any] | None) -> dict[str, Any]:
            if ev is None:
                return choice(echo)
            kind, v = ev
            if kind == "content":
                return choice(v)
            if kind == "usage":
                return {**base, "choices": [], "usage": fmt.usage(v)}
            r, _, seed = v
            end = choice("", fmt.finish_reason(r))
            end["choices"][0]["logprobs"] = completion_logprobs(r, len(echo))
            return {**end, "clover": fmt.clover_stats(r, seed)}

        def final(r: GenerationResult, seed: int) -> dict[str, Any]:
            out = choice(echo + r.text, fmt.finish_reason(r))
            out["choices"][0]["logprobs"] = completion_logprobs(r, len(echo))
            return {**out, "usage": fmt.usage(r), "clover": fmt.clover_stats(r, seed)}

        job = _Job(req, lambda slot: slot.token_reuse(prompt), lambda slot: prompt, None, (), chunk, final)
        return await generate(request, job, "prompt")

    return Guard(app, api_key, limits, on_error=lambda: setattr(metrics, "errors", metrics.errors + 1))


class _Server(uvicorn.Server):
    """uvicorn's server, and a deadline: after SIGTERM or SIGINT, generations are cancelled
    and the graceful shutdown runs; a process still alive HARD_EXIT_AFTER seconds later (a
    generation that does not stop) ends with the signal's exit status all the same."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit, self._deadline_set = on_exit, False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self._deadline_set:
            self._deadline_set = True

            def hard_exit() -> None:
                time.sleep(HARD_EXIT_AFTER)
                sys.stderr.write(f"clover serve: a generation did not stop within {HARD_EXIT_AFTER:g} s; exiting\n")
                sys.stderr.flush()
                os._exit(128 + int(sig))

            threading.Thread(target=hard_exit, daemon=True, name="clover-serve-hard-exit").start()
            try:
                self._on_exit()
            except Exception:  # noqa: BLE001 - the signal must still end the server
                pass
        super().handle_exit(sig, frame)


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8080, parallel: int = 1,
          api_key: str | None = None, n_ctx: int = 4096, n_threads: int | None = None, n_gpu_layers: int = 0,
          max_queue: int = 64, log_level: str = "warning", flash_attn: bool | None = None,
          rpc_servers: str | None = None, tensor_split: list[float] | None = None,
          override_tensor: str | None = None, limits: Limits | None = None) -> None:
    """Load the model and serve it until interrupted."""
    if n_threads is None:
        # the contexts share the cores, less one for the HTTP side: ggml's threads spin at their
        # barriers, so one preempted by the server's own threads stalls the others (measured on
        # 2 cores, --parallel 1: 17.6 req/s with 1 thread, 11.3 with 2, and 2.9 with 2 clients)
        n_threads = max(1, ((os.cpu_count() or 1) - 1) // parallel)
    model = Clover(model_path, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                   rpc_servers=rpc_servers, tensor_split=tensor_split, override_tensor=override_tensor)
    app = create_app(model, parallel=parallel, api_key=api_key, max_queue=max_queue, limits=limits)
    fastapi_app = app.app

    def on_exit() -> None:  # cancel every generation at its next step: shutdown need not wait for them
        st: _State = fastapi_app.state.clover
        st.shutting_down = True
        if st.pool is not None:
            st.pool.cancel_all()

    try:
        # uvicorn.Server, not uvicorn.run (which swallows it): after the graceful shutdown, the
        # Ctrl-C comes back as KeyboardInterrupt and the command exits 130 as the others do
        _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5),
                on_exit).run()
    finally:
        model.close()
