"""``clover serve``: one request's generation.

The endpoints (app.py) describe a request as a :class:`Job`; :class:`Generator` checks its
arguments against the context, takes a slot from the pool, runs the generation on a worker
thread (streamed or not) and gives the slot back. A client that disconnects cancels its
generation at the next denoising step, streaming or not; so do shutdown and the watchdog.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from .. import CLOVER_ERR_CONTEXT_FULL, CLOVER_ERR_INVALID_ARG, Clover, CloverError, GenerationResult
from . import format as fmt
from .pool import ServerState, Slot
from .tools import ToolPlan, ToolStream
from .types import APIError, Knobs, Limits


@dataclass
class Job:
    """One generation request, as the endpoints hand it to :meth:`Generator.run`."""

    req: Knobs
    score: Callable[[Slot], int]               # how many of the prompt's tokens a slot's memory holds
    tokens_for: Callable[[Slot], list[int]]    # the prompt's tokens for that slot (on a thread)
    chat_prompt: str | None                    # a chat's rendered prompt: Clover.generate_chat's
    make_chunk: Callable[..., dict[str, Any]]
    make_final: Callable[[GenerationResult], dict[str, Any]]
    tools: ToolPlan | None = None


def api_error(e: CloverError, param: str | None = None, req: Knobs | None = None) -> APIError:
    """The runtime's error as the API answers it: a bad argument or a full context is the
    client's (400, naming the request's field of the argument refused, CloverError.param, else
    ``param``), anything else the server's (500)."""
    if e.status in (CLOVER_ERR_INVALID_ARG, CLOVER_ERR_CONTEXT_FULL):
        return APIError(400, e.message, param=req.field_of(e.param) if req is not None and e.param else param)
    return APIError(500, e.message, code="generation_failed")


class CanvasEvents:
    """The canvas view's events of one streamed request (``stream_options.include_canvas``;
    docs/server.md): after every denoising step, the block's positions (the prompt's left out),
    each token's text (None while masked) and the step of the block that fixed it. The step
    callback builds them on the decode thread; a pump thread reads the text stream; both go,
    in the order they happened, into one queue that the SSE loop reads."""

    def __init__(self, model: Clover, n_prompt: int, verified: bool) -> None:
        self.model, self.n_prompt, self.verified = model, n_prompt, verified
        self.mask = model.mask_token
        self.q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.block = -1                       # block_start of the block being denoised
        self.n_step = 0                       # its steps so far
        self.fixed: list[int | None] = []     # per position: the step that fixed its token
        self.pieces: dict[int, str] = {}      # token id -> text

    def piece(self, t: int) -> str:
        s = self.pieces.get(t)
        if s is None:
            s = self.pieces[t] = self.model.token_to_piece(t, special=True).decode("utf-8", "replace")
        return s

    def step(self, canvas: list[int], n_masked: int, block_start: int) -> None:
        """From the decode thread, after every denoising step."""
        if block_start != self.block or len(canvas) != len(self.fixed):
            self.block, self.n_step, self.fixed = block_start, 0, [None] * len(canvas)
        self.n_step += 1
        skip = min(len(canvas), max(0, self.n_prompt - block_start))  # (positions of the prompt)
        tokens: list[str | None] = []
        for i in range(skip, len(canvas)):
            t = canvas[i]
            if t == self.mask:
                self.fixed[i] = None
                tokens.append(None)
            else:
                if self.fixed[i] is None:
                    self.fixed[i] = self.n_step
                tokens.append(self.piece(t))
        offset = block_start + skip - self.n_prompt
        self.q.put(("canvas", fmt.canvas_event(offset, block_start, len(canvas), self.n_step, n_masked, tokens,
                                               self.fixed[skip:], self.verified)))

    def pump(self, it: Any) -> None:
        """Reads the text stream ``it`` into the queue on a thread of its own; then ("end", None)."""
        def run() -> None:
            try:
                for piece in it:
                    self.q.put(("piece", piece))
                self.q.put(("end", None))
            except BaseException as e:  # noqa: BLE001 - raised by the SSE loop
                self.q.put(("error", e))
        threading.Thread(target=run, name="clover-serve-canvas", daemon=True).start()

    def next(self) -> tuple[str, Any]:
        kind, v = self.q.get()
        if kind == "error":
            raise v
        return kind, v


