"""Quantizing a Clover GGUF with libllama's ``llama_model_quantize`` (through llama-cpp-python's
low-level ``llama_cpp`` module, loaded against our patched libllama; see :mod:`clover_cpp._lib`).

An importance matrix (``imatrix=``, llama.cpp's GGUF imatrix format as ``llama-imatrix``
writes it) is read with gguf-py and handed to the quantizer as llama-quantize does. Computing
one *on* Clover is not built: ``llama-imatrix`` decodes causally token by token, which a clover
model refuses (patch 0004: that is not how it runs), and a collector over Clover's block passes
does not exist yet."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
#: types that llama.cpp only produces well with an importance matrix (refused without one)
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "Q2_K_S"}


class QuantizeError(ValueError):
    pass


#: the most quantizer threads accepted (llama.cpp starts that many; 100000 made it abort)
MAX_THREADS = max(256, os.cpu_count() or 1)


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
             leave_output_tensor: bool = False, pure: bool = False, imatrix: str | os.PathLike[str] | None = None,
             progress: Callable[[int, int, str], None] | None = None, verbose: bool = False,
             warn: Callable[[str], None] | None = None) -> Path:
    """Quantize the Clover GGUF src into dst (type by name, e.g. "Q4_K_M").

    llama.cpp's quantizer runs in a child process, so that Ctrl-C (or SIGTERM) stops it at once:
    the child is terminated and its temporary file removed. ``progress(i, n, tensor)`` is called
    per tensor; ``warn(line)`` (default: stderr) gets the warnings (weights without importance
    data). The result is written to a temporary file next to dst, read back, and renamed
    into place; dst is replaced only with force, and never when it is not a regular file or is
    src. Returns dst."""
    from ._files import check_output, clean_stale_temps, require_regular, split_gguf_files, temp_path

    src, dst = Path(src), Path(dst)
    name, ftype = parse_quant_type(qtype)
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 0 <= n_threads <= MAX_THREADS:
        raise QuantizeError(f"threads must be 0 (all cores) to {MAX_THREADS}, got {n_threads!r}")
    if name in NEEDS_IMATRIX and imatrix is None:
        raise QuantizeError(f"{name} needs an importance matrix: pass --imatrix FILE")
    # every file llama.cpp will open, refused up front when it is a FIFO or a device (it would
    # block or never end): the input, each shard of a split input, the importance matrix
    for p in split_gguf_files(src):
        require_regular(p, QuantizeError)
    if imatrix is not None:
        require_regular(imatrix, QuantizeError)
        im = load_imatrix(imatrix)  # a bad file fails here, with its own message, before any work
    try:
        info = check_clover_gguf(src)
    except GGUFInfoError as e:
        raise QuantizeError(str(e)) from None
    if imatrix is not None:
        for line in check_imatrix(im, info, Path(imatrix)):
            (warn or (lambda s: print(s, file=sys.stderr)))(line)
    if dst.is_dir():
        dst = dst / f"{src.stem.rsplit('-', 1)[0]}-{name.lower()}.gguf"  # like gguf tools: OUT may be a folder
    # never any file of the input (every shard of a split one) nor the importance matrix
    check_output(dst, [src] + ([Path(imatrix)] if imatrix is not None else []), force, QuantizeError)
    src_type = info.metadata.get("general.file_type")
    if isinstance(src_type, int) and src_type not in UNQUANTIZED_FTYPES and not allow_requantize:
        have = next((k for k, v in QUANT_TYPES.items() if v == src_type), str(src_type))
        raise QuantizeError(f"{src} is already quantized ({have}); requantizing loses quality - "
                            f"pass --allow-requantize to do it anyway")
    clean_stale_temps(dst)
    tmp = temp_path(dst)
    args = json.dumps(dict(src=str(src), dst=str(tmp), ftype=ftype, n_threads=int(n_threads),
                           allow_requantize=bool(allow_requantize), leave_output_tensor=bool(leave_output_tensor),
                           pure=bool(pure), imatrix=None if imatrix is None else str(imatrix)))
    child = subprocess.Popen([sys.executable, "-c", "from clover_cpp.quant import _child_main; _child_main()", args],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             errors="replace", start_new_session=True,  # Ctrl-C reaches us, not the child
                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    tail: list[str] = []
    try:
        assert child.stderr is not None
        for line in child.stderr:
            m = _PROGRESS.match(line)
            if m and progress is not None:
                progress(int(m.group(1)), int(m.group(2)), m.group(3))
            if verbose:
                sys.stderr.write(line)
            tail = (tail + [line.strip()])[-20:]
        rc = child.wait()
        refused = next((t for t in tail if t.startswith(_REFUSED)), None)
        if refused is not None:
            which, why = refused[len(_REFUSED):].split(": ", 1)
            raise QuantizeError(f"{src}: not a model clover can load: {why}" if which == "input" else
                                f"llama.cpp wrote {name}, but clover cannot load the result ({why}); choose another type")
        if rc != 0 or not tmp.is_file():
            why = next((t for t in reversed(tail) if "error" in t.lower() or "failed" in t.lower()), "")
            raise QuantizeError(f"llama.cpp could not quantize {src} to {name}" + (f": {why}" if why else
                                f" (exit status {rc}); run with --verbose for its log"))
        try:
            check_clover_gguf(tmp)  # what inspect and run will read: never hand out a file they refuse
        except GGUFInfoError as e:
            raise QuantizeError(f"llama.cpp wrote {name}, but the result cannot be read back ({str(e).split(': ', 1)[-1]}); "
                                f"choose another type") from None
        os.replace(tmp, dst)
    except BaseException:
        if child.poll() is None:
            child.kill()
            child.wait()
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


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


def _die_with_parent() -> None:
    """In the quantizer child (Linux): SIGKILL when the parent dies, so a killed `clover quantize`
    leaves no orphan writing its temporary file."""
    import signal as _signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(_signal.SIGKILL))  # PR_SET_PDEATHSIG


_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
UNQUANTIZED_FTYPES = {0, 1, 32}  # F32, F16, BF16


def quantize_params(llama_cpp: Any, ftype: int, *, n_threads: int = 0, allow_requantize: bool = False,
                    leave_output_tensor: bool = False, pure: bool = False,
                    imatrix: str | os.PathLike[str] | None = None) -> tuple[Any, list[Any]]:
    """llama_model_quantize's parameters as `clover quantize` sets them (also the one-step
    `clover convert --outtype Q4_K_M`, clover_convert.quantize_stream): (params, what the
    pointers in params refer to, to be kept alive until the call returns)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    params.allow_requantize = allow_requantize
    params.quantize_output_tensor = not leave_output_tensor
    params.pure = pure
    keep: list[Any] = []  # what the pointers in params refer to, alive until the call returns
    if imatrix:
        im = load_imatrix(imatrix)
        rows = (llama_cpp.llama_model_imatrix_data * (len(im.entries) + 1))()  # ends with a NULL name
        for i, (name, data) in enumerate(im.entries.items()):
            keep.append(data)
            rows[i].name = name.encode()
            rows[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            rows[i].size = data.size
        # provenance in the output, under llama-quantize's keys
        kv = (llama_cpp.llama_model_kv_override * 5)()
        meta = [("quantize.imatrix.file", Path(imatrix).name), ("quantize.imatrix.entries_count", len(im.entries)),
                ("quantize.imatrix.chunks_count", im.chunk_count)]
        if im.datasets:
            meta.append(("quantize.imatrix.dataset", im.datasets[0][:127]))
        for o, (key, val) in zip(kv, meta):
            o.key = key.encode()
            if isinstance(val, int):
                o.tag, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, val
            else:
                o.tag, o.value.val_str = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, val.encode()[:127]
        keep += [rows, kv]
        params.imatrix = rows
        params.kv_overrides = kv
        print(f"clover: importance matrix {imatrix}: {len(im.entries)} entries, {im.chunk_count} chunks",
              file=sys.stderr)
    return params, keep


def _child_main() -> None:
    """The quantizer process: llama_model_quantize with llama.cpp's log on stderr (progress)."""
    a = json.loads(sys.argv[1])
    from .model import set_verbosity

    set_verbosity(2)
    llama_cpp = import_llama_cpp()
    params, keep = quantize_params(llama_cpp, a["ftype"], n_threads=a["n_threads"], allow_requantize=a["allow_requantize"],
                                   leave_output_tensor=a["leave_output_tensor"], pure=a["pure"], imatrix=a["imatrix"])
    why = _loader_refuses(a["src"])
    if why is not None:  # never turn a file `clover run` refuses into one it might not
        print(f"{_REFUSED}input: {why}", file=sys.stderr, flush=True)
        os._exit(1)
    rc = llama_cpp.llama_model_quantize(os.fsencode(a["src"]), os.fsencode(a["dst"]), ctypes.byref(params))
    if rc == 0:
        why = _loader_refuses(a["dst"])
        if why is not None:
            print(f"{_REFUSED}output: {why}", file=sys.stderr, flush=True)
            os._exit(1)
    sys.stderr.flush()
    os._exit(0 if rc == 0 else 1)


_REFUSED = "clover-quantize: the loader refuses the "


def _loader_refuses(path: str) -> str | None:
    """libclover's own loader on path (memory-mapped: nothing is read but the header and the
    checks): its one-line reason when it refuses the file, else None."""
    from . import _native as N

    L = N.lib()
    mp = L.clover_model_default_params()
    mp.use_mmap = 1
    err, n = N.err_buffer()
    m = L.clover_model_load(os.fsencode(path), ctypes.byref(mp), err, n)
    if not m:
        return " ".join((err.value or b"load failed").decode("utf-8", "replace").split())
    L.clover_model_free(m)
    return None
