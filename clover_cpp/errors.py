"""Errors and logging of the Python runtime: :class:`CloverError` (and its ValueError /
TypeError kinds), :func:`set_verbosity`, and ``check`` (a libclover status -> an exception)."""

from __future__ import annotations

import ctypes
from typing import Any

from . import _native as N

__all__ = ["CloverError", "CloverValueError", "CloverTypeError", "set_verbosity"]

_verbosity = 0


class CloverError(RuntimeError):
    """An error reported by libclover (or found while checking arguments for it).

    ``message`` is the one-line native message, ``status`` the libclover status code
    (``clover_cpp._native.CLOVER_ERR_*``; ``CLOVER_ERR_INVALID_ARG`` by default, e.g. for an
    argument refused on the Python side before any native call)."""

    def __new__(cls, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG) -> "CloverError":
        # an invalid argument is also a ValueError (CloverValueError), so that code written
        # for other libraries' argument checks catches it
        if cls is CloverError and int(status) == N.CLOVER_ERR_INVALID_ARG:
            cls = CloverValueError
        return super().__new__(cls, message)

    def __init__(self, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG) -> None:
        self.message = " ".join(str(message).split()) or "unknown error"
        self.status = int(status)
        super().__init__(self.message)

    def __reduce__(self) -> Any:
        return (type(self), (self.message, self.status))


class CloverValueError(CloverError, ValueError):
    """An argument refused (by the Python layer or by libclover: ``CLOVER_ERR_INVALID_ARG``)."""


class CloverTypeError(CloverError, TypeError):
    """An argument of the wrong type."""

    def __init__(self, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG) -> None:
        super().__init__(message, status)


def lib() -> ctypes.CDLL:
    """libclover (loaded on first use); a missing library is a :class:`CloverError`."""
    try:
        return N.lib()
    except N.CloverLibraryNotFound as e:
        raise CloverError(str(e), N.CLOVER_ERR_LOAD) from e


def current_verbosity() -> int:
    return _verbosity


def set_verbosity(level: int) -> None:
    """llama.cpp / ggml logging: 0 = silent (default), 1 = warnings and errors, 2 = everything."""
    global _verbosity
    _verbosity = int(level)
    lib().clover_set_verbosity(_verbosity)


def check(status: int, err: Any, what: str = "") -> None:
    """Raise the :class:`CloverError` of a libclover status (none for CLOVER_OK); ``err`` is the
    call's error buffer (or None), ``what`` a prefix naming the call."""
    if status != N.CLOVER_OK:
        msg = err.value.decode("utf-8", "replace") if err is not None and err.value else ""
        if not msg:
            msg = (lib().clover_status_str(status) or b"error").decode()
        raise CloverError(f"{what}: {msg}" if what and not msg.startswith(what) else msg, status)
