"""A small safetensors reader/writer that handles bfloat16.

numpy has no bfloat16, so the ``safetensors`` package's numpy API cannot load bf16
checkpoints. This module parses the format directly:

    [8 bytes: little-endian u64 N][N bytes: JSON header][data]

The header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data section) plus an optional
``"__metadata__"`` dict of str -> str.

Reading is lazy: only the header is read when a file is opened; the data section is
memory-mapped on first access and tensors are returned as views in their storage dtype
(bf16 as ``np.uint16``). ``read_f32`` converts to float32 (a new array).

Every error raised for a malformed file is a ``CheckpointError`` whose message is a
single line naming the file (and the tensor, where there is one).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "CheckpointError",
    "SafetensorsFile",
    "CheckpointReader",
    "bf16_to_f32",
    "f32_to_bf16",
    "write_safetensors",
    "write_safetensors_lazy",
    "DTYPES",
    "INDEX_NAME",
    "SINGLE_NAME",
]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype string -> numpy storage dtype (little-endian). BF16 and the fp8
# types have no numpy equivalent and are stored as unsigned integers of the same width.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# numpy dtype -> safetensors dtype string, for writing arrays given without a dtype
_NP_TO_ST: dict[np.dtype, str] = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("<u8"): "U64",
    np.dtype("<u4"): "U32",
    np.dtype("<u2"): "U16",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
}

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit


class CheckpointError(Exception):
    """A checkpoint file or folder is missing, malformed or inconsistent."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _err(msg: str) -> CheckpointError:
    return CheckpointError(_one_line(msg))


