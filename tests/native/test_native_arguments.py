"""libclover's checks of its arguments (native/libclover/clover.h, through ctypes): bad block size /
threshold / sampling values, empty prompt, prompt too long for the context -> status code +
message, no crash; one rule for the generate parameters, the block size and the room left.

The module is skipped only when libclover is not built (build/bin/libclover.so).
"""
from __future__ import annotations

import ctypes

import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (L, Ctx, NativeError, artifacts, model, random_prompt,  # noqa: E402, F401
                                           vocab_hi)


# ----------------------------------------------------------------------------- errors
def test_errors_generate_arguments(model, vocab_hi):
    prompt = random_prompt(71, 5, vocab_hi)
    with Ctx(model, 8, n_ctx=64) as ctx:
        for kw, code, word in [
            (dict(block_size=-3), N.CLOVER_ERR_INVALID_ARG, "block size"),
            (dict(max_tokens=-1), N.CLOVER_ERR_INVALID_ARG, "max_tokens"),
            (dict(block_size=65), N.CLOVER_ERR_INVALID_ARG, "block size"),
            (dict(threshold=-0.1), N.CLOVER_ERR_INVALID_ARG, "threshold"),
            (dict(threshold=1.5), N.CLOVER_ERR_INVALID_ARG, "threshold"),
            (dict(threshold=float("nan")), N.CLOVER_ERR_INVALID_ARG, "threshold"),
            (dict(temperature=-1.0), N.CLOVER_ERR_INVALID_ARG, "temperature"),
            (dict(top_p=-0.1), N.CLOVER_ERR_INVALID_ARG, "top_p"),
            (dict(top_p=1.5), N.CLOVER_ERR_INVALID_ARG, "top_p"),
            (dict(top_k=-2), N.CLOVER_ERR_INVALID_ARG, "top_k"),
            (dict(max_steps=-1), N.CLOVER_ERR_INVALID_ARG, "max_steps"),
            (dict(max_tokens=60), N.CLOVER_ERR_CONTEXT_FULL, "n_ctx"),
        ]:
            rc, toks, st, msg = ctx.generate(prompt, **kw)
            assert rc == code, (kw, rc, msg)
            assert word in msg, (kw, msg)
            assert toks == []
        # prompt too long for the context
        rc, toks, st, msg = ctx.generate(random_prompt(72, 70, vocab_hi), max_tokens=4)
        assert rc == N.CLOVER_ERR_CONTEXT_FULL and "n_ctx" in msg
        # fits exactly: 56 + 8 = 64
        rc, toks, st, msg = ctx.generate(random_prompt(73, 56, vocab_hi), max_tokens=8, block_size=8)
        assert rc == N.CLOVER_OK, msg
        # token ids outside the vocabulary
        rc, toks, st, msg = ctx.generate([1, 2, 10**6], max_tokens=4)
        assert rc == N.CLOVER_ERR_INVALID_ARG and "vocabulary" in msg
        rc, toks, st, msg = ctx.generate([-1], max_tokens=4)
        assert rc == N.CLOVER_ERR_INVALID_ARG
        # out buffer smaller than max_tokens
        gp = L.clover_generate_default_params()
        gp.max_tokens = 10
        out = (ctypes.c_int32 * 2)()
        eb, el = N.err_buffer()
        assert L.clover_generate(ctx.p, N.as_int32_array(prompt), 5, ctypes.byref(gp), out, 2, None, None, eb, el) \
            == N.CLOVER_ERR_INVALID_ARG
        assert b"out_cap" in eb.value
        # the context is still usable
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=4)
        assert rc == N.CLOVER_OK and len(toks) == 4


