"""``clover serve``: the app: its routes and error handlers.

Nothing slow runs on the event loop: chat templates are rendered and prompts tokenized on
worker threads, after a cheap bound (a prompt of more bytes than the context's tokens could
spell is refused untokenized), so ``/health`` answers while a huge request is being read.
A request's generation: generation.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import Clover, CloverError, GenerationResult
from .. import openai_reply as reply
from ..chat import CHATML_TEMPLATE
from . import format as fmt
from . import llama_dialect as llama
from .asgi import Guard
from .embeddings import Embedder, EmbeddingRequest, not_enabled
from .generation import Choice, Generator, Job, Prompt, api_error, message_of
from .pool import Pool, ServerState, watchdog
from .tools import ToolPlan, plan
from .types import (
    APIError, ApplyTemplateRequest, ChatRequest, CompletionRequest, DetokenizeRequest, Limits, TokenizeRequest,
    parse_body, unsupported, validate)

__all__ = ["create_app"]

#: the chat page's files (``GET /`` and ``/static/``; docs/server.md, "The web page")
STATIC = Path(__file__).resolve().parent / "static"


class PublicPage:
    """``GET /`` and ``/static/*`` past the API key: the page's files hold no secret (the page
    asks for the key and sends it with each request); everything else goes through ``guard``."""

    def __init__(self, guard: Guard) -> None:
        self.guard, self.app = guard, guard.app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and (
                path == "/" or path.startswith("/static/")):
            return await self.app(scope, receive, send)
        return await self.guard(scope, receive, send)


def create_app(model: Clover, parallel: int = 1, api_key: str | None = None, max_queue: int = 64,
               model_name: str | None = None, limits: Limits | None = None, embeddings: bool = False,
               reasoning_format: str = "deepseek") -> Any:
    """The ASGI app serving ``model`` (which the app then owns) with ``parallel`` contexts;
    ``embeddings``: /v1/embeddings too (``model`` made with embedding=True); ``reasoning_format``:
    a chat's default (llama-server's --reasoning-format and its default): other than "none", the
    reply's thinking goes to ``reasoning_content``."""
    limits = limits or Limits()
    name = model_name or model.metadata.get("general.name") or model.model_path.stem
    created = int(time.time())
    st = ServerState()
    metrics = st.metrics
    gen = Generator(model, st, limits)
    template = model.chat_template
    coreset = model.coreset  # the served contexts' block expert coreset (a request's `coreset` overrides it)

    def longest_piece() -> int:
        return max((len(model.token_to_piece(t, special=True)) for t in range(model.n_vocab())), default=1)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.max_piece = max(1, await asyncio.to_thread(longest_piece))
        st.pool = Pool(model, parallel, max_queue)
        st.watchdog = asyncio.create_task(watchdog(st, limits.stuck_after))
        try:
            yield
        finally:
            st.shutting_down = True
            st.pool.cancel_all()
            st.watchdog.cancel()
            st.pool.close()

    app = FastAPI(title="clover serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.clover = st
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> FileResponse:  # the chat page (static/index.html)
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

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
                "meta": {"n_vocab": model.n_vocab(), "n_ctx_train": model.n_ctx_train, "n_ctx": model.n_ctx(),
                         "train_block_size": model.train_block_size, "size": size,
                         "architecture": model.metadata.get("general.architecture")}}

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
        return {"model": name, "model_path": str(model.model_path), "n_ctx": model.n_ctx(),
                "n_ctx_train": model.n_ctx_train, "n_vocab": model.n_vocab(),
                "block_size": "auto", "train_block_size": model.train_block_size, "coreset": coreset,
                "mode": "block-diffusion",
                "modes": {"block-diffusion": "block_size 'auto' or 1..max_block_size, threshold, max_steps",
                          "draft-self": "draft_self: true (the output of block_size 1, verified)",
                          "auto": "draft_self: 'auto' with block_size 'auto': B = 1, block diffusion or draft-self "
                                  "per block (the reply's clover.mode)"},
                "parallel": parallel, "queue_size": max_queue, "chat_template": template or CHATML_TEMPLATE,
                "chat_template_source": model.chat_template_source,
                "total_slots": parallel, "default_generation_settings": {"n_ctx": model.n_ctx()},  # (llama-server's)
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
        if n > 2 * st.max_piece * model.n_ctx():
            raise APIError(400, f"the prompt ({n} bytes) cannot fit the context ({model.n_ctx()} tokens)",
                           code="context_length_exceeded", param=param)

    async def tokenize(text: str, param: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        fits_bytes(text, param)
        try:
            return await asyncio.to_thread(model.tokenize, text, add_special, parse_special)
        except CloverError as e:
            raise api_error(e, param) from None

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
        return {"content": await asyncio.to_thread(model.detokenize_text, req.tokens)}

    def check_ids(ids: list[int], param: str) -> None:
        n = model.n_vocab()
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {n})", param=param)

    async def render(req: ChatRequest | ApplyTemplateRequest) -> tuple[str, ToolPlan]:
        if len(req.messages) > limits.max_messages:
            raise APIError(400, f"messages: at most {limits.max_messages} per request (--max-messages), "
                                f"got {len(req.messages)}", param="messages")
        thinking = getattr(req, "reasoning_format", None) or reasoning_format  # (apply-template: the default)
        tp = plan(req.tools, req.tool_choice, req.parallel_tool_calls, template, thinking)
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

    def token_bytes(t: int) -> bytes:
        return model.token_to_piece(t, special=True)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req: ChatRequest = await body_of(request, ChatRequest)
        text, tp = await render(req)
        gen.constraints(req, tp)  # refused fields: before anything is tokenized
        fits_bytes(text, "messages")
        head = reply.head("chat.completion", name)
        base = {**head, "object": "chat.completion.chunk"}

        def choice(c: Choice, delta: dict[str, Any], finish: str | None = None,
                   logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return {**base, "choices": [reply.delta_choice(c.index, delta, logprobs, finish)]}

        def chunk(c: Choice | None, ev: tuple[str, Any] | None) -> dict[str, Any]:
            if c is None:  # ("usage", the results)
                return {**base, "choices": [], "usage": reply.usage(ev[1], req.n)}  # type: ignore[index]
            if ev is None:
                return choice(c, {"role": "assistant", "content": ""})
            kind, v = ev
            if kind == "content":  # (with its own tokens' logprobs)
                return choice(c, {"content": str(v)}, logprobs=reply.chat_logprobs(v, token_bytes))
            if kind == "reasoning":  # (llama-server's delta field)
                return choice(c, {"reasoning_content": v})
            if kind == "call":
                i, call = v
                return choice(c, {"tool_calls": [{"index": i, **call}]})
            r, ts = v
            finish = reply.finish_reason(r, tool_calls=ts is not None and bool(ts.calls))
            return {**choice(c, {}, finish), "clover": fmt.clover_stats(r)}

        def final(kept: list[Choice], results: list[GenerationResult]) -> dict[str, Any]:
            choices = []
            for c in kept:
                r = c.result
                assert r is not None
                msg, finish = message_of(r, tp)
                choices.append({**reply.message_choice(c.index, msg, reply.chat_logprobs(r, token_bytes), finish),
                                **per_choice_stats(kept, r)})
            return {**head, "choices": choices,
                    "usage": reply.usage(results, req.n), "clover": first_choice_stats(kept)}

        prompt = Prompt(lambda slot: slot.chat_reuse(text), lambda slot: slot.model.chat_tokens(text), chat_prompt=text)
        return await gen.run(request, Job(req, [prompt], chunk, final, tp, best_of=req.n), "messages")

    def first_choice_stats(kept: list[Choice]) -> dict[str, Any]:
        assert kept[0].result is not None
        return fmt.clover_stats(kept[0].result)

    def per_choice_stats(kept: list[Choice], r: GenerationResult) -> dict[str, Any]:
        """Several choices: each with its own ``clover`` figures (the reply's are the first's)."""
        return {"clover": fmt.clover_stats(r)} if len(kept) > 1 else {}

    async def completion_prompt(p: str | list[int]) -> Prompt:
        if isinstance(p, str):
            toks = await tokenize(p, "prompt")
        else:
            if len(p) > model.n_ctx():
                raise APIError(400, f"the prompt ({len(p)} tokens) does not fit the context ({model.n_ctx()} tokens)",
                               code="context_length_exceeded", param="prompt")
            toks = list(p)
            check_ids(toks, "prompt")
        text = await asyncio.to_thread(model.detokenize_text, toks)  # (echo's, and where the reply's offsets start)
        return Prompt(lambda slot: slot.reuse(toks), lambda slot: toks, text=text)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = await body_of(request, CompletionRequest)
        gen.constraints(req)
        if req.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not supported")
        best_of = req.candidates()
        gen.check_generations(len(req.prompts()), best_of, req.n)  # (before any is tokenized)
        prompts = [await completion_prompt(p) for p in req.prompts()]
        base = reply.head("text_completion", name)

        def echoed(c: Choice) -> tuple[str, dict[str, Any] | None]:
            """The echoed prompt's text and, with logprobs, its tokens' (scored: Job.score_prompts)."""
            if not req.echo:
                return "", None
            sc = c.prompt.scored
            return c.prompt.text, reply.prompt_logprobs(sc, model.bos_token, token_bytes) if sc is not None else None

        def choice(c: Choice, text: str, logprobs: dict[str, Any] | None = None,
                   finish: str | None = None) -> dict[str, Any]:
            return reply.text_choice(c.index, text, logprobs, finish)

        offsets: dict[int, int] = {}  # streamed: per choice, where its next token's text starts

        def chunk(c: Choice | None, ev: tuple[str, Any] | None) -> dict[str, Any]:
            if c is None:  # ("usage", the results)
                return {**base, "choices": [], "usage": reply.usage(ev[1], best_of)}  # type: ignore[index]
            if ev is None:  # the echo, with its tokens' logprobs
                return {**base, "choices": [choice(c, *echoed(c))]}
            kind, v = ev
            if kind == "content":  # with its own tokens' logprobs
                at = offsets.get(c.index, len(c.prompt.text))
                lp = reply.reply_logprobs(v, token_bytes, at)
                offsets[c.index] = at + sum(map(len, lp["tokens"])) if lp is not None else at
                return {**base, "choices": [choice(c, str(v), lp)]}
            r, _ = v
            return {**base, "choices": [choice(c, "", None, reply.finish_reason(r))], "clover": fmt.clover_stats(r)}

        def final(kept: list[Choice], results: list[GenerationResult]) -> dict[str, Any]:
            choices = []
            for c in kept:
                r = c.result
                assert r is not None
                echo_text, echo_lp = echoed(c)
                lp = reply.joined(echo_lp, reply.reply_logprobs(r, token_bytes, len(c.prompt.text))) \
                    if r.logprobs is not None else None
                choices.append({**choice(c, echo_text + r.text, lp, reply.finish_reason(r)),
                                **per_choice_stats(kept, r)})
            return {**base, "choices": choices, "usage": reply.usage(results, best_of),
                    "clover": first_choice_stats(kept)}

        job = Job(req, prompts, chunk, final, best_of=best_of,
                  score_prompts=req.echo and req.logprobs is not None)
        return await gen.run(request, job, "prompt")

    embedder = Embedder(model, name) if embeddings else None

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def create_embeddings(request: Request) -> dict[str, Any]:
        if embedder is None:
            raise not_enabled()
        return await embedder.reply(await body_of(request, EmbeddingRequest))

    # ------------------------------------------------------------------ llama-server's dialect (llama_dialect.py)

    @app.post("/completion")
    async def llama_completion(request: Request) -> Any:
        req: llama.LlamaCompletion = await body_of(request, llama.LlamaCompletion)
        openai = req.as_openai()
        gen.constraints(openai)  # refused fields: before anything is tokenized
        prompt = await completion_prompt(req.prompt)
        llama_reply = llama.LlamaReply(req, model, name)
        try:
            job = llama_reply.job(prompt if req.cache_prompt else llama.uncached(prompt), openai)
            response = await gen.run(request, job, "prompt")
        except APIError as e:
            raise llama.renamed(e) from None
        if isinstance(response, EventSourceResponse):
            response.body_iterator = llama.without_done(response.body_iterator)
        return response

    @app.get("/slots")
    async def slots(fail_on_no_slot: int = 0) -> Any:
        assert st.pool is not None
        if fail_on_no_slot and not st.pool.free:
            raise APIError(503, "no free slot", code="unavailable")
        return llama.slots(st.pool)

    return PublicPage(Guard(app, api_key, limits, on_error=lambda: setattr(metrics, "errors", metrics.errors + 1)))
