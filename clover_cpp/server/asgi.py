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
import secrets
from typing import Any

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


class Guard:
    def __init__(self, app: Any, api_key: str | None, limits: Limits, on_error: Any) -> None:
        self.app, self.api_key, self.limits, self.on_error = app, api_key, limits, on_error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"] != "/health":
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

        async def guarded_receive() -> dict[str, Any]:
            if state["done"]:
                return await receive()
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
                    state["done"] = True
            else:
                state["done"] = True
            return msg

        await self.app(scope, guarded_receive, send)
