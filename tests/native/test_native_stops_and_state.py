"""How libclover's generation ends and what it leaves behind (native/libclover/clover.h, through ctypes):
EOS, stop tokens, stop strings (clover_stop_matcher), the committed tokens and the saved /
loaded context state.

The module is skipped only when libclover is not built (build/bin/libclover.so).
"""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import shutil

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (L, Ctx, Model, artifacts, model, random_prompt, ref,  # noqa: E402, F401
                                           vocab_hi)


# ----------------------------------------------------------------------------- EOS
@pytest.fixture(scope="module")
def eos_variant(artifacts, model, ref, vocab_hi):
    """A copy of the f32 GGUF whose EOS is a token the model emits early, and a matching reference."""
    import gguf

    prompt = random_prompt(41, 5, vocab_hi)
    with Ctx(model, 4) as ctx:
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9, stop_at_eos=False)
    assert rc == N.CLOVER_OK, msg
    target = toks[9]  # the first occurrence is what counts
    path = artifacts["dir"] / "tiny-f32-eos.gguf"
    shutil.copy(artifacts["f32"], path)
    rd = gguf.GGUFReader(path, "r+")
    f = rd.fields["tokenizer.ggml.eos_token_id"]
    f.parts[f.data[0]][0] = target
    rd.data.flush()
    del rd, f
    r2 = copy.copy(ref)
    r2.cfg = dataclasses.replace(ref.cfg, eos_token_id=target, eos_token_ids=(target,))
    m = Model(path)
    assert m.eos == target
    yield m, r2, prompt, target
    m.close()


def test_stop_at_eos(eos_variant):
    m, r2, prompt, eos = eos_variant
    from clover_testkit.reference import generate

    with Ctx(m, 4) as ctx:
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9)
        assert rc == N.CLOVER_OK, msg
        r = generate(r2, prompt, max_tokens=40, block_size=4, threshold=0.9)
        assert r.finish_reason == "eos"
        assert toks == r.tokens and eos not in toks
        assert N.FINISH_REASONS[st.finish_reason] == "eos"
        assert st.n_forward == r.n_forward
        rc, toks2, st2, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9, stop_at_eos=False)
        assert rc == N.CLOVER_OK and len(toks2) == 40 and eos in toks2
        assert toks2[:len(toks)] == toks


def test_stop_tokens_end_the_output_in_c(model, vocab_hi):
    """clover_generate_params.stop_tokens: the output ends before the first stop token (whatever
    stop_at_eos says), finish_reason = CLOVER_FINISH_STOP_TOKEN, the stats count the cut output,
    and the block that held it is not committed."""
    prompt = random_prompt(42, 5, vocab_hi)
    with Ctx(model, 4) as ctx:
        rc, full, st, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
        target = full[9]
        cut = full.index(target)
        blocks: list[list[int]] = []
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9, stop_at_eos=False,
                                         stop_tokens=[full[-1] if full[-1] not in full[:cut] else target, target],
                                         block_cb=lambda s, t: blocks.append(t), reuse_prefix=False)
        assert rc == N.CLOVER_OK, msg
        assert toks == full[:cut] and target not in toks
        assert N.FINISH_REASONS[st.finish_reason] == "stop" and st.finish_reason == N.CLOVER_FINISH_STOP_TOKEN
        assert st.n_generated == len(toks) and sum(blocks, []) == toks
        assert st.tokens_per_forward == pytest.approx(len(toks) / st.n_decode_forwards)
        # the prompt and every finished block but the last (the one with the stop token) are committed
        n_blocks = cut // 4 + 1
        assert st.n_blocks == n_blocks and ctx.committed_tokens() == prompt + full[:(n_blocks - 1) * 4]
        assert ctx.n_committed == len(prompt) + (n_blocks - 1) * 4
        # stop_at_eos does not switch them off; a stop token that never comes changes nothing
        rc, toks2, st2, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9,
                                           stop_tokens=[target])
        assert rc == N.CLOVER_OK and toks2 == toks
        absent = next(t for t in range(model.n_vocab) if t not in full and t != model.mask)
        rc, toks3, st3, msg = ctx.generate(prompt, max_tokens=40, block_size=4, threshold=0.9, stop_at_eos=False,
                                           stop_tokens=[absent])
        assert rc == N.CLOVER_OK and toks3 == full and N.FINISH_REASONS[st3.finish_reason] == "max_tokens"
        # ids outside the vocabulary, a NULL array with a count: refused with a message
        rc, toks4, _, msg = ctx.generate(prompt, max_tokens=4, stop_tokens=[model.n_vocab])
        assert rc == N.CLOVER_ERR_INVALID_ARG and "stop_tokens" in msg and toks4 == []
        gp = L.clover_generate_default_params()
        gp.max_tokens, gp.n_stop_tokens = 4, 2
        out, eb = (ctypes.c_int32 * 4)(), N.err_buffer()
        assert L.clover_generate(ctx.p, N.as_int32_array(prompt), 5, ctypes.byref(gp), out, 4, None, None, *eb) \
            == N.CLOVER_ERR_INVALID_ARG and b"stop_tokens" in eb[0].value


def test_committed_tokens(model, vocab_hi):
    """clover_committed_tokens: the text the memory holds, min(n, n_max) of it copied."""
    prompt = random_prompt(43, 7, vocab_hi)
    with Ctx(model, 4) as ctx:
        assert L.clover_committed_tokens(ctx.p, None, 0) == 0 and ctx.committed_tokens() == []
        ctx.commit(prompt[:3])
        ctx.commit(prompt[3:])
        assert ctx.committed_tokens() == prompt
        short = (ctypes.c_int32 * 8)(*([-9] * 8))
        assert L.clover_committed_tokens(ctx.p, short, 2) == 7 and list(short) == prompt[:2] + [-9] * 6
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=10, block_size=4, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
        assert ctx.committed_tokens() == prompt + toks[:8] and L.clover_n_committed(ctx.p) == 15
        ctx.reset()
        assert ctx.committed_tokens() == []
    assert L.clover_committed_tokens(None, None, 0) == 0


def _state(ctx) -> bytes:
    size = L.clover_state_size(ctx.p)
    buf, written, eb = ctypes.create_string_buffer(size), ctypes.c_size_t(0), N.err_buffer()
    assert L.clover_state_save(ctx.p, buf, size, ctypes.byref(written), *eb) == N.CLOVER_OK, eb[0].value
    assert written.value == size
    return buf.raw


