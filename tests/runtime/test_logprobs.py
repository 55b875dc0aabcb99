"""Log-probabilities of the generated tokens (clover.h, clover_generate_params.logprobs /
top_tokens / top_logprobs; Clover.generate(logprobs=N)) against the numpy reference.

A token's log-probability is the log-softmax (temperature 1, the mask token excluded) of the
logits row it was chosen from, at the denoising step that unmasked it, as llama-server reports
``logprobs``. Checked on the tiny fixture (f32, f32 KV cache) against
clover_testkit.reference:

* B = 1 (greedy and sampled): the causal logits of the prompt + output at each position;
* block diffusion (B = 8 at threshold 0.9, B = 4 with a step cap): the row of the block pass
  (or L_last) at the step the reference's own decoding unmasked the position;
* draft-self: the logprobs of B = 1 (the verifier's rows are the causal ones);
* the top-n lists: sorted, n entries, the reference's top-n values, consistent with the token's
  own log-probability; the bounds on n and the buffers refused with one line.

Tolerance: the f32 graph's logits are within 1e-3 * max(1, max |logit|) of the float64
reference (tests/native/test_native_parity.py); a log-softmax at most doubles that.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from clover_cpp import _native as N

pytestmark = pytest.mark.needs_libclover

TOL = 2e-3
PROMPT = [5, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def ref(tiny_artifacts):
    from clover_testkit.reference import CloverReference

    return CloverReference.from_pretrained(tiny_artifacts["ckpt"])


@pytest.fixture(scope="module")
def model(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1, flash_attn=False, kv_f32=True, block_size=8) as m:
        yield m


def log_softmax(row: np.ndarray, mask: int) -> np.ndarray:
    z = np.asarray(row, dtype=np.float64).copy()
    z[mask] = -np.inf
    mx = z.max()
    return z - mx - np.log(np.exp(z - mx).sum())


def tol(row: np.ndarray) -> float:
    return TOL * max(1.0, float(np.abs(row).max()))


def check_top(result, rows: list[np.ndarray], mask: int, n: int) -> None:
    """top_logprobs: n (token, lp) pairs, most probable first, the reference's top-n values, the
    chosen token's own log-probability consistent with them."""
    assert len(result.top_logprobs) == len(result.tokens)
    for i, (tok, lp, top) in enumerate(zip(result.tokens, result.logprobs, result.top_logprobs)):
        want = log_softmax(rows[i], mask)
        assert len(top) == n
        ids = [t for t, _ in top]
        vals = np.array([v for _, v in top])
        assert len(set(ids)) == n and mask not in ids
        assert np.all(np.diff(vals) <= 0), (i, vals)                       # sorted, most probable first
        assert np.allclose(vals, np.sort(want)[::-1][:n], atol=tol(rows[i]), rtol=0), i
        assert np.allclose(vals, want[ids], atol=tol(rows[i]), rtol=0), i  # each value is its token's
        if tok in ids:
            assert abs(vals[ids.index(tok)] - lp) < 1e-6
        else:
            assert lp <= vals[-1] + 1e-6


def test_greedy_b1_logprobs_are_the_causal_log_softmax(model, ref) -> None:
    from clover_testkit.reference import causal_logits

    r = model.generate(PROMPT, max_tokens=24, block_size=1, logprobs=5, stop_at_eos=False)
    assert len(r.tokens) == 24 and len(r.logprobs) == 24
    logits = causal_logits(ref, PROMPT + r.tokens)
    rows = [logits[len(PROMPT) - 1 + i] for i in range(24)]
    for i, tok in enumerate(r.tokens):
        want = log_softmax(rows[i], model.mask_token)
        assert abs(r.logprobs[i] - want[tok]) <= tol(rows[i]), (i, r.logprobs[i], want[tok])
        assert r.top_logprobs[i][0][0] == tok  # greedy: the chosen token is the most probable
    check_top(r, rows, model.mask_token, 5)


