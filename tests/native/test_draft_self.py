"""Draft-self (spec/decoding.md): blocks drafted by block passes and verified by their causal
commit give exactly the autoregressive (block_size = 1) output, whatever the draft."""

from __future__ import annotations

import re

import numpy as np
import pytest

from clover_cpp import Clover
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

# draft knobs: one pass per draft (the default: it rides on the last verification's forward),
# two passes, and the block-diffusion rule (threshold 0.9 capped at 4 steps; threshold 0 = one step)
DRAFTS = [dict(draft_steps=1), dict(draft_steps=2, threshold=0.9), dict(draft_steps=0, threshold=0.9, max_steps=4),
          dict(draft_steps=0, threshold=0.0)]


def _expected_forwards(B: int, budget: int, kept: list[int]) -> int:
    """The llama_decode calls of one-pass draft-self (draft_steps=1) after the prompt, given what
    each verification kept: a draft needs a pass unless the last verification kept its whole draft
    (then that verification's forward ran the pass on a canvas after it); every verification is one
    forward; after a rejection the kept tokens' commit rides on the next pass (or, for a last lone
    token, is a forward of its own)."""
    fw, left, rows, pending = 0, budget, False, False
    for k in kept:
        n = min(B, left)
        fw += (0 if rows else 1) + 1
        rows, pending = (k == n and left - n >= 2), k < n
        left -= k
    return fw + (1 if left == 1 and pending else 0)


