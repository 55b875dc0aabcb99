"""llama-cpp-python's calls on :class:`Clover` (``create_completion``, ``create_chat_completion``,
``__call__``): the same arguments and defaults, OpenAI-shaped dicts. Every argument is honoured
or refused: a knob Clover's sampler does not have is accepted only at its neutral value."""

from __future__ import annotations

import ctypes
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native as N
from . import openai_reply as reply
from . import tool_calls
from ._args import INT32_MAX, bool_arg, int_arg, strings_arg
from .errors import CloverError, CloverTypeError, CloverValueError
from .openai_reply import PromptLogprobs

if TYPE_CHECKING:
    from .decoding import GenerationResult


#: prompt positions per causal commit in :meth:`LlamaCompat.prompt_logprobs` (the logits of one
#: commit are [rows, n_vocab] float32: 64 MiB at a 256k vocabulary)
SCORE_ROWS = 64


def _log_softmax(rows: np.ndarray, mask: int) -> np.ndarray:
    """In double precision, the mask token excluded (as generate()'s logprobs: clover.h)."""
    z = rows.astype(np.float64)
    if mask >= 0:
        z[:, mask] = -np.inf
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _top(row: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n largest entries of ``row``, largest first, ties: lower id first (as libclover's)."""
    if n <= 0:
        return []
    cut = np.partition(row, -n)[-n]
    ids = np.flatnonzero(row >= cut)
    ids = ids[np.lexsort((ids, -row[ids]))][:n]
    return [(int(i), float(row[i])) for i in ids]


#: llama.cpp's LLAMA_DEFAULT_SEED (llama-cpp-python's seed default): a fresh random seed per call
LLAMA_DEFAULT_SEED = 0xFFFFFFFF

#: llama.cpp's enum llama_pooling_type (llama-cpp-python's pooling_type)
POOLING_UNSPECIFIED, POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST = -1, 0, 1, 2, 3

#: ``Llama(...)`` arguments Clover has no use for, with the values that change nothing: any other
#: value is refused, naming the argument (a setting Clover would silently ignore is a bug report)
LLAMA_NEUTRAL_INIT: dict[str, tuple[Any, ...]] = {
    "split_mode": (1,), "main_gpu": (0,), "vocab_only": (False,), "kv_overrides": (None,),
    "rope_scaling_type": (-1,), "attention_type": (-1,), "rope_freq_base": (0.0,),
    "rope_freq_scale": (0.0,), "yarn_ext_factor": (-1.0,), "yarn_attn_factor": (1.0,), "yarn_beta_fast": (32.0,),
    "yarn_beta_slow": (1.0,), "yarn_orig_ctx": (0,), "offload_kqv": (True,), "op_offload": (None, True),
    "swa_full": (None, False), "no_perf": (False, True), "last_n_tokens_size": (64,), "lora_base": (None,),
    "lora_scale": (1.0,), "lora_path": (None,), "numa": (False, 0), "draft_model": (None,), "tokenizer": (None,),
    "type_k": (None,), "type_v": (None,), "spm_infill": (False,),
}


@dataclass(frozen=True)
class LlamaSettings:
    """The ``Llama(...)`` constructor arguments a Clover keeps (see :meth:`of`)."""

    seed: int | None = None  # the default seed of create_completion & co (None: a fresh one per call)
    n_batch: int = 512
    n_ubatch: int = 512
    logits_all: bool = False
    embedding: bool = False
    pooling_type: int = POOLING_UNSPECIFIED
    chat_format: str | None = None

    @classmethod
    def of(cls, seed: Any, n_batch: Any, n_ubatch: Any, logits_all: Any, embedding: Any, pooling_type: Any,
           chat_format: Any, chat_handler: Any, others: Mapping[str, Any],
           n_threads: int | None = None) -> "LlamaSettings":
        """Checked. n_batch / n_ubatch: accepted (positive), no effect: libclover sizes its
        batches from the block size. logits_all: no effect (logprobs need no kept logits here).
        chat_format: None (the GGUF's template, ChatML without one) or "chatml"; chat_handler:
        None. n_threads_batch: None or ``n_threads`` (libclover decodes batches on n_threads).
        Other ``Llama`` arguments: only their neutral values (:data:`LLAMA_NEUTRAL_INIT`)."""
        others = dict(others)
        batch_threads = others.pop("n_threads_batch", None)
        if batch_threads is not None and batch_threads != n_threads:
            raise CloverValueError(f"Clover(): n_threads_batch={batch_threads!r} is not supported: libclover decodes "
                                   f"batches on n_threads; leave it None or n_threads ({n_threads!r})"[:300],
                                   param="n_threads_batch")
        for name, value in others.items():
            if name not in LLAMA_NEUTRAL_INIT:
                raise CloverTypeError(f"Clover() got an unexpected keyword argument {name!r}", param=name)
            ok = LLAMA_NEUTRAL_INIT[name]
            if not any(value is v or (type(value) is type(v) and value == v) for v in ok):
                raise CloverValueError(f"Clover(): {name}={value!r} is not supported; leave it at {ok[0]!r}"[:300],
                                       param=name)
        if chat_handler is not None:
            raise CloverValueError("Clover(): chat_handler is not supported (chats render the GGUF's chat template)",
                                   param="chat_handler")
        if chat_format not in (None, "chatml"):
            raise CloverValueError(f"Clover(): chat_format={chat_format!r} is not supported: None (the GGUF's "
                                   "chat template) or 'chatml'"[:300], param="chat_format")
        seed = int_arg("seed", seed, -1, LLAMA_DEFAULT_SEED)
        pooling = int_arg("pooling_type", pooling_type, POOLING_UNSPECIFIED, POOLING_LAST)
        return cls(None if seed in (-1, LLAMA_DEFAULT_SEED) else seed, int_arg("n_batch", n_batch, 1, INT32_MAX),
                   int_arg("n_ubatch", n_ubatch, 1, INT32_MAX), bool_arg("logits_all", logits_all),
                   bool_arg("embedding", embedding), pooling, chat_format)


class LlamaState:
    """llama-cpp-python's ``LlamaState`` (the same fields): the committed tokens
    (``input_ids[:n_tokens]``), the logits of the last one (``scores``, [1, n_vocab]; [0, n_vocab]
    when nothing is committed), ``llama_state`` (libclover's state bytes: clover_state_save) and
    the default seed."""

    def __init__(self, input_ids: np.ndarray, scores: np.ndarray, n_tokens: int, llama_state: bytes,
                 llama_state_size: int, seed: int) -> None:
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed


class CloverTokenizer:
    """llama-cpp-python's ``LlamaTokenizer`` over a Clover (what ``tokenizer()`` returns):
    ``tokenize`` / ``detokenize`` in bytes, ``encode`` / ``decode`` in str."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._model.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        return self._model.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class LlamaCompat:
    """The llama-cpp-python-compatible methods of :class:`Clover` (a mixin over its generate,
    generate_chat, tokenizer and room)."""

    generate: Any
    generate_chat: Any
    format_chat: Any
    chat_template: Any
    chat_tokens: Any
    tokenize: Any
    detokenize: Any
    token_to_piece: Any
    room: Any
    _tokens: Any
    _op: Any
    reset: Any
    commit: Any
    mask_token: Any
    bos_token: Any
    model_path: Any
    n_ctx: Any
    _llama: "LlamaSettings"
    _embed_llama: Any
    _ctx_args: Any
    _load_args: Any
    committed_tokens: Any
    last_logits: Any
    cache: Any = None  # set_cache's
    # llama-cpp-python's Llama._is_recurrent / _is_hybrid: clover and qwen35moe both keep a
    # recurrent state beside their attention layers' KV cache
    _is_recurrent = False
    _is_hybrid = True

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

    def _from_cache(self, toks: list[int]) -> None:
        """The memory from the cache's longest prefix of ``toks``, when it beats the memory's own."""
        try:
            state = self.cache[toks]
        except KeyError:
            return
        cached = [int(t) for t in state.input_ids[:state.n_tokens]]
        if _common_prefix(cached, toks) > _common_prefix(self.committed_tokens, toks):
            self.load_state(state)

    def _to_cache(self) -> None:
        self.cache[list(self.committed_tokens)] = self.save_state()

    def prompt_logprobs(self, prompt: str | Sequence[int], top_logprobs: int = 0) -> PromptLogprobs:
        """The log-probability of each token of ``prompt`` (text: tokenized as generate() does)
        given the ones before it, from the causal commit of the prompt (the log-softmax, in
        double precision and the mask token excluded, of the logits row that predicts it, as
        generate()'s ``logprobs`` are read), and the ``top_logprobs`` most probable there (at
        most CLOVER_MAX_TOP_LOGPROBS). What lm-eval's loglikelihood scores; llama-cpp-python's
        ``create_completion(echo=True, logprobs=N)`` reports it. Leaves the memory holding the
        prompt (a generate() of a prompt that starts with it reads none of it again)."""
        toks = self.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) \
            else self._tokens(prompt)
        n_top = int_arg("top_logprobs", top_logprobs, 0, N.CLOVER_MAX_TOP_LOGPROBS)
        out = PromptLogprobs(tokens=toks, logprobs=[None] if toks else [], top_logprobs=[[]] if toks else [])
        mask = self.mask_token
        with self._op():
            self.reset()
            for start in range(0, len(toks), SCORE_ROWS):
                rows = self.commit(toks[start:start + SCORE_ROWS], logits=True)
                nxt = toks[start + 1:start + SCORE_ROWS + 1]  # (row i predicts token start + i + 1)
                lp = _log_softmax(rows[:len(nxt)], mask)
                out.logprobs += [float(x) for x in lp[np.arange(len(nxt)), nxt]]
                out.top_logprobs += [_top(row, n_top) for row in lp]
        return out

    # -- llama-cpp-python's state and embedding calls
    def save_state(self) -> LlamaState:
        """The context's memory as a :class:`LlamaState` (llama-cpp-python's fields; its
        ``llama_state`` holds libclover's state bytes: llama.cpp's state of the memory with the
        committed tokens and the last logits): :meth:`load_state` puts it back, and a generation
        then continues exactly as it would have without the calls in between (greedy: the same
        tokens; none of the saved tokens is read again)."""
        with self._op() as c:
            size = int(N.clover_state_size(c.ptr))
            buf, written = ctypes.create_string_buffer(size), ctypes.c_size_t(0)
            c.checked(N.clover_state_save, buf, size, ctypes.byref(written), hop=True, what="save_state")
            data = buf.raw[:written.value]
            toks = self.committed_tokens
            scores = self.last_logits()[None, :] if toks else np.empty((0, self.n_vocab()), np.float32)
        seed = self._llama.seed
        return LlamaState(np.asarray(toks, dtype=np.intc), scores, len(toks), data, len(data),
                          LLAMA_DEFAULT_SEED if seed is None else seed)

    def load_state(self, state: LlamaState) -> None:
        """Restore a :meth:`save_state` of this model (into this or another context of it, any
        block size): the memory, its tokens and last logits come from ``llama_state`` without a
        forward pass, and the default seed is the state's. Bytes of another model or KV type, of
        llama-cpp-python's own ``Llama``, truncated or damaged: one CloverValueError, the memory
        unchanged."""
        data = getattr(state, "llama_state", None)
        if not isinstance(data, (bytes, bytearray)):
            raise CloverValueError("load_state: state.llama_state is not the bytes of Clover.save_state",
                                   param="state")
        seed = int_arg("seed", state.seed, -1, LLAMA_DEFAULT_SEED)
        data = bytes(data)
        with self._op() as c:
            err, n = N.err_buffer()
            rc = c.call(lambda: N.clover_state_load(c.ptr, data, len(data), err, n))
            if rc != N.CLOVER_OK:
                raise CloverValueError(f"load_state: {err.value.decode('utf-8', 'replace')}"[:400], param="state")
            self._last = None  # (a chat's next turn re-reads its prompt's tokens: they are in the memory)
        self._llama = replace(self._llama, seed=None if seed in (-1, LLAMA_DEFAULT_SEED) else seed)

    def set_seed(self, seed: int) -> None:
        """The default seed of the following calls (llama-cpp-python's)."""
        seed = int_arg("seed", seed, -1, LLAMA_DEFAULT_SEED)
        self._llama = replace(self._llama, seed=None if seed in (-1, LLAMA_DEFAULT_SEED) else seed)

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
        from ._lib import import_llama_cpp  # noqa: PLC0415 - optional: llama-cpp-python's Python layer
        from .llama_sample import SampleArgs, sample_token  # noqa: PLC0415

        for name, value in (("logits_processor", logits_processor), ("grammar", grammar)):
            if value is not None:
                raise CloverValueError(f"sample: {name} is not supported by Clover; leave it None", param=name)
        if idx is not None and idx != self.n_tokens - 1:
            raise CloverValueError(f"sample: idx={idx!r} is not supported: only the last committed position's "
                                   f"logits are kept (idx None or {self.n_tokens - 1})"[:300], param="idx")
        a = SampleArgs(int_arg("top_k", top_k), float(top_p), float(min_p), float(typical_p), float(temp),
                       float(repeat_penalty), float(frequency_penalty), float(presence_penalty),
                       int_arg("mirostat_mode", mirostat_mode, 0, 2), float(mirostat_eta), float(mirostat_tau))
        with self._op():
            logits, history = self.last_logits(), self.committed_tokens
        if self.mask_token >= 0:
            logits[self.mask_token] = -np.inf
        seed = self._llama.seed
        return sample_token(import_llama_cpp(), logits, history, a, LLAMA_DEFAULT_SEED if seed is None else seed)

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
        if stopping_criteria is not None:
            raise CloverValueError("generate_tokens: stopping_criteria is not supported by Clover; leave it None",
                                   param="stopping_criteria")
        toks = self._tokens(tokens)
        if bool_arg("reset", reset):
            held = self.committed_tokens
            if held and toks[:len(held)] == held:
                toks = toks[len(held):]
            else:
                self.reset()
        self.eval(toks)
        knobs = dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                     repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                     presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                     mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, penalize_nl=penalize_nl,
                     logits_processor=logits_processor, grammar=grammar)
        while True:
            token = self.sample(**knobs)
            if (yield token) is not None:
                raise CloverValueError("generate_tokens: tokens sent into the generator are not supported by Clover")
            self.eval([token])

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
        p = self._llama.pooling_type
        return POOLING_MEAN if p == POOLING_UNSPECIFIED else p

    def _embedder(self, where: str) -> Any:
        """llama-cpp-python's ``Llama`` over this GGUF with embeddings on (loaded once, on our
        libllama): llama.cpp's pooling of the causal pass's final hidden states."""
        if not self._llama.embedding:
            raise CloverValueError(f"{where}: the model must be created with embedding=True", param="embedding")
        if self._embed_llama is None:
            from ._lib import import_llama_cpp  # noqa: PLC0415 - optional: llama-cpp-python's Python layer

            self._embed_llama = import_llama_cpp().llama.Llama(  # (its module's: the package's may be Clover)
                str(self.model_path), embedding=True, verbose=False, n_ctx=self.n_ctx(), n_batch=self._llama.n_batch,
                n_ubatch=self._llama.n_ubatch, n_threads=self._ctx_args.n_threads,
                n_gpu_layers=self._load_args.n_gpu_layers, use_mmap=self._load_args.use_mmap is not False,
                pooling_type=self.pooling_type())
        return self._embed_llama

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False) -> Any:  # noqa: A002 - llama-cpp-python's name
        """llama-cpp-python's ``Llama.embed``: the embedding of a text (a list of floats), or of
        each text of a list, pooled as ``pooling_type`` says (mean by default; NONE: one per
        token); normalize: unit length; truncate: at n_batch tokens. Needs embedding=True."""
        return self._embedder("embed").embed(input, normalize=normalize, truncate=truncate,
                                              return_count=return_count)

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict[str, Any]:
        """llama-cpp-python's ``Llama.create_embedding``: OpenAI's embedding list
        (``{"object": "list", "data": [{"object": "embedding", "embedding": [...], "index": i}],
        "model", "usage"}``). Needs embedding=True."""
        r = self._embedder("create_embedding").create_embedding(input)
        return {**r, "model": model if isinstance(model, str) else str(self.model_path)}

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

    def _llama_kwargs(self, where: str, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any,
                      stop: Any, logprobs: Any, grammar: Any, response_format: Any, stream: Any,
                      neutral: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """generate() keyword arguments for create_completion / create_chat_completion."""
        for name, (value, ok) in neutral.items():
            if value is not None and not (value == ok if not isinstance(ok, tuple) else value in ok):
                raise CloverValueError(f"{where}: {name}={value!r} is not supported by Clover; leave it at "
                                       f"{ok if not isinstance(ok, tuple) else ok[0]!r}"[:300])
        kw: dict[str, Any] = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed if seed is not None else self._llama.seed,
                                  stop=strings_arg("stop", stop), stream=bool_arg("stream", stream))
        if max_tokens is not None:
            kw["max_tokens"] = int_arg("max_tokens", max_tokens)
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
        return kw

    def _budget(self, kw: dict[str, Any], n_prompt: int, gen_kwargs: Mapping[str, Any]) -> None:
        """max_tokens None or <= 0 (llama-cpp-python): until EOS or the context's end."""
        if kw.get("max_tokens") is None or kw["max_tokens"] <= 0:
            room = self.room(n_prompt, gen_kwargs.get("block_size", "default"), gen_kwargs.get("draft_self", False))
            if room <= 0:
                raise CloverError(f"the prompt ({n_prompt} tokens) leaves no room in n_ctx={self.n_ctx()}",
                                  N.CLOVER_ERR_CONTEXT_FULL)
            kw["max_tokens"] = room

    def _completion_logprobs(self, r: "GenerationResult", prompt_text: str,
                             prompt: PromptLogprobs | None = None) -> dict[str, Any] | None:
        """The reply's logprobs, its text offsets counted from the prompt's start (as
        llama-cpp-python and OpenAI); with ``prompt`` (echo) the prompt's tokens first, a leading
        BOS left out (its text is not echoed) and the first listed token's log-probability None."""
        if getattr(r, "logprobs", None) is None:
            return None
        echoed = reply.prompt_logprobs(prompt, self.bos_token, self.token_to_piece) if prompt is not None else None
        return reply.joined(echoed, reply.reply_logprobs(r, self.token_to_piece, len(prompt_text)))

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
        where = "create_completion"
        kw = self._llama_kwargs(where, max_tokens, temperature, top_p, top_k, seed, stop, logprobs, grammar, None,
                                stream, {"suffix": (suffix, None), "tfs_z": (tfs_z, 1.0),
                                         "stopping_criteria": (stopping_criteria, None),
                                         "logits_processor": (logits_processor, None)})
        kw.update(_chain_kwargs(min_p, typical_p, frequency_penalty, presence_penalty, repeat_penalty, mirostat_mode,
                                mirostat_tau, mirostat_eta, logit_bias))
        if isinstance(prompt, str):
            prompt_text, toks = prompt, self.tokenize(prompt, add_bos=True, special=True)
        else:
            toks = self._tokens(prompt)
            prompt_text = self.detokenize_text(toks)
        self._budget(kw, len(toks), gen_kwargs)
        echo = bool_arg("echo", echo)
        head = reply.head("text_completion", model if isinstance(model, str) else str(self.model_path))
        scored = self.prompt_logprobs(toks, kw["logprobs"]) if echo and kw.get("logprobs") is not None else None
        if self.cache is not None:
            self._from_cache(toks)
        if kw["stream"]:
            s = self.generate(toks, **kw, **gen_kwargs)

            def chunks() -> Iterator[dict[str, Any]]:
                offset = len(prompt_text)  # (the reply's text offsets count from the prompt's start)
                with s:
                    if echo and prompt_text:
                        lp = reply.prompt_logprobs(scored, self.bos_token, self.token_to_piece) \
                            if scored is not None else None
                        yield {**head, "choices": [reply.text_choice(0, prompt_text, lp)]}
                    for piece in s:  # (with logprobs: each piece its own tokens')
                        lp = reply.reply_logprobs(piece, self.token_to_piece, offset)
                        offset += sum(len(t) for t in lp["tokens"]) if lp is not None else 0
                        yield {**head, "choices": [reply.text_choice(0, str(piece), lp)]}
                assert s.result is not None
                if self.cache is not None:
                    self._to_cache()
                yield {**head, "choices": [reply.text_choice(0, "", None, reply.finish_reason(s.result))]}
            return chunks()
        r = self.generate(toks, **kw, **gen_kwargs)
        if self.cache is not None:
            self._to_cache()
        text = (prompt_text if echo else "") + r.text
        return {**head, "choices": [reply.text_choice(0, text, self._completion_logprobs(r, prompt_text, scored),
                                                      reply.finish_reason(r))],
                "usage": reply.usage([r], cached=False)}

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
        where = "create_chat_completion"
        if logprobs is not None:
            logprobs = bool_arg("logprobs", logprobs)
        if top_logprobs is not None and not logprobs:
            raise CloverValueError(f"{where}: top_logprobs needs logprobs=True")
        n_lp = (int_arg("top_logprobs", top_logprobs, 0, 20) if top_logprobs is not None else 0) if logprobs else None
        kw = self._llama_kwargs(where, max_tokens, temperature, top_p, top_k, seed, stop, n_lp, grammar,
                                response_format, stream,
                                {"functions": (functions, None), "function_call": (function_call, None),
                                 "tfs_z": (tfs_z, 1.0), "logits_processor": (logits_processor, None)})
        kw.update(_chain_kwargs(min_p, typical_p, frequency_penalty, presence_penalty, repeat_penalty, mirostat_mode,
                                mirostat_tau, mirostat_eta, logit_bias))
        tp = tool_calls.plan(tools, tool_choice, bool_arg("parallel_tool_calls", parallel_tool_calls),
                             self.chat_template, reasoning_format)
        if tp.grammar is not None:
            if kw.get("grammar") is not None or kw.get("response_format") is not None:
                raise CloverValueError(f"{where}: tool_choice forces a call: grammar and response_format cannot "
                                       "apply too", param="tool_choice")
            kw["grammar"] = tp.grammar
        prompt = (self.format_chat(messages, tools=tp.tools) if tp.active else self.format_chat(messages)) + tp.prefill
        self._budget(kw, len(self.chat_tokens(prompt)), gen_kwargs)
        head = reply.head("chat.completion", model if isinstance(model, str) else str(self.model_path))
        if kw["stream"]:
            s = self.generate_chat(prompt, **kw, **gen_kwargs)
            calls = tool_calls.ToolStream(tp) if tp.parses else None

            def deltas(piece: Any) -> Iterator[dict[str, Any]]:
                """A piece's deltas: its text, or when parsed (tools, reasoning) the content, thinking
                and calls read out of the reply so far."""
                lp = reply.chat_logprobs(piece, self.token_to_piece) if piece is not None else None
                if calls is None:  # (nothing parsed: the end adds nothing)
                    if piece is not None:
                        yield reply.delta_choice(0, {"content": str(piece)}, lp)
                    return
                for kind, v in calls.feed(str(piece)) if piece is not None else calls.finish():
                    if kind == "content":  # (the piece's logprobs with its first content)
                        yield reply.delta_choice(0, {"content": v}, lp)
                        lp = None
                    elif kind == "reasoning":  # (llama-server's delta field)
                        yield reply.delta_choice(0, {"reasoning_content": v})
                    else:
                        i, call = v
                        yield reply.delta_choice(0, {"tool_calls": [{"index": i, **call}]})

            def chunks() -> Iterator[dict[str, Any]]:
                obj = {**head, "object": "chat.completion.chunk"}
                with s:
                    yield {**obj, "choices": [reply.delta_choice(0, {"role": "assistant"})]}
                    for piece in s:  # (with logprobs: each piece its own tokens')
                        yield from ({**obj, "choices": [d]} for d in deltas(piece))
                yield from ({**obj, "choices": [d]} for d in deltas(None))
                assert s.result is not None
                finish = reply.finish_reason(s.result, tool_calls=calls is not None and bool(calls.calls))
                yield {**obj, "choices": [reply.delta_choice(0, {}, None, finish)]}
            return chunks()
        r = self.generate_chat(prompt, **kw, **gen_kwargs)
        message = tool_calls.reply_message(r.text, tp)
        return {**head, "choices": [reply.message_choice(0, message, reply.chat_logprobs(r, self.token_to_piece),
                                                         reply.finish_reason(r, tool_calls="tool_calls" in message))],
                "usage": reply.usage([r], cached=False)}


def _chain_kwargs(min_p: Any, typical_p: Any, frequency_penalty: Any, presence_penalty: Any, repeat_penalty: Any,
                  mirostat_mode: Any, mirostat_tau: Any, mirostat_eta: Any, logit_bias: Any) -> dict[str, Any]:
    """llama-cpp-python's sampler arguments as generate()'s (llama.cpp's sampler chain; None = its
    default, as llama-cpp-python's min_p=None)."""
    kw = dict(min_p=min_p, typical_p=typical_p, frequency_penalty=frequency_penalty,
              presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, mirostat_mode=mirostat_mode,
              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, logit_bias=logit_bias or None)
    return {k: v for k, v in kw.items() if v is not None}