def test_generate_params_check_is_the_one_rule(model, vocab_hi):
    """clover_generate_params_check: the rules clover_generate applies first, one message each
    (starting with the field's name); the defaults keep them all."""
    gp0 = L.clover_generate_default_params()
    assert N.generate_params_problem(gp0) is None
    assert gp0.max_tokens == N.CLOVER_DEFAULT_MAX_TOKENS == 256 and gp0.block_size == N.CLOVER_BLOCK_SIZE_CONTEXT
    cases = [("block_size", -3, "block size must be >= 1"), ("threshold", 1.5, "threshold must be in [0, 1], got 1.5"),
             ("threshold", float("nan"), "threshold"), ("temperature", float("inf"), "temperature must be finite"),
             ("top_p", -0.5, "top_p must be in [0, 1]"), ("top_k", -1, "top_k must be >= 0"),
             ("max_steps", -1, "max_steps must be >= 0"), ("max_tokens", -5, "max_tokens must be >= 0, got -5"),
             ("draft_self", 2, "draft_self must be 0, 1 or -1"), ("draft_steps", -1, "draft_steps must be >= 0"),
             ("n_top_logprobs", 21, "n_top_logprobs must be in [0, 20]"), ("n_top_logprobs", 2, "buffers"),
             ("n_stop_tokens", 1, "needs the stop_tokens array"), ("n_stop_tokens", -1, "n_stop_tokens must be >= 0")]
    prompt = random_prompt(74, 5, vocab_hi)
    with Ctx(model, 4, n_ctx=64) as ctx:
        for field, value, words in cases:
            gp = L.clover_generate_default_params()
            setattr(gp, field, value)
            msg = N.generate_params_problem(gp)
            assert msg is not None and msg.startswith(field.replace("block_size", "block size")), (field, msg)
            assert words in msg, (field, msg)
            # clover_generate refuses with the same line
            out, eb = (ctypes.c_int32 * 256)(), N.err_buffer()
            rc = L.clover_generate(ctx.p, N.as_int32_array(prompt), 5, ctypes.byref(gp), out, 256, None, None, *eb)
            assert rc == N.CLOVER_ERR_INVALID_ARG and eb[0].value.decode() == msg, (field, eb[0].value)
        for v in (N.CLOVER_BLOCK_SIZE_TRAIN, N.CLOVER_BLOCK_SIZE_AUTO, N.CLOVER_BLOCK_SIZE_CONTEXT, 1, 64):
            gp = L.clover_generate_default_params()
            gp.block_size = v
            assert N.generate_params_problem(gp) is None
    eb = N.err_buffer()
    assert L.clover_generate_params_check(None, *eb) == N.CLOVER_ERR_INVALID_ARG


def test_block_size_values_mean_one_thing(model, vocab_hi):
    """CLOVER_BLOCK_SIZE_TRAIN (0) is the training B in both structs, _CONTEXT (-2) the context's B."""
    prompt = random_prompt(75, 5, vocab_hi)
    seen = []
    with Ctx(model, N.CLOVER_BLOCK_SIZE_TRAIN, n_ctx=64) as ctx:
        assert L.clover_block_size(ctx.p) == 8  # the fixture's training B
        assert L.clover_set_block_size(ctx.p, 4, None, 0) == N.CLOVER_OK
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=8, block_cb=lambda s, t: seen.append(s))
        assert rc == N.CLOVER_OK and st.block_size == 4 and seen == [5, 9]  # the context's
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=8, block_size=N.CLOVER_BLOCK_SIZE_TRAIN)
        assert rc == N.CLOVER_OK and st.block_size == 8 and L.clover_block_size(ctx.p) == 8
    cp = L.clover_context_default_params()
    assert cp.block_size == N.CLOVER_BLOCK_SIZE_TRAIN
    for special in (N.CLOVER_BLOCK_SIZE_AUTO, N.CLOVER_BLOCK_SIZE_CONTEXT):  # per generation only
        cp.n_ctx, cp.block_size = 64, special
        eb = N.err_buffer()
        assert not L.clover_context_new(model.p, ctypes.byref(cp), *eb) and b"block size" in eb[0].value


def test_generate_room_is_the_fit_rule(model, vocab_hi):
    """clover_generate_room: the largest max_tokens clover_generate accepts (whole blocks of a fixed B;
    draft-self and auto need none), checked against clover_generate itself at the edge."""
    with Ctx(model, 8, n_ctx=64) as ctx:
        for n_prompt, B, ds, want in [(5, 8, 0, 56), (5, N.CLOVER_BLOCK_SIZE_CONTEXT, 0, 56), (5, 1, 0, 59),
                                      (5, 8, 1, 59), (5, N.CLOVER_BLOCK_SIZE_AUTO, 0, 59), (60, 8, 0, 0),
                                      (64, 1, 0, 0), (70, 1, 0, 0)]:
            gp = L.clover_generate_default_params()
            gp.block_size, gp.draft_self = B, ds
            room = L.clover_generate_room(ctx.p, ctypes.byref(gp), n_prompt)
            assert room == want, (n_prompt, B, ds, room)
            if 0 < room and B != N.CLOVER_BLOCK_SIZE_AUTO:
                prompt = random_prompt(76, n_prompt, vocab_hi)
                for m, ok in ((room, True), (room + 1, False)):
                    rc, toks, st, msg = ctx.generate(prompt, max_tokens=m, block_size=B, threshold=0.0, draft_self=ds)
                    assert (rc == N.CLOVER_OK) == ok and (ok or rc == N.CLOVER_ERR_CONTEXT_FULL), (B, ds, m, msg)
        gp = L.clover_generate_default_params()
        gp.grammar = b'root ::= "a"+'  # a grammar without draft-self decodes at B = 1
        assert L.clover_generate_room(ctx.p, ctypes.byref(gp), 5) == 59
        assert L.clover_generate_room(ctx.p, None, 5) == 56 and L.clover_generate_room(None, None, 5) == -1
        assert L.clover_generate_room(ctx.p, None, -1) == -1
        gp = L.clover_generate_default_params()
        gp.max_tokens = -1  # the budget is not used: clover-cli's -n -1 asks the room with it
        assert L.clover_generate_room(ctx.p, ctypes.byref(gp), 5) == 56
        gp.block_size = -7  # a value with no meaning
        assert L.clover_generate_room(ctx.p, ctypes.byref(gp), 5) == -1


