"""``clover serve``: an OpenAI-compatible HTTP server over libclover.

FastAPI, sse-starlette (server-sent events) and uvicorn: the stack llama-cpp-python's own
server is built on. The package, by job:

- ``app.py``: :func:`create_app`, the routes (information, tokenizer and template, chat and
  completions) and the error handlers;
- ``generation.py``: a request's generation: its arguments and checks, the slot it runs on,
  streaming, and a client's disconnect cancelling it at the next denoising step;
- ``pool.py``: the decoding contexts (``--parallel N`` over one loaded model), their queue
  and watchdog, and the metrics;
- ``types.py``: request bodies and their checks (a field is honoured or refused with a 400
  naming it), the limits, the one error shape;
- ``tools.py``: tool calls; ``format.py``: Clover's own pieces of a reply (the OpenAI ones are
  ``clover_cpp.openai_reply``'s); ``asgi.py``: body limits and the API key; ``run.py``:
  :func:`serve` (uvicorn, signals).

It uses the runtime's public names only. Endpoints, fields and limits: docs/server.md.
"""

from __future__ import annotations

try:
    import anyio  # noqa: F401
    import fastapi  # noqa: F401
    import sse_starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by users without the extra
    raise ImportError(f"clover serve needs the server extra: pip install 'clover-cpp[server]' ({e})") from None

from .app import create_app
from .run import HARD_EXIT_AFTER, serve
from .types import Limits

__all__ = ["HARD_EXIT_AFTER", "Limits", "create_app", "serve"]
