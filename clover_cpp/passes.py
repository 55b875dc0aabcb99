"""The low-level calls on a :class:`Clover` object's context (a mixin): causal commits with
their logits, block passes, the last logits, perplexity (as llama-perplexity computes it), and
the cost curve of block_size="auto" (calibrate / set_cost_curve)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _native as N
from ._args import INT32_MAX, bool_arg, float_arg, int_arg
from .decoding import GenerationStats, Perplexity
from .errors import CloverError, CloverTypeError, CloverValueError, check


class ContextPasses:
    """Calls that run single passes on the context (each in the object's turn, on its decode
    thread)."""

    _op: Any
    _tokens: Any
    tokenize: Any
    n_vocab: Any
    n_ctx: Any
    bos_token: Any

    def calibrate(self, fused: bool = False) -> dict[int, float] | dict[int, tuple[float, float]]:
        """Measure the cost curve used by block_size="auto" (bypassing the disk cache):
        {B: ms per block pass} for B = 1, 2, 4, ...; with fused=True {B: (pass ms, ms of a
        commit fused with a pass)}. Clears the memory."""
        fused = bool_arg("fused", fused)
        with self._op() as c:
            sizes, cnt = (ctypes.c_int32 * 32)(), ctypes.c_int32(0)
            ms, msf = (ctypes.c_double * 32)(), (ctypes.c_double * 32)()
            c.checked(N.clover_calibrate, sizes, ms, msf, 32, ctypes.byref(cnt), hop=True)
            k = min(cnt.value, 32)
            if fused:
                return {int(sizes[i]): (float(ms[i]), float(msf[i])) for i in range(k)}
            return {int(sizes[i]): float(ms[i]) for i in range(k)}

    def set_cost_curve(self, curve: Mapping[int, float], fused: Mapping[int, float] | None = None) -> None:
        """Set the cost curve for block_size="auto" ({1: ms, 2: ms, 4: ms, ...}; fused: the
        cost of a commit fused with a pass, by default that of a pass of 2B, else with the
        same keys) instead of measuring it, e.g. from an earlier :meth:`calibrate`. Costs must
        be in (0, 1e9] ms (libclover's check). Resets the running tokens per pass."""
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
        with self._op() as c:
            sizes = N.as_int32_array([b for b, _ in items])
            ms = (ctypes.c_double * len(items))(*[v for _, v in items])
            msf = None if msf_items is None else (ctypes.c_double * len(items))(*msf_items)
            c.checked(N.clover_set_cost_curve, sizes, ms, msf, len(items))

    # -- low level passes
    def reset(self) -> None:
        """Clear the memory (no committed tokens)."""
        with self._op() as c:
            check(N.clover_reset(c.ptr), None, "reset")

    def commit(self, tokens: Sequence[int], logits: bool = False) -> np.ndarray | None:
        """Commit tokens (n >= 1) causally at the end of the memory. With ``logits``, returns the
        logits [n, n_vocab] (float32) of the committed positions: row t predicts token t + 1, as
        llama.cpp's causal decoding of the same text gives them."""
        toks = self._tokens(tokens)
        logits = bool_arg("logits", logits)
        with self._op() as c:
            arr = N.as_int32_array(toks)
            out = np.empty((max(len(toks), 1), self.n_vocab()), dtype=np.float32) if logits else None
            ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if out is not None else None
            c.checked(N.clover_commit_logits, arr, len(toks), ptr, hop=True)
            return out[: len(toks)] if out is not None else None

    def last_logits(self) -> np.ndarray:
        """The logits [n_vocab] of the last committed position: the prediction of the next one."""
        with self._op() as c:
            out = np.empty(self.n_vocab(), dtype=np.float32)
            if N.clover_last_logits(c.ptr, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) != 0:
                raise CloverError("nothing is committed")
            return out

    def block_logits(self, tokens: Sequence[int], commit_before: Sequence[int] | None = None) -> np.ndarray:
        """Logits [n, n_vocab] (float32) of a block pass of tokens (1 <= n <= B) against the memory,
        which is left unchanged; row t predicts token t + 1. With ``commit_before``, the memory is
        first reset and those tokens are committed."""
        toks = self._tokens(tokens)
        before = self._tokens(commit_before) if commit_before is not None else None
        with self._op() as c:
            if before is not None:
                self.reset()
                if before:
                    self.commit(before)
            nv = self.n_vocab()
            out = np.empty((max(len(toks), 1), nv), dtype=np.float32)
            arr, ptr = N.as_int32_array(toks), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            c.checked(N.clover_block_pass, arr, len(toks), ptr, hop=True)
            return out[: len(toks)]

    def expert_stats(self) -> GenerationStats:
        """The routed experts of the block passes since the count last started (a generate's start
        or the last call of this; :meth:`block_logits` included): a GenerationStats with
        n_expert_passes, experts_per_pass, expert_bytes_per_pass and expert_bytes_b1 set; the
        count starts afresh. Needs ``Clover(expert_stats=True)``."""
        st = N.clover_stats()
        with self._op() as c:
            if N.clover_expert_stats(c.ptr, ctypes.byref(st)) != N.CLOVER_OK:
                raise CloverError("expert_stats() needs a context made with expert_stats=True")
        return GenerationStats(n_expert_passes=st.n_expert_passes, experts_per_pass=st.experts_per_pass,
                               expert_bytes_per_pass=st.expert_bytes_per_pass, expert_bytes_b1=st.expert_bytes_b1)

    def perplexity(self, text: str | bytes | Sequence[int], n_ctx: int = 512,
                   n_chunks: int | None = None) -> "Perplexity":
        """Perplexity of the causal model over a text, computed as llama-perplexity computes it:
        the text tokenized as plain text (special-token text such as ``<|im_end|>`` is not parsed;
        BOS when the model adds one), in chunks of n_ctx (at most n_chunks of them, all when
        None), each on an empty memory with its first token replaced by BOS, scoring the second
        half of every chunk (each position predicted from the one before it). Leaves the memory
        empty."""
        is_text = isinstance(text, (str, bytes))
        toks = self.tokenize(text, add_bos=True, special=False) if is_text else self._tokens(text)
        n_ctx = int_arg("n_ctx", n_ctx, 3, self.n_ctx())  # (3: one position of each chunk scored)
        if len(toks) < 2 * n_ctx:
            raise CloverValueError(f"perplexity needs at least {2 * n_ctx} tokens (2 chunks of n_ctx={n_ctx}), "
                                   f"the text has {len(toks)}")
        n_chunk = len(toks) // n_ctx
        if n_chunks is not None:
            n_chunk = min(n_chunk, int_arg("n_chunks", n_chunks, 1))
        bos = self.bos_token
        first, nll, nll2, count = n_ctx // 2, 0.0, 0.0, 0
        with self._op():
            for i in range(n_chunk):
                chunk = toks[i * n_ctx:(i + 1) * n_ctx]
                if bos >= 0 and is_text:
                    chunk[0] = bos
                self.reset()
                logits = self.commit(chunk, logits=True).astype(np.float64)
                rows = logits[first:n_ctx - 1]
                m = rows.max(axis=1, keepdims=True)
                logp = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
                token_nll = -logp[np.arange(len(rows)), chunk[first + 1:]]
                nll += float(token_nll.sum())
                nll2 += float((token_nll ** 2).sum())
                count += len(rows)
            self.reset()
        return Perplexity.of_sums(nll, nll2, count, n_chunk, n_ctx)
