"""Who owns what in libclover: the loaded model (:class:`ModelRef`, shared by the Clover objects
of :meth:`Clover.new_context`, freed with its last user), a context (:class:`ContextRef`: its
pointer, its error buffers and the hop onto its decode thread), one object's turn on its context
(:class:`Gate`), the model's and context's creation from checked arguments (:class:`LoadArgs`,
:class:`ContextArgs`), and the calls that negotiate an output buffer size with libclover
(tokenize, detokenize, token_to_piece, metadata). The runtime's helpers take these objects; the
raw pointers are read from them at the ctypes calls only."""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from . import _native as N
from ._args import INT32_MAX, MAX_THREADS, bool_arg, float_arg, int32_arg, int_arg, tristate_arg
from .errors import CloverError, CloverTypeError, CloverValueError, check


#: the Python spelling of "B chosen per block" (clover.h: CLOVER_BLOCK_SIZE_AUTO); None means it too
BLOCK_SIZE_AUTO = "auto"


def is_auto(block_size: Any) -> bool:
    """block_size None or "auto": chosen per block."""
    return block_size is None or (isinstance(block_size, str) and block_size == BLOCK_SIZE_AUTO)


@dataclass(frozen=True)
class LoadArgs:
    """clover_model_params, checked (:meth:`of`)."""

    n_gpu_layers: int = 0
    use_mmap: bool | None = None
    rpc_servers: str | None = None
    tensor_split: tuple[float, ...] = ()
    override_tensor: str | None = None
    use_mlock: bool = False

    @classmethod
    def of(cls, n_gpu_layers: Any, use_mmap: Any, rpc_servers: Any, tensor_split: Any,
           override_tensor: Any, use_mlock: Any = False) -> "LoadArgs":
        n_gpu_layers = int_arg("n_gpu_layers", n_gpu_layers, -1, INT32_MAX)
        if isinstance(rpc_servers, (list, tuple)):
            if not all(isinstance(x, str) for x in rpc_servers):
                raise CloverTypeError(f"rpc_servers must be 'HOST:PORT[,...]' or a list of them, got {rpc_servers!r}")
            rpc_servers = ",".join(rpc_servers)
        if rpc_servers is not None and not isinstance(rpc_servers, str):
            raise CloverTypeError(f"rpc_servers must be 'HOST:PORT[,...]' or a list of them, got {rpc_servers!r}")
        if tensor_split is not None and (isinstance(tensor_split, (str, bytes)) or
                                         not isinstance(tensor_split, (Sequence, np.ndarray))):
            raise CloverTypeError(f"tensor_split must be a list of numbers, got {tensor_split!r}")
        split = [float_arg("tensor_split", x) for x in tensor_split] if tensor_split is not None else []
        if any(not (0.0 <= x < math.inf) for x in split) or len(split) > 128:
            raise CloverValueError(f"tensor_split must be at most 128 finite shares >= 0, got {split}")
        if override_tensor is not None and not isinstance(override_tensor, str):
            raise CloverTypeError(f"override_tensor must be 'PATTERN=BUFFER[,...]', got {override_tensor!r}")
        for name, v in (("rpc_servers", rpc_servers), ("override_tensor", override_tensor)):
            if v is not None and "\0" in v:
                raise CloverValueError(f"{name} must not contain a NUL character")
        return cls(n_gpu_layers, None if use_mmap is None else bool_arg("use_mmap", use_mmap), rpc_servers or None,
                   tuple(split), override_tensor or None, bool_arg("use_mlock", use_mlock))


