"""Clover on llama.cpp: Python side.

``Clover`` (the model + decoding context), ``CloverError``, results and ``quantize`` are
loaded lazily, so ``import clover_cpp`` stays cheap and works without the native library.
Importing the package sets ``LLAMA_CPP_LIB_PATH`` to our build folder (unless already set),
so that llama-cpp-python's ``llama_cpp`` module, if imported later, loads our patched libllama.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _lib  # noqa: F401  - sets LLAMA_CPP_LIB_PATH before anyone imports llama_cpp

# libclover's status codes (clover.h): the values of CloverError.status
_STATUS = ("CLOVER_OK", "CLOVER_ERR_INVALID_ARG", "CLOVER_ERR_LOAD", "CLOVER_ERR_DECODE", "CLOVER_ERR_CANCELLED",
           "CLOVER_ERR_CONTEXT_FULL", "CLOVER_ERR_BUFFER_TOO_SMALL", "CLOVER_ERR_INTERNAL")

# clover.h's default a front end shows (the library's generate() default)
_DEFAULTS = ("CLOVER_DEFAULT_MAX_TOKENS",)

__all__ = ["Clover", "CloverError", "CloverValueError", "CloverTypeError", "GenerationResult", "GenerationStats",
           "GenerationStream", "Perplexity", "ChatExchange", "set_verbosity", "render_chat", "quantize", "QUANT_TYPES",
           *_STATUS, *_DEFAULTS]

if TYPE_CHECKING:
    from .model import (ChatExchange, Clover, CloverError, CloverTypeError, CloverValueError, GenerationResult,
                        GenerationStats, GenerationStream, Perplexity, render_chat, set_verbosity)
    from .quant import QUANT_TYPES, quantize

_MODEL = {"Clover", "CloverError", "CloverValueError", "CloverTypeError", "GenerationResult", "GenerationStats",
          "GenerationStream", "Perplexity", "ChatExchange", "set_verbosity", "render_chat"}


def __getattr__(name: str) -> Any:
    if name in _MODEL:
        from . import model  # noqa: PLC0415

        return getattr(model, name)
    if name in _STATUS:
        from . import errors  # noqa: PLC0415

        return getattr(errors, name)
    if name in _DEFAULTS:
        from . import _native  # noqa: PLC0415  - constants only (the library is loaded by Clover)

        return getattr(_native, name)
    if name in ("quantize", "QUANT_TYPES"):
        from . import quant as q  # noqa: PLC0415

        return getattr(q, name)
    raise AttributeError(f"module 'clover_cpp' has no attribute {name!r}")