def constraint_param(req: Knobs) -> str | None:
    return ("grammar" if req.grammar else "response_format" if req.response_format is not None
            else "json_schema" if req.json_schema is not None else None)


def message_of(r: GenerationResult, tp: ToolPlan | None) -> tuple[dict[str, Any], str]:
    """The chat reply's message and finish reason (tool calls parsed out of the text)."""
    if tp is None or not tp.active:
        return {"role": "assistant", "content": r.text}, fmt.finish_reason(r)
    ts = ToolStream(tp)
    ts.feed(r.text)
    ts.finish()
    content, calls = ts.message()
    if not calls:
        return {"role": "assistant", "content": content}, fmt.finish_reason(r)
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


class Generator:
    """Runs the jobs of one app over its pool (``st.pool``) of contexts of ``model``."""

    def __init__(self, model: Clover, st: ServerState, limits: Limits) -> None:
        self.model, self.st, self.limits = model, st, limits

    def constraints(self, req: Knobs, tools: ToolPlan | None = None) -> dict[str, Any]:
        """logprobs, response_format and grammar as Clover.generate takes them (a constrained
        request decodes autoregressively or with draft-self: stats.grammar_mode)."""
        req.check_neutral()
        rf = req.structured_output()
        if rf is not None and req.grammar:
            other = "json_schema" if req.json_schema is not None else "response_format"
            raise APIError(400, f"grammar and {other}: give one", param="grammar")
        forced = tools.grammar if tools is not None else None
        if forced and (rf is not None or req.grammar):
            raise APIError(400, "tool_choice forces a call: grammar and response_format cannot apply too",
                           param="tool_choice")
        return {"logprobs": req.n_logprobs(), "grammar": req.grammar or forced, "response_format": rf}

    def gen_kwargs(self, req: Knobs, n_prompt: int, param: str, tools: ToolPlan | None) -> dict[str, Any]:
        n_ctx = self.model.n_ctx
        B = req.block_size
        if isinstance(B, int):
            top = min(self.limits.max_block_size, n_ctx)
            if not 1 <= B <= top:
                raise APIError(400, f"block_size must be 'auto' or in [1, {top}] (--max-block-size, n_ctx), got {B}",
                               param="block_size")
        B = B or "auto"
        room = self.model.room(n_prompt, block_size=B, draft_self=req.draft_self)  # the runtime's one rule
        if room < 1:
            raise APIError(400, f"the prompt ({n_prompt} tokens) does not fit the context ({n_ctx} tokens"
                                f"{f', in blocks of {B}' if n_ctx > n_prompt else ''})",
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
                                f"({n_ctx} tokens{f', in blocks of {B}' if room < n_ctx - n_prompt else ''})",
                           code="context_length_exceeded", param=which)
        # (the fields a request left out: Clover.generate's defaults, libclover's)
        given = {k: v for k in ("threshold", "max_steps", "top_k", "top_p", "coreset") if (v := getattr(req, k)) is not None}
        return dict(max_tokens=max_tokens, block_size=B, temperature=req.temperature, seed=req.seed,
                    stop=req.stops(self.limits), stop_at_eos=not req.ignore_eos, draft_self=req.draft_self,
                    **given, **self.constraints(req, tools))

    async def _wait_disconnect(self, request: Request, cancel: threading.Event) -> None:
        """Sets ``cancel`` when the client goes away (the body has been read: the next ASGI
        message is the disconnect)."""
        while not cancel.is_set():
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                cancel.set()
                self.st.metrics.cancelled += 1
                return

    def _shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})

    async def run(self, request: Request, job: Job, param: str) -> Any:
        """The reply to ``job``: a JSON response, or server-sent events when it streams."""
        st, limits, metrics = self.st, self.limits, self.st.metrics
        assert st.pool is not None
        pool = st.pool
        req = job.req
        if st.shutting_down:
            raise self._shutting_down()
        want_canvas = bool(req.stream_options and req.stream_options.include_canvas)
        if want_canvas and not req.stream:
            raise APIError(400, "stream_options.include_canvas needs stream: true", param="stream_options")
        metrics.requests += 1
        slot = await pool.acquire(job.score)
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
            await pool.release(slot)  # what its memory holds now, the next request reads from the model

        def failed() -> APIError | None:
            if slot.watchdog_fired:
                return APIError(500, f"the generation made no progress for {limits.stuck_after:g} s and was "
                                     "stopped (--stuck-timeout)", code="generation_stuck")
            return self._shutting_down() if st.shutting_down else None

        try:
            try:
                prompt = await asyncio.to_thread(job.tokens_for, slot)
            except CloverError as e:
                raise api_error(e, param) from None
            kw = self.gen_kwargs(req, len(prompt), param, job.tools)
        except BaseException:
            await finish(None, [])
            raise

        cv = CanvasEvents(slot.model, len(prompt), req.draft_self is True) if want_canvas else None

        def on_step(canvas: list[int], n_masked: int, start: int) -> bool:
            if cv is not None:
                cv.step(canvas, n_masked, start)
            return slot.step(n_masked, start)

        def generate(stream: bool) -> Any:
            call = dict(stream=stream, on_step=on_step, on_block=lambda text, toks: slot.block(), **kw)
            if job.chat_prompt is not None:  # it reads the same tokens (chat_tokens) and keeps the exchange
                return slot.model.generate_chat(job.chat_prompt, **call)
            return slot.model.generate(prompt, **call)

        if not req.stream:
            watcher = asyncio.create_task(self._wait_disconnect(request, cancel))
            result = None
            try:
                result = await asyncio.to_thread(generate, False)
            except CloverError as e:
                raise api_error(e, constraint_param(req), req) from None
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
            return JSONResponse(job.make_final(result))

        try:
            it = await asyncio.to_thread(generate, True)
        except CloverError as e:
            await finish(None, prompt)
            raise api_error(e, constraint_param(req), req) from None

        def next_piece() -> str | None:
            try:
                return next(it)
            except StopIteration:
                return None

        def next_item() -> tuple[str, Any] | None:
            """("piece", text) or ("canvas", event); None at the end."""
            if cv is None:
                piece = next_piece()
                return None if piece is None else ("piece", piece)
            kind, v = cv.next()
            return None if kind == "end" else (kind, v)

        if cv is not None:
            cv.pump(it)

        async def events() -> AsyncIterator[dict[str, str]]:
            ended = False
            ts = ToolStream(job.tools) if job.tools is not None and job.tools.active else None
            try:
                yield {"data": json.dumps(job.make_chunk(None))}
                while (item := await asyncio.to_thread(next_item)) is not None:
                    kind, piece = item
                    if kind == "canvas":
                        yield {"event": "clover.canvas", "data": json.dumps(piece)}
                        continue
                    for ev in (ts.feed(piece) if ts else [("content", piece)]):
                        yield {"data": json.dumps(job.make_chunk(ev))}
                for ev in (ts.finish() if ts else []):
                    yield {"data": json.dumps(job.make_chunk(ev))}
                ended = True
                if (e := failed()) is not None:
                    metrics.errors += 1
                    yield {"data": json.dumps(e.body())}
                    return
                yield {"data": json.dumps(job.make_chunk(("end", (it.result, ts))))}
                if (req.stream_options and req.stream_options.include_usage):
                    yield {"data": json.dumps(job.make_chunk(("usage", it.result)))}
                yield {"data": "[DONE]"}
            except CloverError as e:
                metrics.errors += 1
                yield {"data": json.dumps(api_error(e).body())}
            finally:
                # a client that went away cancels this task: the clean-up must still run
                with anyio.CancelScope(shield=True):
                    if not ended:
                        metrics.cancelled += 1
                    cancel.set()
                    await asyncio.to_thread(it.close)
                    await finish(it.result, prompt)

        return EventSourceResponse(events(), ping=600)