def test_errors_block_size_and_passes(model, vocab_hi):
    eb, el = N.err_buffer()
    for bs in (-3, 65):
        cp = L.clover_context_default_params()
        cp.n_ctx, cp.block_size = 64, bs
        assert not L.clover_context_new(model.p, ctypes.byref(cp), eb, el)
        assert b"block size" in eb.value
    cp = L.clover_context_default_params()
    cp.n_ctx = 2
    assert not L.clover_context_new(model.p, ctypes.byref(cp), eb, el) and b"n_ctx" in eb.value
    cp.n_ctx = 0  # the model's training context (llama.cpp's n_ctx = 0)
    c = L.clover_context_new(model.p, ctypes.byref(cp), eb, el)
    assert c and L.clover_n_ctx(c) == L.clover_n_ctx_train(model.p)
    L.clover_context_free(c)
    assert not L.clover_context_new(None, None, eb, el)
    with Ctx(model, 4, n_ctx=16) as ctx:
        assert L.clover_set_block_size(ctx.p, 0, eb, el) == N.CLOVER_ERR_INVALID_ARG and b"block size" in eb.value
        assert L.clover_set_block_size(ctx.p, 17, eb, el) == N.CLOVER_ERR_INVALID_ARG
        assert L.clover_block_size(ctx.p) == 4
        with pytest.raises(NativeError) as e:
            ctx.block_pass([1] * 5)                       # more than B tokens
        assert e.value.code == N.CLOVER_ERR_INVALID_ARG
        with pytest.raises(NativeError):
            ctx.block_pass([])
        with pytest.raises(NativeError) as e:
            ctx.commit([1, 2, 10**6])
        assert "vocabulary" in e.value.msg
        assert ctx.n_committed == 0                       # checked before anything ran
        with pytest.raises(NativeError) as e:
            ctx.commit([])
        assert e.value.code == N.CLOVER_ERR_INVALID_ARG
        with pytest.raises(NativeError) as e:             # nothing committed: no L_last
            ctx.last_logits()
        assert e.value.code == N.CLOVER_ERR_INVALID_ARG
        # no block alignment: a pass right after a commit of any length
        ctx.commit([1, 2])
        assert ctx.n_committed == 2 and ctx.block_pass([1]).shape == (1, model.n_vocab)
        ctx.last_logits()
        ctx.reset()
        with pytest.raises(NativeError):                  # the reset dropped L_last too
            ctx.last_logits()
        with pytest.raises(NativeError) as e:             # more tokens than n_ctx
            ctx.commit([1] * 17)
        assert e.value.code == N.CLOVER_ERR_INVALID_ARG and ctx.n_committed == 0
        for part in ([1, 2, 3], [4], [5, 6, 7, 8, 9, 1, 2]):
            ctx.commit(part)
        with pytest.raises(NativeError) as e:             # 11 committed + 6 > n_ctx 16: nothing committed
            ctx.commit([1] * 6)
        assert e.value.code == N.CLOVER_ERR_CONTEXT_FULL and ctx.n_committed == 11
        ctx.commit([3, 4, 5, 6, 7])
        assert ctx.n_committed == 16
        with pytest.raises(NativeError) as e:             # 16 committed, n_ctx 16
            ctx.block_pass([1])
        assert e.value.code == N.CLOVER_ERR_CONTEXT_FULL
        with pytest.raises(NativeError) as e:
            ctx.commit([1])
        assert e.value.code == N.CLOVER_ERR_CONTEXT_FULL and ctx.n_committed == 16
    # NULL handles never crash
    assert L.clover_commit_logits(None, None, 0, None, eb, el) == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_last_logits(None, None) == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_bos_token(None) == -1
    # NULL handles never crash
    assert L.clover_block_pass(None, None, 0, None, eb, el) == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_reset(None) == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_generate(None, None, 0, None, None, 0, None, None, eb, el) == N.CLOVER_ERR_INVALID_ARG
    L.clover_context_free(None)
    L.clover_model_free(None)
