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

The runtime's parts: :mod:`.errors`, :mod:`._args` (argument checks), :mod:`._handles` (model
and context ownership, buffer sizes), :mod:`.decoding` (decode thread, one generation, stream,
results), :mod:`.output` (stop strings, output following), :mod:`.chat` (templates, the chat
calls), :mod:`.passes` (commits, block passes, perplexity, cost curve), :mod:`.compat`
(llama-cpp-python's calls); this module is the :class:`Clover` class. libclover owns the rules:
parameter ranges and defaults, "does it fit" (:meth:`Clover.room`), stop tokens and strings.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Union

import numpy as np

from . import _handles as H
from . import _native as N
from . import chat as C
from . import decoding as D
from . import passes as P
from ._args import INT32_MAX, MAX_THREADS, bool_arg, callable_arg, int32_arg, int_arg, str_arg, text_bytes, token_id, \
    token_ids, tristate_arg
from .chat import CHATML_TEMPLATE, ChatExchange, ChatState, render_chat, template_override
from .compat import LLAMA_DEFAULT_SEED, POOLING_UNSPECIFIED, CloverTokenizer, CompatState, LlamaCalls, LlamaSettings, \
    LlamaState
from .decoding import BlockCallback, DecodeThread, DraftCallback, Generation, GenerationResult, GenerationStats, \
    GenerationStream, GenParams, Perplexity, StepCallback, shared_decoder
from .errors import CloverError, CloverTypeError, CloverValueError, check, current_verbosity, lib, set_verbosity
from .openai_reply import PromptLogprobs
from .output import OutputFollower

__all__ = [
    "Clover", "CloverError", "CloverValueError", "CloverTypeError", "GenerationResult", "GenerationStats", "GenerationStream",
    "StepCallback", "BlockCallback", "set_verbosity", "render_chat", "ChatExchange", "Perplexity",
]

Prompt = Union[str, Sequence[int], np.ndarray]

# names kept where they were (clover_cpp.model) before the runtime was cut by job
StopMatcher = OutputFollower
_current_verbosity = current_verbosity  # (_lib.py's)
__all__ += ["CHATML_TEMPLATE", "StopMatcher"]


def coreset_value(value: Any) -> int:
    """A coreset argument as libclover's value: None or 0 = off (0), "model" = CLOVER_CORESET_MODEL,
    "auto" = CLOVER_CORESET_AUTO (measured: spec/decoding.md, "The block expert coreset"), an int N >= 1 = N; the
    range is libclover's (clover_context_params_check's message)."""
    if value is None:
        return 0
    if isinstance(value, str):
        if value in ("model", "auto"):
            return N.CLOVER_CORESET_MODEL if value == "model" else N.CLOVER_CORESET_AUTO
        raise CloverValueError(f"coreset must be an integer >= 0, None, 'auto' or 'model', got {value!r}",
                               N.CLOVER_ERR_INVALID_ARG, param="coreset")
    v = int32_arg("coreset", value)
    cp = N.clover_context_default_params()
    cp.coreset = v
    err, n = N.err_buffer()
    if N.clover_context_params_check(ctypes.byref(cp), err, n) != N.CLOVER_OK:
        raise CloverValueError(err.value.decode(), N.CLOVER_ERR_INVALID_ARG, param="coreset")
    return v


class Clover:
    """A Clover GGUF loaded with libclover, plus one decoding context.

    ``n_threads=None`` lets libclover choose from the hardware. ``block_size``: the default B
    of :meth:`generate`; None (default) = "auto" (chosen per block; its cost curve is measured
    once per model file, backend, build and thread count and kept in a disk cache, see
    ``clover.h``); an integer fixes it. ``flash_attn``: None or "auto" = llama.cpp's automatic
    choice, False or "off" off, True or "on" on. ``chat_template``: the chat template to render
    instead of the GGUF's (Jinja text, or a name: "chatml"; llama-server's --chat-template; it wins
    over ``chat_format``). ``kv_f32=True`` keeps the KV cache in f32 instead of f16 (with flash_attn=False:
    exact parity runs against the numpy reference). ``rpc_servers``: llama.cpp RPC servers
    ("HOST:PORT", a list or a comma-separated string, each running ``ggml-rpc-server``) that
    hold the offloaded layers (``n_gpu_layers``; the rest stays on this machine's CPU), split by
    ``tensor_split`` (one share per device, RPC servers first) or by their free memory;
    ``override_tensor`` ("PATTERN=BUFFER,...", llama.cpp's -ot) places matching tensors, e.g.
    ``"^output\\.weight=CPU"`` keeps the output head here so that no logits cross the network. A lost
    server makes calls raise :class:`CloverError`; :meth:`reload` loads the model again.
    ``expert_stats=True`` counts the routed experts of every block pass (``stats.experts_per_pass``,
    ``expert_bytes_per_pass``): llama.cpp's scheduler then stops after each MoE layer's expert
    selection of a pass to read it, so leave it off when timing. Use as a context manager or call
    :meth:`close` (idempotent).

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

    cache: Any = None  # set_cache's
    # llama-cpp-python's Llama._is_recurrent / _is_hybrid: clover and qwen35moe both keep a
    # recurrent state beside their attention layers' KV cache
    _is_recurrent = False
    _is_hybrid = True

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int = 4096, n_threads: int | None = None,
                 n_gpu_layers: int = 0, *, block_size: int | str | None = None, flash_attn: bool | str | None = None,
                 kv_f32: bool = False, use_mmap: bool | None = None, use_mlock: bool = False, verbose: bool = False,
                 seed: int = LLAMA_DEFAULT_SEED, n_batch: int = 512, n_ubatch: int = 512, logits_all: bool = False,
                 embedding: bool = False, pooling_type: int = POOLING_UNSPECIFIED, chat_format: str | None = None,
                 chat_handler: Any = None, chat_template: str | None = None,
                 rpc_servers: str | Sequence[str] | None = None,
                 tensor_split: Sequence[float] | None = None, override_tensor: str | None = None,
                 coreset: int | str | None = "model", expert_stats: bool = False, _model: H.ModelRef | None = None,
                 **llama_kwargs: Any) -> None:
        # (_model: new_context's, a loaded model this object shares instead of loading one)
        lib()  # (a missing libclover: a CloverError, before anything else)
        self._model: H.ModelRef | None = None  # (_shared while this object uses it)
        self._shared: H.ModelRef | None = None
        self._ctx: H.ContextRef | None = None
        self._owner: int | None = None  # the thread in this object's native decode loop (callbacks)
        self._gate = H.Gate()
        self._streams: weakref.WeakSet[GenerationStream] = weakref.WeakSet()
        self._chat = ChatState()
        if not isinstance(model_path, (str, os.PathLike)):
            raise CloverTypeError(f"model_path must be a path, got {type(model_path).__name__}")
        self.model_path = Path(model_path)
        self._metadata: dict[str, str] | None = None
        self._ctx_args = H.ContextArgs(n_ctx, n_threads, block_size, flash_attn, kv_f32, expert_stats)
        self._ctx_args.checked()  # bad context arguments fail before anything is loaded
        self._coreset_arg = coreset_value(coreset)
        self._load_args = H.LoadArgs.of(n_gpu_layers, use_mmap, rpc_servers, tensor_split, override_tensor, use_mlock)
        settings = LlamaSettings.of(seed, n_batch, n_ubatch, logits_all, embedding, pooling_type, chat_format,
                                    chat_handler, llama_kwargs, n_threads)
        self._compat = CompatState(settings, n_threads, self._load_args.n_gpu_layers, self._load_args.use_mmap)
        self._template_override = template_override(chat_template, settings.chat_format)
        self.verbose = bool_arg("verbose", verbose)
        if _model is None:
            H.check_model_path(self.model_path)
            if self.verbose:
                set_verbosity(max(current_verbosity(), 1))
            self._shared = H.ModelRef.load(self.model_path, self._load_args)
            self._model = self._shared
        else:
            _model.acquire()
            self._shared = self._model = _model
        self._make_context(own_thread=_model is not None)

    def _apply_coreset(self, c: H.ContextRef, value: int) -> None:
        c.checked(N.clover_set_coreset, value)

    @property
    def coreset(self) -> int:
        """The block expert coreset C of this context's block passes (0 = off; spec/model.md,
        "MoE"): each MoE layer of a canvas routes among the C experts of highest summed router
        probability only; committed tokens keep full routing, so draft-self's output never
        changes. Set it to N, None or 0 (off), "auto" (measured at the first generation: the first of
        3 k, 4 k, 6 k below the expert count whose pass is 10% faster and agrees with full routing,
        else off; -2 until then; spec/decoding.md) or "model" (the GGUF's clover.expert_coreset)."""
        with self._op() as c:
            return int(N.clover_coreset(c.ptr))

    @coreset.setter
    def coreset(self, value: int | str | None) -> None:
        v = coreset_value(value)
        with self._op() as c:
            self._apply_coreset(c, v)

    def _make_context(self, own_thread: bool = False) -> None:
        """This object's decoding context, from self._ctx_args, over its loaded model."""
        assert self._model is not None and self._shared is not None
        try:
            c = H.ContextRef.new(self._shared, self._ctx_args, DecodeThread() if own_thread else shared_decoder(),
                                 own_thread)
        except BaseException:
            self._model = None
            self._shared.release()
            raise
        B = self._ctx_args.checked()[2]
        self._default_block_size: int | str = B if B is not None else H.BLOCK_SIZE_AUTO
        self._n_ctx = int(N.clover_n_ctx(c.ptr))
        self._ctx = c
        if self._coreset_arg != N.CLOVER_CORESET_MODEL:  # (the context's default is the model's)
            self._apply_coreset(c, self._coreset_arg)
        self._chat = ChatState()

    def reload(self) -> None:
        """Free the model and context and load them again with the same arguments: after a
        lost RPC server, once it (or a replacement at the same address) is back. Calls waiting
        when it starts raise "the model is closed"."""
        self.close()
        self._gate = H.Gate()
        self._gate.enter()
        try:
            self._shared = H.ModelRef.load(self.model_path, self._load_args)
            self._model = self._shared
            self._make_context()
        finally:
            self._gate.leave()

    def new_context(self, **overrides: Any) -> "Clover":
        """Another Clover over the same loaded model, with its own context (memory, block
        size, cost curve), e.g. one per concurrent request. Keyword arguments override this
        object's n_ctx, n_threads, block_size, flash_attn, kv_f32, expert_stats. The model is freed when
        the last of the objects sharing it closes. The new context decodes on a thread of its own,
        so distinct contexts may run in parallel (give them n_threads that add up to at most the
        cores: OpenMP slows down sharply when its threads outnumber them)."""
        unknown = set(overrides) - {f.name for f in fields(H.ContextArgs)}
        if unknown:
            raise CloverValueError(f"new_context: unknown argument(s) {sorted(unknown)}")
        a, la = replace(self._ctx_args, **overrides), self._load_args
        a.checked()
        with self._model_op():
            ls = self._compat.settings
            return Clover(self.model_path, a.n_ctx, a.n_threads, la.n_gpu_layers, block_size=a.block_size,
                          flash_attn=a.flash_attn, kv_f32=a.kv_f32, expert_stats=a.expert_stats, use_mmap=la.use_mmap,
                          use_mlock=la.use_mlock, rpc_servers=la.rpc_servers, tensor_split=la.tensor_split,
                          override_tensor=la.override_tensor, seed=ls.seed if ls.seed is not None else -1,
                          n_batch=ls.n_batch, n_ubatch=ls.n_ubatch, logits_all=ls.logits_all,
                          embedding=ls.embedding, pooling_type=ls.pooling_type, chat_format=ls.chat_format,
                          chat_template=self._template_override,
                          _model=self._info())

    # -- lifetime
    def close(self) -> None:
        """Cancel a generation in flight, wait for the call in progress, free the context and
        the model (once no other object made by :meth:`new_context` uses it). Safe to call more
        than once, from any thread (not from inside this object's own callbacks)."""
        self._not_in_callback()
        gate = getattr(self, "_gate", None)
        if gate is None:
            return
        for st in list(getattr(self, "_streams", ())):
            st._cancel.set()
        gate.close()  # new calls, and those waiting, raise "the model is closed"; this one holds it
        try:
            compat = getattr(self, "_compat", None)
            if compat is not None and compat.embedder is not None:
                compat.embedder.close()
                compat.embedder = None
            if self._ctx:
                self._ctx.free()
                self._ctx = None
            if self._model:
                self._model = None
                if self._shared is not None:
                    self._shared.release()
        finally:
            gate.leave()

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

    def _m(self) -> H.ModelRef:
        if self._model is None or self._ctx is None:
            raise CloverError("the model is closed")
        return self._model

    def _c(self) -> H.ContextRef:
        self._m()
        self._not_in_callback()
        assert self._ctx is not None
        return self._ctx

    @contextlib.contextmanager
    def _op(self) -> Iterator[H.ContextRef]:
        """A call that uses the context: waits its turn (see the class doc); yields the context."""
        self._not_in_callback()
        self._gate.enter()
        try:
            yield self._c()
        finally:
            self._gate.leave()

    @contextlib.contextmanager
    def _model_op(self) -> Iterator[H.ModelRef]:
        """A call that uses the model only (tokenizer, metadata): no turn to wait for, but the
        model is not freed under it."""
        shared = self._shared
        if shared is None or self._model is None:
            raise CloverError("the model is closed")
        shared.enter()
        try:
            if self._model is None:
                raise CloverError("the model is closed")
            yield shared
        finally:
            shared.leave()

    def _info(self) -> H.ModelRef:
        if self._shared is None or self._model is None:
            raise CloverError("the model is closed")
        return self._shared

    def _not_in_callback(self) -> None:
        # a callback runs inside the native decode loop: touching the context from there
        # (close, reset, block_size, another generate) would pull it out from under the loop
        if getattr(self, "_owner", None) == threading.get_ident():
            raise CloverError("this Clover object cannot be used from inside one of its own callbacks "
                              "(on_step/on_block); return True from the callback to stop instead")

    @contextlib.contextmanager
    def _in_native(self) -> Iterator[None]:
        """Around the native decode loop: its callbacks run on this thread (see _not_in_callback)."""
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None

    def _close_my_streams(self) -> None:
        """Close the streams of this object that the calling thread reads (it has abandoned
        them); the others are left to their readers."""
        me = threading.get_ident()
        for st in list(self._streams):
            if st._reader == me and not st._finished.is_set():
                st.close()

    # -- properties (llama-cpp-python's are methods: n_vocab(), n_ctx(), token_eos(), ...)
    def n_vocab(self) -> int:
        return self._info().n_vocab

    def token_eos(self) -> int:
        """The end-of-sequence token (llama-cpp-python's; -1 if none)."""
        return self.eos_token

    def token_bos(self) -> int:
        """The beginning-of-sequence token (llama-cpp-python's; -1 if the model adds none)."""
        return self.bos_token

    def token_nl(self) -> int:
        """The token of "\\n" (llama-cpp-python's: llama.cpp's newline token)."""
        toks = self.tokenize(b"\n", add_bos=False, special=False)
        return toks[0] if len(toks) == 1 else -1

    def n_embd(self) -> int:
        """The embedding width (the GGUF's ``clover.embedding_length``)."""
        return int(self.metadata["clover.embedding_length"])

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

    def n_ctx(self) -> int:
        """The context's size in positions (llama-cpp-python's n_ctx())."""
        self._m()
        return self._n_ctx

    @property
    def n_committed(self) -> int:
        with self._op() as c:
            return int(N.clover_n_committed(c.ptr))

    @property
    def committed_tokens(self) -> list[int]:
        """The tokens the context's memory holds (clover_committed_tokens): after a generation,
        the prompt and every finished block but the last; a prompt that starts with them reuses
        them (prefix reuse)."""
        with self._op() as c:
            return H.committed_tokens(c)

    @property
    def block_size(self) -> int:
        """The context's block size B. Setting it recreates the llama.cpp context (memory cleared)."""
        with self._op() as c:
            return int(N.clover_block_size(c.ptr))

    @block_size.setter
    def block_size(self, value: int) -> None:
        value = int_arg("block_size", value, 1, self.n_ctx())
        with self._op() as c:
            c.checked(N.clover_set_block_size, value, hop=True)

    def room(self, n_prompt: int, block_size: int | str | None = "default", draft_self: bool | str | None = False) -> int:
        """The largest ``max_tokens`` a generation after ``n_prompt`` prompt tokens may ask for
        (0 when none fits): libclover's rule (clover_generate_room: the rest of the context, in
        whole blocks of a fixed block size; "auto" / None and draft-self need no whole blocks).
        block_size "default" = this object's."""
        n_prompt, ds = int_arg("n_prompt", n_prompt, 0, INT32_MAX), tristate_arg("draft_self", draft_self)
        B = self._block_size_arg(block_size)
        B = B if B is None or isinstance(B, str) else int_arg("block_size", B, 1, INT32_MAX)
        with self._op() as c:
            return D.room(c, n_prompt, D.room_params(B, ds))

    def fits(self, n_prompt: int, max_tokens: int, block_size: int | str | None = "default",
             draft_self: bool | str | None = False) -> bool:
        """Whether a generation of ``max_tokens`` after ``n_prompt`` prompt tokens fits the
        context (see :meth:`room`)."""
        return int_arg("max_tokens", max_tokens, 0, INT32_MAX) <= self.room(n_prompt, block_size, draft_self)

    def _block_size_arg(self, block_size: Any) -> Any:
        return self._default_block_size if isinstance(block_size, str) and block_size == "default" else block_size
    def set_n_threads(self, n_threads: int) -> None:
        n_threads = int_arg("n_threads", n_threads, 1, MAX_THREADS)
        with self._op() as c:
            check(N.clover_set_n_threads(c.ptr, n_threads), None)

    @property
    def metadata(self) -> dict[str, str]:
        """The GGUF's metadata, every key but the arrays, as llama.cpp renders them into strings
        (llama-cpp-python's ``Llama.metadata``). Read once; a copy per access."""
        if self._metadata is None:
            keys = H.metadata_keys(self.model_path)
            with self._model_op() as m:
                got = {k: H.metadata(m, k.encode("utf-8", "surrogateescape")) for k in keys}
            self._metadata = {k: v for k, v in got.items() if v is not None}
        return dict(self._metadata)

    @property
    def chat_template(self) -> str | None:
        """The chat template chats render (:attr:`chat_template_source` says whose); None: the GGUF
        has none and none was given, so chats render ChatML."""
        if self._template_override is not None:
            return self._template_override
        return self.metadata.get("tokenizer.chat_template")

    @property
    def chat_template_source(self) -> str:
        """Whose :attr:`chat_template` it is: "given" (chat_template= / chat_format="chatml"),
        "model" (the GGUF's tokenizer.chat_template) or "default" (ChatML: the GGUF has none)."""
        if self._template_override is not None:
            return "given"
        return "model" if self.metadata.get("tokenizer.chat_template") else "default"

    # -- llama-cpp-python's calls (compat.py)
    def tokenizer(self) -> CloverTokenizer:
        """llama-cpp-python's ``Llama.tokenizer()``: a ``LlamaTokenizer``-like object over this model."""
        return CloverTokenizer(self)

    def set_cache(self, cache: Any) -> None:
        """llama-cpp-python's ``Llama.set_cache``: a ``LlamaRAMCache`` / ``LlamaDiskCache`` (or any
        mapping from token lists to states whose lookup takes the longest cached prefix, raising
        KeyError for none). create_completion then starts from the cached state of the longest
        prefix of its prompt when that is longer than what the memory already holds, and caches
        the state after each completion (prompt and reply), as llama-cpp-python's does; None: off."""
        self.cache = cache

    def prompt_logprobs(self, prompt: str | Sequence[int], top_logprobs: int = 0) -> PromptLogprobs:
        """The log-probability of each token of ``prompt`` (text: tokenized as generate() does)
        given the ones before it, from the causal commit of the prompt (the log-softmax, in
        double precision and the mask token excluded, of the logits row that predicts it, as
        generate()'s ``logprobs`` are read), and the ``top_logprobs`` most probable there (at
        most CLOVER_MAX_TOP_LOGPROBS). What lm-eval's loglikelihood scores; llama-cpp-python's
        ``create_completion(echo=True, logprobs=N)`` reports it. Leaves the memory holding the
        prompt (a generate() of a prompt that starts with it reads none of it again)."""
        return self._llama_calls().prompt_logprobs(prompt, top_logprobs)

    def save_state(self) -> LlamaState:
        """The context's memory as a :class:`LlamaState` (llama-cpp-python's fields; its
        ``llama_state`` holds libclover's state bytes: llama.cpp's state of the memory with the
        committed tokens and the last logits): :meth:`load_state` puts it back, and a generation
        then continues exactly as it would have without the calls in between (greedy: the same
        tokens; none of the saved tokens is read again)."""
        return self._llama_calls().save_state()

    def load_state(self, state: LlamaState) -> None:
        """Restore a :meth:`save_state` of this model (into this or another context of it, any
        block size): the memory, its tokens and last logits come from ``llama_state`` without a
        forward pass, and the default seed is the state's. Bytes of another model or KV type, of
        llama-cpp-python's own ``Llama``, truncated or damaged: one CloverValueError, the memory
        unchanged."""
        self._llama_calls().load_state(state)

    def set_seed(self, seed: int) -> None:
        """The default seed of the following calls (llama-cpp-python's)."""
        self._llama_calls().set_seed(seed)

    def eval(self, tokens: Sequence[int]) -> None:
        """llama-cpp-python's ``Llama.eval``: commit ``tokens`` causally after the memory (after
        :meth:`reset`: from the start); :meth:`sample` then draws the next token."""
        toks = self._tokens(tokens)
        if toks:
            self.commit(toks)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor: Any = None,
               grammar: Any = None, idx: int | None = None) -> int:
        """llama-cpp-python's ``Llama.sample``: the next token after the memory, drawn by its chain
        of llama.cpp's samplers (:mod:`.llama_sample`; the seed: the constructor's or
        :meth:`set_seed`'s, random when none) from the last committed position's logits (the mask
        token excluded); the penalties count the last 64 committed tokens. tfs_z (gone from
        llama.cpp) and penalize_nl are accepted and have no effect, as in llama-cpp-python;
        logits_processor and grammar are refused; idx: None or the last committed position
        (``n_tokens - 1``), the only one whose logits are kept."""
        return self._llama_calls().sample(top_k, top_p, min_p, typical_p, temp, repeat_penalty,
                                          frequency_penalty, presence_penalty, tfs_z, mirostat_mode,
                                          mirostat_eta, mirostat_tau, penalize_nl, logits_processor, grammar,
                                          idx)

    def generate_tokens(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                        typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                        frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                        mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                        penalize_nl: bool = True, logits_processor: Any = None, stopping_criteria: Any = None,
                        grammar: Any = None) -> Iterator[int]:
        """llama-cpp-python's ``Llama.generate`` (its arguments and defaults; Clover's
        :meth:`generate` is block diffusion): a generator of the tokens :meth:`sample` draws one at
        a time after ``tokens`` are committed causally. With ``reset`` the memory is kept when it
        holds a prefix of ``tokens`` (all of them: the first token is drawn from the logits already
        there, nothing is decoded again), else cleared first; reset=False commits after the
        memory. Each drawn token is committed when the generator resumes. Sending tokens in
        (llama-cpp-python's draft verification) and stopping_criteria are refused."""
        yield from self._llama_calls().generate_tokens(tokens, top_k, top_p, min_p, typical_p, temp,
                                                       repeat_penalty, reset, frequency_penalty,
                                                       presence_penalty, tfs_z, mirostat_mode, mirostat_tau,
                                                       mirostat_eta, penalize_nl, logits_processor,
                                                       stopping_criteria, grammar)

    @property
    def n_tokens(self) -> int:
        """The tokens in the memory (llama-cpp-python's ``Llama.n_tokens``)."""
        return len(self.committed_tokens)

    @property
    def input_ids(self) -> np.ndarray:
        """The tokens in the memory as llama-cpp-python's ``Llama.input_ids[:n_tokens]`` (intc)."""
        return np.asarray(self.committed_tokens, dtype=np.intc)

    def pooling_type(self) -> int:
        """The pooling of :meth:`embed` (llama.cpp's enum llama_pooling_type; mean unless the
        constructor's pooling_type said otherwise)."""
        return self._llama_calls().pooling_type()

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False) -> Any:  # noqa: A002 - llama-cpp-python's name
        """llama-cpp-python's ``Llama.embed``: the embedding of a text (a list of floats), or of
        each text of a list, pooled as ``pooling_type`` says (mean by default; NONE: one per
        token); normalize: unit length; truncate: at n_batch tokens. Needs embedding=True."""
        return self._llama_calls().embed(input, normalize, truncate, return_count)

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict[str, Any]:
        """llama-cpp-python's ``Llama.create_embedding``: OpenAI's embedding list
        (``{"object": "list", "data": [{"object": "embedding", "embedding": [...], "index": i}],
        "model", "usage"}``). Needs embedding=True."""
        return self._llama_calls().create_embedding(input, model)

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None, additional_files: list[str] | None = None,
                        local_dir: str | os.PathLike[str] | None = None, local_dir_use_symlinks: bool | str = "auto",
                        cache_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """llama-cpp-python's ``Llama.from_pretrained``: the one GGUF of the Hugging Face
        repository ``repo_id`` whose path matches the glob ``filename`` (and each of
        ``additional_files``: a split GGUF's other shards), fetched by huggingface_hub into
        ``local_dir`` or its cache (``cache_dir``; with HF_HUB_OFFLINE=1 only the cache is read),
        then loaded with ``kwargs``. local_dir_use_symlinks: accepted, no effect (huggingface_hub
        dropped it)."""
        from .hub import pretrained_files  # noqa: PLC0415

        return cls(pretrained_files(repo_id, filename, additional_files, local_dir, cache_dir), **kwargs)

    def create_completion(self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
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
        min_p (0.05), typical_p, the penalties, mirostat and logit_bias are llama.cpp's sampler
        chain (spec/decoding.md, "Sampler chain"; top_n_sigma, xtc_*, dry_*, samplers as extra
        keywords); tfs_z (gone from llama.cpp), suffix, stopping_criteria and logits_processor are
        refused unless left at their neutral values; ``logprobs`` / ``grammar`` need a build whose
        generate() has them.
        ``logprobs=N`` gives llama-cpp-python's ``logprobs`` object (text offsets from the prompt's
        start, each top dict the N most probable and the token's own); with ``echo=True`` the
        prompt's tokens come first, scored by :meth:`prompt_logprobs` (the first one's None).
        Streamed, each chunk carries its own tokens' logprobs (the echo chunk the prompt's), as
        llama-cpp-python's; a chunk is a committed block's text then (see :meth:`generate`).
        Extra keyword arguments go to :meth:`generate` (block_size, threshold, ...)."""
        return self._llama_calls().create_completion(prompt, suffix, max_tokens, temperature, top_p, min_p,
                                                     typical_p, logprobs, echo, stop, frequency_penalty,
                                                     presence_penalty, repeat_penalty, top_k, stream, seed,
                                                     tfs_z, mirostat_mode, mirostat_tau, mirostat_eta, model,
                                                     stopping_criteria, logits_processor, grammar, logit_bias,
                                                     **gen_kwargs)

    def __call__(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """``create_completion`` (as ``Llama.__call__``)."""
        return self.create_completion(prompt, **kwargs)

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], functions: Any = None,
                               function_call: Any = None, tools: Any = None, tool_choice: Any = None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | Sequence[str] | None = None, seed: int | None = None,
                               response_format: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                               logits_processor: Any = None, grammar: Any = None,
                               logit_bias: Mapping[int, float] | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None, parallel_tool_calls: bool = True,
                               reasoning_format: str = "none", **gen_kwargs: Any) -> Any:
        """llama-cpp-python's ``Llama.create_chat_completion``: the messages rendered with the
        model's chat template (:meth:`chat`), the same arguments and defaults (temperature 0.2,
        top_p 0.95, top_k 40, max_tokens None = until the end of the turn or of the context), and
        an OpenAI-shaped ``chat.completion`` dict, or with ``stream=True`` an iterator of
        ``chat.completion.chunk`` dicts (first delta: the role; last: ``finish_reason``).
        ``tools`` (OpenAI's) are rendered by the chat template (a template that renders none:
        CloverValueError naming ``tools``) and the reply's tool-call markup, in whichever of
        llama.cpp's chat formats the template uses, is read by chat.cpp's parser (a reply it refuses:
        by our ``<tool_call>`` reader) into the message's ``tool_calls`` (finish_reason
        "tool_calls"); ``tool_choice`` "none", "auto",
        "required" or a named function (the last two start the reply with a call whose arguments a
        grammar holds to the tool's schema, as ``clover serve``: :mod:`clover_cpp.tool_calls`);
        ``parallel_tool_calls`` (OpenAI's, not llama-cpp-python's): more than one call.
        ``reasoning_format`` (llama-server's: "none", "auto", "deepseek", "deepseek-legacy"; not
        llama-cpp-python's, so "none" by default, which leaves the reply as the model wrote it):
        other than "none", the thinking goes to ``message.reasoning_content`` (streamed:
        ``delta.reasoning_content``), with or without tools.
        The legacy ``functions`` / ``function_call`` are refused; the sampler arguments are
        llama.cpp's sampler chain, the rest as :meth:`create_completion` says."""
        return self._llama_calls().create_chat_completion(messages, functions, function_call, tools,
                                                          tool_choice, temperature, top_p, top_k, min_p,
                                                          typical_p, stream, stop, seed, response_format,
                                                          max_tokens, presence_penalty, frequency_penalty,
                                                          repeat_penalty, tfs_z, mirostat_mode, mirostat_tau,
                                                          mirostat_eta, model, logits_processor, grammar,
                                                          logit_bias, logprobs, top_logprobs,
                                                          parallel_tool_calls, reasoning_format, **gen_kwargs)

    def _llama_calls(self) -> LlamaCalls:
        # (one per call: kept on the object, it would hold the object back from being freed)
        return LlamaCalls(self, self._op, self._compat, self._chat)

    # -- chat (chat.py)
    @property
    def end_of_turn_tokens(self) -> list[int]:
        """The chat end-of-turn token ids (besides EOS) that :meth:`chat` and
        :meth:`generate_chat` stop on: those of ``<|im_end|>``, ``<|eot_id|>`` and ``<|end|>``
        that are single tokens of this model's vocabulary."""
        return C.end_of_turn_tokens(self, self._chat)

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
        object's :attr:`last_exchange`."""
        text = str_arg("text", text)
        return self._generate(C.generate_chat_args(self, self._chat, text, gen_kwargs), text)

    @property
    def last_exchange(self) -> ChatExchange | None:
        """This object's last generation (its chat prompt, if any, the prompt's tokens, the reply):
        the conversation a chat prompt that starts with ``last_exchange.text`` continues."""
        self._m()
        return self._chat.last

    def chat_tokens(self, prompt: str) -> list[int]:
        """The tokens of a rendered chat prompt. When it continues the last chat exchange (that
        prompt, then the reply as generated), they are that exchange's tokens followed by the
        new text's: the model reads its own reply's tokens again (as llama.cpp's conversation
        mode does) rather than a re-tokenization that may differ, so the memory is reused."""
        return C.chat_tokens(self, self._chat, prompt)

    def format_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text of messages under the chat template (:attr:`chat_template`, see
        :func:`render_chat`; its errors name the template, and a failing GGUF template's the way out)."""
        return C.format_chat(self, messages, add_generation_prompt, **template_kwargs)

    # -- single passes on the context (passes.py)
    def calibrate(self, fused: bool = False) -> dict[int, float] | dict[int, tuple[float, float]]:
        """Measure the cost curve used by block_size="auto" (bypassing the disk cache):
        {B: ms per block pass} for B = 1, 2, 4, ...; with fused=True {B: (pass ms, ms of a
        commit fused with a pass)}. Clears the memory."""
        return P.calibrate(self._op, fused)

    def set_cost_curve(self, curve: Mapping[int, float], fused: Mapping[int, float] | None = None) -> None:
        """Set the cost curve for block_size="auto" ({1: ms, 2: ms, 4: ms, ...}; fused: the
        cost of a commit fused with a pass, by default that of a pass of 2B, else with the
        same keys) instead of measuring it, e.g. from an earlier :meth:`calibrate`. Costs must
        be in (0, 1e9] ms (libclover's check). Resets the running tokens per pass."""
        P.set_cost_curve(self._op, curve, fused)

    def reset(self) -> None:
        """Clear the memory (no committed tokens)."""
        P.reset(self._op)

    def commit(self, tokens: Sequence[int], logits: bool = False) -> np.ndarray | None:
        """Commit tokens (n >= 1) causally at the end of the memory. With ``logits``, returns the
        logits [n, n_vocab] (float32) of the committed positions: row t predicts token t + 1, as
        llama.cpp's causal decoding of the same text gives them."""
        return P.commit(self, self._op, tokens, logits)

    def last_logits(self) -> np.ndarray:
        """The logits [n_vocab] of the last committed position: the prediction of the next one."""
        return P.last_logits(self, self._op)

    def block_logits(self, tokens: Sequence[int], commit_before: Sequence[int] | None = None) -> np.ndarray:
        """Logits [n, n_vocab] (float32) of a block pass of tokens (1 <= n <= B) against the memory,
        which is left unchanged; row t predicts token t + 1. With ``commit_before``, the memory is
        first reset and those tokens are committed."""
        return P.block_logits(self, self._op, tokens, commit_before)

    def expert_stats(self) -> GenerationStats:
        """The routed experts of the block passes since the count last started (a generate's start
        or the last call of this; :meth:`block_logits` included): a GenerationStats with
        n_expert_passes, experts_per_pass, expert_bytes_per_pass and expert_bytes_b1 set; the
        count starts afresh. Needs ``Clover(expert_stats=True)``."""
        return P.expert_stats(self._op)

    def perplexity(self, text: str | bytes | Sequence[int], n_ctx: int = 512,
                   n_chunks: int | None = None) -> "Perplexity":
        """Perplexity of the causal model over a text, computed as llama-perplexity computes it:
        the text tokenized as plain text (special-token text such as ``<|im_end|>`` is not parsed;
        BOS when the model adds one), in chunks of n_ctx (at most n_chunks of them, all when
        None), each on an empty memory with its first token replaced by BOS, scoring the second
        half of every chunk (each position predicted from the one before it). Leaves the memory
        empty."""
        return P.perplexity(self, self._op, text, n_ctx, n_chunks)

    # -- tokenizer (llama-cpp-python's signatures; text may be str too)
    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text. add_bos: BOS/EOS as the model asks (llama.cpp's add_special);
        special: recognise special-token text such as ``<|im_start|>``."""
        data = text_bytes(text)
        add_bos, special = bool_arg("add_bos", add_bos), bool_arg("special", special)
        with self._model_op() as m:
            return H.tokenize(m, data, add_bos, special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of tokens (llama-cpp-python's). special: render special tokens' text;
        prev_tokens: the tokens before them (the bytes returned are those ``tokens`` add)."""
        toks = self._tokens(tokens)
        special = bool_arg("special", special)
        if prev_tokens is not None:
            prev = self._tokens(prev_tokens)
            before = self.detokenize(prev, special=special)
            return self.detokenize(prev + toks, special=special)[len(before):]
        if not toks:
            self._info()
            return b""
        with self._model_op() as m:
            return H.detokenize(m, toks, special)

    def detokenize_text(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """The text of tokens (invalid UTF-8 replaced). special: render special tokens' text."""
        return self.detokenize(tokens, special=special).decode("utf-8", "replace")

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token (special: render special tokens' text)."""
        token = self._token(token)
        special = bool_arg("special", special)
        with self._model_op() as m:
            return H.token_to_piece(m, token, special)

    def _token(self, t: Any) -> int:
        return token_id(t, self.n_vocab())

    def _tokens(self, tokens: Any) -> list[int]:
        return token_ids(tokens, self.n_vocab())

    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_bos=True, special=True)
        return self._tokens(prompt)

    # -- generation
    def generate(self, prompt: Prompt, max_tokens: int = N.CLOVER_DEFAULT_MAX_TOKENS, block_size: int | str | None = "default",
                 threshold: float = 0.9, max_steps: int = 0, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True, stream: bool = False,
                 on_step: StepCallback | None = None, on_block: BlockCallback | None = None,
                 stop_tokens: Sequence[int] = (), stop: str | Sequence[str] = (), reuse_prefix: bool = True,
                 draft_self: bool | str | None = False, draft_steps: int = 1, grammar: str | None = None,
                 logprobs: int | None = None,
                 response_format: Mapping[str, Any] | None = None, coreset: int | str | None = "context",
                 min_p: float = 0.0, typical_p: float = 1.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                 mirostat_eta: float = 0.1, top_n_sigma: float = -1.0, xtc_probability: float = 0.0,
                 xtc_threshold: float = 0.1, dry_multiplier: float = 0.0, dry_base: float = 1.75,
                 dry_allowed_length: int = 2, dry_penalty_last_n: int = -1,
                 dry_sequence_breakers: Sequence[str] | None = None, samplers: str | Sequence[str] | None = None,
                 dynatemp_range: float = 0.0, dynatemp_exponent: float = 1.0, min_keep: int = 0,
                 on_draft: DraftCallback | None = None) -> Any:
        """Block-diffusion generation.

        prompt: text (tokenized with add_special and parse_special) or token ids.
        block_size: B for this call; by default the one given to the constructor, else "auto":
        chosen per block from the cost curve (from the disk cache, else measured on the first
        auto call, see :meth:`calibrate`) and the running tokens per pass (rules in clover.h).
        None = "auto" too, as in the constructor (to keep the context's current B, pass
        ``self.block_size``). Does it fit: :meth:`room` / :meth:`fits` (libclover's rule).
        threshold: unmask every masked position whose confidence >= threshold (in [0, 1]).
        max_steps: per-block step cap (0 = none). temperature 0 = greedy (libclover also decodes
        greedily below CLOVER_MIN_TEMPERATURE = 1e-6 and for top_p below 1 / n_vocab, 0 included;
        top_k >= n_vocab is off).
        seed: the sampler's seed; None (default) or -1 = a fresh random seed per call; the seed
        used is in ``result.seed`` (and ``stats.seed``): passing it again reproduces the output.
        on_step(canvas_tokens, n_masked, block_start): called after every denoising step with
        the block's B tokens (masked ones = the mask token); returning True cancels.
        on_block(text, tokens): called with each committed block's text; True cancels.
        on_draft(draft_tokens, block_start): draft-self, each draft before its verification (which
        keeps a prefix of it, and the model's own token after a rejected one: on_block's tokens);
        True cancels.
        stop_tokens: extra token ids that end the output like EOS (the output stops before them;
        libclover stops on them: ``finish_reason`` "stop", the stats of the cut output).
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
        by llama.cpp's converter, llama-server's (:mod:`clover_cpp.grammar`); a schema keyword it
        would not enforce is a CloverValueError naming it. Under block diffusion a
        grammar runs at block_size=1, or with draft_self (verification applies it; the output is
        that of the constrained block_size=1): ``stats.grammar_mode`` "ar" / "draft-self".
        logprobs: None = off; N in [0, 20] = ``result.logprobs`` (each token's log-probability
        under the distribution it was chosen from: the log-softmax of the logits that predicted
        it, at the step that unmasked it) and ``result.top_logprobs`` (the N most probable
        (token, log-probability) pairs there).
        coreset: the block expert coreset of this call's block passes (see :attr:`coreset`):
        "context" (default) = the context's, N, None or 0 = off, "auto" (measured, see
        :attr:`coreset`), "model" = the GGUF's default;
        the context's own setting is back after the call.
        min_p, typical_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
        logit_bias ({token id: bias}, -inf bans), mirostat_mode / _tau / _eta, top_n_sigma,
        xtc_probability / _threshold, dry_multiplier / _base / _allowed_length / _penalty_last_n /
        _sequence_breakers, samplers (the order: llama-server's names or llama-cli's letters),
        dynatemp_range / _exponent (dynamic temperature), min_keep:
        llama.cpp's sampler chain, llama-cpp-python's and llama-server's names; every one off by
        default (clover.h, spec/decoding.md "Sampler chain": what each means under block diffusion
        and draft-self). The penalties count the prompt too, as llama.cpp does.
        A cancelled generation returns what the finished blocks produced (finish_reason
        "cancelled"); exceptions raised by callbacks cancel it and are re-raised here.

        Returns a :class:`GenerationResult`, or with ``stream=True`` a :class:`GenerationStream`
        yielding the text as it becomes final: after every denoising step, the new part of the
        block's contiguous unmasked prefix; with logprobs, each committed block's text (each piece a
        :class:`~clover_cpp.decoding.StreamPiece` with its own tokens' ``logprobs``)."""
        args = dict(locals())
        del args["self"]
        return self._generate(args, None)

    @staticmethod
    def check_generate_args(**kwargs: Any) -> None:
        """generate()'s keyword arguments checked with no model loaded (what a front end asks
        before loading one): the types, then libclover's ranges (clover_generate_params_check);
        a :class:`CloverValueError` / :class:`CloverTypeError` with libclover's message, ``param``
        the keyword refused. What needs the model waits for generate(): token ids, the room in
        the context, the block size's bound (n_ctx)."""
        lib()  # (a missing libclover: a CloverError)
        sig = inspect.signature(Clover.generate).parameters
        a = {k: p.default for k, p in sig.items() if k not in ("self", "prompt")}
        for k in kwargs:
            if k not in a:
                raise CloverTypeError(f"generate() has no argument {k!r}", param=k)
        a.update(kwargs)
        D.GenParams.of_kwargs(a, "auto" if a["block_size"] == "default" else a["block_size"]).check()
        if a["coreset"] != "context":
            coreset_value(a["coreset"])

    def _generate(self, a: Mapping[str, Any], chat_text: str | None) -> Any:
        """generate() with its arguments ``a``; ``chat_text``: the rendered chat prompt of the
        tokens (:meth:`generate_chat`), remembered for the next turn's continuation."""
        self._not_in_callback()
        p = GenParams.of_kwargs(a, self._block_size_arg(a["block_size"]))
        toks = self._prompt_tokens(a["prompt"])
        p = replace(p, stop_tokens=self._tokens(a["stop_tokens"] if a["stop_tokens"] is not None else ()))
        for t in p.chain.logit_bias:  # (the ids need the vocabulary, as stop_tokens')
            if t >= self.n_vocab():  # (a negative id: libclover's rule, p.check)
                raise CloverValueError(f"logit_bias: token {t} is past the vocabulary ({self.n_vocab()} tokens)",
                                       param="logit_bias")
        p.check()  # libclover's ranges, before waiting
        stream = bool_arg("stream", a["stream"])
        on_step, on_block = callable_arg("on_step", a["on_step"]), callable_arg("on_block", a["on_block"])
        on_draft = callable_arg("on_draft", a.get("on_draft"))
        self._close_my_streams()  # a stream this thread left unfinished must not keep decoding
        coreset = None if a.get("coreset", "context") == "context" else coreset_value(a["coreset"])

        def run(push: Callable[[str, list[int]], bool] | None, cancel: threading.Event) -> GenerationResult:
            if coreset is None:
                return self._run(toks, p, chat_text, on_step, on_block, push, cancel, on_draft)
            c = self._c()
            kept = int(N.clover_coreset(c.ptr))
            self._apply_coreset(c, coreset)
            try:
                return self._run(toks, p, chat_text, on_step, on_block, push, cancel, on_draft)
            finally:
                self._apply_coreset(c, kept)

        if not stream:
            # on the object's decode thread (see DecodeThread), in this object's turn; Ctrl-C
            # (or close() from another thread) cancels it at the next denoising step
            with self._op() as c:
                self._check_room(c, len(toks), p)
                cancel = threading.Event()
                self._gate.cancel = cancel
                return c.call(lambda: run(None, cancel), cancel)
        self._gate.enter()  # the stream holds the turn until its decoding ends
        try:
            c = self._c()
            self._check_room(c, len(toks), p)
            s = GenerationStream(run, c.decoder, self._gate)
        except BaseException:
            self._gate.leave()
            raise
        self._streams.add(s)
        return s

    def _check_room(self, c: H.ContextRef, n_prompt: int, p: GenParams) -> None:
        """The prompt + max_tokens fit the context (before an output buffer of max_tokens)."""
        keep: list[Any] = []
        room = D.room(c, n_prompt, p.native(keep))
        if room < 0:  # (a parameter rule broken: its message)
            p.check()
        if p.max_tokens > room:
            raise CloverError(f"prompt ({n_prompt} tokens) + max_tokens ({p.max_tokens}) exceeds n_ctx={self._n_ctx}"
                              f" (at most {room} tokens fit after this prompt)", N.CLOVER_ERR_CONTEXT_FULL)

    def _run(self, toks: list[int], p: GenParams, chat_text: str | None, on_step: StepCallback | None,
             on_block: BlockCallback | None, push: Callable[[str, list[int]], bool] | None,
             cancel: threading.Event, on_draft: DraftCallback | None = None) -> GenerationResult:
        # (the caller holds this object's turn: see _op / GenerationStream)
        info = self._info()
        g = Generation(self._c(), toks, p, mask=info.mask, eos=info.eos, detokenize=self.detokenize,
                       on_step=on_step, on_block=on_block, push=push, cancel=cancel, native=self._in_native,
                       on_draft=on_draft)
        r = g.run()
        if g.ran:
            self._chat.last = ChatExchange(chat_text, tuple(toks), tuple(r.tokens), r.text)
        return r
