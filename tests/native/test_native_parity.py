"""libclover's logits (native/libclover/clover.h, through ctypes) against the numpy reference
(clover_testkit.reference), spec v2: the logits of position t predict the token at t+1; a
commit is causal, whatever B and however the commits are split.

* committed-position logits (clover_commit_logits) vs CloverReference.commit and block-pass
  logits vs CloverReference.block_pass, B in {1, 4, 8 (= B0), 16, 32}, prompt lengths 1,
  < B, > B and > 300, before and after further (unaligned) commits:
  max |diff| <= 1e-3 * max(1, max |logit|) for f32; f16 <= 1e-2 * max(1, max |logit|);
  q8_0: median row <= 1e-1 * max(1, max |logit|) and every row <= 1.0 * max(1, max |logit|)
  (expert-routing flips);
* a commit of n tokens in one call == in uneven chunks == token by token (<= 1e-5).

The module is skipped only when libclover is not built (build/bin/libclover.so).
"""
from __future__ import annotations

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (ParityReport, F32_TOL, Ctx, Model, artifacts, model, random_prompt,  # noqa: E402, F401
                                           ref, relative_diff, vocab_hi)

# f16: every row; q8_0: the median row (a q8_0 router input can flip an expert choice for a
# token, which moves that row a lot: such rows are bounded only by the sanity limit)
QUANT_TOL = {"f16": 1e-2, "q8_0": 1e-1}
Q8_ROW_SANITY = 1.0
ROUTER_TIE = 1e-2  # router logit gap (k-th vs (k+1)-th expert) below which f16 may route differently
REPORT = ParityReport("quantized rows past the tolerance, explained by a router near-tie:")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    REPORT.print()


# ----------------------------------------------------------------------------- block passes
def _check_commit(ctx, mem, ref, toks, key: str, tol: float = F32_TOL) -> None:
    """Commit toks on both sides: the committed-position logits agree, L_last is their last row."""
    got, want = ctx.commit_logits(toks), ref.commit(mem, toks)
    d = relative_diff(got, want)
    REPORT.record(key, d)
    assert d <= tol, (key, d)
    assert ctx.n_committed == mem.n_committed
    assert np.array_equal(ctx.last_logits(), got[-1])