@pytest.mark.parametrize("B", [4, 8, 16, 32])
def test_greedy_draft_self_equals_block_size_1(model, autoregressive, B):
    drafted = accepted = 0
    mask = model.mask_token
    for prompt, budget, want in autoregressive:
        for kw in DRAFTS:
            kept: list[int] = []
            r = model.generate(prompt, max_tokens=budget, block_size=B, stop_at_eos=False, draft_self=True,
                               on_step=lambda canvas, n_masked, start: kept.append(sum(t != mask for t in canvas)),
                               **kw)
            assert list(r.tokens) == want, (prompt, budget, kw)
            s = r.stats
            assert s.n_generated == len(want) and s.mode == "draft-self"
            assert 0 <= s.n_accepted <= s.n_drafted
            # the step callback sees each verification's kept tokens (never a draft), and a last
            # lone token (L_last's own, no verification)
            assert sum(kept) == len(want) and len(kept) - s.n_verifications in (0, 1)
            kept = kept[:s.n_verifications]
            # a verification keeps at most B tokens; a last token alone needs none (it is L_last's)
            assert s.n_verifications >= -(-(len(want) - 1) // B)
            assert s.n_decode_forwards == s.n_forward - -(-(len(prompt) - s.n_reused) // 512)
            if kw["draft_steps"] == 1:   # forwards counted honestly, and a whole draft costs no pass
                # (kept == the draft's length is a whole draft, or a rejection of its last token:
                # the stats give how many of those were rejections, each a forward more at most)
                n_rej = sum(kept) - s.n_accepted
                ambiguous = n_rej - sum(k < min(B, budget - sum(kept[:i])) for i, k in enumerate(kept))
                low = _expected_forwards(B, budget, kept)
                assert low <= s.n_decode_forwards <= low + ambiguous, (kept, s)
            drafted, accepted = drafted + s.n_drafted, accepted + s.n_accepted
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

def _top_k_probs(logits: np.ndarray, mask: int, T: float, k: int) -> np.ndarray:
    """The sampling distribution of spec/decoding.md: mask token out, logits / T, top-k (ties:
    lower ids), renormalised."""
    z = logits.astype(np.float64) / T
    z[mask] = -np.inf
    z[np.argsort(-z, kind="stable")[k:]] = -np.inf
    p = np.exp(z - z.max())
    return p / p.sum()


def _chi2(samples: list[tuple[int, int]], exact: dict[tuple[int, int], float]) -> float:
    """Pearson's statistic of the pairs against their exact distribution (cells expected < 5
    pooled into one)."""
    n = len(samples)
    obs = {c: 0 for c in exact}
    for s in samples:
        obs[s] = obs.get(s, 0) + 1
    big = [c for c in exact if exact[c] * n >= 5]
    stat = sum((obs[c] - exact[c] * n) ** 2 / (exact[c] * n) for c in big)
    rest_e = n - sum(exact[c] * n for c in big)
    rest_o = n - sum(obs[c] for c in big)
    return stat + ((rest_o - rest_e) ** 2 / rest_e if rest_e >= 1 else rest_o * 1e9)


def test_sampling_draft_self_has_the_autoregressive_distribution(model, tiny_artifacts, cfg):
    """At temperature > 0 the first two tokens of draft-self (B = 4, every position drafted in
    one pass) follow the autoregressive distribution, computed exactly from the float64
    reference: Pearson's chi-square over the 16 (top-4 x top-4) pairs stays under the 0.1%
    quantile of 15 degrees of freedom (37.7), for B = 1 and for draft-self alike. Keeping every
    drafted token instead (no acceptance rule) gives the block pass's distribution for the
    second token and fails it (checked when this test was written: chi-square 33,734)."""
    ref = R.CloverReference.from_pretrained(tiny_artifacts["ckpt"])
    T, k, n = 0.7, 4, 400
    prompt = _prompts(cfg, 1)[0][0]
    p1 = _top_k_probs(R.causal_logits(ref, prompt)[-1], cfg.mask_token_id, T, k)
    exact = {}
    for a in np.flatnonzero(p1):
        p2 = _top_k_probs(R.causal_logits(ref, prompt + [int(a)])[-1], cfg.mask_token_id, T, k)
        exact.update({(int(a), int(b)): p1[a] * p2[b] for b in np.flatnonzero(p2)})
    for kw in (dict(block_size=1), dict(block_size=4, threshold=0.0, draft_self=True)):
        pairs = [tuple(model.generate(prompt, max_tokens=2, temperature=T, top_k=k, seed=seed, stop_at_eos=False,
                                      **kw).tokens) for seed in range(n)]
        assert _chi2(pairs, exact) < 37.7, kw
    r = model.generate(prompt, max_tokens=40, temperature=T, top_k=k, seed=1, block_size=8, draft_self=True,
                       stop_at_eos=False)
    again = model.generate(prompt, max_tokens=40, temperature=T, top_k=k, seed=1, block_size=8, draft_self=True,
                           stop_at_eos=False)
    assert list(r.tokens) == list(again.tokens) and r.stats.n_verifications > 0  # seeded: reproducible


def _chi2_bound(df: int) -> float:
    """The 0.1% upper quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3


def test_whole_drafts_ride_on_their_verification(model, cfg):
    """The one-pass path: a draft kept whole leaves the next draft to the canvas that rode on its
    verification's forward (no pass of its own), and the memory is then that commit's without the
    canvas. At a high temperature the draft and the verifier are both near uniform, so speculative
    sampling keeps most drafts whole: the forwards are fewer than a pass plus a verification per
    block, and the memory left behind is exactly the causal processing of the committed text."""
    prompt = _prompts(cfg, 1)[0][0]
    fresh = model.new_context(block_size=1)
    try:
        for seed in range(4):
            r = model.generate(prompt, max_tokens=40, temperature=50.0, seed=seed, stop_at_eos=False, block_size=4,
                               draft_self=True)
            s = r.stats
            assert s.n_generated == 40 and s.n_verifications >= 10
            assert s.n_accepted >= s.n_drafted // 2, s
            # each verification is one forward; a rejection adds one (the kept tokens' commit with
            # the next draft's pass), the first draft's pass is one: nothing else
            assert s.n_decode_forwards <= 1 + s.n_verifications + (s.n_generated - s.n_accepted), s
            assert s.n_decode_forwards < 1 + 2 * s.n_verifications, s   # whole drafts drafted the next
            text = list(prompt) + list(r.tokens)
            n = model.n_committed
            assert len(prompt) <= n <= len(text)
            fresh.reset()   # the prompt in one ubatch as generate did, the rest token by token
            fresh.commit(text[:len(prompt)])
            for t in text[len(prompt):n]:
                fresh.commit([t])
            want = fresh.last_logits()
            np.testing.assert_allclose(model.last_logits(), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
    finally:
        fresh.close()


@pytest.mark.parametrize("n_ctx", [17, 40])
def test_draft_self_fills_the_context_exactly(tiny_artifacts, n_ctx):
    """Draft-self needs no whole blocks: its canvases are cut at n_ctx (a block may start
    anywhere after a rejection), so prompt + max_tokens = n_ctx runs at any B, greedy equal
    to B = 1 and sampled to the budget."""
    with Clover(tiny_artifacts["f32"], block_size=1, n_ctx=n_ctx, kv_f32=True, n_threads=1) as m:
        want = list(m.generate([5, 6], max_tokens=n_ctx - 2, block_size=1, stop_at_eos=False).tokens)
        for B in (4, 8, 16):
            got = m.generate([5, 6], max_tokens=n_ctx - 2, block_size=B, draft_self=True, stop_at_eos=False)
            assert list(got.tokens) == want, B
            hot = m.generate([5, 6], max_tokens=n_ctx - 2, block_size=B, draft_self=True, stop_at_eos=False,
                             temperature=50.0, seed=B)
            assert len(hot.tokens) == n_ctx - 2 and hot.stats.n_verifications > 0


def test_cli_draft_self_prints_the_block_size_1_text(tiny_artifacts):
    import subprocess
    from pathlib import Path

    clover = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "clover"
    base = [str(clover), "run", "-m", str(tiny_artifacts["f32"]), "-p", "def add(a, b):", "-n", "24", "-t", "1",
            "--ignore-eos", "--no-visual"]
    one = subprocess.run(base + ["--block-size", "1"], capture_output=True, text=True, timeout=120)
    ds = subprocess.run(base + ["--block-size", "8", "--draft-self"], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and ds.returncode == 0, ds.stderr
    assert ds.stdout == one.stdout
    assert "draft-self:" in ds.stderr and "tok/verification" in ds.stderr
    acc, drafted = re.search(r"draft-self: (\d+)/(\d+) drafted tokens accepted", ds.stderr).groups()
    assert 0 <= int(acc) <= int(drafted) and int(drafted) > 0


def test_tokens_per_verification_counts_only_draft_self_blocks():
    """Each verification keeps its accepted drafts plus one token; when auto mixes modes, tokens of
    B = 1 or diffusion blocks are not the verifications' (40 tokens after one 3-accepted draft is 4.00).
    The figure is libclover's (clover_stats.tokens_per_verification, tests/project/test_rule_owners.py): the
    line prints it."""
    from clover_cpp.model import GenerationStats

    mixed = GenerationStats(n_generated=40, n_verifications=1, n_drafted=7, n_accepted=3, n_decode_passes=2,
                            tokens_per_verification=4.0)
    assert "3/7 drafted tokens accepted, 4.00 tok/verification" in mixed.format()


def test_the_draft_callback_sees_each_draft_before_its_verification(model, cfg):
    """on_draft (libclover's draft callback) gets every draft: one per verification, the drafted
    tokens adding up to stats.n_drafted; each block's tokens are the draft's accepted prefix, then
    the model's own token where it rejected one; returning True cancels before that verification."""
    drafts, blocks = [], []
    prompt = [5, 17, 33, 90, 12]
    r = model.generate(prompt, max_tokens=24, block_size=8, draft_self=True, stop_at_eos=False,
                       on_draft=lambda d, start: drafts.append((start, d)), on_block=lambda t, toks: blocks.append(toks))
    assert len(drafts) == r.stats.n_verifications >= 2
    assert sum(len(d) for _, d in drafts) == r.stats.n_drafted
    accepted = 0
    for (start, d), toks in zip(drafts, [b for b in blocks if b]):
        k = next((i for i, (t, x) in enumerate(zip(toks, d)) if t != x), min(len(toks), len(d)))
        assert toks[:k] == d[:k] and len(toks) == (k if k == len(d) else k + 1), (d, toks)
        accepted += k
    assert accepted == r.stats.n_accepted
    assert r.tokens == model.generate(prompt, max_tokens=24, block_size=1, stop_at_eos=False).tokens
    seen = []
    c = model.generate(prompt, max_tokens=24, block_size=8, draft_self=True, stop_at_eos=False,
                       on_draft=lambda d, start: seen.append(d) or len(seen) == 2)
    assert c.stats.finish_reason == "cancelled" and c.stats.n_verifications == 1
    assert c.tokens == r.tokens[:len(c.tokens)]
