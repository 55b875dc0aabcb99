"""Decoding: the thread decoding runs on (:class:`DecodeThread`), the parameters of one call
(:class:`GenParams`, checked once), the glue between libclover's decode loop and Python
(:class:`Generation`: callbacks, output following, the result), the stream iterator and the
result types. "Does it fit in n_ctx" is :func:`room` (libclover's rule, clover_generate_room)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import queue
import secrets
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native as N
from ._args import INT32_MAX, bool_arg, float_arg, int32_arg, int_arg, strings_arg, tristate_arg
from ._handles import BLOCK_SIZE_AUTO, ContextRef, is_auto
from .errors import CloverTypeError, CloverValueError, check
from .output import OutputFollower

if TYPE_CHECKING:
    from ._handles import Gate

#: on_step(canvas_tokens, n_masked, block_start) -> True to cancel
StepCallback = Callable[[list[int], int, int], Any]
#: on_block(text_piece, tokens) -> True to cancel
BlockCallback = Callable[[str, list[int]], Any]
#: on_draft(draft_tokens, block_start) -> True to cancel (draft-self: each draft before its verification)
DraftCallback = Callable[[list[int], int], Any]


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
    tokens_per_verification: float = 0.0  # draft-self: tokens each verification kept (libclover's figure)
    n_graphs_reused: int = 0    # decode forwards that ran llama.cpp's previous graph again (same shape; GPU: replayed)
    coreset: int = 0            # the block expert coreset C of the block passes (0 = off): the context's
    #                             setting during the call (clover_coreset; libclover's clover_stats has no field)
    # the routed experts of the block passes, counted with Clover(expert_stats=True) (else 0):
    n_expert_passes: int = 0         # block passes counted (canvases of >= 2 rows, draft-self's drafts included)
    experts_per_pass: float = 0.0    # distinct routed experts per MoE layer of a pass (mean over passes and layers)
    expert_bytes_per_pass: float = 0.0  # bytes of routed-expert weights those are, per pass
    expert_bytes_b1: float = 0.0     # the same for a B = 1 step (k experts a layer)

    @property
    def expert_bytes_ratio(self) -> float:
        """A block pass's routed-expert bytes in B = 1 steps' (0 when not counted)."""
        return self.expert_bytes_per_pass / self.expert_bytes_b1 if self.expert_bytes_b1 else 0.0

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
                   grammar_mode={1: "ar", 2: "draft-self"}.get(int(s.grammar_mode), ""),
                   n_blocks_ar=s.n_blocks_ar, n_blocks_diffusion=s.n_blocks_diffusion,
                   n_blocks_draft_self=s.n_blocks_draft_self, tokens_per_verification=s.tokens_per_verification,
                   n_graphs_reused=s.n_graphs_reused, n_expert_passes=s.n_expert_passes,
                   experts_per_pass=s.experts_per_pass, expert_bytes_per_pass=s.expert_bytes_per_pass,
                   expert_bytes_b1=s.expert_bytes_b1)

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
                + (f", coreset {self.coreset}" if self.coreset else "")
                + (f", experts/pass {self.experts_per_pass:.2f} ({self.expert_bytes_per_pass / 2**20:.1f} MiB, "
                   f"{self.expert_bytes_ratio:.2f}x B = 1)" if self.n_expert_passes else "")
                + (f", draft-self: {self.n_accepted}/{self.n_drafted} drafted tokens accepted, "
                   f"{self.tokens_per_verification:.2f} tok/verification, "
                   f"{self.n_decode_passes / max(self.n_generated, 1):.2f} draft passes/tok"
                   if self.n_verifications else ""))


@dataclass
class Perplexity:
    """Clover.perplexity's figure: exp of the mean next-token negative log-likelihood, and
    llama-perplexity's +/- estimate of it."""

    ppl: float
    n_tokens: int   # positions scored
    n_chunks: int
    n_ctx: int
    #: the standard error of the mean negative log-likelihood times the perplexity (llama-perplexity's
    #: "+/-"); nan with fewer than two positions scored
    uncertainty: float = math.nan

    @classmethod
    def of_sums(cls, nll: float, nll2: float, count: int, n_chunks: int, n_ctx: int) -> "Perplexity":
        """From the sums of the scored positions' negative log-likelihoods and of their squares,
        as llama-perplexity's perplexity() ends."""
        mean = nll / count
        ppl = math.exp(mean)
        variance = nll2 / count - mean * mean
        uncertainty = math.sqrt(variance / (count - 1)) * ppl if count > 1 and variance > 0 else math.nan
        return cls(ppl=ppl, n_tokens=count, n_chunks=n_chunks, n_ctx=n_ctx, uncertainty=uncertainty)