@pytest.mark.parametrize("B", [1, 4, 8, 16, 32])
def test_block_pass_parity_f32(model, ref, vocab_hi, B):
    """Committed-position logits (causal commits of any length) and block-pass logits (a
    canvas right after the committed text, any length 1..B) against the reference."""
    lengths = sorted({1, max(B - 1, 1), B + 3, 303})
    mask = model.mask
    with Ctx(model, B, n_ctx=512) as ctx:
        # empty memory: a block pass at position 0
        toks = random_prompt(100 + B, B, vocab_hi)
        d = relative_diff(ctx.block_pass(toks), ref.block_pass(ref.new_memory(), toks, B))
        REPORT.record(f"f32 B={B} pass, empty memory", d)
        assert d <= F32_TOL, d
        for n in lengths:
            ctx.reset()
            prompt = random_prompt(1000 * B + n, n, vocab_hi)
            mem = ref.new_memory()
            _check_commit(ctx, mem, ref, prompt, f"f32 B={B} commit logits")
            assert ctx.n_committed == n
            # the first decode block (all masks, right after the prompt), a canvas with some
            # positions unmasked, and a partial canvas (n < B)
            canvases = [[mask] * B]
            if B > 1:
                half = random_prompt(3 * n + B, B, vocab_hi)
                half[1::2] = [mask] * len(half[1::2])
                canvases += [half, random_prompt(5 * n + B, B // 2, vocab_hi)]
            for canvas in canvases:
                d = relative_diff(ctx.block_pass(canvas), ref.block_pass(mem, canvas, B))
                REPORT.record(f"f32 B={B} pass", d)
                assert d <= F32_TOL, (n, len(canvas), d)
            # the pass left the memory unchanged: repeat it bit for bit
            assert np.array_equal(ctx.block_pass(canvases[0]), ctx.block_pass(canvases[0]))
            assert ctx.n_committed == n
            # after further commits: a decoded block, then an odd number of tokens
            for k, m in enumerate((B, B // 2 + 1)):
                _check_commit(ctx, mem, ref, random_prompt(7 * n + k, m, vocab_hi), f"f32 B={B} commit logits")
                nxt = random_prompt(9 * n + k, B, vocab_hi)
                nxt[B // 2:] = [mask] * (B - B // 2)
                d = relative_diff(ctx.block_pass(nxt), ref.block_pass(mem, nxt, B))
                REPORT.record(f"f32 B={B} pass after commits", d)
                assert d <= F32_TOL, (n, k, d)


@pytest.mark.parametrize("B", [1, 8, 32])
def test_parity_default_kv_cache(model, ref, vocab_hi, B):
    """The default context (f16 KV cache, automatic flash attention) stays within the f32
    tolerance too: commits, passes, and passes after a further commit."""
    mask = model.mask
    with Ctx(model, B, n_ctx=512, kv_f32=False, flash_attn=-1) as ctx:
        for n in (5, 303):
            ctx.reset()
            mem = ref.new_memory()
            _check_commit(ctx, mem, ref, random_prompt(2000 * B + n, n, vocab_hi), f"f32 default KV B={B} commit logits")
            for k in range(2):
                canvas = random_prompt(11 * n + k, B, vocab_hi)
                canvas[k:] = [mask] * (B - k)
                d = relative_diff(ctx.block_pass(canvas), ref.block_pass(mem, canvas, B))
                REPORT.record(f"f32 default KV B={B} pass", d)
                assert d <= F32_TOL, (n, k, d)
                _check_commit(ctx, mem, ref, random_prompt(13 * n + k, B + 1, vocab_hi),
                              f"f32 default KV B={B} commit logits")


def _chunks(tokens: list[int], sizes) -> list[list[int]]:
    """tokens cut into consecutive chunks of the given sizes (cycled), the last one shorter."""
    out, i, k = [], 0, 0
    while i < len(tokens):
        m = sizes[k % len(sizes)]
        out.append(tokens[i:i + m])
        i, k = i + m, k + 1
    return out


@pytest.mark.parametrize("B,n", [(1, 5), (8, 41), (4, 300), (32, 600)])
def test_commit_in_one_call_equals_chunks_and_token_by_token(model, vocab_hi, B, n):
    """A commit is causal: one call (one ubatch or several), uneven chunks and one token at a
    time give the same committed-position logits, the same L_last and the same memory (the
    next block pass)."""
    prompt = random_prompt(5, n, vocab_hi)
    probe = random_prompt(6, B, vocab_hi)
    probe[1::2] = [model.mask] * len(probe[1::2])
    splits = {"one call": [prompt], "uneven chunks": _chunks(prompt, [3, 1, B + 1, 7, 2 * B - 1]),
              "token by token": [[t] for t in prompt]}
    got = {}
    for name, parts in splits.items():
        with Ctx(model, B, n_ctx=1024) as ctx:
            logits = np.concatenate([ctx.commit_logits(p) for p in parts])
            assert ctx.n_committed == n
            got[name] = (logits, ctx.last_logits(), ctx.block_pass(probe))
    base = got["one call"]
    assert np.array_equal(base[1], base[0][-1])
    for name in ("uneven chunks", "token by token"):
        for what, a, b in zip(("commit logits", "L_last", "block pass"), got[name], base):
            d = relative_diff(a, b)
            REPORT.record(f"{name} vs one call, {what}", d)
            assert d <= 1e-5, (name, what, d)


def _router_gap(ref, layers: list[dict], row: int) -> float:
    """The smallest gap, over the layers of a reference trace, between the k-th and (k+1)-th
    router logits of one row: below ~1e-2, rounded weights can send the token to another
    expert, which moves its logits far more than the rounding itself."""
    from clover_testkit.reference import rms_norm_1p

    c, k = ref.cfg, ref.cfg.num_experts_per_tok
    gaps = []
    for i, rec in enumerate(layers):
        p = f"model.layers.{i}."
        x = rms_norm_1p(rec["h"][row:row + 1], ref.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        g = np.sort((x @ ref.w[p + "mlp.gate.weight"].T)[0])[::-1]
        gaps.append(float(g[k - 1] - g[k]))
    return min(gaps)


def _commit_row_gap(ref, mem_before, tokens, row: int) -> float:
    """_router_gap of committed position `row` of a commit of tokens on mem_before (traced as
    the block of one the causal commit processes it as)."""
    mem = mem_before.copy()
    if row:
        ref.commit(mem, tokens[:row])
    return _router_gap(ref, ref.trace(mem, [tokens[row]], 1)[1], 0)


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_parity_quantized(artifacts, ref, vocab_hi, outtype):
    """Quantized weights: the committed-position rows and the block-pass rows stay close. f16:
    every row within 1e-2, except a row whose token the reference routes with a near-tie
    between its k-th and (k+1)-th expert (f16 rounding may flip that choice), and only a few;
    q8_0: the median row, every row within the sanity bound."""
    m = Model(artifacts[outtype])
    rows: list[float] = []
    rerouted: list[str] = []

    def check(got, want, gap_of, what):
        for j, d in enumerate(np.abs(got - want).max(axis=1) / max(1.0, float(np.abs(want).max()))):
            rows.append(float(d))
            if outtype == "f16" and d > QUANT_TOL["f16"]:
                gap = gap_of(j)
                assert gap < ROUTER_TIE, (what, j, d, gap)
                rerouted.append(f"{what} row {j}: {d:.2e}, router gap {gap:.1e}")

    try:
        for B in (4, 8):
            with Ctx(m, B) as ctx:
                for n in (5, 40, 77):
                    ctx.reset()
                    mem = ref.new_memory()
                    for k, toks in enumerate((random_prompt(n + B, n, vocab_hi), random_prompt(2 * n + B, B, vocab_hi))):
                        mem0 = mem.copy()
                        check(ctx.commit_logits(toks), ref.commit(mem, toks),
                              lambda j: _commit_row_gap(ref, mem0, toks, j), f"B={B} n={n} commit {k}")
                        canvas = toks[:k * B // 2] + [m.mask] * (B - k * B // 2)
                        check(ctx.block_pass(canvas), ref.block_pass(mem, canvas, B),
                              lambda j: _router_gap(ref, ref.trace(mem, canvas, B)[1], j), f"B={B} n={n} pass {k}")
    finally:
        m.close()
    rows_a = np.array(rows)
    REPORT.record(f"{outtype} max row", rows_a.max())
    REPORT.record(f"{outtype} median row", float(np.median(rows_a)))
    REPORT.notes.extend(f"{outtype} {r}" for r in rerouted)
    assert rows_a.max() <= Q8_ROW_SANITY, rows_a.max()
    if outtype == "f16":
        assert len(rerouted) <= len(rows) // 50, rerouted
        assert np.median(rows_a) <= QUANT_TOL["f16"] / 2, np.median(rows_a)
    else:
        assert np.median(rows_a) <= QUANT_TOL["q8_0"], np.median(rows_a)
