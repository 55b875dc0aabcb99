"""A llama.cpp ggml-rpc-server on a free localhost port, for the RPC tests and benchmark."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServer:
    """One ggml-rpc-server (one CPU thread) on a localhost port, listening when the constructor
    returns; it serves one client connection at a time."""

    def __init__(self, binary: str | Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(self.port), "-t", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:  # listening: a bare connect succeeds (the server then sees it close)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"ggml-rpc-server did not start on port {self.port}") from None
                time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
