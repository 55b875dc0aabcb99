"""``clover serve``: one request's generation.

The endpoints (app.py) describe a request as a :class:`Job`; :class:`Generator` checks its
arguments against the context, takes a slot from the pool, runs the generation on a worker
thread (streamed or not) and gives the slot back. A client that disconnects cancels its
generation at the next denoising step, streaming or not; so do shutdown and the watchdog.
"""

from __future__ import annotations

import asyncio
import json
import math
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
from .. import openai_reply as reply
from ..decoding import StreamPiece
from ..openai_reply import PromptLogprobs
from . import format as fmt
from .pool import ServerState, Slot
from .tools import ToolPlan, ToolStream, reply_message
from .types import APIError, Knobs, Limits


@dataclass
class Prompt:
    """One prompt of a request, as the pool and its generations need it."""

    score: Callable[[Slot], int]               # how many of its tokens a slot's memory holds
    tokens_for: Callable[[Slot], list[int]]    # its tokens for that slot (on a thread)
    chat_prompt: str | None = None             # a chat's rendered prompt: Clover.generate_chat's
    text: str = ""                             # a completion's prompt text (echo's; the reply's offsets start after it)
    #: echo with logprobs: its tokens' log-probabilities (Clover.prompt_logprobs, once per prompt)
    scored: PromptLogprobs | None = None


@dataclass
class Choice:
    """One generation of a request: its prompt, its seed, where it goes in the reply, its result."""

    prompt: Prompt
    seed: int | None
    index: int
    result: GenerationResult | None = None


@dataclass
class Job:
    """One request, as the endpoints hand it to :meth:`Generator.run`: its prompts, each
    generated ``best_of`` times (the ``req.n`` best are kept: ``choices`` in OpenAI's order)."""

    req: Knobs
    prompts: list[Prompt]
    #: a streamed chunk of a choice: None (its start), ("content", text: a StreamPiece, whose
    #: logprobs, when not None, the chunk carries), ("call", (i, call)), ("end", (result, tool
    #: stream)); or of the request: ("usage", the results)
    make_chunk: Callable[[Choice | None, tuple[str, Any] | None], dict[str, Any]]
    make_final: Callable[[list[Choice], list[GenerationResult]], dict[str, Any]]  # kept choices, all results
    tools: ToolPlan | None = None
    best_of: int = 1
    score_prompts: bool = False                # echo + logprobs: the prompts' tokens are scored too


def seed_of(seed: int | None, k: int) -> int | None:
    """The seed of a request's k-th generation: seed + k when one is given (each choice its own
    stream, as llama-server's n), else None (a fresh random one, reported per choice)."""
    if seed is None or seed == -1:
        return None
    if k == 0 or not 0 <= seed < 2**64:  # (out of range: the runtime's refusal, naming seed)
        return seed
    return (seed + k) % 2**64


def best_score(r: GenerationResult) -> float:
    """best_of's ranking: the mean log-probability per token, OpenAI's "highest log probability
    per token" (an empty output: -inf, no token to judge it by)."""
    return sum(r.logprobs) / len(r.logprobs) if r.logprobs else -math.inf


def keep_best(choices: list[Choice], best_of: int, n: int) -> list[Choice]:
    """Of each prompt's best_of generations the n best (by best_score, ties: the earlier), indexed
    prompt by prompt as OpenAI orders them (prompt i's choices are i*n .. i*n + n - 1)."""
    kept: list[Choice] = []
    for i in range(0, len(choices), best_of):
        group = choices[i:i + best_of]
        if best_of > n:
            group = sorted(group, key=lambda c: -best_score(c.result))[:n]  # type: ignore[arg-type]
        for j, c in enumerate(group):
            c.index = i // best_of * n + j
            kept.append(c)
    return kept


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

    def __init__(self, model: Clover, n_prompt: int, verified: bool, index: int = 0) -> None:
        self.model, self.n_prompt, self.verified, self.index = model, n_prompt, verified, index
        self.mask = model.mask_token
        self.q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.block = -1                       # block_start of the block being denoised
        self.n_step = 0                       # its steps so far
        self.fixed: list[int | None] = []     # per position: the step that fixed its token
        self.pieces: dict[int, str] = {}      # token id -> text
        self.drafted: tuple[int, list[int]] | None = None  # draft-self: (block_start, the draft being verified)

    def piece(self, t: int) -> str:
        s = self.pieces.get(t)
        if s is None:
            s = self.pieces[t] = self.model.token_to_piece(t, special=True).decode("utf-8", "replace")
        return s

    def draft(self, tokens: list[int], block_start: int) -> None:
        """From the decode thread, with each draft before its verification (draft-self)."""
        self.drafted = (block_start, tokens)

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
        drafted = None
        if self.drafted is not None and self.drafted[0] == block_start:
            d = self.drafted[1]  # (fewer than the block's positions at the budget's end: None after them)
            drafted = [self.piece(t) for t in d[skip:]] + [None] * (len(canvas) - max(skip, len(d)))
            self.drafted = None
        self.q.put(("canvas", fmt.canvas_event(offset, block_start, len(canvas), self.n_step, n_masked, tokens,
                                               self.fixed[skip:], self.verified, self.index, drafted)))

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
    message = reply_message(r.text, tp)
    return message, reply.finish_reason(r, tool_calls="tool_calls" in message)