@dataclass(frozen=True)
class ContextArgs:
    """clover_context_params as the caller gave them; :meth:`checked` checks them."""

    n_ctx: int = 4096
    n_threads: int | None = None
    block_size: int | str | None = None
    flash_attn: bool | str | None = None
    kv_f32: bool = False
    expert_stats: bool = False  # count the block passes' routed experts (GenerationStats.experts_per_pass)

    def checked(self) -> tuple[int, int | None, int | None, int, bool]:
        """n_ctx, n_threads, the block size (None = auto), flash_attn (-1/0/1), kv_f32: their types
        and C widths here (a block size is an int >= 1 or auto), their ranges libclover's
        (clover_context_params_check: its message, ``param`` the argument refused)."""
        n_ctx = int32_arg("n_ctx", self.n_ctx)
        n_threads = None if self.n_threads is None else int_arg("n_threads", self.n_threads, 1, MAX_THREADS)
        fa, kv = tristate_arg("flash_attn", self.flash_attn), bool_arg("kv_f32", self.kv_f32)
        bool_arg("expert_stats", self.expert_stats)
        bs = None if is_auto(self.block_size) else int_arg("block_size", self.block_size, 1, INT32_MAX)
        cp = context_params(n_ctx, n_threads, bs, fa, kv)
        problem = N.context_params_problem(cp)
        if problem is not None:
            # the argument to blame: the first whose default changes the verdict (block_size before
            # n_ctx: "block size must be in [1, n_ctx]" is the block size's)
            default = N.clover_context_default_params()
            for f in ("block_size", "flash_attn", "n_ctx"):
                trial = type(cp).from_buffer_copy(cp)
                setattr(trial, f, getattr(default, f))
                if N.context_params_problem(trial) != problem:
                    raise CloverValueError(problem, param=f)
            raise CloverValueError(problem)
        return n_ctx, n_threads, bs, fa, kv


def context_params(n_ctx: int, n_threads: int | None, block_size: int | None, flash_attn: int,
                   kv_f32: bool) -> N.clover_context_params:
    """clover_context_params of checked arguments (block_size None = CLOVER_BLOCK_SIZE_TRAIN)."""
    cp = N.clover_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_threads = n_threads if n_threads is not None else 0
    cp.block_size = block_size if block_size is not None else N.CLOVER_BLOCK_SIZE_TRAIN
    cp.flash_attn = flash_attn
    cp.kv_f32 = 1 if kv_f32 else 0  # (the struct matches clover.h: _native checks it at load)
    return cp


def check_model_path(path: Path) -> None:
    if "\0" in str(path):
        raise CloverValueError("model_path must not contain a NUL character")
    if not path.exists():
        raise CloverError(f"{path}: no such file", N.CLOVER_ERR_LOAD)
    if path.is_dir():
        raise CloverError(f"{path}: is a folder, not a GGUF file", N.CLOVER_ERR_LOAD)


class ModelRef:
    """A loaded clover_model shared by the Clover objects made with :meth:`Clover.new_context`;
    freed when the last of them closes, once no call is using it (``use``). Its constant
    figures are read once at load."""

    def __init__(self, handle: int) -> None:
        self.handle: int | None = handle
        self.users = 1
        self.active = 0
        self.cond = threading.Condition()
        self.n_vocab = int(N.clover_n_vocab(handle))
        self.mask = int(N.clover_mask_token(handle))
        self.eos = int(N.clover_eos_token(handle))
        self.bos = int(N.clover_bos_token(handle))
        self.train_block = int(N.clover_train_block_size(handle))
        self.n_ctx_train = int(N.clover_n_ctx_train(handle))

    @classmethod
    def load(cls, path: Path, a: LoadArgs) -> "ModelRef":
        mp = N.clover_model_default_params()
        mp.n_gpu_layers = a.n_gpu_layers
        if a.use_mmap is not None:
            mp.use_mmap = 1 if a.use_mmap else 0
        mp.use_mlock = 1 if a.use_mlock else 0
        if a.rpc_servers:
            mp.rpc_servers = a.rpc_servers.encode()
        if a.override_tensor:
            mp.tensor_overrides = a.override_tensor.encode()
        split = (ctypes.c_float * max(1, len(a.tensor_split)))(*a.tensor_split)
        mp.tensor_split = split
        mp.n_tensor_split = len(a.tensor_split)
        err, n = N.err_buffer()
        m = N.clover_model_load(os.fsencode(path), ctypes.byref(mp), err, n)
        if not m:
            check(N.CLOVER_ERR_LOAD, err)
        return cls(m)

    def acquire(self) -> None:
        with self.cond:
            if self.handle is None:
                raise CloverError("the model is closed")
            self.users += 1

    def enter(self) -> None:
        with self.cond:
            if self.handle is None:
                raise CloverError("the model is closed")
            self.active += 1

    def leave(self) -> None:
        with self.cond:
            self.active -= 1
            if self.active == 0:
                self.cond.notify_all()

    def release(self) -> None:
        with self.cond:
            self.users -= 1
            if self.users == 0 and self.handle is not None:
                while self.active > 0:  # a tokenize (say) in another thread: it ends first
                    self.cond.wait(0.25)
                if N._lib is not None:
                    N.clover_model_free(self.handle)
                self.handle = None


class DecodeHop(Protocol):
    """The thread a context's long calls run on (decoding.DecodeThread)."""

    def call(self, fn: Callable[[], Any], cancel: threading.Event | None = None) -> Any: ...

    def stop(self) -> None: ...


class ContextRef:
    """A clover_context: the pointer, the error buffer of each checked call and the decode
    thread its long calls hop onto (``own_thread``: one of its own, stopped with it, else the
    process's shared one)."""

    def __init__(self, ptr: int, decoder: DecodeHop, own_thread: bool) -> None:
        self.ptr: int | None = ptr
        self.decoder = decoder
        self.own_thread = own_thread

    @classmethod
    def new(cls, model: ModelRef, a: ContextArgs, decoder: DecodeHop, own_thread: bool) -> "ContextRef":
        """A context over ``model`` (a failure raises, after stopping a thread of its own)."""
        try:
            cp = context_params(*a.checked())
            cp.expert_stats = 1 if a.expert_stats else 0
            err, n = N.err_buffer()
            c = N.clover_context_new(model.handle, ctypes.byref(cp), err, n)
            if not c:
                check(N.CLOVER_ERR_LOAD, err)
        except BaseException:
            if own_thread:
                decoder.stop()
            raise
        return cls(int(c), decoder, own_thread)

    def call(self, fn: Callable[[], Any], cancel: threading.Event | None = None) -> Any:
        """fn() on the decode thread (llama.cpp's threads stay on one OS thread per context)."""
        return self.decoder.call(fn, cancel)

    def checked(self, f: Callable[..., int], *args: Any, hop: bool = False, what: str = "") -> None:
        """f(ptr, *args, err, err_len), a clover.h call ending with an error buffer, on the decode
        thread when ``hop``; a status other than CLOVER_OK raises its CloverError."""
        err, n = N.err_buffer()
        status = self.call(lambda: f(self.ptr, *args, err, n)) if hop else f(self.ptr, *args, err, n)
        check(status, err, what)

    def free(self) -> None:
        if self.own_thread:
            self.decoder.stop()
        if self.ptr and N._lib is not None:  # (not at interpreter exit after the library went)
            N.clover_context_free(self.ptr)
        self.ptr = None


#: one Clover object's turn on its context: ``with turn() as ctx:`` waits for it (see the Clover
#: class doc) and yields the :class:`ContextRef`; the helpers that run on a context take it
Turn = Callable[[], AbstractContextManager[ContextRef]]


class Decoding(Protocol):
    """What a Gate hands its hold to: a generation decoding on its own thread
    (decoding.GenerationStream), cancelled by its event."""

    _cancel: threading.Event


