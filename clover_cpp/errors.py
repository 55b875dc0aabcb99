"""Errors and logging of the Python runtime: :class:`CloverError` (and its ValueError /
TypeError kinds), :func:`set_verbosity`, and ``check`` (a libclover status -> an exception)."""

from __future__ import annotations

import ctypes
from typing import Any

from clover_gguf.errors import UserFacingError

from . import _native as N

__all__ = ["CloverError", "CloverValueError", "CloverTypeError", "set_verbosity", "show_notices", "CLOVER_OK",
           "CLOVER_ERR_INVALID_ARG", "CLOVER_ERR_LOAD", "CLOVER_ERR_DECODE", "CLOVER_ERR_CANCELLED",
           "CLOVER_ERR_CONTEXT_FULL", "CLOVER_ERR_BUFFER_TOO_SMALL", "CLOVER_ERR_INTERNAL"]

# libclover's status codes (clover.h, enum clover_status): the values of CloverError.status
CLOVER_OK = N.CLOVER_OK
CLOVER_ERR_INVALID_ARG = N.CLOVER_ERR_INVALID_ARG            # a bad argument (also CloverValueError)
CLOVER_ERR_LOAD = N.CLOVER_ERR_LOAD                          # the model file could not be loaded
CLOVER_ERR_DECODE = N.CLOVER_ERR_DECODE                      # llama_decode failed
CLOVER_ERR_CANCELLED = N.CLOVER_ERR_CANCELLED                # a callback asked to stop
CLOVER_ERR_CONTEXT_FULL = N.CLOVER_ERR_CONTEXT_FULL          # the tokens would not fit in n_ctx
CLOVER_ERR_BUFFER_TOO_SMALL = N.CLOVER_ERR_BUFFER_TOO_SMALL
CLOVER_ERR_INTERNAL = N.CLOVER_ERR_INTERNAL                  # an unexpected exception / out of memory

_verbosity = 0


class CloverError(UserFacingError, RuntimeError):
    """An error reported by libclover (or found while checking arguments for it).

    ``message`` is the one-line native message, ``status`` the libclover status code (one of
    ``clover_cpp.CLOVER_ERR_*``, also in ``clover_cpp.errors``; ``CLOVER_ERR_INVALID_ARG`` by
    default, e.g. for an argument refused on the Python side before any native call)."""

    def __new__(cls, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG,
                param: str | None = None) -> "CloverError":
        # an invalid argument is also a ValueError (CloverValueError), so that code written
        # for other libraries' argument checks catches it
        if cls is CloverError and int(status) == N.CLOVER_ERR_INVALID_ARG:
            cls = CloverValueError
        return super().__new__(cls, message)

    def __init__(self, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG, param: str | None = None) -> None:
        self.message = " ".join(str(message).split()) or "unknown error"
        self.status = int(status)
        #: the keyword argument refused (generate's ``threshold``, ``top_p``, ...), when one is
        #: to blame: a front end names its own field or flag with it; the message stays libclover's
        self.param = param
        super().__init__(self.message)

    def __reduce__(self) -> Any:
        return (type(self), (self.message, self.status, self.param))


class CloverValueError(CloverError, ValueError):
    """An argument refused (by the Python layer or by libclover: ``CLOVER_ERR_INVALID_ARG``)."""


class CloverTypeError(CloverError, TypeError):
    """An argument of the wrong type."""

    def __init__(self, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG, param: str | None = None) -> None:
        super().__init__(message, status, param)


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
    lib()
    N.clover_set_verbosity(_verbosity)


def show_notices(on: bool = True) -> None:
    """libclover's notice of a slow step before the first token (measuring the cost curve of
    block size auto, once per process) on stderr: the command lines show it; a library shows it
    only at verbosity 1 and up."""
    lib()
    N.clover_set_notices(int(on))


def check(status: int, err: Any, what: str = "") -> None:
    """Raise the :class:`CloverError` of a libclover status (none for CLOVER_OK); ``err`` is the
    call's error buffer (or None), ``what`` a prefix naming the call."""
    if status != N.CLOVER_OK:
        msg = err.value.decode("utf-8", "replace") if err is not None and err.value else ""
        if not msg:
            msg = (N.clover_status_str(status) or b"error").decode()
        raise CloverError(f"{what}: {msg}" if what and not msg.startswith(what) else msg, status)
