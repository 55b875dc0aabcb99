"""``clover serve``: the process: bind the port, load the model, serve the app under uvicorn, end
on a signal."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import Clover
from ..errors import show_notices
from .app import create_app
from .asgi import check_api_key
from .pool import ServerState
from .types import Limits

#: seconds after SIGTERM / SIGINT at which the process ends even if a generation will not stop
HARD_EXIT_AFTER = 10.0


_TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
             b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_HEAD_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s")


def _raw_error(template: bytes, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if template is _HEAD_TIMEOUT
                                 else "server_error", "param": None, "code": code}}).encode()
    return template % (len(body), body)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with what it lacks: a deadline for the request head
    (uvicorn has a keep-alive timeout for an idle connection but none once bytes trickle in),
    a cap on open connections and one per client address. ``limits`` is set on a subclass
    (:func:`protocol_for`)."""

    limits: Limits = Limits()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        lim = self.limits
        host = self.client[0] if self.client else None
        same = sum(1 for c in self.connections if c.client and c.client[0] == host) if host is not None else 0
        if len(self.connections) > lim.max_connections or same > lim.max_connections_per_client:
            which = (f"{lim.max_connections_per_client} from one address" if same > lim.max_connections_per_client
                     else f"{lim.max_connections} in all")
            self.logger.warning("refused a connection from %s: %s connections open already", host, which)
            transport.write(_raw_error(_TOO_MANY, f"too many connections ({which}); retry later", "too_many_connections"))
            transport.close()
            return
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()  # type: ignore[union-attr]
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is in (its body has --body-timeout)
        if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:  # bytes of a head, never finished
            self.transport.write(_raw_error(_HEAD_TIMEOUT, f"the request head did not arrive within "
                                            f"{self.limits.header_timeout:g} s", "header_timeout"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_head_timer()  # the head is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


def protocol_for(limits: Limits) -> type[GuardedH11]:
    """The protocol class uvicorn instantiates per connection, with these limits."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits})


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

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's run, and a Ctrl-C that lands before the event loop starts serving closes the
        serve coroutine: without it Python prints "coroutine 'Server.serve' was never awaited"."""
        serving = self.serve(sockets=sockets)
        try:
            with asyncio.Runner(loop_factory=self.config.get_loop_factory()) as runner:
                runner.run(serving)
        finally:
            serving.close()


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, before the model loads: a port in use (or an address this machine
    does not have) is an OSError of one line at once, not a failure after the load; a client that
    connects during the load waits in the backlog. (socket.create_server's message would name
    the address twice.)"""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
        sock.bind((host, port))
        sock.listen()
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def check_tls(key_file: str | None, cert_file: str | None) -> None:
    """Both files or neither, and a pair that loads (ValueError, one line): checked before the
    model loads, as uvicorn would only load them once the model is up."""
    if (key_file is None) != (cert_file is None):
        given, missing = ("--ssl-key-file", "--ssl-cert-file") if cert_file is None else ("--ssl-cert-file",
                                                                                           "--ssl-key-file")
        raise ValueError(f"{given} needs {missing} too (TLS takes both, or neither for plain HTTP)")
    if key_file is None or cert_file is None:
        return
    for flag, path in (("--ssl-cert-file", cert_file), ("--ssl-key-file", key_file)):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    try:  # an empty password: an encrypted key fails here rather than prompting on the terminal
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file, password="")
    except ssl.SSLError as e:
        reason = ("the key does not match the certificate" if e.reason == "KEY_VALUES_MISMATCH"
                  else "not a PEM certificate and its unencrypted private key")
        raise ValueError(f"--ssl-cert-file {cert_file} / --ssl-key-file {key_file}: {reason}") from None


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8080, parallel: int = 1,
          api_key: str | None = None, n_ctx: int = 4096, n_threads: int | None = None, n_gpu_layers: int = 0,
          max_queue: int = 64, log_level: str = "warning", flash_attn: bool | None = None,
          rpc_servers: str | None = None, tensor_split: list[float] | None = None,
          override_tensor: str | None = None, limits: Limits | None = None, model_name: str | None = None,
          access_log: bool = False, on_ready: Callable[[str], None] | None = None,
          chat_template: str | None = None, ssl_key_file: str | None = None,
          ssl_cert_file: str | None = None, embeddings: bool = False, reasoning_format: str = "deepseek") -> None:
    """Bind the port, load the model and serve it until interrupted. ``model_name``: the model's
    id in the API (llama-server's --alias; default: the file's general.name, else its stem);
    ``access_log``: uvicorn's line per request (on stdout); ``on_ready(url)`` runs once the port
    is bound and the model loaded, just before the first request is served; ``chat_template``:
    the template chats render instead of the GGUF's (Clover's), rendered once before serving so
    that one that fails stops the start with its error; ``ssl_key_file`` and ``ssl_cert_file``:
    serve HTTPS (llama-server's --ssl-key-file / --ssl-cert-file); ``embeddings``: serve
    /v1/embeddings (llama-server's --embeddings; a second, embedding context of the model);
    ``reasoning_format``: the chats' default (llama-server's --reasoning-format, create_app's)."""
    check_api_key(api_key)  # before the model loads: an empty key would turn auth off
    check_tls(ssl_key_file, ssl_cert_file)
    if embeddings:  # the embedding context is llama-cpp-python's: missing, say so now, not at the first request
        if importlib.util.find_spec("llama_cpp") is None:  # found, not imported: it loads on the first request
            raise ValueError("--embeddings: the embedding context needs llama-cpp-python "
                             "(pip install llama-cpp-python)")
    with listen(host, port) as sock:
        if n_threads is None:
            # the contexts share the cores, less one for the HTTP side: ggml's threads spin at their
            # barriers, so one preempted by the server's own threads stalls the others (measured on
            # 2 cores, --parallel 1: 17.6 req/s with 1 thread, 11.3 with 2, and 2.9 with 2 clients)
            n_threads = max(1, ((os.cpu_count() or 1) - 1) // parallel)
        show_notices()  # the first request of block size auto measures the cost curve: the log says so
        model = Clover(model_path, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                       rpc_servers=rpc_servers, tensor_split=tensor_split, override_tensor=override_tensor,
                       chat_template=chat_template, embedding=embeddings)
        try:
            if chat_template is not None:
                model.format_chat([{"role": "user", "content": "hi"}])
            _run(sock, model, parallel, api_key, max_queue, log_level, limits, model_name, access_log, on_ready,
                 ssl_key_file, ssl_cert_file, embeddings, reasoning_format)
        finally:
            model.close()


def _run(sock: socket.socket, model: Clover, parallel: int, api_key: str | None, max_queue: int, log_level: str,
         limits: Limits | None, model_name: str | None, access_log: bool,
         on_ready: Callable[[str], None] | None, ssl_key_file: str | None = None,
         ssl_cert_file: str | None = None, embeddings: bool = False, reasoning_format: str = "deepseek") -> None:
    limits = limits or Limits()  # a prompt of token ids may be as long as the context (and the body counts 2 per id)
    limits = replace(limits, max_json_values=max(limits.max_json_values, 2 * model.n_ctx() + 4096))
    app = create_app(model, parallel=parallel, api_key=api_key, max_queue=max_queue, model_name=model_name,
                     limits=limits, embeddings=embeddings, reasoning_format=reasoning_format)
    fastapi_app = app.app

    def on_exit() -> None:  # cancel every generation at its next step: shutdown need not wait for them
        st: ServerState = fastapi_app.state.clover
        st.shutting_down = True
        if st.pool is not None:
            st.pool.cancel_all()

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, http=protocol_for(limits),
                            ssl_keyfile=ssl_key_file, ssl_certfile=ssl_cert_file)
    if access_log:  # its lines are INFO: the access logger's level only, uvicorn's own stays at log_level
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    if on_ready is not None:
        host, port = sock.getsockname()[:2]
        scheme = "https" if ssl_cert_file else "http"
        on_ready(f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/v1")
    # uvicorn.Server, not uvicorn.run (which swallows it): after the graceful shutdown, the
    # Ctrl-C comes back as KeyboardInterrupt and the command exits 130 as the others do
    _Server(config, on_exit).run(sockets=[sock])