def test_sampled_b1_logprobs_do_not_depend_on_the_temperature(model, ref) -> None:
    """At temperature > 0 the log-probability is still that of the model's distribution (as
    llama-server's, not the tempered / truncated one)."""
    from clover_testkit.reference import causal_logits

    r = model.generate(PROMPT, max_tokens=16, block_size=1, temperature=1.3, top_k=50, seed=7, logprobs=0,
                       stop_at_eos=False)
    logits = causal_logits(ref, PROMPT + r.tokens)
    for i, tok in enumerate(r.tokens):
        row = logits[len(PROMPT) - 1 + i]
        assert abs(r.logprobs[i] - log_softmax(row, model.mask_token)[tok]) <= tol(row)
    assert r.top_logprobs == [[] for _ in r.tokens]


def reference_block_run(ref, monkeypatch, **kw):
    """reference.generate, and for each output token the logits row it was chosen from (the
    reference's candidates are recorded per denoising step and matched to the positions the
    step unmasked)."""
    import clover_testkit.reference.decode as D

    calls, steps = [], []
    orig = D.candidates

    def spy(logits, *a, **k):
        calls.append(np.array(logits, dtype=np.float64))
        return orig(logits, *a, **k)

    monkeypatch.setattr(D, "candidates", spy)  # (the module whose generate calls it)
    res = D.generate(ref, PROMPT, step_callback=lambda start, canvas, n_masked: steps.append((start, canvas)) and False,
                     **kw)
    monkeypatch.undo()
    mask = ref.cfg.mask_token_id
    rows: dict[int, np.ndarray] = {}
    prev_start, prev, n_cand = None, None, 0
    for (start, canvas), logits in zip(steps, calls, strict=True):
        if start != prev_start:
            prev, n_cand = [mask] * len(canvas), len(logits)
        masked = [p for p in range(n_cand) if prev[p] == mask]
        assert len(masked) == len(logits)
        for j, p in enumerate(masked):
            if canvas[p] != mask:
                rows[start - len(PROMPT) + p] = logits[j]
        prev_start, prev = start, canvas
    return res.tokens, [rows[i] for i in range(len(res.tokens))]


@pytest.mark.parametrize("B,threshold,max_steps", [(8, 0.9, 0), (4, 0.3, 2)])
def test_block_diffusion_logprobs_are_those_of_the_step_that_unmasked(model, ref, monkeypatch, B, threshold,
                                                                        max_steps) -> None:
    want_tokens, rows = reference_block_run(ref, monkeypatch, max_tokens=20, block_size=B, threshold=threshold,
                                            max_steps=max_steps, stop_at_eos=False)
    r = model.generate(PROMPT, max_tokens=20, block_size=B, threshold=threshold, max_steps=max_steps, logprobs=4,
                       stop_at_eos=False)
    assert r.tokens == want_tokens
    for i, tok in enumerate(r.tokens):
        want = log_softmax(rows[i], model.mask_token)[tok]
        assert abs(r.logprobs[i] - want) <= tol(rows[i]), (i, r.logprobs[i], want)
    check_top(r, rows, model.mask_token, 4)
    # not the causal distribution: a block position q > 0 is predicted from the pass's masked canvas
    from clover_testkit.reference import causal_logits

    causal = causal_logits(ref, PROMPT + r.tokens)
    far = max(abs(r.logprobs[i] - log_softmax(causal[len(PROMPT) - 1 + i], model.mask_token)[t])
              for i, t in enumerate(r.tokens))
    assert far > 10 * TOL


