"""The block expert coreset (spec/model.md "MoE"): the numpy reference against a
brute-force statement of the rule, and its invariants (commits and one-row canvases keep full
routing; C >= E is full routing). The native graph against the reference: test_coreset_native*.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from clover_testkit.reference import CloverConfig, CloverReference, coreset_select, sigmoid, silu, softmax
from clover_testkit.random_model import TINY, make_weights

TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=3)


def brute_force_routing(probs: np.ndarray, k: int, C: int) -> list[list[int]]:
    """The rule as written in spec/model.md, with Python's sorted (ties: lower index)."""
    n, E = probs.shape
    score = [sum(float(probs[t, e]) for t in range(n)) for e in range(E)]
    core = sorted(range(E), key=lambda e: (-score[e], e))[:max(C, k)]  # (a C below k is k)
    return [sorted(core, key=lambda e: (-float(probs[t, e]), e))[:k] for t in range(n)]


def brute_force_moe(ref: CloverReference, i: int, x: np.ndarray, C: int) -> np.ndarray:
    c, p = ref.cfg, f"model.layers.{i}.mlp."
    W = lambda name: ref.w[p + name]  # noqa: E731
    probs = softmax(x @ W("gate.weight").T, axis=-1)
    out = np.zeros_like(x)
    for t, chosen in enumerate(brute_force_routing(probs, c.num_experts_per_tok, C)):
        total = sum(probs[t, e] for e in chosen) if c.norm_topk_prob else 1.0
        for e in chosen:
            e_ = f"experts.{e}."
            hmid = silu(x[t] @ W(e_ + "gate_proj.weight").T) * (x[t] @ W(e_ + "up_proj.weight").T)
            out[t] += probs[t, e] / total * (hmid @ W(e_ + "down_proj.weight").T)
    hs = silu(x @ W("shared_expert.gate_proj.weight").T) * (x @ W("shared_expert.up_proj.weight").T)
    return out + sigmoid(x @ W("shared_expert_gate.weight").T) * (hs @ W("shared_expert.down_proj.weight").T)


@pytest.fixture(scope="module")
def ref() -> CloverReference:
    cfg = CloverConfig.from_dict(TINY_MOE)
    return CloverReference(cfg, make_weights(cfg, seed=3))


@pytest.mark.parametrize("C", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_with_coreset_equals_brute_force(ref, C, norm):
    rng = np.random.default_rng(C)
    x = rng.normal(size=(6, ref.cfg.hidden_size))
    old = ref.cfg.norm_topk_prob
    try:
        object.__setattr__(ref.cfg, "norm_topk_prob", norm)
        got = ref._moe(1, x, coreset=C)
        want = brute_force_moe(ref, 1, x, C)
    finally:
        object.__setattr__(ref.cfg, "norm_topk_prob", old)
    assert np.abs(got - want).max() <= 1e-12 * max(1.0, np.abs(want).max())


def test_routing_ties_and_limits():
    probs = np.array([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    top, w = coreset_select(probs, 2, True, 3)
    assert top.tolist() == [[0, 1], [0, 1]] and np.allclose(w, 0.5)
    top, _ = coreset_select(probs, 2, True, 1)  # C < k: C = k
    assert top.tolist() == [[0, 1], [0, 1]]
    rng = np.random.default_rng(0)
    probs = softmax(rng.normal(size=(5, 8)), axis=-1)
    full = coreset_select(probs, 3, True, None)
    for C in (0, 8, 9):
        got = coreset_select(probs, 3, True, C)
        assert np.array_equal(got[0], full[0]) and np.array_equal(got[1], full[1])
    for C in range(1, 8):
        top, _ = coreset_select(probs, 3, True, C)
        assert top.tolist() == brute_force_routing(probs, 3, C)
        assert len(np.unique(top)) <= max(C, 3)


def test_block_pass_distinct_experts_bounded(ref):
    mem = ref.new_memory()
    ref.commit(mem, [1, 2, 3])
    canvas = [5, 63, 63, 9]
    _, layers = ref.trace(mem, canvas, 4, coreset=3)
    assert all(len(np.unique(rec["experts"])) <= 3 for rec in layers)
    _, full = ref.trace(mem, canvas, 4)
    assert any(len(np.unique(rec["experts"])) > 3 for rec in full)


def test_full_routing_where_the_spec_says(ref):
    mem = ref.new_memory()
    ref.commit(mem, [4, 7])
    canvas = [63, 5, 63, 9]  # (identical rows would elect their own top k: the coreset is full routing)
    full = ref.block_pass(mem, canvas, 4)
    assert np.array_equal(ref.block_pass(mem, canvas, 4, coreset=8), full)      # C >= E
    assert np.array_equal(ref.block_pass(mem, canvas, 4, coreset=0), full)      # off
    assert not np.allclose(ref.block_pass(mem, canvas, 4, coreset=1), full)    # on
    # a canvas of one row routes fully whatever C
    assert np.array_equal(ref.block_pass(mem, [9], 4, coreset=1), ref.block_pass(mem, [9], 4))


def test_generate_threads_the_coreset(ref):
    from clover_testkit.reference import generate
    a = generate(ref, [1, 2, 3], max_tokens=8, block_size=4, threshold=0.0, coreset=None)
    b = generate(ref, [1, 2, 3], max_tokens=8, block_size=4, threshold=0.0, coreset=8)
    assert a.tokens == b.tokens
    assert math.isfinite(len(generate(ref, [1, 2, 3], max_tokens=8, block_size=4, coreset=1).tokens))
