"""Locating the native libraries (build/bin) and importing llama-cpp-python against them.

Two native libraries are involved:

* ``libclover`` (our block-diffusion decoding API), loaded by :mod:`clover_cpp._native`;
* ``libllama`` (the patched llama.cpp with the ``clover`` architecture). libclover links it;
  llama-cpp-python's low-level ``llama_cpp`` module loads it by path from the environment
  variable ``LLAMA_CPP_LIB_PATH``, which therefore has to be set *before* ``llama_cpp`` is
  imported. :func:`configure_llama_cpp_env` does that (it runs when ``clover_cpp`` is
  imported, and leaves an existing setting alone); :func:`import_llama_cpp` imports the module.

Importing ``llama_cpp`` installs llama-cpp-python's own log callback in libllama, which would
replace libclover's (libclover keeps llama.cpp's error lines for its error messages), so
:func:`import_llama_cpp` saves the callback in place before the import and restores it after.
A user's own ``import llama_cpp`` after libclover started is kept the same way (:class:`_KeepLog`,
a finder on ``sys.meta_path``): llama-cpp-python's callback would print every line of llama.cpp's
log, debug lines included (a few per block), until a ``Llama`` sets its logger from ``verbose``,
and its levels predate this ggml's (it would print warnings and hide errors). So in a process
that uses clover_cpp, libllama logs at Clover's verbosity (:func:`clover_cpp.set_verbosity`),
``Llama``'s log included.

``import llama_cpp`` before ``clover_cpp``: packaging/_clover_cpp_llama.py, installed beside the
packages, imports clover_cpp first.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["repo_root", "native_lib_dir", "configure_llama_cpp_env", "import_llama_cpp", "llama_lib_path"]

_LLAMA_NAMES = {"darwin": "libllama.dylib", "win32": "llama.dll"}
_lock = threading.Lock()
_llama_cpp: ModuleType | None = None


def repo_root() -> Path:
    """The source checkout root (the folder that holds clover_cpp/)."""
    return Path(__file__).resolve().parent.parent


def _llama_name() -> str:
    return _LLAMA_NAMES.get(sys.platform, "libllama.so")


def native_lib_dir() -> Path | None:
    """The folder holding our patched libllama (and libclover), or None if not found: the first
    of :func:`clover_cpp._native.lib_dirs` that has it."""
    from ._native import lib_dirs

    return next((d for d in lib_dirs() if (d / _llama_name()).is_file()), None)


def configure_llama_cpp_env() -> str | None:
    """Set ``LLAMA_CPP_LIB_PATH`` to our build folder unless it is already set; returns the value."""
    cur = os.environ.get("LLAMA_CPP_LIB_PATH")
    if cur:
        return cur
    d = native_lib_dir()
    if d is not None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(d)
        return str(d)
    return None


def llama_lib_path() -> Path | None:
    d = os.environ.get("LLAMA_CPP_LIB_PATH") or configure_llama_cpp_env()
    if not d:
        return None
    p = Path(d) / _llama_name()
    return p if p.is_file() else None


_LOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _raw_llama() -> ctypes.CDLL | None:
    p = llama_lib_path()
    if p is None:
        return None
    try:
        L = ctypes.CDLL(str(p))
        L.llama_log_get.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        L.llama_log_get.restype = None
        L.llama_log_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        L.llama_log_set.restype = None
        return L
    except (OSError, AttributeError):
        return None


def get_log_callback() -> tuple[int | None, int | None] | None:
    """The (callback, user_data) pointers installed in libllama now, or None if unavailable."""
    L = _raw_llama()
    if L is None:
        return None
    cb, ud = ctypes.c_void_p(), ctypes.c_void_p()
    L.llama_log_get(ctypes.byref(cb), ctypes.byref(ud))
    return cb.value, ud.value


def set_log_callback(saved: tuple[int | None, int | None] | None) -> None:
    L = _raw_llama()
    if L is None or saved is None:
        return
    L.llama_log_set(saved[0], saved[1])


def import_llama_cpp() -> ModuleType:
    """Import llama-cpp-python's ``llama_cpp`` against our libllama (once), keeping libclover's
    log callback. Raises ImportError with a clear message when that is not possible."""
    global _llama_cpp
    with _lock:
        if _llama_cpp is not None:
            return _llama_cpp
        configure_llama_cpp_env()
        saved = None
        try:  # make libclover install its callback first, then remember it
            from . import _native

            _native.clover_model_default_params()
            from .errors import current_verbosity

            _native.clover_set_verbosity(current_verbosity())
            saved = get_log_callback()
        except Exception:  # noqa: BLE001 - libclover is optional for llama_cpp users
            saved = None
        try:
            import llama_cpp  # noqa: PLC0415
        except ModuleNotFoundError as e:
            if e.name != "llama_cpp":
                raise
            # its Python layer only: it loads clover's libllama, so skip its own native build
            raise ImportError("llama-cpp-python is not installed; install its Python layer with "
                              "CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install 'clover-cpp[quantize]' "
                              "(it then uses clover's libllama)") from e
        except (ImportError, OSError, FileNotFoundError, RuntimeError) as e:
            raise ImportError(
                f"cannot import llama_cpp (llama-cpp-python) with LLAMA_CPP_LIB_PATH="
                f"{os.environ.get('LLAMA_CPP_LIB_PATH')!r}: {e}") from e
        finally:
            if saved is not None and saved[0]:
                set_log_callback(saved)
        _llama_cpp = llama_cpp
        return llama_cpp


class _KeepingLoader(importlib.abc.Loader):
    """llama_cpp's own loader, but libclover's log callback, if installed, is put back after the
    package has run (its _logger module installs llama-cpp-python's callback)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        saved = get_log_callback()
        try:
            self.loader.exec_module(module)
        finally:
            if saved is not None and saved[0]:
                set_log_callback(saved)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.loader, name)  # resources and the rest, as the loader has them


class _KeepLog(importlib.abc.MetaPathFinder):
    """On llama_cpp's first import (anyone's), its spec from the other finders, with _KeepingLoader."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "llama_cpp":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _KeepingLoader(spec.loader)
        return spec


configure_llama_cpp_env()
if "llama_cpp" not in sys.modules:
    sys.meta_path.insert(0, _KeepLog())
