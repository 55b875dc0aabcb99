"""``clover serve``: the ASGI layer in front of the app.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which wraps ``receive`` and
so hides a client's disconnect from the endpoint): the API key, the body's size limit
(``Content-Length`` above it: 413 before a byte is read; a chunked body: 413 once it passes
it) and its time limit (the whole body within ``body_timeout`` seconds, else 408: a slow
client, or a ``Content-Length`` larger than the body, cannot hold a connection forever).
Every error it answers has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import secrets
from typing import Any

from starlette.requests import ClientDisconnect

from .types import APIError, Limits


class BodyTimeout(APIError):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body did not arrive within {seconds:g} s "
                              "(is Content-Length larger than the body?)", code="body_timeout",
                         headers={"Connection": "close"})


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-body)", code="body_too_large",
                         headers={"Connection": "close"})


async def send_error(send: Any, e: APIError) -> None:
    body = e.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def check_api_key(api_key: str | None, env: str = "CLOVER_API_KEY") -> None:
    """Refuse a key that would turn auth off or that no client can send (ValueError, one line).

    An empty key used to mean "no key" (a falsy test): ``--api-key ''``, or ``$CLOVER_API_KEY``
    set but empty (click reads an empty variable as absent), served every endpoint to anyone
    with no word. No key at all (the option absent, the variable unset) is an open
    server, as before; a set-but-empty one is now a mistake, refused at start-up."""
    if api_key is None:
        if os.environ.get(env) is not None and not os.environ[env].strip():
            raise ValueError(f"${env} is set but empty, which would turn authentication off; set a key, "
                             f"or unset {env} to serve without one")
        return
    if not isinstance(api_key, str):
        raise ValueError(f"the API key must be a string, got {type(api_key).__name__}")
    if not api_key.strip():
        raise ValueError("--api-key is empty, which would turn authentication off; give a key, or leave the "
                         "option out to serve without one")
    if api_key != api_key.strip() or any(not (0x20 < ord(c) < 0x7f) for c in api_key):
        raise ValueError("--api-key must be printable ASCII without spaces (an HTTP header cannot carry "
                         "anything else, so no client could send it)")


#: set while a request runs: its client has gone (the connection closed). Watched from the end
#: of the body on, so that a request waiting for a context gives its queue place back when its
#: client leaves (pool.Pool.acquire): such places were once kept, and live clients got 503
CLIENT_GONE: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("clover_client_gone",
                                                                                   default=None)


class Guard:
    def __init__(self, app: Any, api_key: str | None, limits: Limits, on_error: Any) -> None:
        check_api_key(api_key)
        self.app, self.api_key, self.limits, self.on_error = app, api_key, limits, on_error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] != "/health":
            got = headers.get(b"authorization", b"")
            if not secrets.compare_digest(got, f"Bearer {self.api_key}".encode()):
                self.on_error()
                return await send_error(send, APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                                       code="invalid_api_key"))
        limit = self.limits.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                self.on_error()
                return await send_error(send, APIError(400, "Content-Length is not a number"))
            if int(length) > limit:
                self.on_error()
                return await send_error(send, BodyTooLarge(limit))
        timeout = self.limits.body_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        state = {"done": scope.get("method") in ("GET", "HEAD"), "got": 0}
        gone, ended = asyncio.Event(), asyncio.Event()
        watcher: list[asyncio.Task[None]] = []

        async def watch() -> None:
            """After the body the server's next message is the disconnect (or the end of the
            response): one reader takes it, every receive() of the app waits for it."""
            try:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
            finally:
                ended.set()

        def body_done() -> None:
            state["done"] = True
            if not watcher:
                watcher.append(asyncio.create_task(watch()))

        async def guarded_receive() -> dict[str, Any]:
            if state["done"]:
                if not watcher:
                    body_done()
                await ended.wait()
                return {"type": "http.disconnect"}
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                msg = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise BodyTimeout(timeout) from None
            if msg["type"] == "http.request":
                state["got"] += len(msg.get("body", b""))
                if state["got"] > limit:
                    raise BodyTooLarge(limit)
                if not msg.get("more_body", False):
                    body_done()
            else:
                state["done"] = True
                if msg["type"] == "http.disconnect":
                    gone.set()
                    ended.set()
            return msg

        if state["done"]:
            body_done()
        token = CLIENT_GONE.set(gone)
        try:
            await self.app(scope, guarded_receive, send)
        except ClientDisconnect:
            # the client left (or uvicorn answered its malformed body, a chunk size of 5,000 hex
            # digits say, with 400 and logged one line): nobody to answer, no traceback
            return
        finally:
            CLIENT_GONE.reset(token)
            for t in watcher:
                t.cancel()
