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
from pathlib import Path
from typing import Any

from clover_gguf.files import check_output, clean_stale_temps, require_regular, split_gguf_files, temp_path
from clover_gguf.quant import (NEEDS_IMATRIX, QUANT_TYPES, UNQUANTIZED_FTYPES, QuantizeError, check_imatrix,
                               load_imatrix, parse_quant_type)
from clover_gguf.reader import GGUFInfoError, check_clover_gguf

from ._lib import import_llama_cpp, llama_lib_path

__all__ = ["QUANT_TYPES", "quantize", "QuantizeError", "parse_quant_type", "quantize_params", "StreamQuantizer",
           "loader_refuses"]

#: the most quantizer threads accepted (llama.cpp starts that many; 100000 made it abort)
MAX_THREADS = max(256, os.cpu_count() or 1)


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


def _die_with_parent() -> None:
    """In the quantizer child (Linux): SIGKILL when the parent dies, so a killed `clover quantize`
    leaves no orphan writing its temporary file."""
    import signal as _signal
    ctypes.CDLL(None, use_errno=True).prctl(1, int(_signal.SIGKILL))  # PR_SET_PDEATHSIG


_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def quantize_params(llama_cpp: Any, ftype: int, *, n_threads: int = 0, allow_requantize: bool = False,
                    leave_output_tensor: bool = False, pure: bool = False,
                    imatrix: str | os.PathLike[str] | None = None) -> tuple[Any, list[Any]]:
    """llama_model_quantize's parameters as `clover quantize` sets them (also StreamQuantizer's):
    (params, what the pointers in params refer to, to be kept alive until the call returns)."""
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


#: the byte-range callback of llama_model_quantize_from (patch 0008): (user data, tensor name,
#: offset, size, where to write) -> whether the bytes were written
_READ_FN = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                            ctypes.c_void_p)


class StreamQuantizer:
    """llama.cpp's quantizer on a GGUF header whose tensor data comes from a callback
    (``llama_model_quantize_from``, patch 0008), with `clover quantize`'s parameters: the
    one-pass quantizing convert (clover_convert.quantize_stream) gives it the bf16 file's header
    and makes each byte range it asks for. QuantizeError when this libllama lacks the patch."""

    def __init__(self, ftype: int, *, max_buf_size: int, n_threads: int = 0, leave_output_tensor: bool = False,
                 pure: bool = False, imatrix: str | os.PathLike[str] | None = None) -> None:
        llama_cpp = import_llama_cpp()
        lib = ctypes.CDLL(str(llama_lib_path()))
        if not hasattr(lib, "llama_model_quantize_from"):
            raise QuantizeError("this libllama lacks llama_model_quantize_from (patch 0008): rebuild clover-cpp")
        self._fn = lib.llama_model_quantize_from
        self._fn.restype = ctypes.c_uint32
        self._fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(llama_cpp.llama_model_quantize_params),
                             _READ_FN, ctypes.c_void_p]
        self._params, self._keep = quantize_params(llama_cpp, ftype, n_threads=n_threads,
                                                   leave_output_tensor=leave_output_tensor, pure=pure, imatrix=imatrix)
        self._params.max_buf_size = max_buf_size

    def run(self, header: Path, out: Path, read: Callable[[str, int, int, int], bool]) -> int:
        """Quantize the model of header into out; ``read(tensor, offset, size, address)`` writes
        each byte range of the tensor data the quantizer asks for and says whether it could.
        Returns llama.cpp's status (0: written). Runs once."""
        cb = _READ_FN(lambda _ud, name, offs, size, ptr: read(name.decode(), offs, size, ptr))
        try:
            return self._fn(os.fsencode(header), os.fsencode(out), ctypes.byref(self._params), cb, None)
        finally:
            self._keep = []  # the importance data the parameters pointed to


def _child_main() -> None:
    """The quantizer process: llama_model_quantize with llama.cpp's log on stderr (progress)."""
    a = json.loads(sys.argv[1])
    from .model import set_verbosity

    set_verbosity(2)
    llama_cpp = import_llama_cpp()
    params, keep = quantize_params(llama_cpp, a["ftype"], n_threads=a["n_threads"], allow_requantize=a["allow_requantize"],
                                   leave_output_tensor=a["leave_output_tensor"], pure=a["pure"], imatrix=a["imatrix"])
    why = loader_refuses(a["src"])
    if why is not None:  # never turn a file `clover run` refuses into one it might not
        print(f"{_REFUSED}input: {why}", file=sys.stderr, flush=True)
        os._exit(1)
    rc = llama_cpp.llama_model_quantize(os.fsencode(a["src"]), os.fsencode(a["dst"]), ctypes.byref(params))
    if rc == 0:
        why = loader_refuses(a["dst"])
        if why is not None:
            print(f"{_REFUSED}output: {why}", file=sys.stderr, flush=True)
            os._exit(1)
    sys.stderr.flush()
    os._exit(0 if rc == 0 else 1)


_REFUSED = "clover-quantize: the loader refuses the "


def loader_refuses(path: str) -> str | None:
    """libclover's own loader on path (memory-mapped: nothing is read but the header and the
    checks): its one-line reason when it refuses the file, else None."""
    from . import _native as N

    mp = N.clover_model_default_params()
    mp.use_mmap = 1
    err, n = N.err_buffer()
    m = N.clover_model_load(os.fsencode(path), ctypes.byref(mp), err, n)
    if not m:
        return " ".join((err.value or b"load failed").decode("utf-8", "replace").split())
    N.clover_model_free(m)
    return None
