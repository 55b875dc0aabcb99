"""The low-level calls on a :class:`Clover` object's context: causal commits with their logits,
block passes, the last logits, perplexity (as llama-perplexity computes it), and the cost curve
of block_size="auto" (calibrate / set_cost_curve). Each takes the object's turn on its context
(:data:`~clover_cpp._handles.Turn`: the call waits for it and runs on the context's decode
thread); those that need the tokenizer or the other calls also take the object itself (``llm``:
its public calls only). :class:`Clover`'s methods of the same names document them."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _native as N
from ._args import INT32_MAX, bool_arg, float_arg, int_arg, token_ids
from ._handles import Turn
from .decoding import GenerationStats, Perplexity
from .errors import CloverError, CloverTypeError, CloverValueError, check


def calibrate(turn: Turn, fused: bool = False) -> dict[int, float] | dict[int, tuple[float, float]]:
    """:meth:`Clover.calibrate`."""
    fused = bool_arg("fused", fused)
    with turn() as c:
        sizes, cnt = (ctypes.c_int32 * 32)(), ctypes.c_int32(0)
        ms, msf = (ctypes.c_double * 32)(), (ctypes.c_double * 32)()
        c.checked(N.clover_calibrate, sizes, ms, msf, 32, ctypes.byref(cnt), hop=True)
        k = min(cnt.value, 32)
        if fused:
            return {int(sizes[i]): (float(ms[i]), float(msf[i])) for i in range(k)}
        return {int(sizes[i]): float(ms[i]) for i in range(k)}


def set_cost_curve(turn: Turn, curve: Mapping[int, float], fused: Mapping[int, float] | None = None) -> None:
    """:meth:`Clover.set_cost_curve`."""
    if not isinstance(curve, Mapping) or not curve:
        raise CloverTypeError(f"curve must be a non-empty mapping {{block size: ms}}, got {curve!r}"[:200])
    if fused is not None and not isinstance(fused, Mapping):
        raise CloverTypeError(f"fused must be a mapping {{block size: ms}} or None, got {fused!r}"[:200])
    items = sorted((int_arg("cost curve block size", b, 1, INT32_MAX), float_arg("cost curve ms", v))
                   for b, v in curve.items())
    msf_items: list[float] | None = None
    if fused is not None:
        fk = {int_arg("fused block size", b, 1, INT32_MAX): float_arg("fused ms", v) for b, v in fused.items()}
        if set(fk) != {b for b, _ in items}:
            raise CloverValueError(f"fused must have the block sizes of curve ({sorted(b for b, _ in items)}), "
                                   f"got {sorted(fk)}")
        msf_items = [fk[b] for b, _ in items]
    with turn() as c:
        sizes = N.as_int32_array([b for b, _ in items])
        ms = (ctypes.c_double * len(items))(*[v for _, v in items])
        msf = None if msf_items is None else (ctypes.c_double * len(items))(*msf_items)
        c.checked(N.clover_set_cost_curve, sizes, ms, msf, len(items))


def reset(turn: Turn) -> None:
    """:meth:`Clover.reset`."""
    with turn() as c:
        check(N.clover_reset(c.ptr), None, "reset")


def commit(llm: Any, turn: Turn, tokens: Sequence[int], logits: bool = False) -> np.ndarray | None:
    """:meth:`Clover.commit`."""
    toks = token_ids(tokens, llm.n_vocab())
    logits = bool_arg("logits", logits)
    with turn() as c:
        arr = N.as_int32_array(toks)
        out = np.empty((max(len(toks), 1), llm.n_vocab()), dtype=np.float32) if logits else None
        ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if out is not None else None
        c.checked(N.clover_commit_logits, arr, len(toks), ptr, hop=True)
        return out[: len(toks)] if out is not None else None


def last_logits(llm: Any, turn: Turn) -> np.ndarray:
    """:meth:`Clover.last_logits`."""
    with turn() as c:
        out = np.empty(llm.n_vocab(), dtype=np.float32)
        if N.clover_last_logits(c.ptr, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) != 0:
            raise CloverError("nothing is committed")
        return out


def block_logits(llm: Any, turn: Turn, tokens: Sequence[int], commit_before: Sequence[int] | None = None) -> np.ndarray:
    """:meth:`Clover.block_logits`."""
    toks = token_ids(tokens, llm.n_vocab())
    before = token_ids(commit_before, llm.n_vocab()) if commit_before is not None else None
    with turn() as c:
        if before is not None:
            llm.reset()
            if before:
                llm.commit(before)
        nv = llm.n_vocab()
        out = np.empty((max(len(toks), 1), nv), dtype=np.float32)
        arr, ptr = N.as_int32_array(toks), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        c.checked(N.clover_block_pass, arr, len(toks), ptr, hop=True)
        return out[: len(toks)]


def expert_stats(turn: Turn) -> GenerationStats:
    """:meth:`Clover.expert_stats`."""
    st = N.clover_stats()
    with turn() as c:
        if N.clover_expert_stats(c.ptr, ctypes.byref(st)) != N.CLOVER_OK:
            raise CloverError("expert_stats() needs a context made with expert_stats=True")
    return GenerationStats(n_expert_passes=st.n_expert_passes, experts_per_pass=st.experts_per_pass,
                           expert_bytes_per_pass=st.expert_bytes_per_pass, expert_bytes_b1=st.expert_bytes_b1)


def perplexity(llm: Any, turn: Turn, text: str | bytes | Sequence[int], n_ctx: int = 512,
               n_chunks: int | None = None) -> "Perplexity":
    """:meth:`Clover.perplexity`."""
    is_text = isinstance(text, (str, bytes))
    toks = llm.tokenize(text, add_bos=True, special=False) if is_text else token_ids(text, llm.n_vocab())
    n_ctx = int_arg("n_ctx", n_ctx, 3, llm.n_ctx())  # (3: one position of each chunk scored)
    if len(toks) < 2 * n_ctx:
        raise CloverValueError(f"perplexity needs at least {2 * n_ctx} tokens (2 chunks of n_ctx={n_ctx}), "
                               f"the text has {len(toks)}")
    n_chunk = len(toks) // n_ctx
    if n_chunks is not None:
        n_chunk = min(n_chunk, int_arg("n_chunks", n_chunks, 1))
    bos = llm.bos_token
    first, nll, nll2, count = n_ctx // 2, 0.0, 0.0, 0
    with turn():
        for i in range(n_chunk):
            chunk = toks[i * n_ctx:(i + 1) * n_ctx]
            if bos >= 0 and is_text:
                chunk[0] = bos
            llm.reset()
            logits = llm.commit(chunk, logits=True).astype(np.float64)
            rows = logits[first:n_ctx - 1]
            m = rows.max(axis=1, keepdims=True)
            logp = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
            token_nll = -logp[np.arange(len(rows)), chunk[first + 1:]]
            nll += float(token_nll.sum())
            nll2 += float((token_nll ** 2).sum())
            count += len(rows)
        llm.reset()
    return Perplexity.of_sums(nll, nll2, count, n_chunk, n_ctx)
