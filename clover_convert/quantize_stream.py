"""Hugging Face checkpoint -> quantized GGUF (Q4_K_M, Q6_K, IQ4_XS, ...) in one streaming pass.

``convert_quantized(src, out, "Q4_K_M")`` gives the file that ``clover convert --outtype bf16``
followed by ``clover quantize ... Q4_K_M`` gives, byte for byte, without the bf16 file:

* the converter plans the bf16 conversion as usual and writes only that file's *header*
  (metadata and tensor infos) to a temporary file whose tensor data is a hole (a sparse file:
  no disk blocks);
* llama.cpp's own quantizer (``llama_model_quantize_from``, patch 0008) runs on that header:
  its per-tensor type rule for the file type (plus our keep-f32 rules, patch 0002), its f32
  conversion, ggml's quantization functions and its output writer, all unchanged. Whenever it
  needs a byte range of a tensor, it calls back here, and the converter's chunked, threaded
  filler (``filler.Filler``: read, permute, transform, round to bf16) makes exactly those bytes in
  memory, from the memory-mapped safetensors.

Memory: the quantizer's slabs are capped (``MAX_BUF_BYTES`` of source, f32 and output rows
together), so the peak stays near the converter's own (well under 2x the largest tensor +
300 MB). Disk: the output only.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

from clover_gguf.files import check_output, clean_stale_temps, require_regular, temp_path
from clover_gguf.quant import NEEDS_IMATRIX, QuantizeError, check_imatrix, load_imatrix, parse_quant_type
from clover_gguf.reader import GGUFInfoError, check_clover_gguf

from .config import ConversionError
from .filler import Filler
from .plan import ConversionPlan, out_path, plan_conversion
from .safetensors_io import CheckpointReader
from .tensors import TensorPlan

__all__ = ["convert_quantized", "QUANT_OUTTYPES", "is_quant_outtype"]

#: the quantizer's slab cap (source + f32 + output rows in memory at once); the output does not
#: depend on it (rows are quantized independently), only the memory does
MAX_BUF_BYTES = 256 * 1024 * 1024

#: the llama.cpp file types `clover convert --outtype` makes in one pass (the converter's own
#: f32 / f16 / bf16 / q8_0 are written directly; Q8_0 in capitals is llama-quantize's Q8_0 mix)
QUANT_OUTTYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1",
                  "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS",
                  "Q2_K", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ1_0", "TQ2_0",
                  "MXFP4_MOE")


def is_quant_outtype(name: str) -> bool:
    return name.upper().replace("-", "_") in QUANT_OUTTYPES


class _MemFiller(Filler):
    """The converter's filler, writing each converted chunk into a memory target (a uint8 array
    given as the ``fd`` of its jobs) instead of a file."""

    def _write(self, fd, data: np.ndarray, offset: int) -> None:  # noqa: ANN001 - the target array
        fd[offset:offset + data.nbytes] = data.view(np.uint8).reshape(-1)

    def fill(self, t: TensorPlan, offs: int, size: int, dst: np.ndarray) -> None:
        """dst = bytes offs..offs+size of tensor t as the bf16 GGUF holds them. The tensor is its
        slabs (one per expert when stacked) of `rows` rows of row_bytes each, one after the other;
        the covering rows are made (in chunks, on every core) straight into dst when the range is
        whole rows, else into a scratch buffer first."""
        piece_shape = t.shape[1:] if t.stacked else t.shape
        rows = 1 if len(piece_shape) == 1 else piece_shape[0]
        cols = piece_shape[0] if len(piece_shape) == 1 else math.prod(piece_shape[1:])
        row_bytes = t.nbytes // len(t.pieces) // max(rows, 1)
        g0, g1 = offs // row_bytes, -(-(offs + size) // row_bytes)  # global rows covering the range
        aligned = offs % row_bytes == 0 and size % row_bytes == 0
        target = dst if aligned else np.empty((g1 - g0) * row_bytes, np.uint8)
        step = max(1, self._chunk_elems() // max(cols, 1))
        jobs: list[Future] = []
        for j, piece in enumerate(t.pieces):
            a, b = max(0, g0 - j * rows), min(rows, g1 - j * rows)
            for r0 in range(a, b, step):
                jobs.append(self._pool.submit(self._fill_rows, piece, (rows, cols), t, r0, min(b, r0 + step),
                                              target, (j * rows + r0 - g0) * row_bytes, row_bytes))
        self.wait(t, jobs)
        if not aligned:
            dst[:] = target[offs - g0 * row_bytes:offs - g0 * row_bytes + size]


def convert_quantized(
    src: str | os.PathLike,
    out: str | os.PathLike | None = None,
    qtype: str = "Q4_K_M",
    *,
    imatrix: str | os.PathLike | None = None,
    n_threads: int = 0,
    leave_output_tensor: bool = False,
    pure: bool = False,
    force: bool = False,
    progress: bool = True,
    dry_run: bool = False,
    log: Callable[[str], None] | None = None,
) -> ConversionPlan:
    """Convert the Clover checkpoint src (folder or hub id) to a GGUF quantized to qtype (a
    llama.cpp file type: Q4_K_M, Q6_K, IQ4_XS, ...) in one pass; see the module doc. Returns
    the bf16 plan with ``out``/``shard_paths`` set to the written file and ``outtype`` to the
    type's name. Raises ConversionError (one line) on bad input; on failure or interruption
    nothing is left behind."""
    say = log or (lambda s: print(s, file=sys.stderr))
    t0 = time.monotonic()
    try:
        name, ftype = parse_quant_type(qtype)
    except QuantizeError as e:
        raise ConversionError(str(e)) from None
    if name in ("F32", "F16", "BF16"):
        raise ConversionError(f"{name} is not a quantized type: use --outtype {name.lower()}")
    if name in NEEDS_IMATRIX and imatrix is None:
        raise ConversionError(f"{name} needs an importance matrix: pass --imatrix FILE (clover imatrix makes one)")
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 0:
        raise ConversionError(f"threads must be 0 (all cores) or more, got {n_threads!r}")
    plan = plan_conversion(src, None, "bf16", None, dry_run=dry_run)
    dst = out_path(plan.source, out, name.lower())
    plan.out, plan.shard_paths, plan.outtype = dst, [dst], name
    im = None
    if imatrix is not None:
        require_regular(Path(imatrix), ConversionError)
        try:
            im = load_imatrix(imatrix)
            for line in check_imatrix(im, SimpleNamespace(tensors=plan.tensors, path=dst), Path(imatrix)):
                say(line)
        except QuantizeError as e:
            raise ConversionError(str(e)) from None
    if dry_run:
        return plan

    inputs = plan.source.files()
    check_output(dst, inputs + ([Path(imatrix)] if imatrix is not None else []), force, ConversionError)
    clean_stale_temps(dst)
    from clover_cpp.quant import StreamQuantizer  # libllama's quantizer: the runtime's public module

    try:
        quantizer = StreamQuantizer(ftype, max_buf_size=MAX_BUF_BYTES, n_threads=n_threads,
                                    leave_output_tensor=leave_output_tensor, pure=pure,
                                    imatrix=None if imatrix is None else str(imatrix))
    except QuantizeError as e:
        raise ConversionError(str(e)) from None

    header, tmp = temp_path(dst.with_name(dst.name + ".bf16-header")), temp_path(dst)
    by_name = {t.name: t for t in plan.tensors}
    reader = CheckpointReader(plan.folder)
    filler = _MemFiller(reader)
    failure: list[BaseException] = []
    bar = None
    total = plan.total_bytes
    try:
        # the bf16 file's header, its tensor data a hole (ftruncate: no blocks written)
        w = plan.writer  # the plan's (bf16, one file), written under the header's temporary name
        w.write_header(dst, {dst: header})
        w.close()
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"Converting to {name}", leave=False)

        def read(tname: str, offs: int, size: int, ptr: int) -> bool:
            try:
                t = by_name[tname]
                dst_arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
                filler.fill(t, offs, size, dst_arr)
                if bar is not None:
                    bar.set_postfix_str(t.name, refresh=False)
                    bar.update(size)
                return True
            except BaseException as e:  # noqa: BLE001 - Ctrl-C included: handed back after the call
                failure.append(e)
                return False

        rc = quantizer.run(header, tmp, read)
        if failure:
            raise failure[0]
        if rc != 0 or not tmp.is_file():
            raise ConversionError(f"llama.cpp could not quantize {plan.src} to {name} "
                                  f"(clover quantize on a bf16 conversion says why with --verbose)")
        try:
            check_clover_gguf(tmp)
        except GGUFInfoError as e:
            raise ConversionError(f"llama.cpp wrote {name}, but the result cannot be read back "
                                  f"({str(e).split(': ', 1)[-1]}); choose another type") from None
        why = _loader_check(tmp)
        if why is not None:
            raise ConversionError(f"llama.cpp wrote {name}, but clover cannot load the result ({why}); "
                                  f"choose another type")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        for tname, n in filler.nonfinite.items():
            say(f"warning: {tname}: {n} NaN/Inf value(s) in the checkpoint")
    finally:
        filler.close()
        reader.close()
        if bar is not None:
            bar.close()
        for p in (header, tmp):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
    plan.elapsed_s = time.monotonic() - t0
    return plan


def _loader_check(path: Path) -> str | None:
    """libclover's loader on the result (as clover quantize checks its output), in a child
    process: loading maps and repacks the whole model, which would count in this process's
    peak memory. Its one-line reason when it refuses the file, else None."""
    import subprocess

    code = ("import sys; from clover_cpp.quant import loader_refuses; "
            "r = loader_refuses(sys.argv[1]); sys.stdout.write('refused: ' + r if r else 'ok')")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    out = res.stdout.strip()
    if res.returncode == 0 and out == "ok":
        return None
    if out.startswith("refused: "):
        return out[len("refused: "):]
    tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return f"the loader check failed (exit status {res.returncode}: {tail})"
