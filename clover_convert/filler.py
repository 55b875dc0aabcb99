"""The chunk filler: the tensor data of a conversion, converted from the memory-mapped
safetensors straight into the output, chunk by chunk, on every core.

Each output tensor is its source slabs (one per expert when stacked) of rows; a chunk is a run
of rows of one slab, read in place (a view of the source's memory map; value heads permuted in
runs of rows), cast, transformed or quantized into a buffer of its worker's (reused), and
written at its place in the file (os.pwrite). Peak memory is a few chunks per worker, not a
tensor, whatever the model size.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as QT

from .config import ConversionError
from .mapping import apply_fn
from .safetensors_io import CheckpointReader, f32_to_bf16

if TYPE_CHECKING:
    from .tensors import Piece, TensorPlan

__all__ = ["Filler", "ChunkResult", "CHUNK_ELEMS", "RELEASE_BYTES", "F16_OVERFLOW"]

CHUNK_ELEMS = 4 * 1024 * 1024          # source elements in the chunks of all workers together
RELEASE_BYTES = 64 * 1024 * 1024       # unmap the sources after touching this many bytes

_STORE_DTYPE = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16, QT.Q8_0: np.uint8}


class ChunkResult(NamedTuple):
    """What a chunk saw of its source."""

    nbytes: int       # source bytes read
    nonfinite: int    # NaN / Inf values among them
    beyond_f16: int   # finite values that became +-inf in f16 (an f16 output only)


class Filler:
    """Converts source slabs straight into the output file, chunk by chunk, on every core:
    each chunk is read in place (a view of the source's memory map), cast into a buffer of its
    worker's (reused) and written at its place in the file (os.pwrite). Numpy's casts and file
    writes release the GIL, so the workers cast and write at once, and nothing of the size of
    a tensor is held: before, a tensor was converted into one of two tensor-sized buffers and
    written by one thread while the next was converted, and the cores waited on each other."""

    def __init__(self, reader: CheckpointReader):
        self.nonfinite: dict[str, int] = {}  # tensor -> NaN/Inf values seen in the source
        self.beyond_f16: dict[str, int] = {}  # tensor -> finite values that became +-inf in f16
        self.reader = reader
        self.touched = 0
        self.read_bytes = 0
        self._local = threading.local()  # each worker's output buffer
        self._workers = os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="clover-chunk")

    def _count(self, nbytes: int) -> None:
        """Account for touched source bytes; past RELEASE_BYTES, drop the memory maps so that
        the touched source pages leave our RSS (the next read maps the file again; views that
        chunks still read keep the old map until they are done)."""
        self.touched += nbytes
        self.read_bytes += nbytes
        if self.touched >= RELEASE_BYTES:
            self.reader.close()
            self.touched = 0

    def _rows(self, piece: Piece, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of the slab (its first axis), a view."""
        rows = slice(piece.row0 + r0, piece.row0 + r1)
        return self.reader.view(piece.hf, (rows,) if piece.expert is None else (piece.expert, rows))

    def submit(self, t: TensorPlan, fd: int, offset: int) -> list[Future]:
        """Queue the tensor's chunks, to be written to fd at offset; wait() for them. A stacked
        tensor's experts are slabs of their own, one after the other in the file."""
        piece_shape = t.shape[1:] if t.stacked else t.shape
        shape2 = (1, piece_shape[0]) if len(piece_shape) == 1 else (piece_shape[0], math.prod(piece_shape[1:]))
        rows, cols = shape2
        assert t.stacked or len(t.pieces) == 1, t.name
        slab_bytes = t.nbytes // len(t.pieces)
        row_bytes = slab_bytes // max(rows, 1)  # of the output
        step = max(1, self._chunk_elems() // max(cols, 1))
        return [self._pool.submit(self._fill_rows, piece, shape2, t, r0, min(rows, r0 + step),
                                  fd, offset + j * slab_bytes + r0 * row_bytes, row_bytes)
                for j, piece in enumerate(t.pieces) for r0 in range(0, rows, step)]

    def wait(self, t: TensorPlan, jobs: list[Future]) -> None:
        """Wait for a tensor's chunks (the first error is raised, the rest are cancelled)."""
        try:
            for job in jobs:
                done: ChunkResult = job.result()
                if done.nonfinite:
                    self.nonfinite[t.name] = self.nonfinite.get(t.name, 0) + done.nonfinite
                if done.beyond_f16:
                    self.beyond_f16[t.name] = self.beyond_f16.get(t.name, 0) + done.beyond_f16
                self._count(done.nbytes)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise

    def _chunk_elems(self) -> int:
        """Source elements per chunk: CHUNK_ELEMS shared by the workers. Each worker holds its
        chunk's output, and a chunk that is not a plain cast (a permutation, a transform, bf16
        rounding, quantization) makes temporaries of several times its size, so what the
        chunks hold is the same on 2 cores or 64: the memory bound (2x the largest tensor +
        300 MB) holds on any machine. (Bigger chunks for plain casts were no faster here.)"""
        return max(CHUNK_ELEMS // self._workers, min(CHUNK_ELEMS, 1 << 16))

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This worker's output buffer, at least nbytes long (reused: no page faults)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def _fill_rows(self, piece: Piece, shape2: tuple[int, int], t: TensorPlan, r0: int, r1: int,
                   fd: int, offset: int, row_bytes: int) -> ChunkResult:
        """Rows r0:r1 of the slab, converted (row_bytes of output each) and written to fd at
        offset; what the chunk saw of its source."""
        rows, cols = shape2
        sdt = self.reader.dtype(piece.hf)
        if r1 - r0 == rows:  # one chunk: the whole slab
            block = self._rows(piece, 0, rows) if piece.expert is not None else self.reader.view(piece.hf)
            block = block.reshape(shape2)
            if t.row_perm is not None:
                block = block[t.row_perm]
        else:  # a slab of 2+ dims whose first axis is the rows; value heads come in runs of rows
            want = t.row_perm[r0:r1] if t.row_perm is not None else np.arange(r0, r1)
            runs = np.split(want, np.flatnonzero(np.diff(want) != 1) + 1)
            parts = [self._rows(piece, int(run[0]), int(run[-1]) + 1) for run in runs]
            block = (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(r1 - r0, cols)
        if t.col_perm is not None:
            block = block[:, t.col_perm]
        out = self._buffer((r1 - r0) * row_bytes)
        _convert_into(out.view(_STORE_DTYPE[t.qtype]).reshape(r1 - r0, -1), block, sdt, t.qtype, t.rule.fn)
        self._write(fd, out, offset)
        nonfinite, beyond = _scan_source(block, sdt, to_f16=t.qtype == QT.F16 and t.rule.fn is None)
        return ChunkResult(block.nbytes, nonfinite, beyond)

    def _write(self, fd, data: np.ndarray, offset: int) -> None:
        """A converted chunk to its place (a subclass may put it elsewhere: quantize_stream's in memory)."""
        _pwrite_all(fd, data, offset)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


_SEEK_AND_WRITE = threading.Lock()  # where os.pwrite is missing (Windows)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """All of data at offset (pwrite may write less than asked). Without os.pwrite (Windows), a
    seek and a write under one lock do the same."""
    view = memoryview(data).cast("B")
    while view:
        if hasattr(os, "pwrite"):
            n = os.pwrite(fd, view, offset)
        else:
            with _SEEK_AND_WRITE:
                os.lseek(fd, offset, os.SEEK_SET)
                n = os.write(fd, view)
        view, offset = view[n:], offset + n


# per source dtype: its bits, its exponent's bits, and the exponent of [2^15, 2^16) (f16's top
# binade: from there up a value can round past 65504)
_EXPONENT = {"BF16": (np.uint16, 0x7F80, 0x4700), "F16": (np.uint16, 0x7C00, None),
             "F32": (np.uint32, 0x7F800000, 0x47000000)}
F16_OVERFLOW = 65520.0  # from here up f32 (and bf16) values round to inf in f16 (65504 + half an ulp)


def _scan_source(block: np.ndarray, sdt: str, to_f16: bool) -> tuple[int, int]:
    """(NaN / Inf values, finite values that f16 turns into +-inf when to_f16) in a source
    block. One fast pass over the exponent bits (their max) says whether to count at all."""
    if sdt not in _EXPONENT or block.size == 0:
        return 0, 0
    bits, ones, f16_top = _EXPONENT[sdt]
    exponent = block.view(bits) & bits(ones)
    top = exponent.max()
    nonfinite = int(np.count_nonzero(exponent == ones)) if top == ones else 0
    beyond = 0
    if to_f16 and f16_top is not None and top >= f16_top:
        x = np.abs(block.view(ml_dtypes.bfloat16).astype(np.float32) if sdt == "BF16" else block)
        beyond = int(np.count_nonzero((x >= F16_OVERFLOW) & np.isfinite(x)))
    return nonfinite, beyond


def _is_plain_cast(sdt: str, qt: QT, fn: str | None) -> bool:
    """A source dtype to qt that numpy casts (or copies) in one pass, with nothing allocated."""
    return fn is None and (qt in (QT.F32, QT.F16) or (qt == QT.BF16 and sdt == "BF16"))


def _convert_into(dst: np.ndarray, block: np.ndarray, sdt: str, qt: QT, fn: str | None) -> None:
    """dst = block converted to qt: a plain cast (or copy) in one pass straight into dst; a
    transform, bf16 rounding of wider floats (NaN payloads kept) or quantization go through
    _convert_block."""
    if _is_plain_cast(sdt, qt, fn):
        src = block.view(ml_dtypes.bfloat16) if sdt == "BF16" and qt != QT.BF16 else block
        with np.errstate(over="ignore"):  # values past f16's range: counted by _scan_source
            np.copyto(dst, src, casting="unsafe")  # numpy's (ml_dtypes') cast, the same as astype
    else:
        dst[...] = _convert_block(block, sdt, qt, fn)


def _convert_block(block: np.ndarray, sdt: str, qt: QT, fn: str | None) -> np.ndarray:
    """The block through float32: transformed (fn), then rounded or quantized to qt."""
    x = block.view(ml_dtypes.bfloat16).astype(np.float32) if sdt == "BF16" else block.astype(np.float32)
    x = apply_fn(fn, x)
    if qt == QT.F32:
        return x
    if qt == QT.F16:
        return x.astype(np.float16)
    if qt == QT.BF16:
        return f32_to_bf16(x)
    if qt == QT.Q8_0:
        return gguf.quants.quantize(np.ascontiguousarray(x), QT.Q8_0)
    raise ConversionError(f"unsupported output type {qt.name}")
