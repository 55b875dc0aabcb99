"""The ``clover`` command: convert, quantize, run, chat, serve, inspect, bench, demo, perplexity,
kld, imatrix.

Flag names follow llama.cpp's tools (-m, -p, -n, -t, -c, --temp, --top-k, --top-p, --seed).
User errors print one line ``error: ...`` on stderr and exit with status 1 (no traceback;
set CLOVER_DEBUG=1 to see one for unexpected errors).

One job per module: ``group`` (the group, one-line errors, Ctrl-C while a command loads, the
commands imported only when named: convert, kld, imatrix), ``options`` (the shared flags and
what every generating command does with them), ``live`` (the live view), and the commands:
``generate`` (run, chat, perplexity), ``tools`` (quantize, inspect, serve), ``bench`` (bench,
demo). They use the runtime's public names only (clover_cpp.Clover, clover_cpp.demo).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import bench, generate, tools  # noqa: F401  (each registers its commands on the group)
from .group import CONTEXT_SETTINGS, UserError, cli
from .options import open_model

__all__ = ["CONTEXT_SETTINGS", "UserError", "cli", "main", "open_model"]


def main(argv: Sequence[str] | None = None) -> Any:
    """Entry point of the ``clover`` command."""
    return cli.main(args=list(argv) if argv is not None else None, prog_name="clover")