class Generator:
    """Runs the jobs of one app over its pool (``st.pool``) of contexts of ``model``."""

    def __init__(self, model: Clover, st: ServerState, limits: Limits) -> None:
        self.model, self.st, self.limits = model, st, limits

    def constraints(self, req: Knobs, tools: ToolPlan | None = None) -> dict[str, Any]:
        """logprobs, response_format and grammar as Clover.generate takes them (a constrained
        request decodes autoregressively or with draft-self: stats.grammar_mode)."""
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
        n_ctx = self.model.n_ctx()
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
                    **given, **req.chain(), **self.constraints(req, tools))

    async def wait_disconnect(self, request: Request, cancel: threading.Event) -> None:
        """Sets ``cancel`` when the client goes away (the body has been read: the next ASGI
        message is the disconnect)."""
        while not cancel.is_set():
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                cancel.set()
                self.st.metrics.cancelled += 1
                return

    def shutting_down_error(self) -> APIError:
        return APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})

    def check_generations(self, n_prompts: int, best_of: int, n: int) -> None:
        """A request's generations (prompts x best_of) within Limits.max_generations."""
        total = n_prompts * best_of
        if total > self.limits.max_generations:
            field = "best_of" if best_of > n else "n"
            raise APIError(400, f"{total} generations asked (prompts x {field}); at most "
                                f"{self.limits.max_generations} per request", param=field)

    async def run(self, request: Request, job: Job, param: str) -> Any:
        """The reply to ``job``: a JSON response, or server-sent events when it streams. Its
        generations run one after the other (each on the free context that holds the most of
        its prompt), under one cancellation: a client that leaves stops them all."""
        st, req = self.st, job.req
        if st.shutting_down:
            raise self.shutting_down_error()
        want_canvas = bool(req.stream_options and req.stream_options.include_canvas)
        if want_canvas and not req.stream:
            raise APIError(400, "stream_options.include_canvas needs stream: true", param="stream_options")
        self.check_generations(len(job.prompts), job.best_of, req.n)
        choices = [Choice(p, seed_of(req.seed, k), k) for k, p in
                   enumerate(p for p in job.prompts for _ in range(job.best_of))]
        st.metrics.requests += 1
        req_run = RequestRun(self, job, param, want_canvas)
        if not req.stream:
            return await req_run.reply(request, choices)
        return await req_run.stream(choices)


