"""Safetensors checkpoints (one file or a sharded index), bfloat16 included.

Parsing and validating a file is the ``safetensors`` library's: ``safe_open(framework="np")``
reads the header and memory-maps the data; a tensor, or part of one (``get_slice``), is
copied out only when asked for (``raw``). The converter reads in place instead (``view``: a
read-only view of our own memory map of the file, at the offsets of the header the library
has checked), which saves a copy and a fresh allocation per tensor. With ``ml_dtypes``
imported, the library gives bf16 tensors as ``ml_dtypes.bfloat16`` bit for bit; this module
hands them out as their ``np.uint16`` bit patterns, the converter's storage dtype for BF16.
``write_safetensors`` is the library's ``save_file``. What stays ours: the sharded index
(``model.safetensors.index.json``) and its checks, which dtypes we read and write, a writer
that streams tensor by tensor, and the errors: every one raised for a malformed file or
folder is a ``CheckpointError`` whose message is a single line naming the file (and the
tensor, where there is one).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import ml_dtypes  # bfloat16 for numpy; safe_open(framework="np") needs it for BF16 tensors
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from clover_gguf.errors import UserFacingError
from clover_gguf.files import require_regular

__all__ = [
    "CheckpointError",
    "SafetensorsFile",
    "CheckpointReader",
    "bf16_to_f32",
    "f32_to_bf16",
    "write_safetensors",
    "write_safetensors_lazy",
    "read_header",
    "require_inside",
    "checkpoint_roots",
    "DTYPES",
    "INDEX_NAME",
    "SINGLE_NAME",
]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# the dtypes we read and write -> the numpy dtype they are handed out / taken as (BF16 as its
# bits). A file may hold others (F8_*, F4, ...): listed with their shape, but not readable.
DTYPES: dict[str, np.dtype] = {k: np.dtype(v) for k, v in {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}.items()}
_NP_TO_ST = {dt: name for name, dt in DTYPES.items() if name != "BF16"}  # a bare array's dtype


class CheckpointError(UserFacingError):
    """A checkpoint file or folder is missing, malformed or inconsistent."""


def _err(msg: str) -> CheckpointError:
    return CheckpointError(" ".join(str(msg).split()))


def _bits(dtype: str) -> int:
    """Bits per element of a safetensors dtype: BOOL, U8, I16, F4, F6_E2M3, F8_E4M3, C64, ..."""
    return 8 if dtype == "BOOL" else int(re.match(r"[A-Z]+(\d+)", dtype).group(1))  # type: ignore[union-attr]


# ---------------------------------------------------------------------------
# bf16 helpers (ml_dtypes: one C pass each)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    u16 = np.asarray(u16)
    if u16.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 expects uint16 bit patterns, got {u16.dtype}")
    return u16.view(ml_dtypes.bfloat16).astype(np.float32)


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even.

    Values past the bf16 range round to +-inf. A NaN keeps its sign and top payload bits,
    with the quiet bit set (as gguf-py and ggml do; ml_dtypes alone would make it 0x7FC0).
    """
    a = np.ascontiguousarray(np.asarray(f32, dtype=np.float32))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / past-range casts are meant
        out = a.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = ((a.view(np.uint32)[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


# ---------------------------------------------------------------------------
# reading


def checkpoint_roots(folder: str | os.PathLike) -> tuple[Path, ...]:
    """Where the files of a checkpoint folder may really be (links resolved): the folder; and
    for a Hugging Face cache snapshot (``.../models--org--name/snapshots/REV``, whose files are
    links into ``../../blobs``), that repo's ``blobs`` folder."""
    root = Path(folder).resolve()
    blobs = root.parent.parent / "blobs"
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--") and blobs.is_dir():
        return root, blobs.resolve()
    return (root,)


def require_inside(path: str | os.PathLike, folder: str | os.PathLike, error: type[Exception],
                   roots: tuple[Path, ...] | None = None) -> None:
    """Raise ``error`` (one line) when ``path`` (a file of the checkpoint ``folder``) is a link
    that resolves outside the folder (or, for a hub cache snapshot, outside its repo's blobs),
    or is not a regular file once resolved. A missing file passes (the reader says so in its own
    words). A checkpoint is untrusted input: a ``chat_template.jinja`` linked to ``/etc/passwd``
    must not end up in the GGUF."""
    p = Path(path)
    if not os.path.lexists(p):
        return
    roots = roots if roots is not None else checkpoint_roots(folder)
    real = Path(os.path.realpath(p))
    if not any(real == r or real.is_relative_to(r) for r in roots):
        raise error(f"{p}: is a link to {real}, outside the checkpoint folder; refusing to read it "
                    "(copy the file into the folder if it is meant)")
    require_regular(p, error)  # a FIFO, a device, a folder (a missing target: the reader's words)


MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_header(path: str | os.PathLike) -> tuple[int, dict[str, Any]] | None:
    """(where the data starts, the JSON header) of a safetensors file, as written and unchecked;
    None when its first bytes are not a header. The library gives neither the data offsets nor
    anything of a file whose data is absent (dry runs on headers-only files need the shapes)."""
    try:
        require_regular(path, OSError)  # a FIFO: open() would block forever
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return (8 + n, header) if isinstance(header, dict) else None


class SafetensorsFile:
    """One .safetensors file: header read and checked on opening, data copied out on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handle: Any = None
        h = self._open()
        self.metadata: dict[str, str] = dict(h.metadata() or {})
        self._info: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name in h.offset_keys():  # file order
            s = h.get_slice(name)
            self._info[name] = (s.get_dtype(), tuple(s.get_shape()))
        self._map: np.ndarray | None = None
        self._offsets = self._data_offsets()

    def _data_offsets(self) -> dict[str, int]:
        """Where each tensor's bytes start in the file. The library has checked the header (its
        length, the JSON, offsets that tile the data exactly) but does not tell the offsets."""
        data_start, header = read_header(self.path) or (0, {})
        return {name: data_start + int(header[name]["data_offsets"][0]) for name in self._info}

    def _open(self) -> Any:
        if self._handle is None:
            require_regular(self.path, CheckpointError)  # a FIFO would block the reader forever
            try:
                self._handle = safe_open(self.path, framework="np")
            except FileNotFoundError:
                raise _err(f"{self.path}: file not found") from None
            except SafetensorError as e:
                why = str(e).replace("Error while deserializing header:", "bad safetensors header:")
                if any(s in why for s in ("too small", "header length", "not fully covered")):
                    why += " (truncated or corrupt file?)"
                raise _err(f"{self.path}: {why}") from None
            except OSError as e:
                raise _err(f"{self.path}: cannot read: {e.strerror or e}") from None
        return self._handle

    # -- API

    def names(self) -> list[str]:
        return list(self._info)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def __len__(self) -> int:
        return len(self._info)

    def _entry(self, name: str) -> tuple[str, tuple[int, ...]]:
        try:
            return self._info[name]
        except KeyError:
            raise _err(f"{self.path}: no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> str:
        return self._entry(name)[0]

    def nbytes(self, name: str) -> int:
        dtype, shape = self._entry(name)
        return (math.prod(shape) * _bits(dtype) + 7) // 8

    def _readable(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The tensor's dtype and shape, if it is one of the dtypes we read."""
        dtype, shape = self._entry(name)
        if dtype not in DTYPES:
            raise _err(f"{self.path}: tensor {name!r}: dtype {dtype} cannot be read (only {', '.join(DTYPES)})")
        return dtype, shape

    def raw(self, name: str, index: tuple[Any, ...] | None = None) -> np.ndarray:
        """The tensor, or ``index`` of it (ints and slices, read without the rest), as a new
        array in its storage dtype (bf16 as uint16)."""
        dtype = self._readable(name)[0]
        h = self._open()
        try:
            a = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        except SafetensorError as e:
            raise _err(f"{self.path}: tensor {name!r}: {e}") from None
        return a.view(np.uint16) if dtype == "BF16" else a

    def view(self, name: str, index: tuple[Any, ...] | None = None) -> np.ndarray:
        """The tensor, or ``index`` of it, as a read-only view of the file's memory map in its
        storage dtype (bf16 as uint16): nothing is copied, the page cache is read in place."""
        dtype, shape = self._readable(name)
        data = self._map  # one read: close() may drop the map meanwhile (the converter's threads)
        if data is None:
            try:
                with open(self.path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise _err(f"{self.path}: cannot read: {e.strerror or e}") from None
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)  # a converter reads it front to back: read ahead
            data = self._map = np.frombuffer(mm, dtype=np.uint8)
        start = self._offsets[name]
        end = start + self.nbytes(name)
        if end > len(data):
            raise _err(f"{self.path}: tensor {name!r}: the file is shorter than its header says (truncated?)")
        a = data[start:end].view(DTYPES[dtype]).reshape(shape)
        return a if index is None else a[index]

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor converted to a new float32 array."""
        a = self.raw(name)
        return bf16_to_f32(a) if self.dtype(name) == "BF16" else a.astype(np.float32)

    def close(self) -> None:
        """Unmap the file (touched pages leave the process); the next read maps it again."""
        h, self._handle = self._handle, None
        if h is not None:
            h.__exit__(None, None, None)
        self._map = None  # unmapped once the last view of it is gone

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
        index_path = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
        if index_path.exists():
            self._load_index(index_path)
        elif single.exists():
            require_inside(single, self.folder, CheckpointError)
            f = SafetensorsFile(single)
            self._files[SINGLE_NAME] = f
            for n in f.names():
                self._where[n] = f
        else:
            raise _err(f"{self.folder}: neither {SINGLE_NAME} nor {INDEX_NAME} found")

    def _load_index(self, index_path: Path) -> None:
        require_inside(index_path, self.folder, CheckpointError)
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _err(f"{index_path}: not valid JSON: {e}") from None
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise _err(f"{index_path}: no 'weight_map' object")
        if not all(isinstance(v, str) for v in index["weight_map"].values()):
            raise _err(f"{index_path}: every 'weight_map' value must be a shard file name")
        weight_map: dict[str, str] = index["weight_map"]
        for fname in sorted(set(weight_map.values())):
            if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise _err(f"{index_path}: bad shard file name {fname!r}")
            p = self.folder / fname
            require_inside(p, self.folder, CheckpointError)
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

    def raw(self, name: str, index: tuple[Any, ...] | None = None) -> np.ndarray:
        return self._file(name).raw(name, index)

    def view(self, name: str, index: tuple[Any, ...] | None = None) -> np.ndarray:
        return self._file(name).view(name, index)

    def read_f32(self, name: str) -> np.ndarray:
        return self._file(name).read_f32(name)

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
    """(array, dtype string) or a bare array -> a contiguous array in the dtype's storage dtype."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"tensor {name!r}: expected (array, dtype_str)")
        arr, dt = np.asarray(value[0]), value[1]
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
        if not (arr.dtype.kind == want.kind or (arr.dtype.kind in "iu" and want.kind in "iu")):
            raise ValueError(f"tensor {name!r}: array dtype {arr.dtype} does not match {dt}")
        arr = arr.astype(want)
    return np.ascontiguousarray(arr), dt


def _atomic(path: str | os.PathLike, write: Callable[[int, str], None]) -> None:
    """write(fd, tmp) fills a temporary file next to path, then it is renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        write(fd, tmp)
        umask = os.umask(0)  # mkstemp (and save_file) make the file 0600; give it the usual mode
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, tuple[np.ndarray, str] | np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (name -> (array, dtype_str), or a bare array) to ``path`` with
    ``safetensors.numpy.save_file``, through a temporary file renamed into place.

    bf16 tensors are given as uint16 bit patterns with dtype "BF16" (float arrays with
    "BF16" are rounded to bf16). The library orders the tensors in the file (by alignment,
    then name).
    """
    arrays = {}
    for name, value in tensors.items():
        arr, dt = _prepare(name, value)
        arrays[name] = arr.view(ml_dtypes.bfloat16) if dt == "BF16" else arr
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None

    def write(fd: int, tmp: str) -> None:
        os.close(fd)
        save_file(arrays, tmp, metadata=meta)

    _atomic(path, write)


def write_safetensors_lazy(
    path: str | os.PathLike,
    specs: Iterable[tuple[str, Sequence[int], str, Callable[[], np.ndarray]]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Like ``write_safetensors``, but each tensor is produced on demand.

    ``specs`` lists ``(name, shape, dtype_str, producer)``; the header is written from
    the shapes, then each producer is called in turn and its array (checked against the
    declared shape, converted as in ``write_safetensors``) streamed to the file, so at
    most one tensor is held in memory. Tensors are written in the given order.

    Our own writer of the format (8-byte little-endian header length, JSON header padded
    to 8 bytes, data in header order), because the library's writers (save_file,
    serialize_file) take every tensor at once: write_checkpoint makes synthetic checkpoints
    (1 GB for the small preset) tensor by tensor. The tests read its files with the library.
    """
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
        n = DTYPES[dt].itemsize * math.prod(int(d) for d in shape)
        header[name] = {"dtype": dt, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)

    def write(fd: int, tmp: str) -> None:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(hbytes)) + hbytes)
            for name, shape, dt, producer in specs:
                arr, _ = _prepare(name, (producer(), dt))
                if tuple(arr.shape) != tuple(int(d) for d in shape):
                    raise ValueError(f"tensor {name!r}: producer gave shape {arr.shape}, declared {tuple(shape)}")
                if arr.nbytes:
                    f.write(memoryview(arr.reshape(-1)).cast("B"))
                del arr

    _atomic(path, write)
