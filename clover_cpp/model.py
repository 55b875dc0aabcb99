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
import contextlib
import ctypes
import functools
import inspect
import math
import os
import queue
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from . import _native as N

__all__ = [
    "Clover", "CloverError", "CloverValueError", "CloverTypeError", "GenerationResult", "GenerationStats", "GenerationStream",
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

    def __new__(cls, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG) -> "CloverError":
        # an invalid argument is also a ValueError (CloverValueError), so that code written
        # for other libraries' argument checks catches it
        if cls is CloverError and int(status) == N.CLOVER_ERR_INVALID_ARG:
            cls = CloverValueError
        return super().__new__(cls, message)

    def __init__(self, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG) -> None:
        self.message = " ".join(str(message).split()) or "unknown error"
        self.status = int(status)
        super().__init__(self.message)

    def __reduce__(self) -> Any:
        return (type(self), (self.message, self.status))


class CloverValueError(CloverError, ValueError):
    """An argument refused (by the Python layer or by libclover: ``CLOVER_ERR_INVALID_ARG``)."""


class CloverTypeError(CloverError, TypeError):
    """An argument of the wrong type."""

    def __init__(self, message: str = "", status: int = N.CLOVER_ERR_INVALID_ARG) -> None:
        super().__init__(message, status)


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
    seed: int | None = None     # the sampler's seed this call used (a fresh random one unless given)
    mode: str = ""              # the last block's: "autoregressive" (B = 1), "diffusion" or "draft-self"
    n_blocks_ar: int = 0        # blocks per mode (block_size="auto" says what it chose)
    n_blocks_diffusion: int = 0
    n_blocks_draft_self: int = 0

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
                   n_decode_forwards=s.n_decode_forwards, mode=N.DECODE_MODES.get(s.mode, ""),
                   n_blocks_ar=s.n_blocks_ar, n_blocks_diffusion=s.n_blocks_diffusion,
                   n_blocks_draft_self=s.n_blocks_draft_self)

    def format(self) -> str:
        """One line for humans (what `clover run` prints after the text)."""
        sw = f" ({self.n_block_switches} switches)" if self.n_block_switches else ""
        reused = f" ({self.n_reused} reused)" if self.n_reused else ""
        mode = f" {self.mode}" if self.mode else ""
        if sum(x > 0 for x in (self.n_blocks_ar, self.n_blocks_diffusion, self.n_blocks_draft_self)) > 1:
            mode += (f" (blocks: {self.n_blocks_ar} autoregressive, {self.n_blocks_diffusion} diffusion, "
                     f"{self.n_blocks_draft_self} draft-self)")
        return (f"[clover] B={self.block_size}{mode}{sw} prompt={self.n_prompt} tok{reused}, generated={self.n_generated} tok, "
                f"blocks={self.n_blocks}, decode passes={self.n_decode_passes} "
                f"({self.tokens_per_forward:.2f} tok/forward), forward passes={self.n_forward}, "
                f"prefill={self.t_prefill_ms:.1f} ms, decode={self.t_decode_ms:.1f} ms "
                f"({self.tokens_per_second:.1f} tok/s), finish={self.finish_reason or 'none'}"
                + (f", cost curve {self.calibration}" if self.calibration else "")
                + (f", draft-self: {self.n_accepted}/{self.n_drafted} drafted tokens accepted, "
                   f"{(self.n_accepted + self.n_verifications) / self.n_verifications:.2f} tok/verification, "
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

    @property
    def seed(self) -> int | None:
        """The sampler's seed the call used: pass it as ``seed`` to reproduce the output."""
        return self.stats.seed


class GenerationStream:
    """Iterator over the output text as it becomes final (after every denoising step: the
    new contiguous unmasked prefix of the block), produced while generation runs in a
    worker thread. After it is exhausted, ``result`` holds the :class:`GenerationResult`.
    ``close()`` (or leaving a ``for`` loop early and dropping it) cancels the generation.
    It holds its Clover object's turn until its decoding ends (see the Clover class doc)."""

    def __init__(self, run: Callable[[Callable[[str, list[int]], bool], threading.Event], GenerationResult],
                 decoder: "_DecodeThread | None" = None, gate: "_Gate | None" = None) -> None:
        self.result: GenerationResult | None = None
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._cancel = threading.Event()
        self._done = False
        self._reader = threading.get_ident()  # the thread reading it (the last to call next)

        def on_piece(piece: str, toks: list[int]) -> bool:
            self._q.put(("piece", piece))
            return self._cancel.is_set()

        self._finished = threading.Event()

        def worker() -> None:
            try:
                res = run(on_piece, self._cancel)
                item: tuple[str, Any] = ("done", res)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                item = ("error", e)
            if gate is not None:  # the object is free before the reader sees the end
                gate.release(self)
            self._q.put(item)
            self._finished.set()

        if gate is not None:
            gate.hand_to(self)
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
        self._reader = threading.get_ident()
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

    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (Sequence, Iterator)):
        raise CloverTypeError(f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}")
    if template is not None and not isinstance(template, str):
        raise CloverTypeError(f"template must be a string or None, got {type(template).__name__}")
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
        raise CloverValueError(str(e)) from None
    if isinstance(logprobs, bool):
        logprobs = 0 if logprobs else None
    n_top = None if logprobs is None else _int("logprobs", logprobs, 0, N.CLOVER_MAX_TOP_LOGPROBS)
    return {"grammar": text, "logprobs": n_top}


# ----------------------------------------------------------------------------- the model

INT32_MAX = 2**31 - 1  # libclover's counts are int32: larger values must not wrap through ctypes
MAX_THREADS = 512      # ggml's GGML_MAX_N_THREADS


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise CloverTypeError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise CloverError(f"{name} must be {rng}, got {v}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise CloverTypeError(f"{name} must be a number, got {v!r}")
    try:
        v = float(v)
    except OverflowError:
        raise CloverValueError(f"{name} is too large: {v}") from None
    if math.isnan(v):
        raise CloverValueError(f"{name} must not be NaN")
    return v


def _bool(name: str, v: Any) -> bool:
    """A flag: a bool, or an integer 0 / 1 (never a string: bool('off') is True)."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and int(v) in (0, 1)):
        return bool(v)
    raise CloverTypeError(f"{name} must be True or False, got {v!r}")


def _tristate(name: str, v: Any) -> int:
    """None / "auto" = -1, False / "off" = 0, True / "on" = 1 (flash_attn)."""
    if v is None:
        return -1
    if isinstance(v, str):
        word = {"auto": -1, "off": 0, "false": 0, "no": 0, "0": 0, "on": 1, "true": 1, "yes": 1, "1": 1}.get(v.strip().lower())
        if word is None:
            raise CloverValueError(f"{name} must be None/'auto', False/'off' or True/'on', got {v!r}")
        return word
    return 1 if _bool(name, v) else 0


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise CloverTypeError(f"{name} must be a string, got {type(v).__name__}")
    return v


def _callable(name: str, v: Any) -> Any:
    if v is not None and not callable(v):
        raise CloverTypeError(f"{name} must be callable or None, got {type(v).__name__}")
    return v


def _strings(name: str, v: Any) -> list[str]:
    """A string or a sequence of strings, as a list."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, (bytes, Mapping)) or not isinstance(v, (Sequence, set, frozenset)) or \
            not all(isinstance(x, str) for x in v):
        raise CloverTypeError(f"{name} must be a string or a list of strings, got {v!r}"[:200])
    return list(v)


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


class _Gate:
    """Serialises the calls on one Clover object's context (see the Clover class doc).

    ``holder`` is the thread (ident) in a call, or the :class:`GenerationStream` decoding; a
    thread may enter again while it holds it (nested calls); others wait, interruptibly. After
    ``closed`` every entry raises "the model is closed". ``cancel`` is the event that cancels
    the generation in flight (set by close)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.holder: Any = None
        self.depth = 0
        self.closed = False
        self.cancel: threading.Event | None = None

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

    def hand_to(self, stream: "GenerationStream") -> None:
        """The calling thread's hold passes to a stream (released when its decoding ends)."""
        with self.cond:
            self.holder, self.depth, self.cancel = stream, 1, stream._cancel

    def release(self, stream: "GenerationStream") -> None:
        with self.cond:
            if self.holder is stream:
                self.holder, self.depth, self.cancel = None, 0, None
                self.cond.notify_all()

    def busy(self) -> bool:
        return self.holder is not None and self.holder != threading.get_ident()


class _ModelRef:
    """A loaded clover_model shared by the Clover objects made with :meth:`Clover.new_context`;
    freed when the last of them closes, once no call is using it (``use``). Its constant
    figures are read once at load."""

    def __init__(self, handle: int) -> None:
        self.handle: int | None = handle
        self.users = 1
        self.active = 0
        self.cond = threading.Condition()
        L = _lib()
        self.n_vocab = int(L.clover_n_vocab(handle))
        self.mask = int(L.clover_mask_token(handle))
        self.eos = int(L.clover_eos_token(handle))
        self.bos = int(L.clover_bos_token(handle))
        self.train_block = int(L.clover_train_block_size(handle))
        self.n_ctx_train = int(L.clover_n_ctx_train(handle))

    def acquire(self) -> int:
        with self.cond:
            if self.handle is None:
                raise CloverError("the model is closed")
            self.users += 1
            return self.handle

    def enter(self) -> int:
        with self.cond:
            if self.handle is None:
                raise CloverError("the model is closed")
            self.active += 1
            return self.handle

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
                    N._lib.clover_model_free(self.handle)
                self.handle = None


class Clover:
    """A Clover GGUF loaded with libclover, plus one decoding context.

    ``n_threads=None`` lets libclover choose from the hardware. ``block_size``: the default B
    of :meth:`generate`; None (default) = "auto" (chosen per block; its cost curve is measured
    once per model file, backend, build and thread count and kept in a disk cache, see
    ``clover.h``); an integer fixes it. ``flash_attn``: None or "auto" = llama.cpp's automatic
    choice, False or "off" off, True or "on" on. ``kv_f32=True`` keeps the KV cache in f32 instead of f16 (with flash_attn=False:
    exact parity runs against the numpy reference). ``rpc_servers``: llama.cpp RPC servers
    ("HOST:PORT", a list or a comma-separated string, each running ``ggml-rpc-server``) that
    hold the offloaded layers (``n_gpu_layers``; the rest stays on this machine's CPU), split by
    ``tensor_split`` (one share per device, RPC servers first) or by their free memory;
    ``override_tensor`` ("PATTERN=BUFFER,...", llama.cpp's -ot) places matching tensors, e.g.
    ``"^output\\.weight=CPU"`` keeps the output head here so that no logits cross the network. A lost
    server makes calls raise :class:`CloverError`; :meth:`reload` loads the model again. Use
    as a context manager or call :meth:`close` (idempotent).

    Errors: every method raises :class:`CloverError` (a bad argument: :class:`CloverValueError`,
    also a ValueError; a wrong type: :class:`CloverTypeError`, also a TypeError).

    Threads: one object may be used from several threads. Calls that use its context
    (generate, chat, block_logits, commit, reset, calibrate, block_size, ...) run one at a
    time, in turn: a call waits while another thread's is in progress. A stream
    (``generate(stream=True)``) holds the context until its decoding ends or it is closed: a
    call from another thread waits for it (it is never cancelled by someone else); a new
    ``generate``/``chat`` (or ``close``) from the thread that reads the stream closes it first
    (that thread has abandoned it); its other calls wait. Tokenizer and metadata calls do not
    wait for decoding. :meth:`close` cancels a generation in flight (at its next denoising step),
    waits for the call in progress (and for tokenizer calls using the model), then frees
    everything; calls made after it, or waiting when it came, raise "the model is closed".
    Distinct objects (:meth:`new_context`) decode in parallel."""

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int = 4096, n_threads: int | None = None,
                 n_gpu_layers: int = 0, block_size: int | None = None, *, flash_attn: bool | str | None = None,
                 kv_f32: bool = False, use_mmap: bool | None = None, verbose: bool = False,
                 rpc_servers: str | Sequence[str] | None = None,
                 tensor_split: Sequence[float] | None = None, override_tensor: str | None = None) -> None:
        self._model: int | None = None
        self._shared: _ModelRef | None = None
        self._ctx: int | None = None
        self._gate = _Gate()
        self._streams: weakref.WeakSet[GenerationStream] = weakref.WeakSet()
        if not isinstance(model_path, (str, os.PathLike)):
            raise CloverTypeError(f"model_path must be a path, got {type(model_path).__name__}")
        self.model_path = Path(model_path)
        self._ctx_args = dict(n_ctx=n_ctx, n_threads=n_threads, block_size=block_size, flash_attn=flash_attn,
                              kv_f32=kv_f32)
        self._context_params()  # bad context arguments fail before anything is loaded
        n_gpu_layers = _int("n_gpu_layers", n_gpu_layers, -1, INT32_MAX)
        if isinstance(rpc_servers, (list, tuple)):
            if not all(isinstance(x, str) for x in rpc_servers):
                raise CloverTypeError(f"rpc_servers must be 'HOST:PORT[,...]' or a list of them, got {rpc_servers!r}")
            rpc_servers = ",".join(rpc_servers)
        if rpc_servers is not None and not isinstance(rpc_servers, str):
            raise CloverTypeError(f"rpc_servers must be 'HOST:PORT[,...]' or a list of them, got {rpc_servers!r}")
        if tensor_split is not None and (isinstance(tensor_split, (str, bytes)) or
                                         not isinstance(tensor_split, (Sequence, np.ndarray))):
            raise CloverTypeError(f"tensor_split must be a list of numbers, got {tensor_split!r}")
        split = [_float("tensor_split", x) for x in tensor_split] if tensor_split is not None else []
        if any(not (0.0 <= x < math.inf) for x in split) or len(split) > 128:
            raise CloverValueError(f"tensor_split must be at most 128 finite shares >= 0, got {split}")
        if override_tensor is not None and not isinstance(override_tensor, str):
            raise CloverTypeError(f"override_tensor must be 'PATTERN=BUFFER[,...]', got {override_tensor!r}")
        for name, v in (("rpc_servers", rpc_servers), ("override_tensor", override_tensor),
                        ("model_path", str(self.model_path))):
            if v is not None and "\0" in v:
                raise CloverValueError(f"{name} must not contain a NUL character")
        self._load_args = dict(n_gpu_layers=n_gpu_layers, use_mmap=None if use_mmap is None else _bool("use_mmap", use_mmap),
                               rpc_servers=rpc_servers or None, tensor_split=split,
                               override_tensor=override_tensor or None)
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
        n_ctx = _int("n_ctx", a["n_ctx"], 3, INT32_MAX)  # (libclover: llama.cpp needs one output per sequence)
        n_threads = None if a["n_threads"] is None else _int("n_threads", a["n_threads"], 1, MAX_THREADS)
        _tristate("flash_attn", a["flash_attn"])
        _bool("kv_f32", a["kv_f32"])
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
        self._shared = _ModelRef(m)
        self._model = m

    def reload(self) -> None:
        """Free the model and context and load them again with the same arguments: after a
        lost RPC server, once it (or a replacement at the same address) is back. Calls waiting
        when it starts raise "the model is closed"."""
        self.close()
        self._gate = _Gate()
        self._gate.enter()
        try:
            self._load_model()
            self._make_context()
        finally:
            self._gate.leave()

    def _make_context(self, own_thread: bool = False) -> None:
        """This object's decoding context, from self._ctx_args, over its loaded model."""
        n_ctx, n_threads, block_size = self._context_params()
        flash_attn, kv_f32 = _tristate("flash_attn", self._ctx_args["flash_attn"]), _bool("kv_f32", self._ctx_args["kv_f32"])
        self._default_block_size: int | str = block_size if block_size is not None else "auto"
        L, m = _lib(), self._model
        err, n = N.err_buffer()
        cp = L.clover_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_threads = n_threads if n_threads is not None else 0
        cp.block_size = block_size or 0
        cp.flash_attn = flash_attn
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
        self._n_ctx = int(L.clover_n_ctx(c))
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
            raise CloverValueError(f"new_context: unknown argument(s) {sorted(unknown)}")
        args = {**self._ctx_args, **overrides}
        with self._model_op():
            assert self._shared is not None
            other = object.__new__(Clover)
            other._ctx = None
            other._model = None
            other._shared = self._shared
            other._gate = _Gate()
            other._streams = weakref.WeakSet()
            other.model_path = self.model_path
            other._load_args = self._load_args
            other._ctx_args = args
            other._context_params()
            other._model = self._shared.acquire()
        other._make_context(own_thread=True)
        return other

    # -- lifetime
    def close(self) -> None:
        """Cancel a generation in flight, wait for the call in progress, free the context and
        the model (once no other object made by :meth:`new_context` uses it). Safe to call more
        than once, from any thread (not from inside this object's own callbacks)."""
        self._not_in_callback()
        gate = getattr(self, "_gate", None)
        if gate is None:
            return
        me = threading.get_ident()
        with gate.cond:
            gate.closed = True  # new calls, and those waiting, raise "the model is closed"
            if gate.cancel is not None:
                gate.cancel.set()
        for st in list(getattr(self, "_streams", ())):
            st._cancel.set()
        with gate.cond:
            while gate.holder is not None and gate.holder != me:
                if gate.cancel is not None:  # (a call that entered just before close)
                    gate.cancel.set()
                gate.cond.wait(0.25)
            if gate.holder is None:
                gate.holder, gate.depth = me, 1  # nobody enters again: closed
        try:
            L = N._lib
            if self._ctx:
                if getattr(self, "_own_decoder", False):
                    self._decoder.stop()
                if L is not None:
                    L.clover_context_free(self._ctx)
                self._ctx = None
            if self._model:
                self._model = None
                if self._shared is not None:
                    self._shared.release()
        finally:
            with gate.cond:
                if gate.holder == me:
                    gate.depth -= 1
                    if gate.depth <= 0:
                        gate.holder, gate.depth = None, 0
                gate.cond.notify_all()

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
        if self.closed:
            state = "closed"
        elif self._gate.busy():
            state = f"busy, n_ctx={self._n_ctx}"
        else:
            state = f"block_size={self.block_size}, n_ctx={self._n_ctx}"
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

    @contextlib.contextmanager
    def _op(self) -> Iterator[int]:
        """A call that uses the context: waits its turn (see the class doc); yields the context."""
        self._not_in_callback()
        self._gate.enter()
        try:
            yield self._c()
        finally:
            self._gate.leave()

    @contextlib.contextmanager
    def _model_op(self) -> Iterator[int]:
        """A call that uses the model only (tokenizer, metadata): no turn to wait for, but the
        model is not freed under it."""
        shared = self._shared
        if shared is None or self._model is None:
            raise CloverError("the model is closed")
        h = shared.enter()
        try:
            if self._model is None:
                raise CloverError("the model is closed")
            yield h
        finally:
            shared.leave()

    def _info(self) -> _ModelRef:
        if self._shared is None or self._model is None:
            raise CloverError("the model is closed")
        return self._shared

    def _not_in_callback(self) -> None:
        # a callback runs inside the native decode loop: touching the context from there
        # (close, reset, block_size, another generate) would pull it out from under the loop
        if getattr(self, "_owner", None) == threading.get_ident():
            raise CloverError("this Clover object cannot be used from inside one of its own callbacks "
                              "(on_step/on_block); return True from the callback to stop instead")

    def _close_my_streams(self) -> None:
        """Close the streams of this object that the calling thread reads (it has abandoned
        them); the others are left to their readers."""
        me = threading.get_ident()
        for st in list(self._streams):
            if st._reader == me and not st._finished.is_set():
                st.close()

    # -- properties
    @property
    def n_vocab(self) -> int:
        return self._info().n_vocab

    @property
    def mask_token(self) -> int:
        return self._info().mask

    @property
    def eos_token(self) -> int:
        return self._info().eos

    @property
    def bos_token(self) -> int:
        return self._info().bos

    @property
    def train_block_size(self) -> int:
        return self._info().train_block

    @property
    def n_ctx_train(self) -> int:
        return self._info().n_ctx_train

    @property
    def n_ctx(self) -> int:
        self._m()
        return self._n_ctx

    @property
    def n_committed(self) -> int:
        with self._op() as c:
            return int(_lib().clover_n_committed(c))

    @property
    def block_size(self) -> int:
        """The context's block size B. Setting it recreates the llama.cpp context (memory cleared)."""
        with self._op() as c:
            return int(_lib().clover_block_size(c))

    @block_size.setter
    def block_size(self, value: int) -> None:
        value = _int("block_size", value, 1, self.n_ctx)
        with self._op() as c:
            err, n = N.err_buffer()
            _check(self._decoder.call(lambda: _lib().clover_set_block_size(c, value, err, n)), err)

    def calibrate(self, fused: bool = False) -> dict[int, float] | dict[int, tuple[float, float]]:
        """Measure the cost curve used by block_size="auto" (bypassing the disk cache):
        {B: ms per block pass} for B = 1, 2, 4, ...; with fused=True {B: (pass ms, ms of a
        commit fused with a pass)}. Clears the memory."""
        fused = _bool("fused", fused)
        with self._op() as c:
            L, err, n = _lib(), *N.err_buffer()
            sizes, cnt = (ctypes.c_int32 * 32)(), ctypes.c_int32(0)
            ms, msf = (ctypes.c_double * 32)(), (ctypes.c_double * 32)()
            _check(self._decoder.call(lambda: L.clover_calibrate(c, sizes, ms, msf, 32, ctypes.byref(cnt), err, n)),
                   err)
            k = min(cnt.value, 32)
            if fused:
                return {int(sizes[i]): (float(ms[i]), float(msf[i])) for i in range(k)}
            return {int(sizes[i]): float(ms[i]) for i in range(k)}

    def set_cost_curve(self, curve: Mapping[int, float], fused: Mapping[int, float] | None = None) -> None:
        """Set the cost curve for block_size="auto" ({1: ms, 2: ms, 4: ms, ...}; fused: the
        cost of a commit fused with a pass, by default that of a pass of 2B, else with the
        same keys) instead of measuring it, e.g. from an earlier :meth:`calibrate`. Costs must
        be in (0, 1e9] ms (libclover's check). Resets the running tokens per pass."""
        if not isinstance(curve, Mapping) or not curve:
            raise CloverTypeError(f"curve must be a non-empty mapping {{block size: ms}}, got {curve!r}"[:200])
        if fused is not None and not isinstance(fused, Mapping):
            raise CloverTypeError(f"fused must be a mapping {{block size: ms}} or None, got {fused!r}"[:200])
        items = sorted((_int("cost curve block size", b, 1, INT32_MAX), _float("cost curve ms", v))
                       for b, v in curve.items())
        msf_items: list[float] | None = None
        if fused is not None:
            fk = {_int("fused block size", b, 1, INT32_MAX): _float("fused ms", v) for b, v in fused.items()}
            if set(fk) != {b for b, _ in items}:
                raise CloverValueError(f"fused must have the block sizes of curve ({sorted(b for b, _ in items)}), "
                                       f"got {sorted(fk)}")
            msf_items = [fk[b] for b, _ in items]
        with self._op() as c:
            err, n = N.err_buffer()
            sizes = N.as_int32_array([b for b, _ in items])
            ms = (ctypes.c_double * len(items))(*[v for _, v in items])
            msf = None if msf_items is None else (ctypes.c_double * len(items))(*msf_items)
            _check(_lib().clover_set_cost_curve(c, sizes, ms, msf, len(items), err, n), err)

    def set_n_threads(self, n_threads: int) -> None:
        n_threads = _int("n_threads", n_threads, 1, MAX_THREADS)
        with self._op() as c:
            _check(_lib().clover_set_n_threads(c, n_threads), None)

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None if absent."""
        k = _str("key", key).encode("utf-8", "surrogateescape")
        if b"\0" in k:
            raise CloverValueError("key must not contain a NUL character")
        L = _lib()
        with self._model_op() as m:
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
                raise CloverValueError(f"text is not valid Unicode: {e.reason} at index {e.start}") from None
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise CloverTypeError(f"expected text (str or bytes), got {type(text).__name__}")
        if len(data) > INT32_MAX - 16:
            raise CloverValueError(f"text too long to tokenize ({len(data)} bytes)")
        add_special, parse_special = _bool("add_special", add_special), _bool("parse_special", parse_special)
        L = _lib()
        cap = len(data) + 16
        with self._model_op() as m:
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
        special = _bool("special", special)
        if not toks:
            self._info()
            return b""
        L = _lib()
        arr = N.as_int32_array(toks)
        cap = 8 * len(toks) + 16
        with self._model_op() as m:
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
        """The bytes of one token (special: render special tokens' text)."""
        token = self._token(token)
        special = _bool("special", special)
        L = _lib()
        with self._model_op() as m:
            buf = ctypes.create_string_buffer(64)
            n_out = ctypes.c_int32(0)
            st = L.clover_token_to_piece(m, token, buf, 64, int(special), ctypes.byref(n_out))
            if st == N.CLOVER_ERR_BUFFER_TOO_SMALL:
                buf = ctypes.create_string_buffer(n_out.value + 1)
                st = L.clover_token_to_piece(m, token, buf, n_out.value + 1, int(special), ctypes.byref(n_out))
        if st < 0:
            _check(st, None, "token_to_piece")
        # clover.h documents "returns the number of bytes written"; the implementation returns
        # CLOVER_OK and reports the count through n_out - accept both
        return buf.raw[: (st if st > 0 else n_out.value)]

    def _token(self, t: Any) -> int:
        """One token id, checked against the vocabulary (never wrapped to 32 bits)."""
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise CloverTypeError(f"a token id must be an integer, got {t!r}"[:200])
        t, nv = int(t), self.n_vocab
        if not 0 <= t < nv:
            raise CloverValueError(f"token id {t} out of range [0, {nv})")
        return t

    def _tokens(self, tokens: Any) -> list[int]:
        """Token ids, each an integer in [0, n_vocab) (values past 32 bits are refused, not wrapped)."""
        if isinstance(tokens, (str, bytes)):
            raise CloverTypeError("expected a sequence of token ids, got text")
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1:
                raise CloverValueError(f"expected a 1-D sequence of token ids, got an array of shape {tokens.shape}")
            if tokens.dtype.kind not in "iu":
                raise CloverTypeError(f"expected integer token ids, got an array of {tokens.dtype}")
            tokens = tokens.tolist()
        try:
            it = iter(tokens)
        except TypeError:
            raise CloverTypeError(f"expected a sequence of token ids, got {type(tokens).__name__}") from None
        nv = self.n_vocab
        out: list[int] = []
        for t in it:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise CloverTypeError(f"expected a sequence of token ids, got an element {t!r}"[:200])
            t = int(t)
            if not 0 <= t < nv:
                raise CloverValueError(f"token id {t} out of range [0, {nv})")
            out.append(t)
        if len(out) > INT32_MAX:
            raise CloverValueError(f"too many tokens ({len(out)})")
        return out

    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        return self._tokens(prompt)

    # -- low level passes
    def reset(self) -> None:
        """Clear the memory (no committed tokens)."""
        with self._op() as c:
            _check(_lib().clover_reset(c), None, "reset")

    def commit(self, tokens: Sequence[int], logits: bool = False) -> np.ndarray | None:
        """Commit tokens (n >= 1) causally at the end of the memory. With ``logits``, returns the
        logits [n, n_vocab] (float32) of the committed positions: row t predicts token t + 1, as
        llama.cpp's causal decoding of the same text gives them."""
        toks = self._tokens(tokens)
        logits = _bool("logits", logits)
        with self._op() as c:
            err, n = N.err_buffer()
            arr = N.as_int32_array(toks)
            out = np.empty((max(len(toks), 1), self.n_vocab), dtype=np.float32) if logits else None
            ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if out is not None else None
            _check(self._decoder.call(lambda: _lib().clover_commit_logits(c, arr, len(toks), ptr, err, n)), err)
            return out[: len(toks)] if out is not None else None

    def last_logits(self) -> np.ndarray:
        """The logits [n_vocab] of the last committed position: the prediction of the next one."""
        with self._op() as c:
            out = np.empty(self.n_vocab, dtype=np.float32)
            if _lib().clover_last_logits(c, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) != 0:
                raise CloverError("nothing is committed")
            return out

    def block_logits(self, tokens: Sequence[int], commit_before: Sequence[int] | None = None) -> np.ndarray:
        """Logits [n, n_vocab] (float32) of a block pass of tokens (1 <= n <= B) against the memory,
        which is left unchanged; row t predicts token t + 1. With ``commit_before``, the memory is
        first reset and those tokens are committed."""
        toks = self._tokens(tokens)
        before = self._tokens(commit_before) if commit_before is not None else None
        with self._op() as c:
            if before is not None:
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
            raise CloverValueError(f"perplexity needs at least {2 * n_ctx} tokens (2 chunks of n_ctx={n_ctx}), "
                                   f"the text has {len(toks)}")
        bos = self.bos_token
        first, nll, count = n_ctx // 2, 0.0, 0
        with self._op():
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
    @property
    def end_of_turn_tokens(self) -> list[int]:
        """The chat end-of-turn token ids (besides EOS) that :meth:`chat` and
        :meth:`generate_chat` stop on: those of ``<|im_end|>``, ``<|eot_id|>`` and ``<|end|>``
        that are single tokens of this model's vocabulary."""
        return list(self._stop_tokens())

    def _stop_tokens(self) -> list[int]:
        """End-of-turn tokens used by chat (besides EOS): :attr:`end_of_turn_tokens`."""
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
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True, stream: bool = False,
                 on_step: StepCallback | None = None, on_block: BlockCallback | None = None,
                 stop_tokens: Sequence[int] = (), stop: str | Sequence[str] = (), reuse_prefix: bool = True,
                 draft_self: bool | str | None = False, draft_steps: int = 1, grammar: str | None = None,
                 logprobs: int | None = None,
                 response_format: Mapping[str, Any] | None = None, _chat_text: str | None = None) -> Any:
        """Block-diffusion generation.

        prompt: text (tokenized with add_special and parse_special) or token ids.
        block_size: B for this call; by default the one given to the constructor, else "auto":
        chosen per block from the cost curve (from the disk cache, else measured on the first
        auto call, see :meth:`calibrate`) and the running tokens per pass (rules in clover.h).
        None = the context's current block size.
        threshold: unmask every masked position whose confidence >= threshold (in [0, 1]).
        max_steps: per-block step cap (0 = none). temperature 0 = greedy (libclover also decodes
        greedily below CLOVER_MIN_TEMPERATURE = 1e-6 and for top_p below 1 / n_vocab, 0 included;
        top_k >= n_vocab is off).
        seed: the sampler's seed; None (default) or -1 = a fresh random seed per call; the seed
        used is in ``result.seed`` (and ``stats.seed``): passing it again reproduces the output.
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
        say how it went; with block_size="auto": B = 1 or draft-self (both lossless). "auto" (or
        None): with block_size="auto" the mode too is chosen per block (B = 1, block diffusion or
        draft-self, the cheapest per token by the cost curve and the running figures); with a
        fixed block size, block diffusion. False (default): block diffusion (auto: B = 1 or block
        diffusion). ``stats.mode`` / ``stats.n_blocks_*`` say what ran. draft_steps: passes per
        draft (1 = one pass, riding on the previous verification's forward; 0 = threshold /
        max_steps as block diffusion).
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
        self._not_in_callback()
        if isinstance(block_size, str) and block_size == "default":
            block_size = self._default_block_size
        kw = self._gen_params(max_tokens, block_size, threshold, max_steps, temperature, top_k, top_p, seed)
        toks = self._prompt_tokens(prompt)
        if stop_tokens is None:
            stop_tokens = ()
        stops = self._tokens(stop_tokens)
        kw.update(stop_strings=_strings("stop", stop), reuse_prefix=_bool("reuse_prefix", reuse_prefix),
                  draft_self=_tristate("draft_self", draft_self),
                  draft_steps=_int("draft_steps", draft_steps, 0, INT32_MAX), chat_text=_chat_text,
                  **_constraint_params(grammar, logprobs, response_format))
        stop_at_eos, stream = _bool("stop_at_eos", stop_at_eos), _bool("stream", stream)
        _callable("on_step", on_step)
        _callable("on_block", on_block)
        if len(toks) + kw["max_tokens"] > self.n_ctx:  # before waiting, and before an output buffer of max_tokens
            raise CloverError(f"prompt ({len(toks)} tokens) + max_tokens ({kw['max_tokens']}) exceeds "
                              f"n_ctx={self.n_ctx}", N.CLOVER_ERR_CONTEXT_FULL)
        self._close_my_streams()  # a stream this thread left unfinished must not keep decoding
        if not stream:
            # on the object's decode thread (see _DecodeThread), in this object's turn; Ctrl-C
            # (or close() from another thread) cancels it at the next denoising step
            with self._op():
                cancel = threading.Event()
                self._gate.cancel = cancel
                return self._decoder.call(
                    lambda: self._run(toks, kw, stop_at_eos, stops, on_step, on_block, None, cancel), cancel)

        def run(push: Callable[[str, list[int]], bool], cancel: threading.Event) -> GenerationResult:
            return self._run(toks, kw, stop_at_eos, stops, on_step, on_block, push, cancel)

        self._gate.enter()  # the stream holds the turn until its decoding ends
        try:
            self._c()
            s = GenerationStream(run, self._decoder, self._gate)
        except BaseException:
            self._gate.leave()
            raise
        self._streams.add(s)
        return s

    def _gen_params(self, max_tokens: Any, block_size: Any, threshold: Any, max_steps: Any, temperature: Any,
                    top_k: Any, top_p: Any, seed: Any) -> dict[str, Any]:
        if seed is None or (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed == -1):
            seed = secrets.randbits(63)  # a fresh seed per call, reported in the result
        kw: dict[str, Any] = dict(max_tokens=_int("max_tokens", max_tokens, 0, INT32_MAX),
                                  max_steps=_int("max_steps", max_steps, 0, INT32_MAX),
                                  top_k=_int("top_k", top_k, 0, INT32_MAX),
                                  seed=_int("seed (None or -1 = random)", seed, 0, 2**64 - 1))
        if isinstance(block_size, str) and block_size == "auto":
            kw["block_size"] = N.CLOVER_BLOCK_SIZE_AUTO
        elif block_size is not None:
            kw["block_size"] = _int("block_size", block_size, 1, INT32_MAX)
        # the ranges libclover accepts (it is the authority and normalises the degenerate values:
        # tiny temperature / top_p = greedy, top_k >= n_vocab = off), checked here before waiting
        th = _float("threshold", threshold)
        if not 0.0 <= th <= 1.0:
            raise CloverValueError(f"threshold must be in [0, 1], got {th}")
        t = _float("temperature", temperature)
        if not 0.0 <= t < math.inf:
            raise CloverValueError(f"temperature must be finite and >= 0, got {t}")
        p = _float("top_p", top_p)
        if not 0.0 <= p <= 1.0:
            raise CloverValueError(f"top_p must be in [0, 1], got {p}")
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
        follow = (push is not None or bool(matcher.stops)) and kw.get("draft_self", 0) != 1
        pieces: list[str] = []
        got: list[int] = []        # final output tokens so far (what the pieces spell)
        stopset = set(stops)
        if stop_at_eos and self.eos_token >= 0:
            prefix_stops = stopset | {self.eos_token}
        else:
            prefix_stops = stopset
        mask, n_prompt, budget = self.mask_token, len(toks), kw["max_tokens"]
        if cancel is not None and cancel.is_set():  # (a stream closed before its turn came)
            return GenerationResult(text="", tokens=[], stats=GenerationStats(n_prompt=n_prompt,
                                                                             finish_reason="cancelled", seed=kw["seed"]))

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

        c_step = N.clover_step_callback(step_cb)
        c_block = N.clover_block_callback(block_cb)
        # (the caller holds this object's turn: see _op / GenerationStream)
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
        gp.draft_self = kw.get("draft_self", 0)
        gp.draft_steps = kw.get("draft_steps", 1)
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
        stats.seed = kw["seed"]
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
        return self.generate_chat(self.format_chat(messages), **gen_kwargs)

    def generate_chat(self, text: str, **gen_kwargs: Any) -> Any:
        """Generate the reply to an already rendered chat prompt (:meth:`format_chat`'s text):
        its tokens are :meth:`chat_tokens`'s (the last exchange's own tokens when ``text``
        continues it, so the memory is reused), and the output stops at EOS or an
        :attr:`end_of_turn_tokens` token (besides any ``stop_tokens`` given). Keyword arguments
        are those of :meth:`generate` (stream=True works); the reply is remembered as this
        object's last chat exchange."""
        text = _str("text", text)
        stops = self._tokens(gen_kwargs.pop("stop_tokens", None) or ()) + self._stop_tokens()
        return self.generate(self.chat_tokens(text), stop_tokens=stops, _chat_text=text, **gen_kwargs)

    def chat_tokens(self, prompt: str) -> list[int]:
        """The tokens of a rendered chat prompt. When it continues the last chat exchange (that
        prompt, then the reply as generated), they are that exchange's tokens followed by the
        new text's: the model reads its own reply's tokens again (as llama.cpp's conversation
        mode does) rather than a re-tokenization that may differ, so the memory is reused."""
        prompt = _str("prompt", prompt)
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

    # -- llama-cpp-python compatible calls (OpenAI-shaped dicts)
    def _llama_kwargs(self, where: str, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any,
                      stop: Any, logprobs: Any, grammar: Any, response_format: Any, stream: Any,
                      neutral: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """generate() keyword arguments for create_completion / create_chat_completion: every
        argument is honoured or refused (a knob Clover's sampler does not have is accepted only
        at its neutral value)."""
        for name, (value, ok) in neutral.items():
            if value is not None and not (value == ok if not isinstance(ok, tuple) else value in ok):
                raise CloverValueError(f"{where}: {name}={value!r} is not supported by Clover; leave it at "
                                       f"{ok if not isinstance(ok, tuple) else ok[0]!r}"[:300])
        kw: dict[str, Any] = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                  stop=_strings("stop", stop), stream=_bool("stream", stream))
        if max_tokens is not None:
            kw["max_tokens"] = _int("max_tokens", max_tokens)
        extra = {"logprobs": logprobs, "grammar": grammar, "response_format": response_format}
        accepts = inspect.signature(self.generate).parameters
        for name, value in extra.items():
            if value is None or value is False:
                continue
            if name not in accepts:
                raise CloverValueError(f"{where}: {name} is not supported by this build of clover_cpp")
            if name == "grammar" and not isinstance(value, str):  # llama_cpp.LlamaGrammar
                value = getattr(value, "_grammar", None) or getattr(value, "grammar", None)
                if not isinstance(value, str):
                    raise CloverTypeError(f"{where}: grammar must be GBNF text or a llama_cpp.LlamaGrammar")
            kw[name] = value
        if kw.get("logprobs") is not None and kw["stream"]:
            raise CloverValueError(f"{where}: logprobs with stream=True is not supported; use stream=False")
        return kw

    def _budget(self, kw: dict[str, Any], n_prompt: int) -> None:
        """max_tokens None or <= 0 (llama-cpp-python): until EOS or the context's end."""
        if kw.get("max_tokens") is None or kw["max_tokens"] <= 0:
            room = self.n_ctx - n_prompt
            B = self._default_block_size
            if isinstance(B, int):
                room = room // B * B
            if room <= 0:
                raise CloverError(f"the prompt ({n_prompt} tokens) leaves no room in n_ctx={self.n_ctx}",
                                  N.CLOVER_ERR_CONTEXT_FULL)
            kw["max_tokens"] = room

    @staticmethod
    def _finish(r: GenerationResult, max_tokens: int) -> str:
        return "length" if r.finish_reason == "max_tokens" or (
            r.finish_reason not in ("eos", "stop") and len(r.tokens) >= max_tokens) else "stop"

    def _completion_logprobs(self, r: GenerationResult, offset: int) -> dict[str, Any] | None:
        if getattr(r, "logprobs", None) is None:
            return None
        pieces = [self.token_to_piece(t).decode("utf-8", "replace") for t in r.tokens]
        offsets, pos = [], offset
        for p in pieces:
            offsets.append(pos)
            pos += len(p)
        tops = getattr(r, "top_logprobs", None) or [[] for _ in r.tokens]
        return {"tokens": pieces, "token_logprobs": list(r.logprobs), "text_offset": offsets,
                "top_logprobs": [{self.token_to_piece(t).decode("utf-8", "replace"): lp for t, lp in row}
                                 for row in tops]}

    def _chat_logprobs(self, r: GenerationResult) -> dict[str, Any] | None:
        if getattr(r, "logprobs", None) is None:
            return None
        tops = getattr(r, "top_logprobs", None) or [[] for _ in r.tokens]

        def entry(t: int, lp: float) -> dict[str, Any]:
            b = self.token_to_piece(t)
            return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in row]}
                            for t, lp, row in zip(r.tokens, r.logprobs, tops)]}

    def create_completion(self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float | None = None,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | Sequence[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                          stopping_criteria: Any = None, logits_processor: Any = None, grammar: Any = None,
                          logit_bias: Mapping[int, float] | None = None, **gen_kwargs: Any) -> Any:
        """llama-cpp-python's ``Llama.create_completion``: the same arguments and defaults
        (temperature 0.8, top_p 0.95, top_k 40, max_tokens 16; None or <= 0 = until EOS or the
        context's end) and an OpenAI-shaped ``text_completion`` dict, or with ``stream=True`` an
        iterator of ``text_completion`` chunks (the last one carries ``finish_reason``).
        Arguments Clover's sampler lacks (min_p, typical_p, penalties, mirostat, tfs_z,
        logit_bias, suffix, stopping_criteria, logits_processor) are refused unless left at
        their neutral values; ``logprobs`` / ``grammar`` need a build whose generate() has them.
        Extra keyword arguments go to :meth:`generate` (block_size, threshold, ...)."""
        where = "create_completion"
        kw = self._llama_kwargs(where, max_tokens, temperature, top_p, top_k, seed, stop, logprobs, grammar, None,
                                stream, {"suffix": (suffix, None), "min_p": (min_p, (0.0, None)),
                                         "typical_p": (typical_p, 1.0), "frequency_penalty": (frequency_penalty, 0.0),
                                         "presence_penalty": (presence_penalty, 0.0),
                                         "repeat_penalty": (repeat_penalty, 1.0), "tfs_z": (tfs_z, 1.0),
                                         "mirostat_mode": (mirostat_mode, 0),
                                         "stopping_criteria": (stopping_criteria, None),
                                         "logits_processor": (logits_processor, None),
                                         "logit_bias": (logit_bias or None, None)})
        if isinstance(prompt, str):
            prompt_text, toks = prompt, self.tokenize(prompt, add_special=True, parse_special=True)
        else:
            toks = self._tokens(prompt)
            prompt_text = self.detokenize(toks)
        self._budget(kw, len(toks))
        echo = _bool("echo", echo)
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model if isinstance(model, str) else str(self.model_path)}
        if kw["stream"]:
            s = self.generate(toks, **kw, **gen_kwargs)

            def chunks() -> Iterator[dict[str, Any]]:
                with s:
                    if echo and prompt_text:
                        yield {**head, "choices": [{"text": prompt_text, "index": 0, "logprobs": None,
                                                    "finish_reason": None}]}
                    for piece in s:
                        yield {**head, "choices": [{"text": piece, "index": 0, "logprobs": None,
                                                    "finish_reason": None}]}
                assert s.result is not None
                yield {**head, "choices": [{"text": "", "index": 0, "logprobs": None,
                                            "finish_reason": self._finish(s.result, kw["max_tokens"])}]}
            return chunks()
        r = self.generate(toks, **kw, **gen_kwargs)
        text = (prompt_text if echo else "") + r.text
        return {**head, "choices": [{"text": text, "index": 0,
                                     "logprobs": self._completion_logprobs(r, len(prompt_text) if echo else 0),
                                     "finish_reason": self._finish(r, kw["max_tokens"])}],
                "usage": {"prompt_tokens": len(toks), "completion_tokens": len(r.tokens),
                          "total_tokens": len(toks) + len(r.tokens)}}

    def __call__(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """``create_completion`` (as ``Llama.__call__``)."""
        return self.create_completion(prompt, **kwargs)

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], functions: Any = None,
                               function_call: Any = None, tools: Any = None, tool_choice: Any = None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float | None = None, typical_p: float = 1.0, stream: bool = False,
                               stop: str | Sequence[str] | None = None, seed: int | None = None,
                               response_format: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                               logits_processor: Any = None, grammar: Any = None,
                               logit_bias: Mapping[int, float] | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None, **gen_kwargs: Any) -> Any:
        """llama-cpp-python's ``Llama.create_chat_completion``: the messages rendered with the
        model's chat template (:meth:`chat`), the same arguments and defaults (temperature 0.2,
        top_p 0.95, top_k 40, max_tokens None = until the end of the turn or of the context), and
        an OpenAI-shaped ``chat.completion`` dict, or with ``stream=True`` an iterator of
        ``chat.completion.chunk`` dicts (first delta: the role; last: ``finish_reason``).
        Tool / function calling is refused (``clover serve`` has it); arguments Clover's sampler
        lacks are refused unless neutral (see :meth:`create_completion`)."""
        where = "create_chat_completion"
        if logprobs is not None:
            logprobs = _bool("logprobs", logprobs)
        if top_logprobs is not None and not logprobs:
            raise CloverValueError(f"{where}: top_logprobs needs logprobs=True")
        n_lp = (_int("top_logprobs", top_logprobs, 0, 20) if top_logprobs is not None else 0) if logprobs else None
        kw = self._llama_kwargs(where, max_tokens, temperature, top_p, top_k, seed, stop, n_lp, grammar,
                                response_format, stream,
                                {"functions": (functions, None), "function_call": (function_call, None),
                                 "tools": (tools or None, None), "tool_choice": (tool_choice, (None, "none", "auto")),
                                 "min_p": (min_p, (0.0, None)), "typical_p": (typical_p, 1.0),
                                 "frequency_penalty": (frequency_penalty, 0.0),
                                 "presence_penalty": (presence_penalty, 0.0), "repeat_penalty": (repeat_penalty, 1.0),
                                 "tfs_z": (tfs_z, 1.0), "mirostat_mode": (mirostat_mode, 0),
                                 "logits_processor": (logits_processor, None), "logit_bias": (logit_bias or None, None)})
        prompt = self.format_chat(messages)
        toks = self.chat_tokens(prompt)
        self._budget(kw, len(toks))
        head = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()),
                "model": model if isinstance(model, str) else str(self.model_path)}
        if kw["stream"]:
            s = self.chat(messages, **kw, **gen_kwargs)

            def chunks() -> Iterator[dict[str, Any]]:
                obj = {**head, "object": "chat.completion.chunk"}
                with s:
                    yield {**obj, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                               "finish_reason": None}]}
                    for piece in s:
                        yield {**obj, "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                                   "finish_reason": None}]}
                assert s.result is not None
                yield {**obj, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                           "finish_reason": self._finish(s.result, kw["max_tokens"])}]}
            return chunks()
        r = self.chat(messages, **kw, **gen_kwargs)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": self._chat_logprobs(r), "finish_reason": self._finish(r, kw["max_tokens"])}],
                "usage": {"prompt_tokens": r.stats.n_prompt, "completion_tokens": len(r.tokens),
                          "total_tokens": r.stats.n_prompt + len(r.tokens)}}
