"""llama-cpp-python's calls on :class:`Clover` (``create_completion``, ``create_chat_completion``,
``__call__``, ...: :class:`LlamaCalls`, over the :class:`CompatState` the object keeps): the same
arguments and defaults, OpenAI-shaped dicts. Every argument is honoured or refused: a knob
Clover's sampler does not have is accepted only at its neutral value."""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native as N
from . import openai_reply as reply
from . import tool_calls
from ._args import INT32_MAX, bool_arg, int_arg, strings_arg, token_ids
from ._handles import Turn
from .chat import ChatState
from .errors import CloverError, CloverTypeError, CloverValueError
from .openai_reply import PromptLogprobs

if TYPE_CHECKING:
    from .decoding import GenerationResult


#: prompt positions per causal commit in :meth:`Clover.prompt_logprobs` (the logits of one
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


@dataclass
class CompatState:
    """What llama-cpp-python's calls keep on a Clover object (the object owns it): the
    constructor's settings (the default seed: set_seed / load_state change it), where the
    embedder loads the model, and the embedder (create_embedding's llama_cpp.Llama, loaded on
    first use)."""

    settings: LlamaSettings
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool | None = None
    embedder: Any = None


class LlamaCalls:
    """llama-cpp-python's calls on a Clover object (``llm``: its public calls) in its turn on its
    context (``turn``), over the state it keeps for them and for its chats; its methods of the same
    names document them. Made per call: it holds the object, which must not be held back by it
    (dropping the object frees the model)."""

    def __init__(self, llm: Any, turn: Turn, compat: CompatState, chat: ChatState) -> None:
        self.llm, self.turn, self.compat, self.chat = llm, turn, compat, chat

    def _from_cache(self, toks: list[int]) -> None:
        """The memory from the cache's longest prefix of ``toks``, when it beats the memory's own."""
        try:
            state = self.llm.cache[toks]
        except KeyError:
            return
        cached = [int(t) for t in state.input_ids[:state.n_tokens]]
        if _common_prefix(cached, toks) > _common_prefix(self.llm.committed_tokens, toks):
            self.llm.load_state(state)

    def _to_cache(self) -> None:
        self.llm.cache[list(self.llm.committed_tokens)] = self.llm.save_state()

    def prompt_logprobs(self, prompt: str | Sequence[int], top_logprobs: int = 0) -> PromptLogprobs:
        """:meth:`Clover.prompt_logprobs`."""
        toks = self.llm.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) \
            else token_ids(prompt, self.llm.n_vocab())
        n_top = int_arg("top_logprobs", top_logprobs, 0, N.CLOVER_MAX_TOP_LOGPROBS)
        out = PromptLogprobs(tokens=toks, logprobs=[None] if toks else [], top_logprobs=[[]] if toks else [])
        mask = self.llm.mask_token
        with self.turn():
            self.llm.reset()
            for start in range(0, len(toks), SCORE_ROWS):
                rows = self.llm.commit(toks[start:start + SCORE_ROWS], logits=True)
                nxt = toks[start + 1:start + SCORE_ROWS + 1]  # (row i predicts token start + i + 1)
                lp = _log_softmax(rows[:len(nxt)], mask)
                out.logprobs += [float(x) for x in lp[np.arange(len(nxt)), nxt]]
                out.top_logprobs += [_top(row, n_top) for row in lp]
        return out

    def save_state(self) -> LlamaState:
        """:meth:`Clover.save_state`."""
        with self.turn() as c:
            size = int(N.clover_state_size(c.ptr))
            buf, written = ctypes.create_string_buffer(size), ctypes.c_size_t(0)
            c.checked(N.clover_state_save, buf, size, ctypes.byref(written), hop=True, what="save_state")
            data = buf.raw[:written.value]
            toks = self.llm.committed_tokens
            scores = self.llm.last_logits()[None, :] if toks else np.empty((0, self.llm.n_vocab()), np.float32)
        seed = self.compat.settings.seed
        return LlamaState(np.asarray(toks, dtype=np.intc), scores, len(toks), data, len(data),
                          LLAMA_DEFAULT_SEED if seed is None else seed)

    def load_state(self, state: LlamaState) -> None:
        """:meth:`Clover.load_state`."""
        data = getattr(state, "llama_state", None)
        if not isinstance(data, (bytes, bytearray)):
            raise CloverValueError("load_state: state.llama_state is not the bytes of Clover.save_state",
                                   param="state")
        seed = int_arg("seed", state.seed, -1, LLAMA_DEFAULT_SEED)
        data = bytes(data)
        with self.turn() as c:
            err, n = N.err_buffer()
            rc = c.call(lambda: N.clover_state_load(c.ptr, data, len(data), err, n))
            if rc != N.CLOVER_OK:
                raise CloverValueError(f"load_state: {err.value.decode('utf-8', 'replace')}"[:400], param="state")
            self.chat.last = None  # (a chat's next turn re-reads its prompt's tokens: they are in the memory)
        self.compat.settings = replace(self.compat.settings, seed=None if seed in (-1, LLAMA_DEFAULT_SEED) else seed)

    def set_seed(self, seed: int) -> None:
        """:meth:`Clover.set_seed`."""
        seed = int_arg("seed", seed, -1, LLAMA_DEFAULT_SEED)
        self.compat.settings = replace(self.compat.settings, seed=None if seed in (-1, LLAMA_DEFAULT_SEED) else seed)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor: Any = None,
               grammar: Any = None, idx: int | None = None) -> int:
        """:meth:`Clover.sample`."""
        from ._lib import import_llama_cpp  # noqa: PLC0415 - optional: llama-cpp-python's Python layer
        from .llama_sample import SampleArgs, sample_token  # noqa: PLC0415

        for name, value in (("logits_processor", logits_processor), ("grammar", grammar)):
            if value is not None:
                raise CloverValueError(f"sample: {name} is not supported by Clover; leave it None", param=name)
        if idx is not None and idx != self.llm.n_tokens - 1:
            raise CloverValueError(f"sample: idx={idx!r} is not supported: only the last committed position's "
                                   f"logits are kept (idx None or {self.llm.n_tokens - 1})"[:300], param="idx")
        a = SampleArgs(int_arg("top_k", top_k), float(top_p), float(min_p), float(typical_p), float(temp),
                       float(repeat_penalty), float(frequency_penalty), float(presence_penalty),
                       int_arg("mirostat_mode", mirostat_mode, 0, 2), float(mirostat_eta), float(mirostat_tau))
        with self.turn():
            logits, history = self.llm.last_logits(), self.llm.committed_tokens
        if self.llm.mask_token >= 0:
            logits[self.llm.mask_token] = -np.inf
        seed = self.compat.settings.seed
        return sample_token(import_llama_cpp(), logits, history, a, LLAMA_DEFAULT_SEED if seed is None else seed)

    def generate_tokens(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                        typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                        frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                        mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                        penalize_nl: bool = True, logits_processor: Any = None, stopping_criteria: Any = None,
                        grammar: Any = None) -> Iterator[int]:
        """:meth:`Clover.generate_tokens`."""
        if stopping_criteria is not None:
            raise CloverValueError("generate_tokens: stopping_criteria is not supported by Clover; leave it None",
                                   param="stopping_criteria")
        toks = token_ids(tokens, self.llm.n_vocab())
        if bool_arg("reset", reset):
            held = self.llm.committed_tokens
            if held and toks[:len(held)] == held:
                toks = toks[len(held):]
            else:
                self.llm.reset()
        self.llm.eval(toks)
        knobs = dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                     repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                     presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                     mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, penalize_nl=penalize_nl,
                     logits_processor=logits_processor, grammar=grammar)
        while True:
            token = self.llm.sample(**knobs)
            if (yield token) is not None:
                raise CloverValueError("generate_tokens: tokens sent into the generator are not supported by Clover")
            self.llm.eval([token])

    def pooling_type(self) -> int:
        """:meth:`Clover.pooling_type`."""
        p = self.compat.settings.pooling_type
        return POOLING_MEAN if p == POOLING_UNSPECIFIED else p

    def _embedder(self, where: str) -> Any:
        """llama-cpp-python's ``Llama`` over this GGUF with embeddings on (loaded once, on our
        libllama): llama.cpp's pooling of the causal pass's final hidden states."""
        if not self.compat.settings.embedding:
            raise CloverValueError(f"{where}: the model must be created with embedding=True", param="embedding")
        if self.compat.embedder is None:
            from ._lib import import_llama_cpp  # noqa: PLC0415 - optional: llama-cpp-python's Python layer

            self.compat.embedder = import_llama_cpp().llama.Llama(  # (its module's: the package's may be Clover)
                str(self.llm.model_path), embedding=True, verbose=False, n_ctx=self.llm.n_ctx(),
                n_batch=self.compat.settings.n_batch,
                n_ubatch=self.compat.settings.n_ubatch, n_threads=self.compat.n_threads,
                n_gpu_layers=self.compat.n_gpu_layers, use_mmap=self.compat.use_mmap is not False,
                pooling_type=self.llm.pooling_type())
        return self.compat.embedder

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False) -> Any:  # noqa: A002 - llama-cpp-python's name
        """:meth:`Clover.embed`."""
        return self._embedder("embed").embed(input, normalize=normalize, truncate=truncate,
                                              return_count=return_count)

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict[str, Any]:
        """:meth:`Clover.create_embedding`."""
        r = self._embedder("create_embedding").create_embedding(input)
        return {**r, "model": model if isinstance(model, str) else str(self.llm.model_path)}

    def _llama_kwargs(self, where: str, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any,
                      stop: Any, logprobs: Any, grammar: Any, response_format: Any, stream: Any,
                      neutral: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """generate() keyword arguments for create_completion / create_chat_completion."""
        for name, (value, ok) in neutral.items():
            if value is not None and not (value == ok if not isinstance(ok, tuple) else value in ok):
                raise CloverValueError(f"{where}: {name}={value!r} is not supported by Clover; leave it at "
                                       f"{ok if not isinstance(ok, tuple) else ok[0]!r}"[:300])
        kw: dict[str, Any] = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed if seed is not None else self.compat.settings.seed,
                                  stop=strings_arg("stop", stop), stream=bool_arg("stream", stream))
        if max_tokens is not None:
            kw["max_tokens"] = int_arg("max_tokens", max_tokens)
        extra = {"logprobs": logprobs, "grammar": grammar, "response_format": response_format}
        accepts = inspect.signature(self.llm.generate).parameters
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
            room = self.llm.room(n_prompt, gen_kwargs.get("block_size", "default"), gen_kwargs.get("draft_self", False))
            if room <= 0:
                raise CloverError(f"the prompt ({n_prompt} tokens) leaves no room in n_ctx={self.llm.n_ctx()}",
                                  N.CLOVER_ERR_CONTEXT_FULL)
            kw["max_tokens"] = room

    def _completion_logprobs(self, r: "GenerationResult", prompt_text: str,
                             prompt: PromptLogprobs | None = None) -> dict[str, Any] | None:
        """The reply's logprobs, its text offsets counted from the prompt's start (as
        llama-cpp-python and OpenAI); with ``prompt`` (echo) the prompt's tokens first, a leading
        BOS left out (its text is not echoed) and the first listed token's log-probability None."""
        if getattr(r, "logprobs", None) is None:
            return None
        echoed = reply.prompt_logprobs(prompt, self.llm.bos_token, self.llm.token_to_piece) \
            if prompt is not None else None
        return reply.joined(echoed, reply.reply_logprobs(r, self.llm.token_to_piece, len(prompt_text)))

    def create_completion(self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | Sequence[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                          stopping_criteria: Any = None, logits_processor: Any = None, grammar: Any = None,
                          logit_bias: Mapping[int, float] | None = None, **gen_kwargs: Any) -> Any:
        """:meth:`Clover.create_completion`."""
        where = "create_completion"
        kw = self._llama_kwargs(where, max_tokens, temperature, top_p, top_k, seed, stop, logprobs, grammar, None,
                                stream, {"suffix": (suffix, None), "tfs_z": (tfs_z, 1.0),
                                         "stopping_criteria": (stopping_criteria, None),
                                         "logits_processor": (logits_processor, None)})
        kw.update(_chain_kwargs(min_p, typical_p, frequency_penalty, presence_penalty, repeat_penalty, mirostat_mode,
                                mirostat_tau, mirostat_eta, logit_bias))
        if isinstance(prompt, str):
            prompt_text, toks = prompt, self.llm.tokenize(prompt, add_bos=True, special=True)
        else:
            toks = token_ids(prompt, self.llm.n_vocab())
            prompt_text = self.llm.detokenize_text(toks)
        self._budget(kw, len(toks), gen_kwargs)
        echo = bool_arg("echo", echo)
        head = reply.head("text_completion", model if isinstance(model, str) else str(self.llm.model_path))
        scored = self.llm.prompt_logprobs(toks, kw["logprobs"]) if echo and kw.get("logprobs") is not None else None
        if self.llm.cache is not None:
            self._from_cache(toks)
        if kw["stream"]:
            s = self.llm.generate(toks, **kw, **gen_kwargs)

            def chunks() -> Iterator[dict[str, Any]]:
                offset = len(prompt_text)  # (the reply's text offsets count from the prompt's start)
                with s:
                    if echo and prompt_text:
                        lp = reply.prompt_logprobs(scored, self.llm.bos_token, self.llm.token_to_piece) \
                            if scored is not None else None
                        yield {**head, "choices": [reply.text_choice(0, prompt_text, lp)]}
                    for piece in s:  # (with logprobs: each piece its own tokens')
                        lp = reply.reply_logprobs(piece, self.llm.token_to_piece, offset)
                        offset += sum(len(t) for t in lp["tokens"]) if lp is not None else 0
                        yield {**head, "choices": [reply.text_choice(0, str(piece), lp)]}
                assert s.result is not None
                if self.llm.cache is not None:
                    self._to_cache()
                yield {**head, "choices": [reply.text_choice(0, "", None, reply.finish_reason(s.result))]}
            return chunks()
        r = self.llm.generate(toks, **kw, **gen_kwargs)
        if self.llm.cache is not None:
            self._to_cache()
        text = (prompt_text if echo else "") + r.text
        return {**head, "choices": [reply.text_choice(0, text, self._completion_logprobs(r, prompt_text, scored),
                                                      reply.finish_reason(r))],
                "usage": reply.usage([r], cached=False)}

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
        """:meth:`Clover.create_chat_completion`."""
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
                             self.llm.chat_template, reasoning_format)
        if tp.grammar is not None:
            if kw.get("grammar") is not None or kw.get("response_format") is not None:
                raise CloverValueError(f"{where}: tool_choice forces a call: grammar and response_format cannot "
                                       "apply too", param="tool_choice")
            kw["grammar"] = tp.grammar
        prompt = (self.llm.format_chat(messages, tools=tp.tools) if tp.active
                  else self.llm.format_chat(messages)) + tp.prefill
        self._budget(kw, len(self.llm.chat_tokens(prompt)), gen_kwargs)
        head = reply.head("chat.completion", model if isinstance(model, str) else str(self.llm.model_path))
        if kw["stream"]:
            s = self.llm.generate_chat(prompt, **kw, **gen_kwargs)
            calls = tool_calls.ToolStream(tp) if tp.parses else None

            def deltas(piece: Any) -> Iterator[dict[str, Any]]:
                """A piece's deltas: its text, or when parsed (tools, reasoning) the content, thinking
                and calls read out of the reply so far."""
                lp = reply.chat_logprobs(piece, self.llm.token_to_piece) if piece is not None else None
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
        r = self.llm.generate_chat(prompt, **kw, **gen_kwargs)
        message = tool_calls.reply_message(r.text, tp)
        return {**head, "choices": [reply.message_choice(0, message, reply.chat_logprobs(r, self.llm.token_to_piece),
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
