"""Greedy outputs of two f32 backends, compared up to an MoE routing tie.

Two f32 builds (CPU against Vulkan, or against the CPU kernels of remote RPC servers) sum in
different orders, so a router whose k-th and (k+1)-th expert probabilities are a few ulps apart
routes a row to a different expert on each side; that row's MoE output then differs by a whole
expert, and so does every logit of a block pass (the canvas is bidirectional). The tiny preset's
prompt (seed 7, 21 tokens) at B = 8 meets one: token 401's router at layer 0 in the pass over
[308, 401, 160, 341, M, M, M, 418] after 24 generated tokens has experts 5 and 1 at relative gap
1.4e-7 in float64 (one f32 ulp); the CPU build picks 5 like the reference, llvmpipe picks 1 and
the greedy output forks at token 28 (457 for 1).

``assert_same_tokens_up_to_a_tie`` accepts such a fork only where the float64 reference shows
the tie; anything else (a fork with no tie, a difference before it) fails.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from clover_testkit.reference import CloverReference, rms_norm_1p, softmax

#: a relative gap between the k-th and (k+1)-th router probabilities below this is a tie in f32
#: (float32's epsilon is 1.2e-7; the gap of two f32 sums of 64 products moves by a few of them)
TIE_GAP = 1e-5


def routing_margin(model: CloverReference, mem, tokens: Sequence[int], block_size: int) -> float:
    """The smallest relative gap, over every layer and row of the block pass of ``tokens`` on
    ``mem`` (unchanged), between a row's k-th and (k+1)-th router probabilities."""
    _, layers = model.trace(mem, tokens, block_size)
    c, k, out = model.cfg, model.cfg.num_experts_per_tok, np.inf
    for i, rec in enumerate(layers):
        hn = rms_norm_1p(rec["h"], model.w[f"model.layers.{i}.post_attention_layernorm.weight"], c.rms_norm_eps)
        p = -np.sort(-softmax(hn @ model.w[f"model.layers.{i}.mlp.gate.weight"].T, axis=-1), axis=-1)
        if p.shape[1] > k:
            out = min(out, float(((p[:, k - 1] - p[:, k]) / p[:, k - 1]).min()))
    return out


def assert_same_tokens_up_to_a_tie(model: CloverReference, prompt: Sequence[int], got: Sequence[int],
                                   want: Sequence[int], steps: Sequence[tuple[int, list[int]]], block_size: int,
                                   mask: int, what: object = "") -> None:
    """got == want, or they agree up to the block where they fork and the float64 reference has a
    router tie (TIE_GAP) in a forward that decided that block: the causal commits of the block
    before it (token by token) or one of the block's passes. steps: (block_start, canvas) of
    got's generation after each step (generate's on_step); what: named in a failure."""
    got, want = list(got), list(want)
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
    start = max((s for s, _ in steps if s - len(prompt) <= first), default=len(prompt))
    n0 = start - len(prompt)   # the forked block's first output token
    assert got[:n0] == want[:n0], (what, first, n0)
    mem = model.new_memory()
    model.commit(mem, list(prompt) + got[:max(0, n0 - block_size)])
    margins = []
    for t in got[max(0, n0 - block_size):n0]:   # the previous block, committed one token at a time
        margins.append(routing_margin(model, mem, [t], 1))
        model.commit(mem, [t])
    canvases = [[mask] * block_size] + [c for s, c in steps if s == start][:-1]
    margins += [routing_margin(model, mem, c, block_size) for c in canvases]
    assert min(margins) < TIE_GAP, (f"{what}: outputs fork at token {first} ({got[first:first + 1]} vs "
                                    f"{want[first:first + 1]}) with no router tie (smallest gap {min(margins):.1e})")
