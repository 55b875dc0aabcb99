"""``clover serve``: the process: load the model, serve the app under uvicorn, end on a signal."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from .. import Clover
from .app import create_app
from .asgi import check_api_key
from .pool import ServerState
from .types import Limits

#: seconds after SIGTERM / SIGINT at which the process ends even if a generation will not stop
HARD_EXIT_AFTER = 10.0


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
    check_api_key(api_key)  # before the model loads: an empty key would turn auth off (issue 40)
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
        st: ServerState = fastapi_app.state.clover
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
