"""OpenAI's completion and chat replies, built from generate()'s results: ids, choices, chunks,
finish_reason, usage and logprobs. The one builder of :meth:`Clover.create_completion` /
``create_chat_completion`` (llama-cpp-python's shapes) and of ``clover serve``'s /v1 replies."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .decoding import GenerationResult, StreamPiece


def finish_reason(r: "GenerationResult", tool_calls: bool = False) -> str:
    """"stop" when the reply was ended on purpose: EOS, a stop token or string, a callback's
    cancel (llama-cpp-python's stopping_criteria: "stop" even on the budget's last token);
    "tool_calls" instead when the reply holds tool calls; "length" when the budget ran out,
    max_tokens 0 too (nothing run, no reason from libclover), calls or not: a reply cut off
    may be cut inside its next call."""
    reason = r.stats.finish_reason
    if reason == "max_tokens" or (not reason and not r.tokens):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def head(obj: str, model: str) -> dict[str, Any]:
    """A reply's id ("cmpl-" or, for a chat, "chatcmpl-" and a uuid4, as llama-cpp-python's),
    object ("text_completion", "chat.completion"), creation time and model; every chunk of a
    stream carries the same (a chat's chunks as "chat.completion.chunk")."""
    prefix = "chatcmpl" if obj.startswith("chat.") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4()}", "object": obj, "created": int(time.time()), "model": model}


def text_choice(index: int, text: str, logprobs: dict[str, Any] | None = None,
                finish: str | None = None) -> dict[str, Any]:
    """A ``text_completion`` choice (a chunk's: finish None until the last)."""
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def message_choice(index: int, message: dict[str, Any], logprobs: dict[str, Any] | None,
                   finish: str) -> dict[str, Any]:
    """A ``chat.completion`` choice."""
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def delta_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                 finish: str | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` choice (the last one: an empty delta and the finish reason)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def usage(rs: Sequence["GenerationResult"], per_prompt: int = 1, cached: bool = True) -> dict[str, Any]:
    """A request's usage: each prompt once (the first of its ``per_prompt`` generations), every
    generated token (best_of's candidates too, as OpenAI counts them); ``cached``: OpenAI's
    prompt_tokens_details (llama-cpp-python has none)."""
    firsts = rs[::per_prompt]
    n_prompt, n_out = sum(r.stats.n_prompt for r in firsts), sum(len(r.tokens) for r in rs)
    out: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(r.stats.n_reused for r in firsts)}
    return out


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(r: "GenerationResult | StreamPiece", piece: Callable[[int], bytes]) -> dict[str, Any] | None:
    """OpenAI's chat logprobs: per token, its text, log-probability, bytes and top ones
    (``bytes``: a token may hold part of a character); of a reply, or of a streamed chunk's own
    tokens (a StreamPiece's; None when it carries none)."""
    if getattr(r, "logprobs", None) is None:
        return None
    tops = r.top_logprobs or [[] for _ in r.tokens]

    def entry(t: int, lp: float) -> dict[str, Any]:
        b = piece(t)
        return {"token": _text(b), "logprob": lp, "bytes": list(b)}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in row]}
                        for t, lp, row in zip(r.tokens, r.logprobs, tops)]}


def completion_logprobs(tokens: Sequence[int], logprobs: Sequence[float | None],
                        top: Sequence[Sequence[tuple[int, float]] | None] | None, piece: Callable[[int], str],
                        offset: int) -> dict[str, Any]:
    """The legacy completions' ``logprobs`` object (OpenAI's, llama-cpp-python's): ``tokens``,
    ``text_offset`` (from ``offset``: where the first token's text starts in prompt + reply),
    ``token_logprobs`` and ``top_logprobs`` (a dict of the N most probable and the token's own,
    as OpenAI: up to N + 1 entries); a position with no log-probability (None: the prompt's
    first token) has None in both."""
    texts, offsets, tops = [], [], []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        text = piece(t)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        if top is None:
            continue
        if lp is None:
            tops.append(None)
        else:
            row = {piece(a): b for a, b in top[i] or ()}
            row[text] = lp
            tops.append(row)
    return {"tokens": texts, "text_offset": offsets, "token_logprobs": list(logprobs),
            "top_logprobs": tops if top is not None else None}


def reply_logprobs(r: "GenerationResult | StreamPiece", piece: Callable[[int], bytes],
                   offset: int) -> dict[str, Any] | None:
    """The legacy completions' logprobs of a reply or of a streamed chunk's own tokens (text
    offsets from ``offset``: where the first token's text starts, counted from the prompt's
    start); None when it carries none."""
    if getattr(r, "logprobs", None) is None:
        return None
    return completion_logprobs(r.tokens, r.logprobs, r.top_logprobs, lambda t: _text(piece(t)), offset)


@dataclass
class PromptLogprobs:
    """:meth:`Clover.prompt_logprobs`: per prompt token, its log-probability given the
    tokens before it (None for the first: nothing predicts it) and the N most probable
    (token id, log-probability) pairs there, most probable first ([] for the first)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]


def echoed_prompt(scored: PromptLogprobs, bos: int) -> tuple[list[int], list[float | None], list[Any]]:
    """The prompt's part of echo's logprobs (tokens, logprobs, top ones): a leading BOS left out
    (its text is not echoed), the first listed token's log-probability None (OpenAI's, even after
    a BOS; llama-cpp-python's)."""
    skip = 1 if bos >= 0 and scored.tokens[:1] == [bos] else 0
    lps: list[float | None] = list(scored.logprobs[skip:])
    if lps:
        lps[0] = None
    return scored.tokens[skip:], lps, list(scored.top_logprobs[skip:])


def prompt_logprobs(scored: PromptLogprobs, bos: int, piece: Callable[[int], bytes]) -> dict[str, Any]:
    """An echoed prompt's logprobs object (text offsets from 0; the first token's null)."""
    return completion_logprobs(*echoed_prompt(scored, bos), lambda t: _text(piece(t)), 0)


def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two logprobs objects of consecutive text (an echoed prompt's, its reply's) as one."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}
