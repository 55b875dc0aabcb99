"""Quantizing a Clover GGUF with libllama's ``llama_model_quantize`` (through llama-cpp-python's
low-level ``llama_cpp`` module, loaded against our patched libllama; see :mod:`clover_cpp._lib`)."""

from __future__ import annotations

import ctypes
import os
import uuid
from pathlib import Path

from ._lib import import_llama_cpp
from .gguf_info import GGUFInfoError, check_clover_gguf

__all__ = ["QUANT_TYPES", "quantize", "QuantizeError", "parse_quant_type"]

#: llama.cpp ftypes by name (llama.h ``LLAMA_FTYPE_*``; the values are those of the pinned llama.cpp)
QUANT_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
    "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XS": 22,
    "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29,
    "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37, "MXFP4_MOE": 38,
    "NVFP4": 39, "Q1_0": 40, "Q2_0": 41,
}
_ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q3_K": "Q3_K_M", "FP16": "F16",
            "FP32": "F32", "Q8": "Q8_0"}
#: types that llama.cpp only produces well with an importance matrix (refused here: no imatrix support)
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q2_K_S"}


class QuantizeError(ValueError):
    pass


def parse_quant_type(name: str | int) -> tuple[str, int]:
    if isinstance(name, int):
        for k, v in QUANT_TYPES.items():
            if v == name:
                return k, v
        raise QuantizeError(f"unknown quantization type {name}")
    key = str(name).strip().upper().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in QUANT_TYPES:
        raise QuantizeError(f"unknown quantization type {name!r} (choose from {', '.join(QUANT_TYPES)})")
    return key, QUANT_TYPES[key]


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str | int, *,
             n_threads: int = 0, force: bool = False, allow_requantize: bool = False,
             leave_output_tensor: bool = False, pure: bool = False) -> Path:
    """Quantize the Clover GGUF src into dst (type by name, e.g. "Q4_K_M"). Writes to a temporary
    file next to dst and renames it; refuses to overwrite dst unless force. Returns dst."""
    src, dst = Path(src), Path(dst)
    name, ftype = parse_quant_type(qtype)
    if name in NEEDS_IMATRIX:
        raise QuantizeError(f"{name} needs an importance matrix, which this command does not support")
    try:
        check_clover_gguf(src)
    except GGUFInfoError as e:
        raise QuantizeError(str(e)) from None
    if dst.is_dir():
        raise QuantizeError(f"{dst}: is a folder")
    if dst.exists() and not force:
        raise QuantizeError(f"{dst} already exists (use --force to overwrite)")
    if src.resolve() == dst.resolve():
        raise QuantizeError("input and output are the same file")
    if not dst.parent.is_dir():
        raise QuantizeError(f"{dst.parent}: output folder does not exist")
    try:
        llama_cpp = import_llama_cpp()
    except ImportError as e:
        raise QuantizeError(str(e)) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(n_threads)
    params.allow_requantize = bool(allow_requantize)
    params.quantize_output_tensor = not leave_output_tensor
    params.pure = bool(pure)
    tmp = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            raise QuantizeError(f"llama_model_quantize failed for {src} -> {name} (status {rc}); "
                                f"run with --verbose for llama.cpp's log")
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst
