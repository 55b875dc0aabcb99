"""Pythonic surface over libclover (:mod:`clover_cpp._native`): :class:`Clover`.

>>> with Clover("model.gguf", n_threads=4) as m:
...     r = m.generate("The quick brown fox", max_tokens=64, block_size=8)
...     print(r.text, r.stats.tokens_per_forward)
...     for piece in m.generate("Once upon a time", stream=True):
...         print(piece, end="", flush=True)

Decoding follows spec/decoding.md (spec v2): the prompt is committed causally, each decode
block of B positions after it starts fully masked and is denoised step by step (position 0
predicted by the prompt's last logits, position q by the block pass's logits at q - 1),
unmasking every position whose confidence reaches ``threshold`` (at least one per step), then
committed causally. ``block_size=1`` is autoregressive decoding.

Chat templates: :meth:`Clover.chat` renders the GGUF's ``tokenizer.chat_template`` with jinja2
in a sandbox, as Hugging Face's ``apply_chat_template`` does (ChatML when the model has none).

Prefix reuse: a context keeps its committed memory after a call; when the next prompt starts
with those tokens, only the rest is committed (``stats.n_reused``), so a chat does not re-read
its history every turn; the memory is the same for every block size, so the result is too.
"""

from __future__ import annotations

import atexit
import codecs
import ctypes
import functools
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from . import _native as N

__all__ = [
    "Clover", "CloverError", "GenerationResult", "GenerationStats", "GenerationStream",
    "StepCallback", "BlockCallback", "set_verbosity", "render_chat",
]

Prompt = Union[str, Sequence[int], np.ndarray]
#: on_step(canvas_tokens, n_masked, block_start) -> True to cancel
StepCallback = Callable[[list[int], int, int], Any]
#: on_block(text_piece, tokens) -> True to cancel
BlockCallback = Callable[[str, list[int]], Any]

_verbosity = 0


class CloverError(RuntimeError):
    """An error reported by libclover (or found while checking arguments for it).

    ``message`` is the one-line native message, ``status`` the libclover status code
    (``clover_cpp._native.CLOVER_ERR_*``; ``CLOVER_ERR_INVALID_ARG`` by default, e.g. for an
    argument refused on the Python side before any native call)."""

    def __init__(self, message: str, status: int = N.CLOVER_ERR_INVALID_ARG) -> None:
        self.message = " ".join(str(message).split()) or "unknown error"
        self.status = int(status)
        super().__init__(self.message)


def _lib() -> ctypes.CDLL:
    try:
        return N.lib()
    except N.CloverLibraryNotFound as e:
        raise CloverError(str(e), N.CLOVER_ERR_LOAD) from e


def _current_verbosity() -> int:
    return _verbosity


def set_verbosity(level: int) -> None:
    """llama.cpp / ggml logging: 0 = silent (default), 1 = warnings and errors, 2 = everything."""
    global _verbosity
    _verbosity = int(level)
    _lib().clover_set_verbosity(_verbosity)


def _check(status: int, err: Any, what: str = "") -> None:
    if status != N.CLOVER_OK:
        msg = err.value.decode("utf-8", "replace") if err is not None and err.value else ""
        if not msg:
            msg = (_lib().clover_status_str(status) or b"error").decode()
        raise CloverError(f"{what}: {msg}" if what and not msg.startswith(what) else msg, status)


# ----------------------------------------------------------------------------- results

@dataclass
class GenerationStats:
    """Numbers of one generation (libclover's clover_stats)."""

    n_prompt: int = 0
    n_generated: int = 0
    n_forward: int = 0          # llama_decode calls: prompt, block passes, commits that rode on no pass
    n_decode_passes: int = 0    # block passes while decoding (= denoising steps)
    n_steps: int = 0
    n_commits: int = 0          # decode blocks committed
    n_blocks: int = 0           # decode blocks started
    finish_reason: str = ""     # "eos", "stop", "max_tokens", "cancelled" or ""
    tokens_per_forward: float = 0.0
    t_prefill_ms: float = 0.0
    t_decode_ms: float = 0.0
    tokens_per_second: float = 0.0
    block_size: int = 0         # B of the last block
    n_block_switches: int = 0   # B changes (block_size="auto")
    calibration: str = ""       # block_size="auto": "measured" or "cached" when this call set the cost curve
    n_reused: int = 0           # prompt tokens kept committed from the previous call (prefix reuse)
    n_verifications: int = 0    # draft-self: causal commits that verified a draft
    n_drafted: int = 0          # draft-self: drafted tokens verified
    n_accepted: int = 0         # draft-self: drafted tokens accepted
    n_decode_forwards: int = 0  # llama_decode calls after the prompt's (passes + commits on no pass)
    grammar_mode: str = ""      # a grammar: "ar" (decoded at block_size=1) or "draft-self"; "" = none

    @classmethod
    def _from_native(cls, s: N.clover_stats, block_size: int) -> "GenerationStats":
        return cls(n_prompt=s.n_prompt, n_generated=s.n_generated, n_forward=s.n_forward,
                   n_decode_passes=s.n_decode_passes, n_steps=s.n_steps, n_commits=s.n_commits,
                   n_blocks=s.n_blocks, finish_reason=N.FINISH_REASONS.get(s.finish_reason, ""),
                   tokens_per_forward=s.tokens_per_forward, t_prefill_ms=s.t_prefill_ms,
                   t_decode_ms=s.t_decode_ms, tokens_per_second=s.tokens_per_second, block_size=block_size,
                   n_block_switches=s.n_block_switches,
                   calibration={1: "measured", 2: "cached"}.get(s.calibration, ""), n_reused=s.n_reused,
                   n_verifications=s.n_verifications, n_drafted=s.n_drafted, n_accepted=s.n_accepted,
                   n_decode_forwards=s.n_decode_forwards)

    def format(self) -> str:
        """One line for humans (what `clover run` prints after the text)."""
        sw = f" ({self.n_block_switches} switches)" if self.n_block_switches else ""
        reused = f" ({self.n_reused} reused)" if self.n_reused else ""
        return (f"[clover] B={self.block_size}{sw} prompt={self.n_prompt} tok{reused}, generated={self.n_generated} tok, "
                f"blocks={self.n_blocks}, decode passes={self.n_decode_passes} "
                f"({self.tokens_per_forward:.2f} tok/forward), forward passes={self.n_forward}, "
                f"prefill={self.t_prefill_ms:.1f} ms, decode={self.t_decode_ms:.1f} ms "
                f"({self.tokens_per_second:.1f} tok/s), finish={self.finish_reason or 'none'}"
                + (f", cost curve {self.calibration}" if self.calibration else "")
                + (f", draft-self: {self.n_accepted}/{self.n_drafted} drafted tokens accepted, "
                   f"{self.n_generated / self.n_verifications:.2f} tok/verification, "
                   f"{self.n_decode_passes / max(self.n_generated, 1):.2f} draft passes/tok"
                   if self.n_verifications else ""))


@dataclass
class Perplexity:
    """Clover.perplexity's figure: exp of the mean next-token negative log-likelihood."""

    ppl: float
    n_tokens: int   # positions scored
    n_chunks: int
    n_ctx: int


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    #: generate(logprobs=N): per token of ``tokens``, its log-probability under the distribution it
    #: was chosen from (clover.h, clover_generate_params.logprobs), and the N most probable
    #: (token id, log-probability) pairs of that distribution, most probable first
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


class GenerationStream:
    """Iterator over the output text as it becomes final (after every denoising step: the
    new contiguous unmasked prefix of the block), produced while generation runs in a
    worker thread. After it is exhausted, ``result`` holds the :class:`GenerationResult`.
    ``close()`` (or leaving a ``for`` loop early and dropping it) cancels the generation."""

    def __init__(self, run: Callable[[Callable[[str, list[int]], bool], threading.Event], GenerationResult],
                 decoder: "_DecodeThread | None" = None) -> None:
        self.result: GenerationResult | None = None
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._cancel = threading.Event()
        self._done = False

        def on_piece(piece: str, toks: list[int]) -> bool:
            self._q.put(("piece", piece))
            return self._cancel.is_set()

        self._finished = threading.Event()

        def worker() -> None:
            try:
                res = run(on_piece, self._cancel)
                self._q.put(("done", res))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self._q.put(("error", e))
            finally:
                self._finished.set()

        _LIVE_STREAMS.add(self)
        if decoder is not None:
            self._thread = decoder.thread
            decoder.submit(worker)
        else:
            self._thread = threading.Thread(target=worker, name="clover-generate", daemon=True)
            self._thread.start()

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> str:
        while not self._done:
            try:
                kind, val = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "piece":
                if val:
                    return val
                continue
            self._done = True
            if kind == "error":
                raise val
            self.result = val
        raise StopIteration

    def close(self) -> None:
        """Cancel (if still running) and wait for the worker thread."""
        self._cancel.set()
        if self._thread is not threading.current_thread():
            while not self._finished.wait(0.25):  # (an Event: see _interruptible)
                pass
        if not self._done:
            self._done = True
            while True:
                try:
                    kind, val = self._q.get_nowait()
                except queue.Empty:
                    break
                if kind == "done":
                    self.result = val

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._cancel.set()
        except Exception:  # noqa: BLE001
            pass

    @property
    def text(self) -> str:
        """Consume what is left and return the whole text."""
        for _ in self:
            pass
        return self.result.text if self.result else ""


# ----------------------------------------------------------------------------- chat templates

#: used when the GGUF has no template (the format the default model is trained on)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> Any:
    """A sandboxed jinja2 template with Hugging Face's chat-template environment
    (trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, tojson)."""
    import datetime  # noqa: PLC0415
    import json  # noqa: PLC0415

    import jinja2  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(messages: Sequence[Mapping[str, Any]], template: str | None = None,
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                **template_kwargs: Any) -> str:
    """Render chat messages ({"role", "content", ...} dicts) with a jinja2 chat template (the
    model's; ChatML when None), with Hugging Face's semantics: ``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra keyword arguments
    are the template's variables, so its own defaults (a default system message, say) apply."""
    import jinja2  # noqa: PLC0415

    msgs = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise CloverError("each chat message must be a mapping with 'role' and 'content'")
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, type(None))):
            raise CloverError("a chat message's role and content must be strings")
        msgs.append(dict(m))
    try:
        return _compile_template(template or CHATML_TEMPLATE).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **template_kwargs)
    except jinja2.TemplateError as e:
        raise CloverError(f"chat template: {' '.join(str(e).split())}") from e


class StopMatcher:
    """Cuts streamed text at the first of some stop strings, which may span pieces: text that
    could be the start of a stop string is held back until it is known not to be one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [x for x in stops if x]
        self._held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        """The part of ``piece`` (after what was held back) that is final; sets ``hit`` when a
        stop string has been seen (nothing from it on is returned, then or later)."""
        if self.hit:
            return ""
        text = self._held + piece
        cut = min((i for i in (text.find(x) for x in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._held = True, ""
            return text[:cut]
        keep = 0
        for x in self.stops:  # the longest tail of text that begins some stop string
            for k in range(min(len(x) - 1, len(text)), keep, -1):
                if x.startswith(text[-k:]):
                    keep = k
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = ("" if self.hit else self._held), ""
        return held


def _constraint_params(grammar: Any, logprobs: Any, response_format: Any) -> dict[str, Any]:
    """generate()'s grammar / response_format (-> GBNF text, clover_cpp.grammar) and logprobs."""
    from .grammar import GrammarError, grammar_for

    try:
        text = grammar_for(grammar, response_format)
    except GrammarError as e:
        raise CloverError(str(e), N.CLOVER_ERR_INVALID_ARG) from None
    if isinstance(logprobs, bool):
        logprobs = 0 if logprobs else None
    n_top = None if logprobs is None else _int("logprobs", logprobs, 0, N.CLOVER_MAX_TOP_LOGPROBS)
    return {"grammar": text, "logprobs": n_top}


# ----------------------------------------------------------------------------- the model

INT32_MAX = 2**31 - 1  # libclover's counts are int32: larger values must not wrap through ctypes
MAX_THREADS = 512      # ggml's GGML_MAX_N_THREADS


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise CloverError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise CloverError(f"{name} must be {rng}, got {v}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise CloverError(f"{name} must be a number, got {v!r}")
    v = float(v)
    if math.isnan(v):
        raise CloverError(f"{name} must not be NaN")
    return v


_LIVE_STREAMS: "weakref.WeakSet[GenerationStream]" = weakref.WeakSet()


@atexit.register
def _join_streams_at_exit() -> None:
    # a worker thread still inside libclover when the interpreter finalizes would be torn down
    # mid-C++ (abort: "exception not rethrown"): cancel and join every live stream first
    for st in list(_LIVE_STREAMS):
        st.close()
    for d in list(_DECODERS):
        d.stop()


class _DecodeThread:
    """A thread that runs decoding calls.

    ggml's CPU backend runs its threads with OpenMP, which keeps one thread team per calling
    thread. Decoding from several threads (a new one per call, the caller's, a server's pool,
    one per object) leaves several teams alive, more threads than cores, and libgomp then makes
    its threads sleep instead of spin between graph nodes: decoding ran up to 10x slower
    (measured: B = 1 on the default model, 1,500 -> 150-250 tok/s). So every Clover object
    decodes on one process-wide thread, except contexts made to run in parallel
    (:meth:`Clover.new_context`), which get a thread each (give them n_threads that add up to
    at most the cores).
    The caller waits interruptibly: Ctrl-C sets ``cancel`` (the decode stops at the next step),
    waits for the thread and is raised."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="clover-decode", daemon=True)
        self.thread.start()
        _DECODERS.add(self)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def call(self, fn: Callable[[], Any], cancel: threading.Event | None = None) -> Any:
        if threading.current_thread() is self.thread:
            return fn()
        box: dict[str, Any] = {}
        done = threading.Event()  # (not a join: a wait cut short by Ctrl-C can misreport the end)

        def job() -> None:
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                done.set()

        self.submit(job)
        try:
            while not done.wait(0.25):
                pass
        except BaseException:
            if cancel is not None:
                cancel.set()
            while not done.wait(0.25):
                pass
            raise
        if "error" in box:
            raise box["error"]
        return box["result"]

    def stop(self) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self._jobs.put(None)
            self.thread.join()


_DECODERS: "weakref.WeakSet[_DecodeThread]" = weakref.WeakSet()
_SHARED_DECODER: _DecodeThread | None = None
_SHARED_LOCK = threading.Lock()


def _shared_decoder() -> _DecodeThread:
    global _SHARED_DECODER
    with _SHARED_LOCK:
        if _SHARED_DECODER is None or not _SHARED_DECODER.thread.is_alive():
            _SHARED_DECODER = _DecodeThread()
        return _SHARED_DECODER


class _ModelRef:
    """A loaded clover_model shared by the Clover objects made with :meth:`Clover.new_context`;
    freed when the last of them closes."""

    def __init__(self, handle: int) -> None:
        self.handle: int | None = handle
        self.users = 1
        self.lock = threading.Lock()

    def acquire(self) -> int:
        with self.lock:
            if self.handle is None:
                raise CloverError("the model is closed")
            self.users += 1
            return self.handle

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.handle is not None:
                if N._lib is not None:
                    N._lib.clover_model_free(self.handle)
                self.handle = None


class Clover:
    """A Clover GGUF loaded with libclover, plus one decoding context.

    ``n_threads=None`` lets libclover choose from the hardware. ``block_size``: the default B
    of :meth:`generate`; None (default) = "auto" (chosen per block; its cost curve is measured
    once per model file, backend, build and thread count and kept in a disk cache, see
    ``clover.h``); an integer fixes it. ``flash_attn``: None = llama.cpp's automatic choice, False
    off, True on. ``kv_f32=True`` keeps the KV cache in f32 instead of f16 (with flash_attn=False:
    exact parity runs against the numpy reference). ``rpc_servers``: llama.cpp RPC servers
    ("HOST:PORT", a list or a comma-separated string, each running ``ggml-rpc-server``) that
    hold the offloaded layers (``n_gpu_layers``; the rest stays on this machine's CPU), split by
    ``tensor_split`` (one share per device, RPC servers first) or by their free memory;
    ``override_tensor`` ("PATTERN=BUFFER,...", llama.cpp's -ot) places matching tensors, e.g.
    ``"^output\\.weight=CPU"`` keeps the output head here so that no logits cross the network. A lost
    server makes calls raise :class:`CloverError`; :meth:`reload` loads the model again. Use
    as a context manager or call :meth:`close` (idempotent). A Clover object must not be used from two threads at once
    (calls are serialised by a lock); distinct objects are independent."""

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int = 4096, n_threads: int | None = None,
                 n_gpu_layers: int = 0, block_size: int | None = None, *, flash_attn: bool | None = None,
                 kv_f32: bool = False, use_mmap: bool | None = None, verbose: bool = False,
                 rpc_servers: str | Sequence[str] | None = None,
                 tensor_split: Sequence[float] | None = None, override_tensor: str | None = None) -> None:
        self._model: int | None = None
        self._shared: _ModelRef | None = None
        self._ctx: int | None = None
        self._lock = threading.RLock()
        self._streams: weakref.WeakSet[GenerationStream] = weakref.WeakSet()
        self.model_path = Path(model_path)
        self._ctx_args = dict(n_ctx=n_ctx, n_threads=n_threads, block_size=block_size, flash_attn=flash_attn,
                              kv_f32=kv_f32)
        self._context_params()  # bad context arguments fail before anything is loaded
        n_gpu_layers = _int("n_gpu_layers", n_gpu_layers, -1, INT32_MAX)
        if isinstance(rpc_servers, (list, tuple)):
            rpc_servers = ",".join(str(x) for x in rpc_servers)
        if rpc_servers is not None and not isinstance(rpc_servers, str):
            raise CloverError(f"rpc_servers must be 'HOST:PORT[,...]' or a list of them, got {rpc_servers!r}")
        split = [_float("tensor_split", x) for x in tensor_split] if tensor_split is not None else []
        if override_tensor is not None and not isinstance(override_tensor, str):
            raise CloverError(f"override_tensor must be 'PATTERN=BUFFER[,...]', got {override_tensor!r}")
        self._load_args = dict(n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, rpc_servers=rpc_servers or None,
                               tensor_split=split, override_tensor=override_tensor or None)
        if not self.model_path.exists():
            raise CloverError(f"{self.model_path}: no such file", N.CLOVER_ERR_LOAD)
        if self.model_path.is_dir():
            raise CloverError(f"{self.model_path}: is a folder, not a GGUF file", N.CLOVER_ERR_LOAD)
        if verbose:
            set_verbosity(max(_verbosity, 1))
        self._load_model()
        self._make_context()

    def _context_params(self) -> tuple[int, int | None, int | None]:
        """n_ctx, n_threads and the block size (None = auto) of self._ctx_args, checked."""
        a = self._ctx_args
        n_ctx = _int("n_ctx", a["n_ctx"], 1, INT32_MAX)
        n_threads = None if a["n_threads"] is None else _int("n_threads", a["n_threads"], 1, MAX_THREADS)
        bs = a["block_size"]
        return n_ctx, n_threads, None if bs is None or (isinstance(bs, str) and bs == "auto") else \
            _int("block_size", bs, 1, n_ctx)

    def _load_model(self) -> None:
        L, a = _lib(), self._load_args
        mp = L.clover_model_default_params()
        mp.n_gpu_layers = a["n_gpu_layers"]
        if a["use_mmap"] is not None:
            mp.use_mmap = 1 if a["use_mmap"] else 0
        if a["rpc_servers"]:
            mp.rpc_servers = a["rpc_servers"].encode()
        if a["override_tensor"]:
            mp.tensor_overrides = a["override_tensor"].encode()
        split = (ctypes.c_float * max(1, len(a["tensor_split"])))(*a["tensor_split"])
        mp.tensor_split = split
        mp.n_tensor_split = len(a["tensor_split"])
        err, n = N.err_buffer()
        m = L.clover_model_load(os.fsencode(self.model_path), ctypes.byref(mp), err, n)
        if not m:
            _check(N.CLOVER_ERR_LOAD, err)
        self._model = m
        self._shared = _ModelRef(m)

    def reload(self) -> None:
        """Free the model and context and load them again with the same arguments: after a
        lost RPC server, once it (or a replacement at the same address) is back."""
        self.close()
        with self._lock:
            self._load_model()
            self._make_context()

    def _make_context(self, own_thread: bool = False) -> None:
        """This object's decoding context, from self._ctx_args, over its loaded model."""
        n_ctx, n_threads, block_size = self._context_params()
        flash_attn, kv_f32 = self._ctx_args["flash_attn"], bool(self._ctx_args["kv_f32"])
        self._default_block_size: int | str = block_size if block_size is not None else "auto"
        L, m = _lib(), self._model
        err, n = N.err_buffer()
        cp = L.clover_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_threads = n_threads if n_threads is not None else 0
        cp.block_size = block_size or 0
        cp.flash_attn = -1 if flash_attn is None else (1 if flash_attn else 0)
        if kv_f32:
            if not any(f[0] == "kv_f32" for f in N.clover_context_params._fields_):
                raise CloverError("kv_f32 needs a libclover with clover_context_params.kv_f32")
            cp.kv_f32 = 1
        c = L.clover_context_new(m, ctypes.byref(cp), err, n)
        if not c:
            self._model = None
            assert self._shared is not None
            self._shared.release()
            _check(N.CLOVER_ERR_LOAD, err)
        self._ctx = c
        self._own_decoder = own_thread
        self._decoder = _DecodeThread() if own_thread else _shared_decoder()
        self._eot_cache: list[int] | None = None
        self._last_chat: tuple[str | None, list[int], list[int], str] | None = None

    def new_context(self, **overrides: Any) -> "Clover":
        """Another Clover over the same loaded model, with its own context (memory, block
        size, cost curve), e.g. one per concurrent request. Keyword arguments override this
        object's n_ctx, n_threads, block_size, flash_attn, kv_f32. The model is freed when
        the last of the objects sharing it closes. The new context decodes on a thread of its own,
        so distinct contexts may run in parallel (give them n_threads that add up to at most the
        cores: OpenMP slows down sharply when its threads outnumber them)."""
        unknown = set(overrides) - set(self._ctx_args)
        if unknown:
            raise CloverError(f"new_context: unknown argument(s) {sorted(unknown)}")
        args = {**self._ctx_args, **overrides}
        with self._lock:
            self._m()
            assert self._shared is not None
            other = object.__new__(Clover)
            other._model = self._shared.acquire()
            other._shared = self._shared
            other._ctx = None
            other._lock = threading.RLock()
            other._streams = weakref.WeakSet()
            other.model_path = self.model_path
            other._load_args = self._load_args
            other._ctx_args = args
        other._make_context(own_thread=True)
        return other

    # -- lifetime
    def close(self) -> None:
        """Free the context and the model. Safe to call more than once."""
        self._not_in_callback()
        self._cancel_streams()
        with self._lock:
            L = N._lib
            if self._ctx:
                if self._own_decoder:
                    self._decoder.stop()
                if L is not None:
                    L.clover_context_free(self._ctx)
                self._ctx = None
            if self._model:
                self._model = None
                if self._shared is not None:
                    self._shared.release()

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def __enter__(self) -> "Clover":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"block_size={self.block_size}, n_ctx={self.n_ctx}"
        return f"Clover({str(self.model_path)!r}, {state})"

    def _m(self) -> int:
        if self._model is None or self._ctx is None:
            raise CloverError("the model is closed")
        return self._model

    def _c(self) -> int:
        self._m()
        self._not_in_callback()
        assert self._ctx is not None
        return self._ctx

    def _not_in_callback(self) -> None:
        # a callback runs inside the native decode loop: touching the context from there
        # (close, reset, block_size, another generate) would pull it out from under the loop
        if getattr(self, "_owner", None) == threading.get_ident():
            raise CloverError("this Clover object cannot be used from inside one of its own callbacks "
                              "(on_step/on_block); return True from the callback to stop instead")

    def _cancel_streams(self) -> None:
        """Cancel and join the streams of this object that were left unfinished."""
        me = threading.current_thread()
        for st in list(self._streams):
            if st._thread is not me:
                st.close()

    # -- properties
    @property
    def n_vocab(self) -> int:
        return int(_lib().clover_n_vocab(self._m()))

    @property
    def mask_token(self) -> int:
        return int(_lib().clover_mask_token(self._m()))

    @property
    def eos_token(self) -> int:
        return int(_lib().clover_eos_token(self._m()))

    @property
    def train_block_size(self) -> int:
        return int(_lib().clover_train_block_size(self._m()))

    @property
    def n_ctx_train(self) -> int:
        return int(_lib().clover_n_ctx_train(self._m()))

    @property
    def n_ctx(self) -> int:
        return int(_lib().clover_n_ctx(self._c()))

    @property
    def n_committed(self) -> int:
        return int(_lib().clover_n_committed(self._c()))

    @property
    def block_size(self) -> int:
        """The context's block size B. Setting it recreates the llama.cpp context (memory cleared)."""
        return int(_lib().clover_block_size(self._c()))

    @block_size.setter
    def block_size(self, value: int) -> None:
        value = _int("block_size", value, 1, self.n_ctx)
        with self._lock:
            err, n = N.err_buffer()
            _check(_lib().clover_set_block_size(self._c(), value, err, n), err)

    def calibrate(self, fused: bool = False) -> dict[int, float] | dict[int, tuple[float, float]]:
        """Measure the cost curve used by block_size="auto" (bypassing the disk cache):
        {B: ms per block pass} for B = 1, 2, 4, ...; with fused=True {B: (pass ms, ms of a
        commit fused with a pass)}. Clears the memory."""
        with self._lock:
            L, err, n = _lib(), *N.err_buffer()
            sizes, cnt = (ctypes.c_int32 * 32)(), ctypes.c_int32(0)
            ms, msf = (ctypes.c_double * 32)(), (ctypes.c_double * 32)()
            c = self._c()
            _check(self._decoder.call(lambda: L.clover_calibrate(c, sizes, ms, msf, 32, ctypes.byref(cnt), err, n)),
                   err)
            k = min(cnt.value, 32)
            if fused:
                return {int(sizes[i]): (float(ms[i]), float(msf[i])) for i in range(k)}
            return {int(sizes[i]): float(ms[i]) for i in range(k)}

    def set_cost_curve(self, curve: Mapping[int, float], fused: Mapping[int, float] | None = None) -> None:
        """Set the cost curve for block_size="auto" ({1: ms, 2: ms, 4: ms, ...}; fused: the
        cost of a commit fused with a pass, by default that of a pass of 2B) instead of
        measuring it, e.g. from an earlier :meth:`calibrate`. Resets the running tokens per pass."""
        items = sorted((int(b), float(v)) for b, v in curve.items())
        with self._lock:
            err, n = N.err_buffer()
            sizes = N.as_int32_array([b for b, _ in items])
            ms = (ctypes.c_double * max(1, len(items)))(*[v for _, v in items])
            msf = None
            if fused is not None:
                msf = (ctypes.c_double * max(1, len(items)))(*[float(fused[b]) for b, _ in items])
            _check(_lib().clover_set_cost_curve(self._c(), sizes, ms, msf, len(items), err, n), err)

    def set_n_threads(self, n_threads: int) -> None:
        with self._lock:
            _check(_lib().clover_set_n_threads(self._c(), _int("n_threads", n_threads, 1, MAX_THREADS)), None)

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None if absent."""
        L, m = _lib(), self._m()
        k = key.encode()
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = L.clover_model_meta(m, k, buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1

    @property
    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")

    # -- tokenizer
    def tokenize(self, text: str | bytes, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of text. add_special: BOS/EOS as the model asks; parse_special: recognise
        special-token text such as ``<|im_start|>``."""
        if isinstance(text, str):
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise CloverError(f"text is not valid Unicode: {e.reason} at index {e.start}") from None
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise CloverError(f"expected text (str or bytes), got {type(text).__name__}")
        L, m = _lib(), self._m()
        cap = len(data) + 16
        for _ in range(2):
            buf = (ctypes.c_int32 * cap)()
            n_out = ctypes.c_int32(0)
            st = L.clover_tokenize(m, data, len(data), buf, cap, int(add_special), int(parse_special),
                                   ctypes.byref(n_out))
            if st == N.CLOVER_ERR_BUFFER_TOO_SMALL:
                cap = n_out.value + 1
                continue
            _check(st, None, "tokenize")
            return list(buf[: n_out.value])
        raise CloverError("tokenize: buffer size negotiation failed", N.CLOVER_ERR_INTERNAL)

    def detokenize_bytes(self, tokens: Sequence[int], special: bool = False) -> bytes:
        toks = self._tokens(tokens)
        if not toks:
            return b""
        L, m = _lib(), self._m()
        arr = N.as_int32_array(toks)
        cap = 8 * len(toks) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n_out = ctypes.c_int32(0)
            st = L.clover_detokenize(m, arr, len(toks), buf, cap, 0, int(special), ctypes.byref(n_out))
            if st == N.CLOVER_ERR_BUFFER_TOO_SMALL:
                cap = n_out.value + 1
                continue
            _check(st, None, "detokenize")
            return buf.raw[: n_out.value]
        raise CloverError("detokenize: buffer size negotiation failed", N.CLOVER_ERR_INTERNAL)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of tokens (invalid UTF-8 replaced). special: render special tokens' text."""
        return self.detokenize_bytes(tokens, special).decode("utf-8", "replace")

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        L, m = _lib(), self._m()
        buf = ctypes.create_string_buffer(64)
        n_out = ctypes.c_int32(0)
        st = L.clover_token_to_piece(m, int(token), buf, 64, int(special), ctypes.byref(n_out))
        if st == N.CLOVER_ERR_BUFFER_TOO_SMALL:
            buf = ctypes.create_string_buffer(n_out.value + 1)
            st = L.clover_token_to_piece(m, int(token), buf, n_out.value + 1, int(special), ctypes.byref(n_out))
        if st < 0:
            _check(st, None, "token_to_piece")
        # clover.h documents "returns the number of bytes written"; the implementation returns
        # CLOVER_OK and reports the count through n_out - accept both
        return buf.raw[: (st if st > 0 else n_out.value)]

    def _tokens(self, tokens: Any) -> list[int]:
        if isinstance(tokens, (str, bytes)):
            raise CloverError("expected a sequence of token ids, got text")
        try:
            toks = [int(t) for t in tokens]
        except (TypeError, ValueError) as e:
            raise CloverError(f"expected a sequence of token ids: {e}") from None
        return toks

    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        toks = self._tokens(prompt)
        nv = self.n_vocab
        for t in toks:
            if not 0 <= t < nv:
                raise CloverError(f"token id {t} out of range [0, {nv})")
        return toks

    # -- low level passes
    def reset(self) -> None:
        """Clear the memory (no committed tokens)."""
        with self._lock:
            _check(_lib().clover_reset(self._c()), None, "reset")

    def commit(self, tokens: Sequence[int], logits: bool = False) -> np.ndarray | None:
        """Commit tokens (n >= 1) causally at the end of the memory. With ``logits``, returns the
        logits [n, n_vocab] (float32) of the committed positions: row t predicts token t + 1, as
        llama.cpp's causal decoding of the same text gives them."""
        toks = self._tokens(tokens)
        with self._lock:
            err, n = N.err_buffer()
            c, arr = self._c(), N.as_int32_array(toks)
            out = np.empty((max(len(toks), 1), self.n_vocab), dtype=np.float32) if logits else None
            ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if logits else None
            _check(self._decoder.call(lambda: _lib().clover_commit_logits(c, arr, len(toks), ptr, err, n)), err)
            return out[: len(toks)] if logits else None

    def last_logits(self) -> np.ndarray:
        """The logits [n_vocab] of the last committed position: the prediction of the next one."""
        with self._lock:
            out = np.empty(self.n_vocab, dtype=np.float32)
            if _lib().clover_last_logits(self._c(), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) != 0:
                raise CloverError("nothing is committed")
            return out

    def block_logits(self, tokens: Sequence[int], commit_before: Sequence[int] | None = None) -> np.ndarray:
        """Logits [n, n_vocab] (float32) of a block pass of tokens (1 <= n <= B) against the memory,
        which is left unchanged; row t predicts token t + 1. With ``commit_before``, the memory is
        first reset and those tokens are committed."""
        toks = self._tokens(tokens)
        with self._lock:
            c = self._c()
            if commit_before is not None:
                before = self._tokens(commit_before)
                self.reset()
                if before:
                    self.commit(before)
            nv = self.n_vocab
            out = np.empty((max(len(toks), 1), nv), dtype=np.float32)
            err, n = N.err_buffer()
            arr, ptr = N.as_int32_array(toks), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            st = self._decoder.call(lambda: _lib().clover_block_pass(c, arr, len(toks), ptr, err, n))
            _check(st, err)
            return out[: len(toks)]

    def perplexity(self, text: str | Sequence[int], n_ctx: int = 512) -> "Perplexity":
        """Perplexity of the causal model over a text, computed as llama-perplexity computes it:
        the tokens (with BOS when the model adds one) in chunks of n_ctx, each on an empty
        memory with its first token replaced by BOS, scoring the second half of every chunk
        (each position predicted from the one before it). Leaves the memory empty."""
        toks = self.tokenize(text, add_special=True) if isinstance(text, str) else self._tokens(text)
        n_ctx = _int("n_ctx", n_ctx, 2, self.n_ctx)
        n_chunk = len(toks) // n_ctx
        if n_chunk < 2:
            raise CloverError(f"perplexity needs at least {2 * n_ctx} tokens (2 chunks of n_ctx={n_ctx}), "
                              f"the text has {len(toks)}")
        bos = int(_lib().clover_bos_token(self._m()))
        first, nll, count = n_ctx // 2, 0.0, 0
        for i in range(n_chunk):
            chunk = toks[i * n_ctx:(i + 1) * n_ctx]
            if bos >= 0 and isinstance(text, str):
                chunk[0] = bos
            self.reset()
            logits = self.commit(chunk, logits=True).astype(np.float64)
            rows = logits[first:n_ctx - 1]
            m = rows.max(axis=1, keepdims=True)
            logp = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
            nll -= float(logp[np.arange(len(rows)), chunk[first + 1:]].sum())
            count += len(rows)
        self.reset()
        return Perplexity(ppl=math.exp(nll / count), n_tokens=count, n_chunks=n_chunk, n_ctx=n_ctx)

    # -- generation
    def _stop_tokens(self) -> list[int]:
        """End-of-turn tokens used by chat (besides EOS)."""
        if self._eot_cache is None:
            ids: list[int] = []
            for txt in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
                try:
                    t = self.tokenize(txt, add_special=False, parse_special=True)
                except CloverError:
                    continue
                if len(t) == 1 and t[0] != self.mask_token:
                    ids.append(t[0])
            self._eot_cache = ids
        return self._eot_cache

    def generate(self, prompt: Prompt, max_tokens: int = 256, block_size: int | str | None = "default",
                 threshold: float = 0.9, max_steps: int = 0, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True, stream: bool = False,
                 on_step: StepCallback | None = None, on_block: BlockCallback | None = None,
                 stop_tokens: Sequence[int] = (), stop: str | Sequence[str] = (), reuse_prefix: bool = True,
                 draft_self: bool = False, grammar: str | None = None, logprobs: int | None = None,
                 response_format: Mapping[str, Any] | None = None, _chat_text: str | None = None) -> Any:
        """Block-diffusion generation.

        prompt: text (tokenized with add_special and parse_special) or token ids.
        block_size: B for this call; by default the one given to the constructor, else "auto":
        chosen per block from the cost curve (from the disk cache, else measured on the first
        auto call, see :meth:`calibrate`) and the running tokens per pass (rules in clover.h).
        None = the context's current block size.
        threshold: unmask every masked position whose confidence >= threshold (in [0, 1]).
        max_steps: per-block step cap (0 = none). temperature 0 = greedy.
        on_step(canvas_tokens, n_masked, block_start): called after every denoising step with
        the block's B tokens (masked ones = the mask token); returning True cancels.
        on_block(text, tokens): called with each committed block's text; True cancels.
        stop_tokens: extra token ids that end the output like EOS (the output stops before them).
        stop: strings that end the output (matched across token boundaries; the text stops
        before the first one, ``finish_reason`` "stop"; ``tokens`` then run to the token that
        completed it).
        reuse_prefix: keep the committed memory when the prompt starts with it (see the module
        doc; the result is the same either way).
        draft_self: lossless self-speculative decoding: each block is drafted by block passes and
        verified by its causal commit, so the output is that of block_size=1 (token for token at
        temperature 0, in distribution above it); stats.n_accepted / n_drafted / n_verifications
        say how it went.
        grammar: GBNF text (llama.cpp's grammar format): every output token is one the grammar
        allows (llama.cpp's grammar sampler). response_format: {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"schema": {...}}} (OpenAI's), turned into a grammar
        by llama-cpp-python's converter (:mod:`clover_cpp.grammar`). Under block diffusion a
        grammar runs at block_size=1, or with draft_self (verification applies it; the output is
        that of the constrained block_size=1): ``stats.grammar_mode`` "ar" / "draft-self".
        logprobs: None = off; N in [0, 20] = ``result.logprobs`` (each token's log-probability
        under the distribution it was chosen from: the log-softmax of the logits that predicted
        it, at the step that unmasked it) and ``result.top_logprobs`` (the N most probable
        (token, log-probability) pairs there).
        A cancelled generation returns what the finished blocks produced (finish_reason
        "cancelled"); exceptions raised by callbacks cancel it and are re-raised here.

        Returns a :class:`GenerationResult`, or with ``stream=True`` a :class:`GenerationStream`
        yielding the text as it becomes final: after every denoising step, the new part of the
        block's contiguous unmasked prefix."""
        if isinstance(block_size, str) and block_size == "default":
            block_size = self._default_block_size
        kw = self._gen_params(max_tokens, block_size, threshold, max_steps, temperature, top_k, top_p, seed)
        toks = self._prompt_tokens(prompt)
        stops = self._tokens(stop_tokens)
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(x, str) for x in stop):
            raise CloverError("stop must be a string or a list of strings")
        kw.update(stop_strings=list(stop), reuse_prefix=bool(reuse_prefix), draft_self=bool(draft_self),
                  chat_text=_chat_text, **_constraint_params(grammar, logprobs, response_format))
        self._not_in_callback()
        self._cancel_streams()  # a stream left unfinished must not keep decoding (or hold the lock)
        if not stream:
            # on the object's decode thread (see _DecodeThread); Ctrl-C here cancels it at the
            # next denoising step and is raised
            cancel = threading.Event()
            return self._decoder.call(
                lambda: self._run(toks, kw, bool(stop_at_eos), stops, on_step, on_block, None, cancel), cancel)

        def run(push: Callable[[str, list[int]], bool], cancel: threading.Event) -> GenerationResult:
            return self._run(toks, kw, bool(stop_at_eos), stops, on_step, on_block, push, cancel)

        s = GenerationStream(run, self._decoder)
        self._streams.add(s)
        return s

    def _gen_params(self, max_tokens: Any, block_size: Any, threshold: Any, max_steps: Any, temperature: Any,
                    top_k: Any, top_p: Any, seed: Any) -> dict[str, Any]:
        kw: dict[str, Any] = dict(max_tokens=_int("max_tokens", max_tokens, 0, INT32_MAX),
                                  max_steps=_int("max_steps", max_steps, 0, INT32_MAX),
                                  top_k=_int("top_k", top_k, 0, INT32_MAX),
                                  seed=_int("seed", seed, 0, 2**64 - 1))
        if isinstance(block_size, str) and block_size == "auto":
            kw["block_size"] = N.CLOVER_BLOCK_SIZE_AUTO
        elif block_size is not None:
            kw["block_size"] = _int("block_size", block_size, 1, INT32_MAX)
        th = _float("threshold", threshold)
        if not 0.0 <= th <= 1.0:
            raise CloverError(f"threshold must be in [0, 1], got {th}")
        t = _float("temperature", temperature)
        if t < 0:
            raise CloverError(f"temperature must be >= 0, got {t}")
        p = _float("top_p", top_p)
        if not 0.0 < p <= 1.0:
            raise CloverError(f"top_p must be in (0, 1], got {p}")
        kw.update(threshold=th, temperature=t, top_p=p)
        return kw

    def _run(self, toks: list[int], kw: dict[str, Any], stop_at_eos: bool, stops: list[int],
             on_step: StepCallback | None, on_block: BlockCallback | None,
             push: Callable[[str, list[int]], bool] | None, cancel: threading.Event | None) -> GenerationResult:
        """push (streams): called with each new piece of final text: after every denoising
        step, the contiguous unmasked prefix of the block that is new (unmasked tokens never
        change), cut at EOS, stop tokens and the budget."""
        L = _lib()
        state: dict[str, Any] = {"exc": None, "stopped": False, "base": 0, "block": []}
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        matcher = StopMatcher(kw.get("stop_strings", ()))
        # track the canvas's final prefix every step (a draft-self canvas is only a draft: its
        # tokens are final once the block's verification has kept them)
        follow = (push is not None or bool(matcher.stops)) and not kw.get("draft_self", False)
        pieces: list[str] = []
        got: list[int] = []        # final output tokens so far (what the pieces spell)
        stopset = set(stops)
        if stop_at_eos and self.eos_token >= 0:
            prefix_stops = stopset | {self.eos_token}
        else:
            prefix_stops = stopset
        mask, n_prompt, budget = self.mask_token, len(toks), kw["max_tokens"]

        def advance(bt: list[int], final: bool) -> bool:
            """bt: the current block's output known so far (a prefix of what it will be).
            Emits what is new; True when a stop token ended the output."""
            stop = False
            if stopset:
                for i, t in enumerate(bt):
                    if t in stopset:
                        bt, stop = bt[:i], True
                        break
            new = bt[len(got) - state["base"]:]
            if new:
                got.extend(new)
                piece = dec.decode(self.detokenize_bytes(new))
            else:
                piece = ""
            if stop or (final and state["stopped"]):
                piece += dec.decode(b"", final=True)
            if matcher.stops:
                piece = matcher.feed(piece)
                stop = stop or matcher.hit
            if piece:
                pieces.append(piece)
                state["block"].append(piece)
                if push is not None and push(piece, new):
                    return True
            return stop

        def step_cb(block_start: int, canvas: Any, bsz: int, n_masked: int, _ud: Any) -> int:
            try:
                if cancel is not None and cancel.is_set():
                    return 1
                if on_step is not None and on_step(list(canvas[:bsz]), int(n_masked), int(block_start)):
                    return 1
                if follow:
                    first = max(0, n_prompt - block_start)
                    room = budget - state["base"]
                    prefix: list[int] = []
                    for t in canvas[first:min(bsz, first + room)]:
                        if t == mask or t in prefix_stops:
                            break
                        prefix.append(int(t))
                    if advance(prefix, False):
                        state["stopped"] = True
                        return 1
                return 0
            except BaseException as e:  # noqa: BLE001 - re-raised after the native call returns
                state["exc"] = e
                return 1

        def block_cb(block_start: int, tokens: Any, n_tokens: int, _ud: Any) -> int:
            try:
                bt = list(tokens[:n_tokens])
                if stopset and any(t in stopset for t in bt):
                    state["stopped"] = True
                stop = advance(bt, True)
                block_text = "".join(state["block"])
                state["block"], state["base"] = [], len(got)
                want_stop = False
                if on_block is not None:
                    want_stop = bool(on_block(block_text, bt[:len(got)]))
                if cancel is not None and cancel.is_set():
                    want_stop = True
                return 1 if (stop or want_stop) else 0
            except BaseException as e:  # noqa: BLE001
                state["exc"] = e
                return 1

        if n_prompt + budget > self.n_ctx:  # before allocating an output buffer of max_tokens
            raise CloverError(f"prompt ({n_prompt} tokens) + max_tokens ({budget}) exceeds n_ctx={self.n_ctx}",
                              N.CLOVER_ERR_CONTEXT_FULL)
        c_step = N.clover_step_callback(step_cb)
        c_block = N.clover_block_callback(block_cb)
        with self._lock:
            c = self._c()
            gp = L.clover_generate_default_params()
            gp.block_size = kw.get("block_size", 0)
            gp.threshold = kw["threshold"]
            gp.max_steps = kw["max_steps"]
            gp.temperature = kw["temperature"]
            gp.top_k = kw["top_k"]
            gp.top_p = kw["top_p"]
            gp.seed = kw["seed"]
            gp.max_tokens = kw["max_tokens"]
            gp.stop_at_eos = 1 if stop_at_eos else 0
            gp.step_callback = c_step
            gp.block_callback = c_block
            gp.reuse_prefix = 1 if kw.get("reuse_prefix", True) else 0
            gp.draft_self = 1 if kw.get("draft_self", False) else 0
            cap = max(kw["max_tokens"], 1)
            n_top = kw.get("logprobs")
            if kw.get("grammar"):
                gp.grammar = kw["grammar"].encode("utf-8")
            if n_top is not None:  # grammar / logprobs: clover.h, clover_generate_params
                lp_buf, top_tok, top_lp = ((ctypes.c_float * cap)(), (ctypes.c_int32 * max(cap * n_top, 1))(),
                                           (ctypes.c_float * max(cap * n_top, 1))())
                gp.logprobs, gp.n_top_logprobs, gp.top_tokens, gp.top_logprobs = lp_buf, n_top, top_tok, top_lp
            out = (ctypes.c_int32 * cap)()
            n_out = ctypes.c_int32(0)
            st = N.clover_stats()
            err, n = N.err_buffer()
            arr = N.as_int32_array(toks)
            self._owner = threading.get_ident()
            try:
                rc = L.clover_generate(c, arr, len(toks), ctypes.byref(gp), out, cap, ctypes.byref(n_out),
                                       ctypes.byref(st), err, n)
            finally:
                self._owner = None
            B = int(st.block_size) or int(L.clover_block_size(c))
        if state["exc"] is not None:
            raise state["exc"]
        if rc not in (N.CLOVER_OK, N.CLOVER_ERR_CANCELLED):
            _check(rc, err)
        tokens = list(out[: n_out.value])
        stats = GenerationStats._from_native(st, B)
        if state["stopped"]:
            tokens = got
            stats.finish_reason = "stop"
            stats.n_generated = len(tokens)
            if stats.n_decode_forwards:  # the same forwards (after the prompt's), fewer tokens
                stats.tokens_per_forward = len(tokens) / stats.n_decode_forwards
            if stats.t_decode_ms > 0:
                stats.tokens_per_second = len(tokens) / (stats.t_decode_ms / 1000.0)
        tail = dec.decode(b"", final=True)
        if matcher.stops:
            tail = matcher.feed(tail) + matcher.flush()
            if matcher.hit:
                tokens, state["stopped"] = got, True
                stats.finish_reason = "stop"
                stats.n_generated = len(tokens)
        if tail:
            pieces.append(tail)
            if push is not None:
                push(tail, [])
            if on_block is not None:
                on_block(tail, [])
        text = "".join(pieces) if (tokens == got or matcher.stops) else self.detokenize(tokens)
        self._last_chat = (kw.get("chat_text"), toks, tokens, text)
        result = GenerationResult(text=text, tokens=tokens, stats=stats)
        stats.grammar_mode = {1: "ar", 2: "draft-self"}.get(int(st.grammar_mode), "")
        if n_top is not None:  # (tokens is a prefix of the native output)
            result.logprobs = [float(x) for x in lp_buf[:len(tokens)]]
            result.top_logprobs = [[(int(top_tok[i * n_top + j]), float(top_lp[i * n_top + j])) for j in range(n_top)]
                                   for i in range(len(tokens))]
        return result

    def chat(self, messages: Sequence[Mapping[str, str]], **gen_kwargs: Any) -> Any:
        """Format messages with the model's chat template (see the module doc) and generate the
        assistant's reply; stops at EOS or the end-of-turn token. Keyword arguments are those
        of :meth:`generate` (stream=True works). The conversation's earlier turns are not
        re-read when the context still holds them (prefix reuse)."""
        prompt = self.format_chat(messages)
        stops = list(gen_kwargs.pop("stop_tokens", ())) + self._stop_tokens()
        return self.generate(self.chat_tokens(prompt), stop_tokens=stops, _chat_text=prompt, **gen_kwargs)

    def chat_tokens(self, prompt: str) -> list[int]:
        """The tokens of a rendered chat prompt. When it continues the last chat exchange (that
        prompt, then the reply as generated), they are that exchange's tokens followed by the
        new text's: the model reads its own reply's tokens again (as llama.cpp's conversation
        mode does) rather than a re-tokenization that may differ, so the memory is reused."""
        last = getattr(self, "_last_chat", None)
        if last is not None and last[0] is not None:
            before = last[0] + last[3]
            if prompt.startswith(before) and self.detokenize(last[2]) == last[3]:
                return list(last[1]) + list(last[2]) + self.tokenize(prompt[len(before):], add_special=False)
        return self.tokenize(prompt, add_special=True, parse_special=True)

    def _special_text(self, key: str) -> str:
        tid = self.metadata(key)
        try:
            return self.token_to_piece(int(tid), special=True).decode("utf-8", "replace") if tid else ""
        except (CloverError, ValueError):
            return ""

    def format_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text of messages under the model's chat template (see :func:`render_chat`)."""
        return render_chat(messages, self.chat_template, add_generation_prompt,
                           bos_token=self._special_text("tokenizer.ggml.bos_token_id"),
                           eos_token=self._special_text("tokenizer.ggml.eos_token_id"), **template_kwargs)
