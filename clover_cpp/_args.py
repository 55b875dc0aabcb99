"""Argument checks of the Python runtime: each turns a caller's value into the type libclover
takes, or raises a one-line :class:`CloverTypeError` / :class:`CloverValueError` naming the
argument. Ranges that libclover checks itself are not repeated here (it is the authority)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CloverError, CloverTypeError, CloverValueError

INT32_MAX = 2**31 - 1  # libclover's counts are int32: larger values must not wrap through ctypes
MAX_THREADS = 512      # ggml's GGML_MAX_N_THREADS


def _param(name: str) -> str:
    """The keyword a message names first ("seed (None or -1 = random)" -> "seed"): CloverError.param."""
    return name.split()[0]


def int_arg(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise CloverTypeError(f"{name} must be an integer, got {v!r}", param=_param(name))
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise CloverError(f"{name} must be {rng}, got {v}", param=_param(name))
    return v


def int32_arg(name: str, v: Any) -> int:
    """An integer that fits a C int32 (ctypes would wrap a larger one); its range is libclover's."""
    return int_arg(name, v, -INT32_MAX - 1, INT32_MAX)


def float_arg(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise CloverTypeError(f"{name} must be a number, got {v!r}", param=_param(name))
    try:
        v = float(v)
    except OverflowError:
        raise CloverValueError(f"{name} is too large: {v}", param=_param(name)) from None
    if math.isnan(v):
        raise CloverValueError(f"{name} must not be NaN", param=_param(name))
    return v


def bool_arg(name: str, v: Any) -> bool:
    """A flag: a bool, or an integer 0 / 1 (never a string: bool('off') is True)."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and int(v) in (0, 1)):
        return bool(v)
    raise CloverTypeError(f"{name} must be True or False, got {v!r}", param=_param(name))


def tristate_arg(name: str, v: Any) -> int:
    """None / "auto" = -1, False / "off" = 0, True / "on" = 1 (flash_attn, draft_self)."""
    if v is None:
        return -1
    if isinstance(v, str):
        word = {"auto": -1, "off": 0, "false": 0, "no": 0, "0": 0, "on": 1, "true": 1, "yes": 1, "1": 1}.get(v.strip().lower())
        if word is None:
            raise CloverValueError(f"{name} must be None/'auto', False/'off' or True/'on', got {v!r}",
                                   param=_param(name))
        return word
    return 1 if bool_arg(name, v) else 0


def str_arg(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise CloverTypeError(f"{name} must be a string, got {type(v).__name__}")
    return v


def callable_arg(name: str, v: Any) -> Any:
    if v is not None and not callable(v):
        raise CloverTypeError(f"{name} must be callable or None, got {type(v).__name__}")
    return v


def strings_arg(name: str, v: Any) -> list[str]:
    """A string or a sequence of strings, as a list."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, (bytes, Mapping)) or not isinstance(v, (Sequence, set, frozenset)) or \
            not all(isinstance(x, str) for x in v):
        raise CloverTypeError(f"{name} must be a string or a list of strings, got {v!r}"[:200], param=_param(name))
    return list(v)


def token_id(t: Any, n_vocab: int) -> int:
    """One token id, checked against the vocabulary (never wrapped to 32 bits)."""
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        raise CloverTypeError(f"a token id must be an integer, got {t!r}"[:200])
    t = int(t)
    if not 0 <= t < n_vocab:
        raise CloverValueError(f"token id {t} out of range [0, {n_vocab})")
    return t


def token_ids(tokens: Any, n_vocab: int) -> list[int]:
    """Token ids, each an integer in [0, n_vocab) (values past 32 bits are refused, not wrapped)."""
    if isinstance(tokens, (str, bytes)):
        raise CloverTypeError("expected a sequence of token ids, got text")
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise CloverValueError(f"expected a 1-D sequence of token ids, got an array of shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise CloverTypeError(f"expected integer token ids, got an array of {tokens.dtype}")
        tokens = tokens.tolist()
    try:
        it = iter(tokens)
    except TypeError:
        raise CloverTypeError(f"expected a sequence of token ids, got {type(tokens).__name__}") from None
    out: list[int] = []
    for t in it:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise CloverTypeError(f"expected a sequence of token ids, got an element {t!r}"[:200])
        t = int(t)
        if not 0 <= t < n_vocab:
            raise CloverValueError(f"token id {t} out of range [0, {n_vocab})")
        out.append(t)
    if len(out) > INT32_MAX:
        raise CloverValueError(f"too many tokens ({len(out)})")
    return out


def text_bytes(text: Any) -> bytes:
    """The UTF-8 bytes of text to tokenize (str, or bytes-like as they are)."""
    if isinstance(text, str):
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CloverValueError(f"text is not valid Unicode: {e.reason} at index {e.start}") from None
    elif isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
    else:
        raise CloverTypeError(f"expected text (str or bytes), got {type(text).__name__}")
    if len(data) > INT32_MAX - 16:
        raise CloverValueError(f"text too long to tokenize ({len(data)} bytes)")
    return data
