"""``clover serve``: Clover's own pieces of a reply (its stats, the canvas events); the OpenAI
parts are :mod:`clover_cpp.openai_reply`'s."""

from __future__ import annotations

from typing import Any

from .. import GenerationResult


def clover_stats(r: GenerationResult) -> dict[str, Any]:
    """Clover's own figures of a reply (the ``clover`` object), with the seed the call used."""
    s = r.stats
    out = {"block_size": s.block_size, "tokens_per_forward": round(s.tokens_per_forward, 4),
           "decode_passes": s.n_decode_passes, "reused_prompt_tokens": s.n_reused,
           "tokens_per_second": round(s.tokens_per_second, 2), "seed": r.seed,
           "coreset": getattr(s, "coreset", 0)}  # the block expert coreset the call's block passes used (0 = off)
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
                 tokens: list[str | None], steps: list[int | None], verified: bool, index: int = 0,
                 drafted: list[str | None] | None = None) -> dict[str, Any]:
    """One ``clover.canvas`` event (docs/server.md, "The canvas events"): the block of choice
    ``index`` after a denoising step. ``offset``: the reply's token index of ``tokens[0]``;
    ``tokens``: each position's text, None while masked; ``steps``: the step of this block that
    fixed it; ``drafted`` (draft-self's verifications): the draft it checked, position by position
    (None past the draft)."""
    ev = {"object": "clover.canvas", "index": index, "offset": offset, "block_start": block_start,
          "block_size": block_size, "step": step, "n_masked": n_masked, "tokens": tokens, "steps": steps,
          "verified": verified}
    if drafted is not None:
        ev["drafted"] = drafted
    return ev
