"""``clover serve``: llama-server's own dialect (docs/server.md, "llama-server's dialect").

``POST /completion`` is read into a :class:`CompletionRequest` and run by the same
:class:`Generator` as ``/v1/completions`` (limits, key, queue, cancellation alike); its replies
are llama-server's shapes (tools/server/server-task.cpp: ``to_json_non_oaicompat``). A field
of llama-server's that this server has no sampler for is accepted at its neutral value only,
else a 400 naming it; any other unknown field is a 400 too (``extra="forbid"``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from .. import Clover, GenerationResult
from .. import openai_reply as reply
from . import format as fmt
from .generation import Choice, Job, Prompt
from .pool import Pool, Slot
from .types import APIError, CompletionRequest, SamplerChainFields, unsupported

__all__ = ["LlamaCompletion", "LlamaReply", "slots", "uncached", "without_done"]

#: llama-server's fields with no sampler (or feature) behind them here: accepted only at these
#: values, which change nothing (the samplers' "disabled", the features' "off")
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n_probs": (0,), "post_sampling_probs": (False,), "n_indent": (0,), "n_keep": (0,),
    "t_max_predict_ms": (0,), "id_slot": (-1,), "n_cmpl": (1,), "timings_per_token": (False,),
    "return_progress": (False,), "lora": ([],),
}


def _same(v: Any, neutral: Any) -> bool:
    return v == neutral and isinstance(v, bool) == isinstance(neutral, bool)


class LlamaCompletion(SamplerChainFields):
    """``POST /completion``'s body: llama-server's fields this server honours, and Clover's knobs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Union[str, list[int]]          # a text (BOS added as the model says, special text parsed) or token ids
    n_predict: int = Field(default=-1, ge=-1)  # -1: the default budget (the room less 64)
    cache_prompt: bool = True              # false: the context's memory is cleared before the prompt is read
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None                # None or -1: a fresh random seed
    stop: Union[str, list[str], None] = None
    grammar: str | None = Field(default=None, max_length=1 << 20)
    json_schema: Union[dict[str, Any], bool, None] = None
    stream: bool = False
    ignore_eos: bool = False
    return_tokens: bool = False
    # Clover's knobs, as on /v1/completions
    block_size: Union[int, Literal["auto"], None] = None
    threshold: float | None = None
    max_steps: int | None = None
    draft_self: Union[bool, Literal["auto"]] = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise ValueError("one prompt per request, a text or a list of token ids (several prompts, a prompt "
                             "mixing texts and ids, multimodal objects: not served)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, body: Any) -> Any:
        """Drops the fields of NEUTRAL that hold a neutral value; any other value is a 400."""
        if not isinstance(body, dict):
            return body
        for name, values in NEUTRAL.items():
            if name in body:
                v = body.pop(name)
                if not any(_same(v, n) for n in values):
                    allowed = " or ".join(json.dumps(n) for n in values)
                    raise unsupported(name, f"there is no such sampler or feature here (send {allowed} or leave it out)")
        return body

    def as_openai(self) -> CompletionRequest:
        """The same request as /v1/completions reads it (what the Generator runs)."""
        return CompletionRequest(
            prompt=self.prompt, max_tokens=None if self.n_predict == -1 else self.n_predict,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop=self.stop,
            grammar=self.grammar, json_schema=self.json_schema, stream=self.stream, ignore_eos=self.ignore_eos,
            block_size=self.block_size, threshold=self.threshold, max_steps=self.max_steps, draft_self=self.draft_self,
            **{f: getattr(self, f) for f in self.CHAIN_FIELDS + ("mirostat", "logit_bias")})

    def settings(self, n_ctx: int, model: str) -> dict[str, Any]:
        """The reply's ``generation_settings``: the fields as given, with n_ctx and the model."""
        return {"n_ctx": n_ctx, "model": model, **self.model_dump(exclude={"prompt"})}


def uncached(p: Prompt) -> Prompt:
    """``cache_prompt: false``: no context is preferred, and the one taken forgets its memory
    before the prompt is read (every token prefilled)."""
    def fresh(slot: Slot) -> list[int]:
        slot.model.reset()
        return p.tokens_for(slot)
    return Prompt(lambda slot: 0, fresh, text=p.text)


def stop_type(r: GenerationResult, word: str) -> str:
    """llama-server's stop_type: ``word`` (a stop string), ``eos`` (an end-of-generation token),
    ``limit`` (the budget; n_predict 0 too), else ``none``."""
    if word:
        return "word"
    if r.stats.finish_reason in ("eos", "stop"):
        return "eos"
    return "limit" if reply.finish_reason(r) == "length" else "none"


def timings(r: GenerationResult) -> dict[str, Any]:
    """llama-server's ``timings`` (server_slot_stats::to_json) from the generation's stats."""
    s = r.stats
    n_read, n_out = s.n_prompt - s.n_reused, len(r.tokens)

    def per_token(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0
    out = {"cache_n": s.n_reused, "prompt_n": n_read, "prompt_ms": s.t_prefill_ms,
           "prompt_per_token_ms": per_token(s.t_prefill_ms, n_read), "prompt_per_second": per_second(s.t_prefill_ms, n_read),
           "predicted_n": n_out, "predicted_ms": s.t_decode_ms, "predicted_per_token_ms": per_token(s.t_decode_ms, n_out),
           "predicted_per_second": per_second(s.t_decode_ms, n_out)}
    if s.n_verifications:
        out.update(draft_n=s.n_drafted, draft_n_accepted=s.n_accepted)
    return out


@dataclass
class LlamaReply:
    """The reply objects of one ``/completion`` request (one prompt, one choice)."""

    req: LlamaCompletion
    model: Clover
    name: str
    prompt: list[int] = field(default_factory=list)  # its tokens, and the context that read them
    id_slot: int = -1

    def on_slot(self, p: Prompt) -> Prompt:
        """``p``, noting its tokens and the context they are read on (the replies' ``id_slot``)."""
        def tokens_for(slot: Slot) -> list[int]:
            self.id_slot = slot.index
            self.prompt = p.tokens_for(slot)
            return self.prompt
        return Prompt(p.score, tokens_for, text=p.text)

    def stopping_word(self, r: GenerationResult) -> str:
        """The stop string that ended the reply: the one its tokens' text continues with."""
        if r.stats.finish_reason != "stop":  # (a stop string or token)
            return ""
        stops = [self.req.stop] if isinstance(self.req.stop, str) else self.req.stop or []
        full = self.model.detokenize_text(r.tokens)
        return next((s for s in stops if full.startswith(s, len(r.text))), "")

    def final(self, r: GenerationResult, content: str) -> dict[str, Any]:
        word = self.stopping_word(r)
        return {"index": 0, "content": content, "tokens": r.tokens if self.req.return_tokens else [],
                "id_slot": self.id_slot, "stop": True, "model": self.name, "tokens_predicted": len(r.tokens),
                "tokens_evaluated": r.stats.n_prompt, "generation_settings": self.req.settings(self.model.n_ctx(), self.name),
                "prompt": self.model.detokenize_text(self.prompt, special=True), "has_new_line": "\n" in r.text,
                "truncated": False, "stop_type": stop_type(r, word), "stopping_word": word,
                "tokens_cached": r.stats.n_reused, "timings": timings(r), "clover": fmt.clover_stats(r)}

    def chunk(self, c: Choice | None, ev: tuple[str, Any] | None) -> dict[str, Any]:
        """A streamed event: the text so far arrives as ``content`` pieces with ``stop: false``,
        the last event is the final object with ``stop: true`` (the text already sent)."""
        if ev is not None and ev[0] == "end":
            return self.final(ev[1][0], "")
        content = str(ev[1]) if ev is not None else ""  # (a piece: text, maybe with its logprobs)
        return {"index": 0, "content": content, "stop": False, "id_slot": self.id_slot,
                "tokens_evaluated": len(self.prompt)}

    def job(self, prompt: Prompt, openai: CompletionRequest) -> Job:
        return Job(openai, [self.on_slot(prompt)], self.chunk, lambda kept, rs: self.final(rs[0], rs[0].text))


async def without_done(events: AsyncIterator[dict[str, str]]) -> AsyncIterator[dict[str, str]]:
    """The Generator's server-sent events less OpenAI's closing ``[DONE]`` (llama-server's
    /completion stream ends with its ``stop: true`` object)."""
    try:
        async for ev in events:
            if ev.get("data") != "[DONE]":
                yield ev
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def renamed(e: APIError) -> APIError:
    """The Generator's errors in this dialect's names: its budget is ``n_predict``."""
    if e.param == "max_tokens":
        e.param, e.message = "n_predict", e.message.replace("max_tokens", "n_predict")
    return e


def slots(pool: Pool) -> list[dict[str, Any]]:
    """``GET /slots``: one entry per decoding context, llama-server's first fields."""
    return [{"id": s.index, "n_ctx": s.model.n_ctx(), "speculative": False, "is_processing": s not in pool.free}
            for s in pool.slots]