class StreamPiece(str):
    """A piece of a stream's text (a ``str``) and the output tokens it carries: ``tokens`` (a
    token whose text is held back, part of a character or of a possible stop string, comes with a
    later piece; the pieces' tokens joined are ``result.tokens``, with ``logprobs``); with
    generate(logprobs=N) their ``logprobs`` / ``top_logprobs`` as :class:`GenerationResult` has
    them (None without), read when the token's block was committed. With logprobs a piece may have
    no text (the tokens of a stop string, at the end)."""

    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None

    def __new__(cls, text: str, tokens: Sequence[int] = (), logprobs: list[float] | None = None,
                top_logprobs: list[list[tuple[int, float]]] | None = None) -> "StreamPiece":
        piece = super().__new__(cls, text)
        piece.tokens, piece.logprobs, piece.top_logprobs = list(tokens), logprobs, top_logprobs
        return piece

    @classmethod
    def joined(cls, pieces: Sequence["StreamPiece"]) -> "StreamPiece":
        """Consecutive pieces as one (their text, tokens and log-probabilities in order)."""
        lps = None if not pieces or pieces[0].logprobs is None else [x for p in pieces for x in p.logprobs or ()]
        tops = None if not pieces or pieces[0].top_logprobs is None else \
            [x for p in pieces for x in p.top_logprobs or ()]
        return cls("".join(pieces), [t for p in pieces for t in p.tokens], lps, tops)


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


# ----------------------------------------------------------------------------- fits in n_ctx

def native_block_size(block_size: int | str | None) -> int:
    """clover_generate_params.block_size of a Python block size (a B, or "auto" / None)."""
    return N.CLOVER_BLOCK_SIZE_AUTO if is_auto(block_size) else int(block_size)  # type: ignore[arg-type]


def room(ctx: ContextRef, n_prompt: int, gp: N.clover_generate_params | None = None) -> int:
    """The largest max_tokens a generation with ``gp`` (None = the defaults) after n_prompt
    prompt tokens may ask for, 0 when none fits: libclover's one "does it fit" rule
    (clover_generate_room: the rest of n_ctx, in whole blocks of the B the call starts with;
    auto and draft-self need no whole blocks)."""
    return int(N.clover_generate_room(ctx.ptr, None if gp is None else ctypes.byref(gp), n_prompt))


def room_params(block_size: int | str | None, draft_self: int) -> N.clover_generate_params:
    """The defaults with this block size and draft-self (what :func:`room` depends on)."""
    gp = N.clover_generate_default_params()
    gp.block_size, gp.draft_self = native_block_size(block_size), draft_self
    return gp


# ----------------------------------------------------------------------------- parameters

