"""Draft-self (spec/decoding.md): blocks drafted by block passes and verified by their causal
commit give exactly the autoregressive (block_size = 1) output, whatever the draft."""

from __future__ import annotations

import numpy as np
import pytest

from clover_cpp import Clover, CloverError
from clover_testkit import reference as R

pytestmark = pytest.mark.xdist_group("draft_self")

@pytest.fixture(scope="module")
def model(tiny_artifacts):
    with Clover(tiny_artifacts["f32"], block_size=1, n_ctx=1024, kv_f32=True, n_threads=1) as m:
        yield m

@pytest.fixture(scope="module")
def cfg(tiny_artifacts):
    return R.CloverReference.from_pretrained(tiny_artifacts["ckpt"]).cfg

def _prompts(cfg, n: int = 30) -> list[tuple[list[int], int]]:
    """n (prompt, budget) pairs: prompts of 1-60 tokens, budgets of 1-70 tokens."""
    rng = np.random.default_rng(7)
    return [([int(t) for t in rng.integers(0, cfg.mask_token_id, int(rng.integers(1, 61)))], int(rng.integers(1, 71)))
            for _ in range(n)]

@pytest.fixture(scope="module")
def autoregressive(model, cfg) -> list[tuple[list[int], int, list[int]]]:
    """(prompt, budget, the block_size = 1 output) of every prompt of _prompts."""
    return [(p, n, list(model.generate(p, max_tokens=n, block_size=1, stop_at_eos=False).tokens))
            for p, n in _prompts(cfg)]

@pytest.mark.parametrize("B", [4, 8, 16, 32])
def test_greedy_draft_self_equals_block_size_1(model, autoregressive, B):
    drafted = accepted = 0
    for prompt, budget, want in autoregressive:
        # a draft of threshold 0.9 on random weights would unmask one token per pass: capped
        for threshold, max_steps in ((0.9, 4), (0.0, 0)):
            r = model.generate(prompt, max_tokens=budget, block_size=B, threshold=threshold, max_steps=max_steps,
                               stop_at_eos=False, draft_self=True)
            assert list(r.tokens) == want, (prompt, budget, threshold)
            assert r.stats.n_generated == len(want)
            assert 0 <= r.stats.n_accepted <= r.stats.n_drafted
            assert r.stats.n_verifications >= -(-len(want) // B)
            drafted, accepted = drafted + r.stats.n_drafted, accepted + r.stats.n_accepted
    assert drafted > 0 and accepted > 0  # the verification really ran and really kept drafted tokens

def test_draft_self_with_eos_and_stop_strings(model, cfg):
    """EOS inside a draft ends the output as at B = 1; so do stop strings."""
    eos = cfg.eos_token_ids[0]
    for prompt, budget in _prompts(cfg, 10):
        want = model.generate(prompt + [eos], max_tokens=budget, block_size=1)
        got = model.generate(prompt + [eos], max_tokens=budget, block_size=8, draft_self=True)
        assert list(got.tokens) == list(want.tokens) and got.stats.finish_reason == want.stats.finish_reason
    prompt, _ = _prompts(cfg, 1)[0]
    full = model.generate(prompt, max_tokens=40, block_size=1, stop_at_eos=False)
    stop = full.text[len(full.text) // 2:][:3]
    if stop.strip():
        want = model.generate(prompt, max_tokens=40, block_size=1, stop_at_eos=False, stop=stop)
        got = model.generate(prompt, max_tokens=40, block_size=16, stop_at_eos=False, stop=stop, draft_self=True)
        assert got.text == want.text and got.stats.finish_reason == "stop"

def test_draft_self_rejects_sampling(model):
    with pytest.raises(CloverError, match="greedily"):
        model.generate([1, 2, 3], max_tokens=4, block_size=4, temperature=0.7, draft_self=True)
