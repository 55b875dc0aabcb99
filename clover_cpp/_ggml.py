"""Low-level ctypes declarations for what Clover reads of ggml and of the patched libllama
beside clover.h (``_native``): ``struct ggml_tensor``, the scheduler's eval-callback type,
``llama_set_default_eval_callback`` (patch 0008) and the few ggml functions the callbacks use.

The functions are looked up through libclover's handle (dlsym searches its dependencies), so a
callback is installed in the very libllama that creates Clover's contexts, never in another
copy found by path. ggml has no ABI query, so ``lib()`` checks the mirror at first use against
the loaded ggml itself: ``ggml_tensor_overhead()`` must be the size the mirror implies, and
tensors built by ggml must read back through the mirror as through ggml's own accessors
(``CloverLibraryMismatch`` names the first field that does not).
"""
from __future__ import annotations

import ctypes
import math
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_int, c_int32, c_int64, c_size_t,
                    c_void_p)
from typing import Any

import numpy as np

from ._native import CloverLibraryMismatch
from ._native import lib as _libclover

__all__ = ["GGML_TYPE_F32", "GGML_TYPE_I32", "GGML_OP_ADD", "ggml_tensor", "ggml_object", "ggml_init_params",
           "ggml_backend_sched_eval_callback", "mirror_mismatches", "lib", "set_default_eval_callback",
           "tensor_array"]

# ggml.h of the pinned tree
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_OP_ADD = 2


class ggml_tensor(Structure):
    pass