@dataclass(eq=False)
class Gate:
    """Serialises the calls on one Clover object's context (see the Clover class doc).

    ``holder`` is the thread (ident) in a call, or the :class:`GenerationStream` decoding; a
    thread may enter again while it holds it (nested calls); others wait, interruptibly. After
    ``closed`` every entry raises "the model is closed". ``cancel`` is the event that cancels
    the generation in flight (set by close)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    holder: Any = None
    depth: int = 0
    closed: bool = False
    cancel: threading.Event | None = None

    def enter(self) -> None:
        me = threading.get_ident()
        with self.cond:
            while True:
                if self.closed:
                    raise CloverError("the model is closed")
                if self.holder is None:
                    self.holder, self.depth = me, 1
                    return
                if self.holder == me:
                    self.depth += 1
                    return
                self.cond.wait(0.25)  # (a timeout: Ctrl-C is seen)

    def leave(self) -> None:
        with self.cond:
            self.depth -= 1
            if self.depth <= 0:
                self.holder, self.depth, self.cancel = None, 0, None
                self.cond.notify_all()

    def hand_to(self, stream: Decoding) -> None:
        """The calling thread's hold passes to a stream (released when its decoding ends)."""
        with self.cond:
            self.holder, self.depth, self.cancel = stream, 1, stream._cancel

    def release(self, stream: Decoding) -> None:
        with self.cond:
            if self.holder is stream:
                self.holder, self.depth, self.cancel = None, 0, None
                self.cond.notify_all()

    def busy(self) -> bool:
        return self.holder is not None and self.holder != threading.get_ident()

    def close(self) -> None:
        """Closed for good: cancel the call in flight, wait for it, then hold the gate (the
        caller frees what it guards and calls :meth:`leave`)."""
        me = threading.get_ident()
        with self.cond:
            self.closed = True  # new calls, and those waiting, raise "the model is closed"
            while self.holder is not None and self.holder != me:
                if self.cancel is not None:  # (also a call that entered just before close)
                    self.cancel.set()
                self.cond.wait(0.25)
            if self.holder is None:
                self.holder, self.depth = me, 1  # nobody enters again: closed
            else:
                self.depth += 1


# ----------------------------------------------------------------------------- buffer negotiation

def _negotiate(what: str, cap: int, call: Any) -> Any:
    """call(cap) -> (status, n_out, result of n_out): once more with the size libclover asked
    for when the first buffer was too small."""
    for _ in range(2):
        st, n_out, take = call(cap)
        if st == N.CLOVER_ERR_BUFFER_TOO_SMALL:
            cap = n_out + 1
            continue
        check(st, None, what)
        return take(n_out)
    raise CloverError(f"{what}: buffer size negotiation failed", N.CLOVER_ERR_INTERNAL)


def tokenize(model: ModelRef, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
    def call(cap: int) -> Any:
        buf, n_out = (ctypes.c_int32 * cap)(), ctypes.c_int32(0)
        st = N.clover_tokenize(model.handle, data, len(data), buf, cap, int(add_special), int(parse_special),
                               ctypes.byref(n_out))
        return st, n_out.value, lambda k: list(buf[:k])
    return _negotiate("tokenize", len(data) + 16, call)


def detokenize(model: ModelRef, toks: list[int], special: bool) -> bytes:
    arr = N.as_int32_array(toks)

    def call(cap: int) -> Any:
        buf, n_out = ctypes.create_string_buffer(cap), ctypes.c_int32(0)
        st = N.clover_detokenize(model.handle, arr, len(toks), buf, cap, 0, int(special), ctypes.byref(n_out))
        return st, n_out.value, lambda k: buf.raw[:k]
    return _negotiate("detokenize", 8 * len(toks) + 16, call)


def token_to_piece(model: ModelRef, token: int, special: bool) -> bytes:
    def call(cap: int) -> Any:
        buf, n_out = ctypes.create_string_buffer(cap), ctypes.c_int32(0)
        st = N.clover_token_to_piece(model.handle, token, buf, cap, int(special), ctypes.byref(n_out))
        return st, n_out.value, lambda k: buf.raw[:k]  # (clover.h: CLOVER_OK, the count in n_out)
    return _negotiate("token_to_piece", 64, call)


def metadata(model: ModelRef, key: bytes) -> str | None:
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = N.clover_model_meta(model.handle, key, buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1


def metadata_keys(path: Path) -> list[str]:
    """The metadata keys of a GGUF that llama.cpp lists with llama_model_meta_* (all but the
    arrays), in the file's order; the file is one the native library loaded."""
    from gguf import GGUFReader, GGUFValueType  # noqa: PLC0415

    return [k for k, f in GGUFReader(path).fields.items()
            if not k.startswith("GGUF.") and f.types and f.types[0] != GGUFValueType.ARRAY]


def committed_tokens(ctx: ContextRef) -> list[int]:
    """The tokens the context's memory holds (clover_committed_tokens)."""
    n = int(N.clover_committed_tokens(ctx.ptr, None, 0))
    buf = (ctypes.c_int32 * max(n, 1))()
    n = min(n, int(N.clover_committed_tokens(ctx.ptr, buf, n)))
    return list(buf[:n])