class RequestRun:
    """The generations of one request, one after the other, under one cancellation."""

    def __init__(self, gen: Generator, job: Job, param: str, want_canvas: bool) -> None:
        self.gen, self.job, self.param, self.want_canvas = gen, job, param, want_canvas
        self.st, self.limits, self.metrics = gen.st, gen.limits, gen.st.metrics
        self.cancel = threading.Event()
        self.stuck = False   # the watchdog stopped one of them
        req = job.req
        # best_of ranks by logprobs: asked of the runtime even when the request does not want them
        self.n_top = req.n_logprobs()
        if self.n_top is None and job.best_of > req.n:
            self.n_top = 0
        self.want_logprobs = req.n_logprobs() is not None

    def failed(self) -> APIError | None:
        if self.stuck:
            return APIError(500, f"the generation made no progress for {self.limits.stuck_after:g} s and was "
                                 "stopped (--stuck-timeout)", code="generation_stuck")
        return self.gen.shutting_down_error() if self.st.shutting_down else None

    async def open(self, c: Choice) -> "OneGeneration":
        """A slot for ``c``, its prompt's tokens, generate()'s arguments (a bad request: APIError,
        the slot given back) and, for echo + logprobs, the prompt's scores."""
        g = OneGeneration(self, c, await self.st.pool.acquire(c.prompt.score))  # type: ignore[union-attr]
        try:
            try:
                g.prompt = await asyncio.to_thread(c.prompt.tokens_for, g.slot)
                g.kw = self.gen.gen_kwargs(self.job.req, len(g.prompt), self.param, self.job.tools)
                g.kw.update(seed=c.seed, logprobs=self.n_top)
                if self.job.score_prompts and c.prompt.scored is None:
                    c.prompt.scored = await asyncio.to_thread(g.slot.model.prompt_logprobs, g.prompt, self.n_top or 0)
            except CloverError as e:
                raise api_error(e, self.param) from None
        except BaseException:
            await g.finish(None)
            raise
        return g

    def reported(self, r: GenerationResult) -> GenerationResult:
        """``r`` as the reply shows it: logprobs asked only for best_of's ranking are left out."""
        if not self.want_logprobs:
            r.logprobs = r.top_logprobs = None
        return r

    async def reply(self, request: Request, choices: list[Choice]) -> JSONResponse:
        job, req = self.job, self.job.req
        watcher = asyncio.create_task(self.gen.wait_disconnect(request, self.cancel))
        try:
            for c in choices:
                if self.cancel.is_set():
                    break
                g = await self.open(c)
                result = None
                try:
                    result = await asyncio.to_thread(g.generate, False)
                except CloverError as e:
                    raise api_error(e, constraint_param(req), req) from None
                except asyncio.CancelledError:
                    if not self.st.shutting_down:
                        raise
                    # uvicorn gave up waiting at shutdown: answer (if anyone listens), do not log a traceback
                    raise APIError(503, "the server is shutting down", code="shutting_down") from None
                finally:
                    await g.finish(result)
                c.result = result
        finally:
            self.cancel.set()
            watcher.cancel()
        if (e := self.failed()) is not None:
            raise e
        if any(c.result is None for c in choices):  # (the client left: nobody reads this)
            raise APIError(499, "the client closed the connection", code="client_closed")
        kept = keep_best(choices, job.best_of, req.n)
        results = [self.reported(c.result) for c in choices]  # type: ignore[arg-type]
        return JSONResponse(job.make_final(kept, results))

    async def stream(self, choices: list[Choice]) -> EventSourceResponse:
        """Server-sent events: each choice's chunks in turn (best_of = n: every choice is kept,
        in order). The first generation starts before the response, so a bad request is still
        an HTTP error."""
        job, req, metrics = self.job, self.job.req, self.metrics
        first = await self.open(choices[0])
        try:
            await first.start()
        except BaseException as e:
            await first.finish(None)
            if isinstance(e, CloverError):
                raise api_error(e, constraint_param(req), req) from None
            raise

        async def events() -> AsyncIterator[dict[str, str]]:
            g: OneGeneration | None = first
            results: list[GenerationResult] = []
            ended = False
            try:
                for c in choices:
                    if g is None:
                        try:
                            g = await self.open(c)
                            await g.start()
                        except (APIError, CloverError) as e:
                            ended = True
                            metrics.errors += 1
                            err = e if isinstance(e, APIError) else api_error(e, constraint_param(req), req)
                            yield {"data": json.dumps(err.body())}
                            return
                    async for ev in g.events():
                        yield ev
                    ts, result = g.ts, await g.finish(None)
                    g = None
                    if (e := self.failed()) is not None:
                        ended = True
                        metrics.errors += 1
                        yield {"data": json.dumps(e.body())}
                        return
                    if result is None:
                        return
                    c.result = self.reported(result)
                    results.append(result)
                    yield {"data": json.dumps(job.make_chunk(c, ("end", (result, ts))))}
                ended = True
                if req.stream_options and req.stream_options.include_usage:
                    yield {"data": json.dumps(job.make_chunk(None, ("usage", results)))}
                yield {"data": "[DONE]"}
            except CloverError as e:
                metrics.errors += 1
                yield {"data": json.dumps(api_error(e).body())}
            finally:
                # a client that went away cancels this task: the clean-up must still run
                with anyio.CancelScope(shield=True):
                    if not ended:
                        metrics.cancelled += 1
                    self.cancel.set()
                    if g is not None:
                        await g.finish(None)

        return EventSourceResponse(events(), ping=600)


