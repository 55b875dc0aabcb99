"""libclover's sampling and its hooks (native/libclover/clover.h, through ctypes): seeded sampling is
reproducible, clover_pick_candidate and the unmask schedule against the reference, the block
and step callbacks (streaming, cancellation), the statistics.

The module is skipped only when libclover is not built (build/bin/libclover.so).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (L, Ctx, artifacts, float_ptr, model, random_prompt, ref,  # noqa: E402, F401
                                           vocab_hi)


# ----------------------------------------------------------------------------- sampling
def test_seeded_sampling_reproducible(model, vocab_hi):
    prompt = random_prompt(51, 6, vocab_hi)
    kw = dict(max_tokens=24, block_size=8, threshold=0.5, temperature=0.8, top_k=40, top_p=0.9)
    with Ctx(model, 8) as ctx:
        a = ctx.generate(prompt, seed=123, **kw)
        b = ctx.generate(prompt, seed=123, **kw)
        c = ctx.generate(prompt, seed=124, **kw)
    with Ctx(model, 8, n_threads=1) as ctx1:
        d = ctx1.generate(prompt, seed=123, **kw)
    for x in (a, b, c, d):
        assert x[0] == N.CLOVER_OK, x[3]
        assert len(x[1]) == 24
    assert a[1] == b[1] == d[1]
    assert a[1] != c[1]
    assert model.mask not in a[1]


def test_pick_candidate_greedy_matches_reference(ref):
    from clover_testkit.reference import candidates

    rng = np.random.default_rng(3)
    V, mask = ref.cfg.vocab_size, ref.cfg.mask_token_id
    logits = rng.normal(0, 2, (64, V)).astype(np.float32)
    logits[5, mask] = 100.0        # the mask is never a candidate
    logits[6, [3, 9]] = 50.0       # exact tie: lowest id
    want_tok, want_conf = candidates(logits, mask, 0.0, 0, 1.0, None)
    for i in range(len(logits)):
        tok, conf = ctypes.c_int32(), ctypes.c_double()
        row = np.ascontiguousarray(logits[i])
        assert L.clover_pick_candidate(float_ptr(row), V, mask, 0.0, 0, 1.0, 0, ctypes.byref(tok), ctypes.byref(conf)) == 0
        assert tok.value == want_tok[i]
        # (the exp is in float, vectorized: each term off by at most ~ulp(logit gap), ~3e-7 relative)
        assert conf.value == pytest.approx(want_conf[i], rel=1e-6)
    assert want_tok[6] == 3


def test_pick_candidate_sampling():
    V, mask = 8, 7
    logits = np.log(np.array([0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.02, 0.0], np.float64) + 1e-30).astype(np.float32)
    logits[mask] = 10.0

    def pick(T, k, p, seed):
        tok, conf = ctypes.c_int32(), ctypes.c_double()
        assert L.clover_pick_candidate(float_ptr(logits), V, mask, T, k, p, seed, ctypes.byref(tok), ctypes.byref(conf)) == 0
        return tok.value, conf.value

    # top-k 1 and a tiny top-p are greedy with confidence 1
    assert pick(1.0, 1, 1.0, 5) == (0, 1.0)
    assert pick(1.0, 0, 0.01, 5) == (0, 1.0)
    assert pick(1.0, 0, 0.0, 5) == (0, 1.0)  # top_p 0: the argmax alone, as top_k 1
    # a temperature too small to matter is greedy (confidence: the argmax's softmax probability);
    # 1e-310 made logits / T overflow: NaN everywhere, the mask token picked, a block that never ended
    assert pick(1e-310, 0, 1.0, 5) == pick(0.0, 0, 1.0, 5) == pick(5e-7, 0, 1.0, 5)
    assert pick(0.0, 0, 1.0, 5)[0] == 0 and pick(0.0, 0, 1.0, 5)[1] == pytest.approx(0.4, rel=1e-5)
    # top_k >= n_vocab is off
    assert pick(0.9, V, 1.0, 11) == pick(0.9, 0, 1.0, 11) == pick(0.9, 10**6, 1.0, 11)
    # infinite logits share the mass (they made NaNs); the mask token is never the candidate
    inf = logits.copy()
    inf[2] = inf[4] = np.inf
    tok, conf = ctypes.c_int32(), ctypes.c_double()
    for T in (0.0, 1.0):
        seen = set()
        for s in range(40):
            assert L.clover_pick_candidate(float_ptr(inf), V, mask, T, 0, 1.0, s, ctypes.byref(tok), ctypes.byref(conf)) == 0
            seen.add(tok.value)
            assert conf.value == pytest.approx(0.5)
        assert seen == ({2} if T == 0.0 else {2, 4}), (T, seen)
    # top-p 0.65: keep {0: .4, 1: .3} (cum .4 < .65 <= .7), renormalised
    seen = {pick(1.0, 0, 0.65, s) for s in range(200)}
    assert {t for t, _ in seen} == {0, 1}
    assert dict(seen)[0] == pytest.approx(0.4 / 0.7, rel=1e-5)
    # frequencies follow the distribution (mask excluded)
    counts = np.bincount([pick(1.0, 0, 1.0, s)[0] for s in range(4000)], minlength=V)
    assert counts[mask] == 0
    p = np.array([0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.02])
    assert np.allclose(counts[:7] / 4000, p, atol=0.03)
    # same seed, same draw
    assert pick(0.7, 3, 0.95, 99) == pick(0.7, 3, 0.95, 99)
    # invalid
    tok, conf = ctypes.c_int32(), ctypes.c_double()
    assert L.clover_pick_candidate(float_ptr(logits), V, mask, -1.0, 0, 1.0, 0, ctypes.byref(tok), ctypes.byref(conf)) \
        == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_pick_candidate(float_ptr(logits), V, mask, 1.0, 0, -0.1, 0, ctypes.byref(tok), ctypes.byref(conf)) \
        == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_pick_candidate(float_ptr(logits), V, mask, float("inf"), 0, 1.0, 0, ctypes.byref(tok),
                                   ctypes.byref(conf)) == N.CLOVER_ERR_INVALID_ARG


def _select(conf, threshold, max_steps=0, step=0):
    c = (ctypes.c_double * len(conf))(*conf)
    order = (ctypes.c_int32 * len(conf))()
    k = L.clover_select_unmask(c, len(conf), threshold, max_steps, step, order)
    return k, list(order)


def test_select_unmask_schedule():
    assert _select([0.2, 0.95, 0.95, 0.5], 0.9) == (2, [1, 2, 3, 0])
    assert _select([0.2, 0.3, 0.3], 0.9) == (1, [1, 2, 0])           # none: the single best, lowest index
    assert _select([0.2, 0.3, 0.3], 0.0) == (3, [1, 2, 0])           # threshold 0: everything
    assert _select([0.9, 0.9], 1.0)[0] == 1
    assert _select([1.0, 0.5], 1.0)[0] == 1
    conf = [0.1] * 7
    assert _select(conf, 0.9, max_steps=3, step=0)[0] == 3            # ceil(7 / 3)
    assert _select(conf, 0.9, max_steps=3, step=1)[0] == 4            # ceil(7 / 2)
    assert _select(conf, 0.9, max_steps=3, step=2)[0] == 7
    assert _select(conf, 0.9, max_steps=3, step=5)[0] == 7            # past the cap: all
    assert _select([0.95, 0.1, 0.1], 0.9, max_steps=10, step=0)[0] == 1
    assert _select([0.1], 1.5)[0] == N.CLOVER_ERR_INVALID_ARG


# ----------------------------------------------------------------------------- callbacks
def test_block_callback_streams_the_output(model, vocab_hi):
    """Decode blocks start right after the prompt (no alignment to multiples of B)."""
    prompt = random_prompt(61, 3, vocab_hi)
    chunks: list[tuple[int, list[int]]] = []
    with Ctx(model, 4) as ctx:
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=10, block_size=4,
                                         block_cb=lambda s, t: chunks.append((s, t)))
    assert rc == N.CLOVER_OK, msg
    assert [s for s, _ in chunks] == [3, 7, 11]
    assert [len(t) for _, t in chunks] == [4, 4, 2]
    assert sum((t for _, t in chunks), []) == toks and len(toks) == 10


def test_block_callback_cut_at_max_tokens(model, vocab_hi):
    chunks = []
    with Ctx(model, 8) as ctx:
        rc, toks, st, msg = ctx.generate(random_prompt(62, 8, vocab_hi), max_tokens=5, block_size=8,
                                         block_cb=lambda s, t: chunks.append(t))
    assert rc == N.CLOVER_OK and len(toks) == 5 and chunks == [toks]
    assert N.FINISH_REASONS[st.finish_reason] == "max_tokens"


def test_step_callback_cancel(model, ref, vocab_hi):
    from clover_testkit.reference import generate

    prompt = random_prompt(63, 5, vocab_hi)
    calls = []

    def cb(s, c, nm):
        calls.append((s, nm))
        return len(calls) >= 6

    with Ctx(model, 4) as ctx:
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=30, block_size=4, threshold=0.9, step_cb=cb)
        assert rc == N.CLOVER_ERR_CANCELLED and "cancel" in msg
        assert N.FINISH_REASONS[st.finish_reason] == "cancelled"
        n = [0]

        def rcb(s, c, nm):
            n[0] += 1
            return n[0] >= 6

        r = generate(ref, prompt, max_tokens=30, block_size=4, threshold=0.9, step_callback=rcb)
        assert r.finish_reason == "cancelled"
        # six steps, each a block pass unless only position 0 (from L_last) was left
        assert len(calls) == n[0] == 6
        assert toks == r.tokens and st.n_generated == len(toks) and st.n_steps == r.n_steps <= 6
        # the context still works afterwards
        rc, toks2, st, msg = ctx.generate(prompt, max_tokens=4, block_size=4)
        assert rc == N.CLOVER_OK and len(toks2) == 4


def test_block_callback_cancel(model, vocab_hi):
    """The block callback runs before the block is committed: cancelling there commits nothing
    past the prompt."""
    prompt = random_prompt(64, 4, vocab_hi)
    with Ctx(model, 4) as ctx:
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=30, block_size=4, block_cb=lambda s, t: True)
        assert rc == N.CLOVER_ERR_CANCELLED and len(toks) == 4 and st.n_commits == 0 and st.n_blocks == 1
        assert ctx.n_committed == len(prompt)


def test_stats_timing(model, vocab_hi):
    with Ctx(model, 8) as ctx:
        rc, toks, st, msg = ctx.generate(random_prompt(65, 20, vocab_hi), max_tokens=16, block_size=8, threshold=0.5)
    assert rc == N.CLOVER_OK
    assert st.n_prompt == 20 and st.n_generated == 16
    assert st.t_decode_ms > 0 and st.tokens_per_second > 0 and st.t_prefill_ms >= 0
    # one forward commits the prompt; of the 2 decode blocks the first is committed, riding on
    # the second one's first pass, the last is not committed
    assert st.n_forward == st.n_decode_passes + 1 and st.n_commits == 1 and st.n_blocks == 2
    assert st.tokens_per_forward == pytest.approx(16 / st.n_decode_passes)