ggml_tensor._fields_ = [
    ("type", c_int),
    ("buffer", c_void_p),
    ("ne", c_int64 * GGML_MAX_DIMS),
    ("nb", c_size_t * GGML_MAX_DIMS),
    ("op", c_int),
    ("op_params", c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", c_int32),
    ("src", POINTER(ggml_tensor) * GGML_MAX_SRC),
    ("view_src", POINTER(ggml_tensor)),
    ("view_offs", c_size_t),
    ("data", c_void_p),
    ("name", c_char * GGML_MAX_NAME),
    ("extra", c_void_p),
    ("padding", c_char * 8),
]


class ggml_object(Structure):
    """ggml.c's private header of every object in a context: only its size is used (the check:
    ggml_tensor_overhead() = sizeof(ggml_object) + sizeof(ggml_tensor))."""
    _fields_ = [("offs", c_size_t), ("size", c_size_t), ("next", c_void_p), ("type", c_int), ("padding", c_char * 4)]


class ggml_init_params(Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


# bool (*)(struct ggml_tensor * t, bool ask, void * user_data)  (ggml-backend.h)
ggml_backend_sched_eval_callback = CFUNCTYPE(c_bool, POINTER(ggml_tensor), c_bool, c_void_p)

_tensor_p = c_void_p  # struct ggml_tensor * as an address: the check reads it through any mirror
_DECLS: dict[str, tuple[list[Any], Any]] = {
    "llama_set_default_eval_callback": ([c_void_p, c_void_p], None),
    "ggml_op_name": ([c_int], c_char_p),
    "ggml_op_desc": ([_tensor_p], c_char_p),
    "ggml_nbytes": ([_tensor_p], c_size_t),
    "ggml_backend_tensor_get": ([_tensor_p, c_void_p, c_size_t, c_size_t], None),
    "ggml_tensor_overhead": ([], c_size_t),
    "ggml_init": ([ggml_init_params], c_void_p),
    "ggml_free": ([c_void_p], None),
    "ggml_new_tensor_2d": ([c_void_p, c_int, c_int64, c_int64], _tensor_p),
    "ggml_set_name": ([_tensor_p, c_char_p], _tensor_p),
    "ggml_get_name": ([_tensor_p], c_char_p),
    "ggml_get_data": ([_tensor_p], c_void_p),
    "ggml_nelements": ([_tensor_p], c_int64),
    "ggml_type_size": ([c_int], c_size_t),
    "ggml_row_size": ([c_int, c_int64], c_size_t),
    "ggml_add": ([c_void_p, _tensor_p, _tensor_p], _tensor_p),
    "ggml_view_1d": ([c_void_p, _tensor_p, c_int64, c_size_t], _tensor_p),
}


def _declared() -> ctypes.CDLL:
    """libclover's handle in a CDLL of its own (these signatures stay off _native's functions)."""
    clover = _libclover()
    L = ctypes.CDLL(clover._name, handle=clover._handle)
    for name, (argtypes, restype) in _DECLS.items():
        if not hasattr(L, name):
            raise CloverLibraryMismatch(f"the libllama / ggml that libclover at {clover._name} links lack {name} "
                                        "(patch 0008): rebuild it (./dev.sh build) or reinstall clover-cpp")
        f = getattr(L, name)
        f.argtypes, f.restype = argtypes, restype
    return L


def _address(p: Any) -> int | None:
    return ctypes.cast(p, c_void_p).value


def mirror_mismatches(L: ctypes.CDLL, tensor: type | None = None) -> list[str]:
    """How ``tensor`` (a mirror of struct ggml_tensor; default ggml_tensor, read at the call)
    reads tensors that ggml built (a named 2-D tensor, an ADD of two, a view) differently from
    ggml's accessors, then whether ggml_tensor_overhead() is the size it implies; [] = none."""
    tensor = ggml_tensor if tensor is None else tensor
    ne0, ne1, typ, name = 7, 5, GGML_TYPE_I32, b"clover-mirror-check"
    mem = 8 * L.ggml_tensor_overhead() + 4 * ne0 * ne1 * 8
    ctx = L.ggml_init(ggml_init_params(mem, None, False))
    if not ctx:
        return ["ggml_init failed"]
    try:
        a = L.ggml_set_name(L.ggml_new_tensor_2d(ctx, typ, ne0, ne1), name)
        b = L.ggml_new_tensor_2d(ctx, typ, ne0, ne1)
        s = L.ggml_add(ctx, a, b)
        offs = 2 * L.ggml_type_size(typ)
        v = L.ggml_view_1d(ctx, a, 3, offs)
        ta, ts, tv = (ctypes.cast(p, POINTER(tensor)).contents for p in (a, s, v))
        nb0, nb1 = L.ggml_type_size(typ), L.ggml_row_size(typ, ne0)
        checks = [  # (what, through ggml, through the mirror)
            ("ggml_tensor.type", typ, ta.type),
            ("ggml_tensor.ne", (ne0, ne1, 1, 1), tuple(ta.ne)),
            ("ggml_tensor.ne", L.ggml_nelements(a), math.prod(ta.ne)),
            ("ggml_tensor.nb", (nb0, nb1, nb1 * ne1, nb1 * ne1), tuple(ta.nb)),
            ("ggml_tensor.op", GGML_OP_ADD, ts.op),
            ("GGML_OP_ADD", L.ggml_op_desc(s), L.ggml_op_name(GGML_OP_ADD)),
            ("ggml_tensor.src", (a, b), (_address(ts.src[0]), _address(ts.src[1]))),
            ("ggml_tensor.view_src", a, _address(tv.view_src)),
            ("ggml_tensor.view_offs", offs, tv.view_offs),
            ("ggml_tensor.data", L.ggml_get_data(a), ta.data),
            ("ggml_tensor.name", L.ggml_get_name(a), ta.name),
        ]
        out = [f"{what} = {lib_v!r} in the library, {mine!r} here"
               for what, lib_v, mine in checks if lib_v != mine]
    finally:
        L.ggml_free(ctx)
    mine = ctypes.sizeof(ggml_object) + ctypes.sizeof(tensor)
    if L.ggml_tensor_overhead() != mine:
        out.append(f"ggml_tensor_overhead() = {L.ggml_tensor_overhead()} in the library, "
                   f"sizeof(ggml_object) + sizeof(ggml_tensor) = {mine} here")
    return out


def _check(L: ctypes.CDLL) -> None:
    bad = mirror_mismatches(L)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CloverLibraryMismatch(f"the ggml that libclover at {L._name} links does not match clover_cpp's "
                                    f"mirror of struct ggml_tensor: {bad[0]}{more}; rebuild it (./dev.sh build) "
                                    "or reinstall clover-cpp")


_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    """The declared functions, the mirror checked against the loaded ggml (once)."""
    global _lib
    if _lib is None:
        L = _declared()
        _check(L)
        _lib = L
    return _lib


def set_default_eval_callback(cb: Any | None) -> None:
    """llama.cpp's default eval callback of every context created from now on (patch 0008:
    libclover's contexts set none), a ggml_backend_sched_eval_callback kept alive by the
    caller; None removes it."""
    lib().llama_set_default_eval_callback(ctypes.cast(cb, c_void_p) if cb is not None else None, None)


def tensor_array(t: ggml_tensor) -> np.ndarray:
    """A tensor's data (f32, else i32) copied from its backend (any device, any strides), as a
    numpy array in ggml's index order reversed ([ne3, ne2, ne1, ne0])."""
    L = lib()
    nbytes = L.ggml_nbytes(ctypes.addressof(t))
    buf = np.empty(nbytes, np.uint8)
    L.ggml_backend_tensor_get(ctypes.addressof(t), buf.ctypes.data, 0, nbytes)
    dt = np.float32 if t.type == GGML_TYPE_F32 else np.int32
    return np.lib.stride_tricks.as_strided(buf.view(dt), shape=tuple(t.ne[i] for i in (3, 2, 1, 0)),
                                           strides=tuple(t.nb[i] for i in (3, 2, 1, 0)))