@pytest.mark.parametrize("B", [4, 8])
def test_draft_self_logprobs_are_those_of_b1(model, B) -> None:
    a = model.generate(PROMPT, max_tokens=24, block_size=1, logprobs=3, stop_at_eos=False)
    b = model.generate(PROMPT, max_tokens=24, block_size=B, draft_self=True, logprobs=3, stop_at_eos=False)
    assert b.tokens == a.tokens and b.stats.n_verifications > 0
    assert np.allclose(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
    assert [[t for t, _ in x] for x in b.top_logprobs] == [[t for t, _ in x] for x in a.top_logprobs]


def test_logprobs_follow_the_cut_output(model) -> None:
    """Cut by a stop token or a stop string, the lists stay aligned with result.tokens; off by
    default."""
    full = model.generate(PROMPT, max_tokens=12, block_size=1, logprobs=2, stop_at_eos=False)
    assert model.generate(PROMPT, max_tokens=12, block_size=1, stop_at_eos=False).logprobs is None
    cut = model.generate(PROMPT, max_tokens=12, block_size=4, logprobs=2, stop_tokens=[full.tokens[5]],
                         stop_at_eos=False)
    assert len(cut.logprobs) == len(cut.tokens) == len(cut.top_logprobs)
    s = model.generate(PROMPT, max_tokens=12, block_size=1, logprobs=True, stream=True, stop_at_eos=False)
    text = "".join(s)
    assert text == full.text and s.result.logprobs == pytest.approx(full.logprobs, abs=1e-6)


@pytest.mark.parametrize("bad", [-1, 21, "3", 2.5])
def test_bad_logprobs_count_is_refused(model, bad) -> None:
    from clover_cpp import CloverError

    with pytest.raises(CloverError) as e:
        model.generate(PROMPT, max_tokens=4, logprobs=bad)
    assert "logprobs" in str(e.value) and "\n" not in str(e.value)


def test_native_api_checks_the_top_buffers(tiny_artifacts) -> None:
    from clover_testkit.native_handles import Ctx, L, Model

    err, n = N.err_buffer()
    m = Model(tiny_artifacts["f32"])
    ctx = Ctx(m, N.CLOVER_BLOCK_SIZE_TRAIN, n_ctx=128, n_threads=1)
    c = ctx.p
    try:
        out = (ctypes.c_int32 * 8)()
        n_out = ctypes.c_int32(0)
        for n_top, bufs, msg in [(21, True, b"n_top_logprobs must be in [0, 20]"), (-1, True, b"n_top_logprobs"),
                                 (3, False, b"top_tokens and top_logprobs")]:
            gp = L.clover_generate_default_params()
            gp.max_tokens, gp.n_top_logprobs = 8, n_top
            if bufs:
                gp.top_tokens, gp.top_logprobs = (ctypes.c_int32 * 200)(), (ctypes.c_float * 200)()
            rc = L.clover_generate(c, N.as_int32_array(PROMPT), len(PROMPT), ctypes.byref(gp), out, 8,
                                   ctypes.byref(n_out), None, err, n)
            assert rc == N.CLOVER_ERR_INVALID_ARG and msg in err.value and n_out.value == 0
        # logprobs alone (no top list)
        gp = L.clover_generate_default_params()
        lp = (ctypes.c_float * 8)()
        gp.max_tokens, gp.block_size, gp.logprobs, gp.stop_at_eos = 8, 2, lp, 0
        st = N.clover_stats()
        assert L.clover_generate(c, N.as_int32_array(PROMPT), len(PROMPT), ctypes.byref(gp), out, 8,
                                 ctypes.byref(n_out), ctypes.byref(st), err, n) == N.CLOVER_OK
        assert n_out.value == 8 and all(-50 < x <= 0 for x in lp) and st.grammar_mode == 0
    finally:
        ctx.close()
        m.close()


@pytest.mark.parametrize("mode", [dict(block_size=1), dict(block_size=4), dict(block_size=4, draft_self=1)])
def test_native_block_callback_reads_its_blocks_logprobs(tiny_artifacts, mode) -> None:
    """The buffers are written block by block, before the block callback: each call reads its
    own tokens' entries (the final values), and no later token's is written yet."""
    from clover_testkit.native_handles import Ctx, L, Model

    err, n = N.err_buffer()
    m = Model(tiny_artifacts["f32"])
    ctx = Ctx(m, N.CLOVER_BLOCK_SIZE_TRAIN, n_ctx=128, n_threads=1)
    c = ctx.p
    cap, n_top, unwritten = 12, 3, 1.0  # (a log-probability is <= 0)
    lp, top_tok, top_lp = ((ctypes.c_float * cap)(), (ctypes.c_int32 * (cap * n_top))(),
                           (ctypes.c_float * (cap * n_top))())
    for i in range(cap):
        lp[i] = unwritten
    seen: list[tuple[list[int], list[float], list[int], list[float], list[float]]] = []

    def on_block(_start, tokens, n_tokens, _ud):
        at = sum(len(s[0]) for s in seen)
        seen.append((list(tokens[:n_tokens]), list(lp[at:at + n_tokens]),
                     list(top_tok[at * n_top:(at + n_tokens) * n_top]),
                     list(top_lp[at * n_top:(at + n_tokens) * n_top]), list(lp[at + n_tokens:])))
        return 0

    cb = N.clover_block_callback(on_block)
    try:
        gp = L.clover_generate_default_params()
        gp.max_tokens, gp.stop_at_eos, gp.block_callback = cap, 0, cb
        gp.block_size, gp.draft_self = mode["block_size"], mode.get("draft_self", 0)
        gp.logprobs, gp.n_top_logprobs, gp.top_tokens, gp.top_logprobs = lp, n_top, top_tok, top_lp
        out, n_out = (ctypes.c_int32 * cap)(), ctypes.c_int32(0)
        assert L.clover_generate(c, N.as_int32_array(PROMPT), len(PROMPT), ctypes.byref(gp), out, cap,
                                 ctypes.byref(n_out), None, err, n) == N.CLOVER_OK
        assert n_out.value == cap and len(seen) >= 2
        assert [t for s in seen for t in s[0]] == list(out[:cap])
        assert [x for s in seen for x in s[1]] == list(lp[:cap]) and all(x <= 0 for x in lp)
        assert [x for s in seen for x in s[2]] == list(top_tok[:cap * n_top])
        assert [x for s in seen for x in s[3]] == list(top_lp[:cap * n_top])
        assert all(x == unwritten for s in seen for x in s[4])  # later tokens: not written yet
    finally:
        ctx.close()
        m.close()


def carried(pieces, field: str) -> list:
    return [x for p in pieces for x in getattr(p, field)]


@pytest.mark.parametrize("kw", [dict(block_size=1), dict(block_size=4), dict(block_size=8, draft_self=True),
                                dict(block_size=4, temperature=0.8, seed=3)])
def test_streamed_pieces_carry_their_own_logprobs(model, kw) -> None:
    """generate(stream=True, logprobs=N): each piece carries its own tokens and their logprobs;
    joined, they are the unstreamed result's (same seed)."""
    want = model.generate(PROMPT, max_tokens=12, logprobs=2, stop_at_eos=False, **kw)
    s = model.generate(PROMPT, max_tokens=12, logprobs=2, stop_at_eos=False, stream=True, **kw)
    pieces = list(s)
    assert len(pieces) >= 2 and "".join(pieces) == want.text == s.result.text
    assert carried(pieces, "tokens") == want.tokens
    assert carried(pieces, "logprobs") == want.logprobs and carried(pieces, "top_logprobs") == want.top_logprobs
    toks: list[int] = []
    for i, p in enumerate(pieces):  # a piece's tokens spell its text (a split character waits for the next)
        assert len(p.tokens) == len(p.logprobs) == len(p.top_logprobs) >= 1
        toks += p.tokens
        text, spelled = "".join(pieces[:i + 1]), model.detokenize(toks).decode("utf-8", "replace")
        assert spelled == text or (spelled.startswith(text) and spelled[len(text):] == "\ufffd")


def test_streamed_logprobs_with_a_stop_string(model) -> None:
    """A stop string held back and cut: its tokens' logprobs still come (a last piece of no text)."""
    full = model.generate(PROMPT, max_tokens=12, block_size=4, stop_at_eos=False)
    stop = full.text[len(full.text) // 2:][:2]
    want = model.generate(PROMPT, max_tokens=12, block_size=4, logprobs=1, stop=[stop], stop_at_eos=False)
    pieces = list(model.generate(PROMPT, max_tokens=12, block_size=4, logprobs=1, stop=[stop], stop_at_eos=False,
                                 stream=True))
    assert want.finish_reason == "stop" and "".join(pieces) == want.text
    assert carried(pieces, "tokens") == want.tokens and carried(pieces, "logprobs") == want.logprobs
