"""llama.cpp's quantization types by name (gguf-py's ``LlamaFileType``) and its importance-matrix
format (GGUF, as ``llama-imatrix`` writes it and ``llama-quantize`` reads it): what ``clover
quantize`` and the one-pass quantizing convert both accept."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import LlamaFileType

from .errors import UserFacingError

__all__ = ["QUANT_TYPES", "NEEDS_IMATRIX", "UNQUANTIZED_FTYPES", "QuantizeError", "parse_quant_type",
           "ImportanceMatrix", "load_imatrix", "check_imatrix"]

#: llama.cpp ftypes by name (llama.h ``LLAMA_FTYPE_*``), gguf-py's names without MOSTLY_ / ALL_;
#: the pinned llama.h has Q2_0 (41), which gguf-py does not list yet
QUANT_TYPES: dict[str, int] = {t.name.removeprefix("MOSTLY_").removeprefix("ALL_"): int(t)
                               for t in LlamaFileType if t is not LlamaFileType.GUESSED}
QUANT_TYPES.setdefault("Q2_0", 41)
_ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q3_K": "Q3_K_M", "FP16": "F16",
            "FP32": "F32", "Q8": "Q8_0"}
#: types that llama.cpp only produces well with an importance matrix (refused without one)
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q2_K_S"}
UNQUANTIZED_FTYPES = {0, 1, 32}  # F32, F16, BF16


class QuantizeError(UserFacingError, ValueError):
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


@dataclass
class ImportanceMatrix:
    """Per weight tensor, the mean squared activation of each input column (one slice per expert)."""
    entries: dict[str, np.ndarray]
    datasets: list[str]
    chunk_count: int


def load_imatrix(path: str | os.PathLike[str]) -> ImportanceMatrix:
    """Read a GGUF imatrix (NAME.in_sum2 and NAME.counts per weight, as llama-imatrix writes) and
    normalise it as llama-quantize does: the sums over each expert's count, 1 where unseen."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise QuantizeError(f"{path}: no such importance matrix file")
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any failure is the file's
        raise QuantizeError(f"{path}: not a GGUF importance matrix ({e}); the legacy .dat format is not read: "
                            f"convert it with llama-imatrix --in-file {path.name} -o NEW.gguf") from None
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in r.tensors:
        for suffix, into in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise QuantizeError(f"{path}: {t.name} must be F32")
                into[t.name[: -len(suffix)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums or set(sums) != set(counts):
        odd = sorted(set(sums) ^ set(counts))
        raise QuantizeError(f"{path}: " + (f"sums without counts or counts without sums: {odd[:3]}" if odd
                                           else "no importance data (NAME.in_sum2 / NAME.counts tensors)"))
    entries = {}
    for name, s in sums.items():
        c = counts[name]
        if c.size == 0 or s.size % c.size:
            raise QuantizeError(f"{path}: {name}: {s.size} sums do not split into {c.size} experts")
        # sums of squares and counts: finite and >= 0; a tensor whose data is all zero would make
        # every quantized block's weighting zero (the quantizer then picks scales at random: the
        # model prints only spaces)
        for what, a in (("sums", s), ("counts", c)):
            if not np.isfinite(a).all():
                raise QuantizeError(f"{path}: {name}: {what} hold NaN or infinite values")
            if (a < 0).any():
                raise QuantizeError(f"{path}: {name}: {what} hold negative values ({float(a.min()):g})")
        per = s.reshape(c.size, -1)
        if not (c > 0).any():
            raise QuantizeError(f"{path}: {name}: every count is zero (no data was collected)")
        if not (per[c > 0] > 0).any():
            raise QuantizeError(f"{path}: {name}: every importance value is zero")
        entries[name] = np.where(c[:, None] > 0, per / np.maximum(c[:, None], 1), 1.0).astype(np.float32).reshape(-1)

    def field(key: str) -> Any:
        f = r.fields.get(key)
        return f.contents() if f is not None else None

    return ImportanceMatrix(entries, list(field("imatrix.datasets") or []), int(field("imatrix.chunk_count") or 0))


def check_imatrix(im: ImportanceMatrix, info: Any, path: Path) -> list[str]:
    """Match an importance matrix to the model (its GGUF header): every entry names a weight
    and has one value per input column (and expert), else QuantizeError; returns the warning
    lines (weights that get no importance data)."""
    shapes = {t.name: t.shape for t in info.tensors}  # numpy order: (experts, rows, columns)
    unknown = sorted(n for n in im.entries if n not in shapes)
    if unknown:
        raise QuantizeError(f"{path}: {len(unknown)} of {len(im.entries)} entries name no tensor of "
                            f"{info.path.name} (e.g. {', '.join(unknown[:3])}): an importance matrix of another model?")
    for n, data in im.entries.items():
        shape = shapes[n]
        want = int(shape[-1]) * (int(shape[0]) if len(shape) == 3 else 1)
        if len(shape) < 2 or data.size != want:
            raise QuantizeError(f"{path}: {n}: {data.size} values, but the tensor {tuple(shape)} needs {want} "
                                f"(one per input column{' and expert' if len(shape) == 3 else ''})")
    missing = [t.name for t in info.tensors if len(t.shape) >= 2 and t.name.endswith(".weight")
               and t.name != "token_embd.weight" and t.name not in im.entries]
    if not missing:
        return []
    more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    return [f"warning: {path.name} has no data for {len(missing)} weight tensors ({', '.join(missing[:6])}{more}); "
            f"they are quantized without importance weighting"]