# generate()'s keywords -> the clover_generate_params fields they set (GenParams.check)
_PARAM_FIELDS = {"block_size": ("block_size",), "threshold": ("threshold",), "max_steps": ("max_steps",),
                 "temperature": ("temperature",), "top_k": ("top_k",), "top_p": ("top_p",),
                 "max_tokens": ("max_tokens",), "draft_self": ("draft_self",), "draft_steps": ("draft_steps",),
                 "logprobs": ("n_top_logprobs", "top_tokens", "top_logprobs"),
                 "stop_tokens": ("n_stop_tokens", "stop_tokens"),
                 # llama.cpp's sampler chain (ChainParams)
                 "min_p": ("min_p",), "typical_p": ("typical_p",), "top_n_sigma": ("top_n_sigma",),
                 "xtc_probability": ("xtc_probability",), "xtc_threshold": ("xtc_threshold",),
                 "repeat_last_n": ("repeat_last_n",), "repeat_penalty": ("repeat_penalty",),
                 "frequency_penalty": ("frequency_penalty",), "presence_penalty": ("presence_penalty",),
                 "dry_multiplier": ("dry_multiplier",), "dry_base": ("dry_base",),
                 "dry_allowed_length": ("dry_allowed_length",), "dry_penalty_last_n": ("dry_penalty_last_n",),
                 "dry_sequence_breakers": ("n_dry_sequence_breakers", "dry_sequence_breakers"),
                 "mirostat_mode": ("mirostat",), "mirostat_tau": ("mirostat_tau",), "mirostat_eta": ("mirostat_eta",),
                 "dynatemp_range": ("dynatemp_range",), "dynatemp_exponent": ("dynatemp_exponent",),
                 "min_keep": ("min_keep",),
                 "logit_bias": ("n_logit_bias", "logit_bias_tokens", "logit_bias"), "samplers": ("samplers",)}


@dataclass
class ChainParams:
    """llama.cpp's sampler chain of one call (clover.h, clover_generate_params.min_p ... samplers):
    llama-cpp-python's argument names (mirostat_mode for the C field mirostat), every sampler off
    by default. The ranges are libclover's (GenParams.check)."""

    min_p: float = 0.0
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None  # None = llama.cpp's ["\n", ":", "\"", "*"]
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    min_keep: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    samplers: str | None = None  # llama-server's names (";"-separated or a list) or llama-cli's letters

    FLOATS = ("min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "repeat_penalty",
              "frequency_penalty", "presence_penalty", "dry_multiplier", "dry_base", "mirostat_tau", "mirostat_eta",
              "dynatemp_range", "dynatemp_exponent")
    INTS = ("repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat_mode", "min_keep")

    @classmethod
    def of(cls, a: Mapping[str, Any]) -> "ChainParams":
        """The chain's keywords of ``a`` (absent ones keep the defaults), checked for types."""
        p = cls()
        for k in cls.FLOATS:
            if k in a:
                setattr(p, k, float_arg(k, a[k]))
        for k in cls.INTS:
            if k in a:
                setattr(p, k, int32_arg(k, a[k]))
        if a.get("dry_sequence_breakers") is not None:
            p.dry_sequence_breakers = strings_arg("dry_sequence_breakers", a["dry_sequence_breakers"])
        if a.get("logit_bias"):
            p.logit_bias = logit_bias_arg(a["logit_bias"])
        if a.get("samplers") is not None:
            v = a["samplers"]
            p.samplers = v if isinstance(v, str) else ";".join(strings_arg("samplers", v))
        return p

    def set_native(self, gp: N.clover_generate_params, keep: list[Any]) -> None:
        for k in self.FLOATS + self.INTS:
            setattr(gp, "mirostat" if k == "mirostat_mode" else k, getattr(self, k))
        if self.dry_sequence_breakers:
            keep.append((ctypes.c_char_p * len(self.dry_sequence_breakers))(
                *[b.encode("utf-8") for b in self.dry_sequence_breakers]))
            gp.dry_sequence_breakers, gp.n_dry_sequence_breakers = keep[-1], len(self.dry_sequence_breakers)
        if self.logit_bias:
            keep.append(N.as_int32_array(list(self.logit_bias)))
            keep.append((ctypes.c_float * len(self.logit_bias))(*self.logit_bias.values()))
            gp.logit_bias_tokens, gp.logit_bias, gp.n_logit_bias = keep[-2], keep[-1], len(self.logit_bias)
        if self.samplers:
            keep.append(self.samplers.encode("utf-8"))
            gp.samplers = keep[-1]