def test_state_save_load_continues_block_diffusion(model, vocab_hi):
    """clover_state_save after a block-diffusion generation (fused commits), clover_state_load into
    another context of another block size: the next generation equals the uninterrupted one, the
    memory's tokens and L_last are the saved ones, none of them read again (n_reused)."""
    prompt = random_prompt(44, 9, vocab_hi)
    with Ctx(model, 4) as ctx, Ctx(model, 8) as other:
        rc, toks, _, msg = ctx.generate(prompt, max_tokens=12, block_size=4, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
        saved, mem, last = _state(ctx), ctx.committed_tokens(), ctx.last_logits()
        go_on = prompt + toks
        rc, want, st_want, msg = ctx.generate(go_on, max_tokens=12, block_size=4, stop_at_eos=False)
        eb = N.err_buffer()
        assert L.clover_state_load(other.p, saved, len(saved), *eb) == N.CLOVER_OK, eb[0].value
        assert other.committed_tokens() == mem and np.array_equal(other.last_logits(), last)
        rc, got, st, msg = other.generate(go_on, max_tokens=12, block_size=4, stop_at_eos=False)
        assert rc == N.CLOVER_OK and got == want and st.n_reused == st_want.n_reused == len(mem)


def test_state_refusals(model, vocab_hi):
    """A buffer too small, NULLs, a NULL context's size: status codes with one line, nothing written."""
    with Ctx(model, 4) as ctx:
        ctx.commit(random_prompt(45, 5, vocab_hi))
        size = L.clover_state_size(ctx.p)
        buf, written, eb = ctypes.create_string_buffer(size), ctypes.c_size_t(7), N.err_buffer()
        assert L.clover_state_save(ctx.p, buf, size - 1, ctypes.byref(written), *eb) == N.CLOVER_ERR_BUFFER_TOO_SMALL
        assert written.value == 0 and str(size) in eb[0].value.decode()
        assert L.clover_state_save(None, buf, size, None, *eb) == N.CLOVER_ERR_INVALID_ARG
        assert L.clover_state_load(ctx.p, None, 0, *eb) == N.CLOVER_ERR_INVALID_ARG
        assert L.clover_state_load(ctx.p, b"CLOVSTAT", 8, *eb) == N.CLOVER_ERR_INVALID_ARG
        assert ctx.n_committed == 5
    assert L.clover_state_size(None) == 0


# ----------------------------------------------------------------------------- stop strings
class _Matcher:
    """clover_stop_matcher through ctypes (text in, final text out)."""

    def __init__(self, stops):
        enc = [x.encode() for x in stops]
        arr = (ctypes.c_char_p * max(len(enc), 1))(*enc)
        self.h = L.clover_stop_matcher_new(arr, len(enc))
        assert self.h

    def feed(self, text: str) -> str:
        b, n = text.encode(), ctypes.c_int32()
        p = L.clover_stop_matcher_feed(self.h, b, len(b), ctypes.byref(n))
        return ctypes.string_at(p, n.value).decode()

    def flush(self) -> str:
        n = ctypes.c_int32()
        return ctypes.string_at(L.clover_stop_matcher_flush(self.h, ctypes.byref(n)), n.value).decode()

    @property
    def hit(self) -> bool:
        return bool(L.clover_stop_matcher_hit(self.h))

    def close(self):
        L.clover_stop_matcher_free(self.h)


def test_stop_matcher_holds_back_and_cuts():
    m = _Matcher(["</s>", "ab", "é!"])
    try:
        assert m.feed("xx<") == "xx" and m.feed("/") == "" and m.feed("q") == "</q"   # held, then released
        assert m.feed("a") == "" and m.feed("c") == "ac"
        assert m.feed("zé") == "z" and not m.hit and m.feed("!tail") == "" and m.hit   # a stop across pieces
        assert m.feed("more") == "" and m.flush() == ""                                # nothing after a hit
    finally:
        m.close()
    m = _Matcher(["STOP"])
    assert m.feed("abc ST") == "abc " and m.flush() == "ST" and not m.hit              # never came: released
    m.close()
    m = _Matcher([])
    assert m.feed("anything") == "anything" and m.flush() == ""
    m.close()
    assert not L.clover_stop_matcher_new(None, 2) and not L.clover_stop_matcher_new(None, -1)
    assert not L.clover_stop_matcher_feed(None, b"x", 1, None)
    L.clover_stop_matcher_free(None)


def test_stop_matcher_equals_the_cut_of_the_whole_text():
    """Whatever the pieces, the output is the text before the first stop string (all of it when
    none comes), each piece ending at a character boundary (UTF-8 in, UTF-8 out)."""
    import random

    rng = random.Random(5)
    alphabet = "ab<>/é€ \n"
    for case in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = [i for i in (text.find(x) for x in stops) if i >= 0]
        want = text[:min(cuts)] if cuts else text
        m = _Matcher(stops)
        out, i = [], 0
        while i < len(text):
            j = i + rng.randint(0, 6)
            out.append(m.feed(text[i:j]))  # .decode() raises on a piece cut inside a character
            i = j
        out.append(m.flush())
        assert "".join(out) == want and m.hit == bool(cuts), (case, stops, text)
        m.close()