class OneGeneration:
    """One generation of a request on its slot, from the slot's acquisition to its release."""

    def __init__(self, run: RequestRun, choice: Choice, slot: Slot) -> None:
        self.run, self.choice, self.slot = run, choice, slot
        self.prompt: list[int] = []
        self.kw: dict[str, Any] = {}
        self.it: Any = None           # the stream (stream: true)
        self.cv: CanvasEvents | None = None
        self.ts: ToolStream | None = None  # a chat's tool calls, parsed out of the streamed text
        self.released = False
        slot.start(run.cancel)

    def _on_draft(self, draft: list[int], start: int) -> bool:
        if self.cv is not None:
            self.cv.draft(draft, start)
        return False

    def _on_step(self, canvas: list[int], n_masked: int, start: int) -> bool:
        if self.cv is not None:
            self.cv.step(canvas, n_masked, start)
        return self.slot.step(n_masked, start)

    def generate(self, stream: bool) -> Any:
        """Clover.generate (or generate_chat: it reads the same tokens and keeps the exchange)."""
        call = dict(stream=stream, on_step=self._on_step, on_block=lambda text, toks: self.slot.block(), **self.kw)
        if self.run.want_canvas:  # (drafts come in draft-self's blocks only)
            call["on_draft"] = self._on_draft
        chat = self.choice.prompt.chat_prompt
        if chat is not None:
            return self.slot.model.generate_chat(chat, **call)
        return self.slot.model.generate(self.prompt, **call)

    async def finish(self, r: GenerationResult | None) -> GenerationResult | None:
        """Gives the slot back (once): what its memory holds now, the next request reads from the model."""
        if self.released:
            return r
        self.released = True
        if self.it is not None:
            await asyncio.to_thread(self.it.close)
            r = self.it.result
        if self.slot.watchdog_fired:
            self.run.stuck = True
        if r is not None:
            self.run.metrics.add(r, len(self.prompt))
        await self.run.st.pool.release(self.slot)  # type: ignore[union-attr]
        return r

    async def start(self) -> None:
        """Starts the streamed generation (its argument errors: CloverError, here)."""
        if self.run.want_canvas:  # (before the decoding starts: its first steps' events must find it)
            self.cv = CanvasEvents(self.slot.model, len(self.prompt), self.run.job.req.draft_self is True,
                                   self.choice.index)
        self.it = await asyncio.to_thread(self.generate, True)
        if self.cv is not None:
            self.cv.pump(self.it)

    def _next_item(self) -> tuple[str, Any] | None:
        """("piece", text) or ("canvas", event); None at the end."""
        if self.cv is None:
            try:
                return "piece", next(self.it)
            except StopIteration:
                return None
        kind, v = self.cv.next()
        return None if kind == "end" else (kind, v)

    async def events(self) -> AsyncIterator[dict[str, str]]:
        """This choice's server-sent events up to its end (the caller sends its last chunk)."""
        job, c = self.run.job, self.choice
        self.ts = ToolStream(job.tools) if job.tools is not None and job.tools.parses else None
        # each content chunk carries the logprobs of the tokens streamed since the last one that
        # carried any (a tool stream may hold text back); those left at the end: a chunk of their own
        owed: list[StreamPiece] = []

        def chunk(ev: tuple[str, Any]) -> dict[str, str]:
            if ev[0] == "content" and owed:
                paid = StreamPiece.joined(owed)
                owed.clear()
                ev = ("content", StreamPiece(ev[1], paid.tokens, paid.logprobs, paid.top_logprobs))
            return {"data": json.dumps(job.make_chunk(c, ev))}

        yield {"data": json.dumps(job.make_chunk(c, None))}
        while (item := await asyncio.to_thread(self._next_item)) is not None:
            kind, piece = item
            if kind == "canvas":
                yield {"event": "clover.canvas", "data": json.dumps(piece)}
                continue
            if not (isinstance(piece, StreamPiece) and self.run.want_logprobs):
                piece = StreamPiece(piece)  # (logprobs asked only for best_of's ranking are not shown)
            owed.append(piece)
            for ev in (self.ts.feed(str(piece)) if self.ts else [("content", str(piece))]):
                yield chunk(ev)
        for ev in (self.ts.finish() if self.ts else []):
            yield chunk(ev)
        if owed and owed[0].logprobs is not None:
            yield chunk(("content", ""))