def logit_bias_arg(v: Any) -> dict[int, float]:
    """{token id: bias} (llama-cpp-python's; a JSON object's keys are digit strings), -inf bans."""
    if not isinstance(v, Mapping):
        raise CloverTypeError(f"logit_bias must be a mapping of token id to bias, got {v!r}"[:200], param="logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        tok = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        out[int_arg("logit_bias token id", tok, -INT32_MAX - 1, INT32_MAX)] = float_arg("logit_bias value", b)
    return out


@dataclass
class GenParams:
    """One generate() call's parameters, checked (:meth:`of`), and their clover_generate_params."""

    max_tokens: int
    block_size: int | str       # B, or "auto"
    threshold: float
    max_steps: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_at_eos: bool = True
    stop_tokens: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    reuse_prefix: bool = True
    draft_self: int = 0         # -1 auto, 0 off, 1 on (clover_generate_params.draft_self)
    draft_steps: int = 1
    grammar: str | None = None
    logprobs: int | None = None  # top log-probabilities per token; None = off
    chain: ChainParams = field(default_factory=ChainParams)

    @classmethod
    def of(cls, max_tokens: Any, block_size: Any, threshold: Any, max_steps: Any, temperature: Any, top_k: Any,
           top_p: Any, seed: Any, **rest: Any) -> "GenParams":
        if seed is None or (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed == -1):
            seed = secrets.randbits(63)  # a fresh seed per call, reported in the result
        # (types and the int32 / uint64 range of the C fields here; the ranges are libclover's: check())
        return cls(max_tokens=int32_arg("max_tokens", max_tokens),
                   block_size=BLOCK_SIZE_AUTO if is_auto(block_size) else int_arg("block_size", block_size, 1, INT32_MAX),
                   threshold=float_arg("threshold", threshold), max_steps=int32_arg("max_steps", max_steps),
                   temperature=float_arg("temperature", temperature), top_k=int32_arg("top_k", top_k),
                   top_p=float_arg("top_p", top_p), seed=int_arg("seed (None or -1 = random)", seed, 0, 2**64 - 1),
                   **rest)

    @classmethod
    def of_kwargs(cls, a: Mapping[str, Any], block_size: Any) -> "GenParams":
        """generate()'s keyword arguments ``a`` (all of them, its defaults filled in) with this
        block size, checked for types (not yet the ranges: :meth:`check`; nor stop_tokens, which
        need the vocabulary)."""
        p = cls.of(a["max_tokens"], block_size, a["threshold"], a["max_steps"], a["temperature"], a["top_k"],
                   a["top_p"], a["seed"])
        return replace(p, **cls.options(a["stop"], a["reuse_prefix"], a["draft_self"], a["draft_steps"]),
                       **cls.constraints(a["grammar"], a["logprobs"], a["response_format"]),
                       stop_at_eos=bool_arg("stop_at_eos", a["stop_at_eos"]), chain=ChainParams.of(a))

    def native(self, keep: list[Any]) -> N.clover_generate_params:
        """These values as clover_generate_params (``keep`` holds what its pointers point to;
        no callbacks and no output buffers yet)."""
        gp = N.clover_generate_default_params()
        gp.block_size = native_block_size(self.block_size)
        gp.threshold, gp.max_steps, gp.temperature = self.threshold, self.max_steps, self.temperature
        gp.top_k, gp.top_p, gp.seed, gp.max_tokens = self.top_k, self.top_p, self.seed, self.max_tokens
        gp.stop_at_eos = 1 if self.stop_at_eos else 0
        gp.reuse_prefix = 1 if self.reuse_prefix else 0
        gp.draft_self, gp.draft_steps = self.draft_self, self.draft_steps
        if self.stop_tokens:
            keep.append(N.as_int32_array(self.stop_tokens))
            gp.stop_tokens, gp.n_stop_tokens = keep[-1], len(self.stop_tokens)
        if self.grammar:
            keep.append(self.grammar.encode("utf-8"))
            gp.grammar = keep[-1]
        self.chain.set_native(gp, keep)
        if self.logprobs is not None:  # (1-entry top buffers until the call passes its own)
            keep += [(ctypes.c_int32 * 1)(), (ctypes.c_float * 1)()]
            gp.n_top_logprobs, gp.top_tokens, gp.top_logprobs = self.logprobs, keep[-2], keep[-1]
        return gp

    def check(self) -> None:
        """libclover's rules for these values (clover_generate_params_check, the one owner of the
        ranges and their messages): before waiting for the turn or allocating anything."""
        keep: list[Any] = []
        gp = self.native(keep)
        problem = N.generate_params_problem(gp)
        if problem is None:
            return
        # the keyword to blame (CloverError.param): the first whose default value changes the
        # verdict (libclover reports the first broken rule; no parsing of its message)
        default = N.clover_generate_default_params()
        for name, fields in _PARAM_FIELDS.items():
            trial = type(gp).from_buffer_copy(gp)
            for f in fields:
                setattr(trial, f, getattr(default, f))
            if N.generate_params_problem(trial) != problem:
                raise CloverValueError(problem, param=name)
        raise CloverValueError(problem)

    @staticmethod
    def constraints(grammar: Any, logprobs: Any, response_format: Any) -> dict[str, Any]:
        """grammar / response_format (-> GBNF text, clover_cpp.grammar) and logprobs."""
        from .grammar import GrammarError, grammar_for  # noqa: PLC0415

        try:
            text = grammar_for(grammar, response_format)
        except GrammarError as e:
            raise CloverValueError(str(e)) from None
        if isinstance(logprobs, bool):
            logprobs = 0 if logprobs else None
        n_top = None if logprobs is None else int32_arg("logprobs", logprobs)  # (range: check())
        return {"grammar": text, "logprobs": n_top}

    @staticmethod
    def options(stop: Any, reuse_prefix: Any, draft_self: Any, draft_steps: Any) -> dict[str, Any]:
        return dict(stop_strings=strings_arg("stop", stop), reuse_prefix=bool_arg("reuse_prefix", reuse_prefix),
                    draft_self=tristate_arg("draft_self", draft_self),
                    draft_steps=int32_arg("draft_steps", draft_steps))


# ----------------------------------------------------------------------------- one generation

class Generation:
    """One clover_generate call and its Python side: the step and block callbacks (the
    caller's, the output follower's, cancellation), the output buffers, the result.

    ``native`` is a context manager factory entered around the native call (the Clover object
    marks its callbacks' thread with it); ``push`` (streams) gets each new piece of final text
    (a :class:`StreamPiece`): after every denoising step, the contiguous unmasked prefix of the
    block that is new; with logprobs, after every block (libclover writes a block's logprobs when
    it commits it, before the block callback)."""

    def __init__(self, ctx: ContextRef, prompt: list[int], p: GenParams, *, mask: int, eos: int,
                 detokenize: Callable[[list[int]], bytes], on_step: StepCallback | None = None,
                 on_block: BlockCallback | None = None, push: Callable[[str, list[int]], bool] | None = None,
                 cancel: threading.Event | None = None,
                 native: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                 on_draft: DraftCallback | None = None) -> None:
        self.ctx, self.prompt, self.p = ctx, prompt, p
        self.mask = mask
        self.on_step, self.on_block, self.push, self.cancel = on_step, on_block, push, cancel
        self.on_draft = on_draft
        self.native = native
        self._detokenize = detokenize
        ends = set(p.stop_tokens) | ({eos} if p.stop_at_eos and eos >= 0 else set())
        self.out = OutputFollower(p.stop_strings, stop_tokens=ends, detokenize=detokenize,
                                  push=self._push if push is not None else None)
        # track the canvas's final prefix every step (a draft-self canvas is only a draft: its
        # tokens are final once the block's verification has kept them; a token's logprobs are
        # there once its block is committed)
        self.follow = (push is not None or bool(self.out.stops)) and p.draft_self != 1 and p.logprobs is None
        self._lp: tuple[Any, Any, Any] | None = None  # the logprob buffers (logprobs, top tokens, top logprobs)
        self._n_pushed = 0  # output tokens handed to push
        self.exc: BaseException | None = None  # raised by a callback: re-raised after the native call
        self.ran = False  # the native call was made (not a stream closed before its turn)

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def _step(self, block_start: int, canvas: Any, bsz: int, n_masked: int, _ud: Any) -> int:
        try:
            if self._cancelled():
                return 1
            if self.on_step is not None and self.on_step(list(canvas[:bsz]), int(n_masked), int(block_start)):
                return 1
            if self.follow and self.out.step(canvas, max(0, len(self.prompt) - block_start), bsz, self.mask,
                                             self.p.max_tokens):
                return 1
            return 0
        except BaseException as e:  # noqa: BLE001 - re-raised after the native call returns
            self.exc = e
            return 1

    def _draft(self, block_start: int, draft: Any, n_draft: int, _ud: Any) -> int:
        try:
            assert self.on_draft is not None
            return 1 if (self.on_draft(list(draft[:n_draft]), int(block_start)) or self._cancelled()) else 0
        except BaseException as e:  # noqa: BLE001 - re-raised after the native call returns
            self.exc = e
            return 1

    def _block(self, block_start: int, tokens: Any, n_tokens: int, _ud: Any) -> int:
        try:
            bt = list(tokens[:n_tokens])
            stop, text = self.out.block(bt)
            want_stop = False
            if self.on_block is not None:
                want_stop = bool(self.on_block(text, bt[:len(self.out.tokens)]))
            return 1 if (stop or want_stop or self._cancelled()) else 0
        except BaseException as e:  # noqa: BLE001
            self.exc = e
            return 1

    def _logprobs(self, start: int, end: int) -> tuple[list[float], list[list[tuple[int, float]]]] | None:
        """Output tokens [start, end)'s logprobs and top ones (written by libclover when their
        block was committed); None without logprobs."""
        if self._lp is None or self.p.logprobs is None:
            return None
        lp_buf, top_tok, top_lp = self._lp
        n_top = self.p.logprobs
        return ([float(x) for x in lp_buf[start:end]],
                [[(int(top_tok[i * n_top + j]), float(top_lp[i * n_top + j])) for j in range(n_top)]
                 for i in range(start, end)])

    def _push(self, piece: str, tokens: list[int]) -> bool:
        """The output follower's piece to the stream, with its tokens' logprobs (a piece of no
        text only when it carries logprobs)."""
        start = self._n_pushed
        self._n_pushed += len(tokens)
        lps = self._logprobs(start, self._n_pushed)
        if not piece and (lps is None or not tokens):
            return False
        assert self.push is not None
        return self.push(StreamPiece(piece, tokens, *(lps or (None, None))), tokens)

    def _native_params(self, keep: list[Any]) -> N.clover_generate_params:
        gp = self.p.native(keep)
        keep += [N.clover_step_callback(self._step), N.clover_block_callback(self._block)]
        gp.step_callback, gp.block_callback = keep[-2], keep[-1]
        if self.on_draft is not None:
            keep.append(N.clover_draft_callback(self._draft))
            gp.draft_callback = keep[-1]
        return gp

    def _coreset(self) -> int:
        """The context's block expert coreset now, the one this call runs with (a "model"
        setting is already the GGUF's C there); libclover's clover_stats has no field for it."""
        return max(0, int(N.clover_coreset(self.ctx.ptr)))

    def run(self) -> GenerationResult:
        p, n_prompt = self.p, len(self.prompt)
        if self._cancelled():  # (a stream closed before its turn came)
            return GenerationResult(text="", tokens=[], stats=GenerationStats(n_prompt=n_prompt,
                                                                             finish_reason="cancelled", seed=p.seed,
                                                                             coreset=self._coreset()))
        keep: list[Any] = []
        gp = self._native_params(keep)
        cap, n_top = max(p.max_tokens, 1), p.logprobs
        if n_top is not None:  # logprobs: clover.h, clover_generate_params
            lp_buf, top_tok, top_lp = ((ctypes.c_float * cap)(), (ctypes.c_int32 * max(cap * n_top, 1))(),
                                       (ctypes.c_float * max(cap * n_top, 1))())
            gp.logprobs, gp.n_top_logprobs, gp.top_tokens, gp.top_logprobs = lp_buf, n_top, top_tok, top_lp
            self._lp = (lp_buf, top_tok, top_lp)
        out, n_out, st = (ctypes.c_int32 * cap)(), ctypes.c_int32(0), N.clover_stats()
        err, n = N.err_buffer()
        arr = N.as_int32_array(self.prompt)
        self.ran = True
        with self.native():
            rc = N.clover_generate(self.ctx.ptr, arr, n_prompt, ctypes.byref(gp), out, cap, ctypes.byref(n_out),
                                   ctypes.byref(st), err, n)
        B = int(st.block_size) or int(N.clover_block_size(self.ctx.ptr))
        if self.exc is not None:
            raise self.exc
        if rc not in (N.CLOVER_OK, N.CLOVER_ERR_CANCELLED):
            check(rc, err)
        tokens = list(out[: n_out.value])
        tail = self.out.finish()
        self.out.close()
        if self.out.hit:  # a stop string: the output ends at the token that completed it
            tokens = self.out.tokens
            check(N.clover_stats_cut(ctypes.byref(st), len(tokens)), None, "clover_stats_cut")
        stats = GenerationStats._from_native(st, B)
        stats.seed = p.seed
        stats.coreset = self._coreset()
        if self.out.hit:  # (libclover saw a cancel)
            stats.finish_reason = "stop"
        if tail and self.on_block is not None:
            self.on_block(tail, [])
        follower = self.out
        text = follower.text if (tokens == follower.tokens or follower.stops) else \
            self._detokenize(tokens).decode("utf-8", "replace")
        result = GenerationResult(text=text, tokens=tokens, stats=stats)
        lps = self._logprobs(0, len(tokens))  # (tokens is a prefix of the native output)
        if lps is not None:
            result.logprobs, result.top_logprobs = lps
        return result


# ----------------------------------------------------------------------------- threads and streams

class DecodeThread:
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
        outcome: list[tuple[bool, Any]] = []  # (ok, result or exception)
        done = threading.Event()  # (not a join: a wait cut short by Ctrl-C can misreport the end)

        def job() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome.append((False, e))
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
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self._jobs.put(None)
            self.thread.join()


_DECODERS: "weakref.WeakSet[DecodeThread]" = weakref.WeakSet()
_SHARED_DECODER: DecodeThread | None = None
_SHARED_LOCK = threading.Lock()


def shared_decoder() -> DecodeThread:
    global _SHARED_DECODER
    with _SHARED_LOCK:
        if _SHARED_DECODER is None or not _SHARED_DECODER.thread.is_alive():
            _SHARED_DECODER = DecodeThread()
        return _SHARED_DECODER


class GenerationStream:
    """Iterator over the output text as it becomes final (after every denoising step: the
    new contiguous unmasked prefix of the block; with logprobs, block by block), as
    :class:`StreamPiece` strings that carry their tokens (and logprobs), produced while
    generation runs in a worker thread. After it is exhausted, ``result`` holds the :class:`GenerationResult`.
    ``close()`` (or leaving a ``for`` loop early and dropping it) cancels the generation.
    It holds its Clover object's turn until its decoding ends (see the Clover class doc)."""

    def __init__(self, run: Callable[[Callable[[str, list[int]], bool], threading.Event], GenerationResult],
                 decoder: DecodeThread | None = None, gate: "Gate | None" = None) -> None:
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

    def __next__(self) -> StreamPiece:
        self._reader = threading.get_ident()
        while not self._done:
            try:
                kind, val = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "piece":
                return val
            self._done = True
            if kind == "error":
                raise val
            self.result = val
        raise StopIteration

    def close(self) -> None:
        """Cancel (if still running) and wait for the worker thread."""
        self._cancel.set()
        if self._thread is not threading.current_thread():
            while not self._finished.wait(0.25):  # (an Event: see DecodeThread.call)
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


_LIVE_STREAMS: "weakref.WeakSet[GenerationStream]" = weakref.WeakSet()


@atexit.register
def _join_streams_at_exit() -> None:
    # a worker thread still inside libclover when the interpreter finalizes would be torn down
    # mid-C++ (abort: "exception not rethrown"): cancel and join every live stream first
    for st in list(_LIVE_STREAMS):
        st.close()
    for d in list(_DECODERS):
        d.stop()