# ---------------------------------------------------------------------------
# bf16 helpers


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    u16 = np.asarray(u16)
    if u16.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 expects uint16 bit patterns, got {u16.dtype}")
    return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even.

    NaNs stay NaN (quiet bit set); values past the bf16 range round to +-inf.
    """
    a = np.ascontiguousarray(np.asarray(f32, dtype=np.float32))
    bits = a.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


# ---------------------------------------------------------------------------
# reading


class _Entry:
    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: str, shape: tuple[int, ...], begin: int, end: int):
        self.dtype = dtype
        self.shape = shape
        self.begin = begin
        self.end = end


class SafetensorsFile:
    """One .safetensors file: header parsed and validated eagerly, data mapped lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise _err(f"{self.path}: file not found") from None
        except OSError as e:
            raise _err(f"{self.path}: cannot stat: {e}") from None
        if size < 8:
            raise _err(f"{self.path}: file is {size} bytes, shorter than the 8-byte header length")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise _err(f"{self.path}: header length {n} is implausibly large (corrupt file?)")
            if 8 + n > size:
                raise _err(
                    f"{self.path}: header length {n} runs past the end of the file "
                    f"({size} bytes; truncated or corrupt)"
                )
            raw_header = f.read(n)
        try:
            header = json.loads(raw_header.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _err(f"{self.path}: header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise _err(f"{self.path}: header is not a JSON object")

        self._data_start = 8 + n
        self._data_len = size - self._data_start
        self.metadata: dict[str, str] = {}
        meta = header.pop("__metadata__", None)
        if meta is not None:
            if not isinstance(meta, dict):
                raise _err(f"{self.path}: __metadata__ is not a JSON object")
            self.metadata = {str(k): str(v) for k, v in meta.items()}

        self._entries: dict[str, _Entry] = {}
        for name, info in header.items():
            self._entries[name] = self._parse_entry(name, info)
        # tensors must not share bytes (the official library refuses overlapping data too)
        spans = sorted((e.begin, e.end, n) for n, e in self._entries.items() if e.end > e.begin)
        for (_, end0, n0), (begin1, _, n1) in zip(spans, spans[1:]):
            if begin1 < end0:
                raise _err(f"{self.path}: tensors {n0!r} and {n1!r} overlap in the data section")
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None

    def _parse_entry(self, name: str, info: Any) -> _Entry:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise _err(f"{where}: header entry is not a JSON object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise _err(f"{where}: header entry lacks {key!r}")
        dtype = info["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _err(f"{where}: unknown dtype {dtype!r}")
        shape = info["shape"]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _err(f"{where}: bad shape {shape!r}")
        offs = info["data_offsets"]
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise _err(f"{where}: bad data_offsets {offs!r}")
        begin, end = offs
        if begin < 0 or end < begin:
            raise _err(f"{where}: bad data_offsets [{begin}, {end}]")
        if end > self._data_len:
            raise _err(
                f"{where}: data_offsets [{begin}, {end}] lie outside the {self._data_len}-byte "
                f"data section (truncated file?)"
            )
        count = 1
        for d in shape:
            count *= d
        expected = count * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise _err(
                f"{where}: {end - begin} data bytes, but shape {shape} of {dtype} needs {expected}"
            )
        return _Entry(dtype, tuple(shape), begin, end)

    # -- API

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise _err(f"{self.path}: no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        return self._entry(name).dtype

    def nbytes(self, name: str) -> int:
        e = self._entry(name)
        return e.end - e.begin

    def _data(self) -> np.ndarray:
        if self._buf is None:
            if self._data_len == 0:
                self._buf = np.zeros(0, dtype=np.uint8)
            else:
                with open(self.path, "rb") as f:
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._buf = np.frombuffer(self._mm, dtype=np.uint8)[self._data_start :]
        return self._buf

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its storage dtype (bf16 as uint16), a read-only view (no copy)."""
        e = self._entry(name)
        dt = DTYPES[e.dtype]
        buf = self._data()[e.begin : e.end]
        if e.end - e.begin == 0:
            return np.zeros(e.shape, dtype=dt)
        if (self._data_start + e.begin) % dt.itemsize == 0:
            return buf.view(dt).reshape(e.shape)
        # misaligned offsets are legal in the format; copy so the view is aligned
        return np.frombuffer(buf.tobytes(), dtype=dt).reshape(e.shape)

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor converted to a new float32 array."""
        e = self._entry(name)
        a = self.raw(name)
        if e.dtype == "BF16":
            return bf16_to_f32(a)
        if e.dtype in ("F8_E4M3", "F8_E5M2"):
            raise _err(f"{self.path}: tensor {name!r}: {e.dtype} -> f32 is not supported")
        return a.astype(np.float32)

    def close(self) -> None:
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # views handed out still reference the map; let GC release it
                pass
            self._mm = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


class CheckpointReader:
    """All tensors of a Hugging Face checkpoint folder.

    Either a single ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json`` (the index wins when both exist).
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise _err(f"{self.folder}: checkpoint folder not found")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        self.index: dict[str, Any] | None = None
        index_path = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
        if index_path.exists():
            self._load_index(index_path)
        elif single.exists():
            f = SafetensorsFile(single)
            self._files[SINGLE_NAME] = f
            for n in f.names():
                self._where[n] = f
        else:
            raise _err(f"{self.folder}: neither {SINGLE_NAME} nor {INDEX_NAME} found")

    def _load_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _err(f"{index_path}: not valid JSON: {e}") from None
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise _err(f"{index_path}: no 'weight_map' object")
        if not all(isinstance(v, str) for v in index["weight_map"].values()):
            raise _err(f"{index_path}: every 'weight_map' value must be a shard file name")
        self.index = index
        weight_map: dict[str, str] = index["weight_map"]
        for fname in sorted(set(weight_map.values())):
            if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise _err(f"{index_path}: bad shard file name {fname!r}")
            p = self.folder / fname
            if not p.exists():
                raise _err(f"{index_path}: shard file {fname} is missing from {self.folder}")
            self._files[fname] = SafetensorsFile(p)
        for name, fname in weight_map.items():
            f = self._files[fname]
            if name not in f:
                raise _err(f"{index_path}: tensor {name!r} is mapped to {fname}, which lacks it")
            self._where[name] = f
        # tensors present in a shard but absent from the weight map are still readable
        for f in self._files.values():
            for n in f.names():
                self._where.setdefault(n, f)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise _err(f"{self.folder}: checkpoint has no tensor named {name!r}") from None

    def file_of(self, name: str) -> Path:
        return self._file(name).path

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> str:
        return self._file(name).dtype(name)

    def nbytes(self, name: str) -> int:
        return self._file(name).nbytes(name)

    def raw(self, name: str) -> np.ndarray:
        return self._file(name).raw(name)

    def read_f32(self, name: str) -> np.ndarray:
        return self._file(name).read_f32(name)

    def files(self) -> list[Path]:
        return [f.path for f in self._files.values()]

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.folder)!r}, {len(self._files)} files, {len(self)} tensors)"


# ---------------------------------------------------------------------------
# writing


def _prepare(name: str, value: Any) -> tuple[np.ndarray, str]:
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"tensor {name!r}: expected (array, dtype_str)")
        arr, dt = value
        arr = np.asarray(arr)
    else:
        arr = np.asarray(value)
        dt = _NP_TO_ST.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if dt is None:
            raise ValueError(f"tensor {name!r}: no safetensors dtype for numpy {arr.dtype}")
    if dt not in DTYPES:
        raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dt!r}")
    want = DTYPES[dt]
    if dt == "BF16" and arr.dtype != np.uint16:
        if arr.dtype.kind != "f":
            raise ValueError(f"tensor {name!r}: BF16 needs uint16 bit patterns or floats, got {arr.dtype}")
        arr = f32_to_bf16(arr)
    elif arr.dtype != want:
        same_kind = arr.dtype.kind == want.kind or (arr.dtype.kind in "iu" and want.kind in "iu")
        if not same_kind:
            raise ValueError(f"tensor {name!r}: array dtype {arr.dtype} does not match {dt}")
        arr = arr.astype(want)
    return np.ascontiguousarray(arr), dt


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, tuple[np.ndarray, str] | np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (name -> (array, dtype_str), or a bare array) to ``path``.

    bf16 tensors are given as uint16 bit patterns with dtype "BF16" (float arrays with
    "BF16" are rounded to bf16). Tensors are written in the given order. The file is
    written to a temporary file in the same folder and renamed into place.
    """
    prepared: list[tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]] = []
    for name, value in tensors.items():
        arr, dt = _prepare(name, value)
        prepared.append((name, arr.shape, dt, (lambda a=arr: a)))
    write_safetensors_lazy(path, prepared, metadata)


def write_safetensors_lazy(
    path: str | os.PathLike,
    specs: Iterable[tuple[str, Sequence[int], str, Callable[[], np.ndarray]]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Like ``write_safetensors``, but each tensor is produced on demand.

    ``specs`` lists ``(name, shape, dtype_str, producer)``; the header is written from
    the shapes, then each producer is called in turn and its array (checked against the
    declared shape, converted as in ``write_safetensors``) streamed to the file, so at
    most one tensor is held in memory. Written atomically (temp file + rename).
    """
    path = Path(path)
    specs = list(specs)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, shape, dt, _ in specs:
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot be a tensor name")
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        if dt not in DTYPES:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dt!r}")
        n = DTYPES[dt].itemsize
        for d in shape:
            n *= int(d)
        header[name] = {"dtype": dt, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates the file 0600; give it the usual umask-derived mode
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(hbytes)))
            f.write(hbytes)
            for name, shape, dt, producer in specs:
                arr, dt2 = _prepare(name, (producer(), dt))
                if tuple(arr.shape) != tuple(int(d) for d in shape):
                    raise ValueError(f"tensor {name!r}: producer gave shape {arr.shape}, declared {tuple(shape)}")
                if arr.nbytes:
                    f.write(memoryview(arr.reshape(-1)).cast("B"))
                del arr
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
