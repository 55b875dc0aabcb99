"""``clover serve``: the pieces of a reply (finish reason, usage, Clover's stats, log-probabilities)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import GenerationResult, compat
from ..compat import PromptLogprobs
from ..decoding import StreamPiece


def finish_reason(r: GenerationResult) -> str:
    # (max_tokens 0: nothing generated and no reason from libclover, a budget spent all the same)
    return "length" if r.stats.finish_reason == "max_tokens" or (not r.stats.finish_reason and not r.tokens) \
        else "stop"


def usage(rs: Sequence[GenerationResult], per_prompt: int = 1) -> dict[str, Any]:
    """A request's usage: each prompt once (the first of its ``per_prompt`` generations), every
    generated token (best_of's candidates too, as OpenAI counts them)."""
    firsts = rs[::per_prompt]
    n_prompt, n_out = sum(r.stats.n_prompt for r in firsts), sum(len(r.tokens) for r in rs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.n_reused for r in firsts)}}


def clover_stats(r: GenerationResult) -> dict[str, Any]:
    """Clover's own figures of a reply (the ``clover`` object), with the seed the call used."""
    s = r.stats
    out = {"block_size": s.block_size, "tokens_per_forward": round(s.tokens_per_forward, 4),
           "decode_passes": s.n_decode_passes, "reused_prompt_tokens": s.n_reused,
           "tokens_per_second": round(s.tokens_per_second, 2), "seed": r.seed}
    if getattr(s, "mode", ""):
        # the last block's mode ("autoregressive", "diffusion" or "draft-self": what block_size /
        # draft_self "auto" chose) and the blocks per mode
        out["mode"] = s.mode
        out["blocks"] = {"autoregressive": s.n_blocks_ar, "diffusion": s.n_blocks_diffusion,
                         "draft-self": s.n_blocks_draft_self}
    if getattr(s, "n_verifications", 0):
        # draft-self: verifications, the drafted tokens they verified and those they accepted
        out["draft_self"] = {"verifications": s.n_verifications, "drafted": s.n_drafted, "accepted": s.n_accepted}
    if getattr(s, "grammar_mode", ""):
        out["grammar_mode"] = s.grammar_mode  # "ar" or "draft-self": how a constrained request decoded
    return out


def canvas_event(offset: int, block_start: int, block_size: int, step: int, n_masked: int,
                 tokens: list[str | None], steps: list[int | None], verified: bool, index: int = 0) -> dict[str, Any]:
    """One ``clover.canvas`` event (docs/server.md, "The canvas events"): the block of choice
    ``index`` after a denoising step. ``offset``: the reply's token index of ``tokens[0]``;
    ``tokens``: each position's text, None while masked; ``steps``: the step of this block that
    fixed it."""
    return {"object": "clover.canvas", "index": index, "offset": offset, "block_start": block_start,
            "block_size": block_size, "step": step, "n_masked": n_masked, "tokens": tokens, "steps": steps,
            "verified": verified}


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(r: GenerationResult | StreamPiece, piece: Callable[[int], bytes]) -> dict[str, Any] | None:
    """OpenAI's chat logprobs: per token, its text, log-probability, bytes and top ones
    (``bytes``: a token may hold part of a character); of a reply, or of a streamed chunk's own
    tokens (a StreamPiece's; None when it carries none)."""
    if getattr(r, "logprobs", None) is None:
        return None
    out = []
    for i, (t, lp) in enumerate(zip(r.tokens, r.logprobs)):
        b = piece(t)
        top = [{"token": _text(piece(tt)), "logprob": tlp, "bytes": list(piece(tt))}
               for tt, tlp in (r.top_logprobs[i] if r.top_logprobs else [])]
        out.append({"token": _text(b), "logprob": lp, "bytes": list(b), "top_logprobs": top})
    return {"content": out}


def completion_logprobs(r: GenerationResult | StreamPiece, piece: Callable[[int], bytes],
                        offset: int) -> dict[str, Any] | None:
    """The legacy completions' logprobs of a reply or of a streamed chunk's own tokens (tokens,
    token_logprobs, top_logprobs: the N most probable and the token's own, text_offset counted
    from the prompt's start: ``offset`` is where the first token's text starts); None when it
    carries none."""
    if getattr(r, "logprobs", None) is None:
        return None
    return compat.completion_logprobs(r.tokens, r.logprobs, r.top_logprobs, lambda t: _text(piece(t)), offset)


def prompt_logprobs(scored: PromptLogprobs, bos: int, piece: Callable[[int], bytes]) -> dict[str, Any]:
    """The same for an echoed prompt's tokens (from 0; the first one's log-probability null)."""
    return compat.completion_logprobs(*compat.echoed_prompt(scored, bos), lambda t: _text(piece(t)), 0)


def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two logprobs objects of consecutive text (an echoed prompt's, its reply's) as one."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}
