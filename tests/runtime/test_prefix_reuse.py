"""Prefix reuse (a context keeps its committed memory across calls, whatever the block size:
spec v2's memory is the causal processing of the committed text), contexts sharing one model,
and stop strings, on the tiny preset."""

from __future__ import annotations

import numpy as np
import pytest

from clover_cpp.model import StopMatcher

pytestmark = pytest.mark.needs_libclover


@pytest.fixture(scope="module")
def pair(tiny_artifacts):
    """Two contexts over one f32 model (exact arithmetic: kv f32, no flash attention)."""
    from clover_cpp import Clover

    a = Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1, flash_attn=False, kv_f32=True, block_size=4)
    b = a.new_context()
    yield a, b
    a.close()
    b.close()


def _turn(m, prompt: list[int], n: int = 24, **kw):
    return m.generate(prompt, max_tokens=n, stop_at_eos=False, **kw)


# cheap single tokens, costly B = 2: auto runs B = 1, a B = 2 probe, then larger blocks
SWITCHING = {1: 1.0, 2: 1.9, 4: 2.0, 8: 2.2, 16: 10.0, 32: 20.0}


def _recorded(m, prompt: list[int], B, **kw):
    """A generation of 24 tokens at B (an int or "auto": then with the SWITCHING curve, set
    afresh) and the B of each of its decode blocks."""
    sched: list[int] = []
    starts: list[int] = []

    def on_step(canvas, n_masked, block_start):
        if not starts or starts[-1] != block_start:
            starts.append(block_start)
            sched.append(len(canvas))

    if B == "auto":
        m.set_cost_curve(SWITCHING, SWITCHING)
    r = _turn(m, prompt, block_size=B, on_step=on_step, **kw)
    assert starts == [len(prompt) + sum(sched[:k]) for k in range(len(sched))], "blocks follow the prompt"
    return r, sched


def _prompt(cfg: dict, n: int, seed: int = 0) -> list[int]:
    """n token ids below the special ones (the fixture's vocabulary)."""
    hi = min(cfg["eos_token_id"], cfg["mask_token_id"])
    return np.random.default_rng(seed).integers(0, hi, n).tolist()


@pytest.fixture(scope="module")
def reference_turns(tiny_artifacts):
    """The reference's generation for a prompt and a schedule, computed once per pair."""
    from clover_testkit.reference import CloverReference, generate

    ref = CloverReference.from_pretrained(tiny_artifacts["ckpt"])
    memo: dict[tuple, object] = {}

    def get(prompt: list[int], sched: list[int]):
        key = (tuple(prompt), tuple(sched))
        if key not in memo:
            memo[key] = generate(ref, prompt, max_tokens=24, block_size=0, threshold=0.9, stop_at_eos=False,
                                 block_schedule=sched)
        return memo[key]
    return get


# (B of the call that leaves the memory, B of the call that reuses it): the same B, another B
REUSE_PAIRS = [(1, 1), (4, 4), (32, 32), (4, 1), (32, 4), (1, 32), ("auto", 4), (4, "auto")]


@pytest.mark.parametrize("B_before,B", REUSE_PAIRS)
def test_reused_prefix_equals_a_cleared_memory(pair, tiny_artifacts, reference_turns, B_before, B) -> None:
    """Spec v2: the memory is the causal processing of the committed text, so a call that keeps
    the previous call's memory (whatever B either call used) gives what a cleared memory gives,
    commits only the new prompt tokens, and leaves the same memory behind."""
    a, b = pair
    p = _prompt(tiny_artifacts["cfg"], 500)
    r1, sched1 = _recorded(a, p, B_before)
    kept = a.n_committed
    assert kept == len(p) + sum(sched1[:-1])  # the prompt and every decode block but the last
    # 529 tokens: a cleared memory commits them in two ubatches of 512, the kept one the new 29 in one
    p2 = p + r1.tokens + p[:5]
    r2, sched2 = _recorded(a, p2, B)
    fresh, sched_fresh = _recorded(b, p2, B, reuse_prefix=False)
    assert r2.stats.n_reused == kept and fresh.stats.n_reused == 0
    assert sched2 == sched_fresh
    assert r2.tokens == fresh.tokens
    for counter in ("n_decode_passes", "n_commits", "n_blocks", "n_block_switches", "n_generated"):
        assert getattr(r2.stats, counter) == getattr(fresh.stats, counter), counter
    assert r2.stats.n_forward == fresh.stats.n_forward - 1   # only the new tokens were committed
    want = reference_turns(p2, sched_fresh)
    assert fresh.tokens == want.tokens and fresh.stats.n_forward == want.n_forward
    assert fresh.stats.n_decode_passes == want.n_steps and fresh.stats.n_commits == want.n_commits
    # and the memories are the same: the same text, L_last and block-pass logits
    assert a.n_committed == b.n_committed == len(p2) + sum(sched2[:-1])
    np.testing.assert_allclose(a.last_logits(), b.last_logits(), rtol=0,
                               atol=1e-5 * float(np.abs(b.last_logits()).max()))
    assert a.block_size == b.block_size
    probe = p[: min(3, a.block_size)]
    la, lb = a.block_logits(probe), b.block_logits(probe)
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5 * float(np.abs(lb).max()))


def test_reuse_needs_the_whole_memory_as_prefix(pair) -> None:
    """The memory is kept when the prompt starts with all of it, whatever the block sizes;
    a prompt that differs, or stops inside it (a recurrent state cannot be cut back), clears
    it. Every case gives the tokens of a cleared memory."""
    a, b = pair
    p = a.tokenize("hello world, hello", add_bos=True, special=True)
    r = _turn(a, p, block_size=4)
    assert a.n_committed == len(p) + 20       # 6 blocks of 4 for 24 tokens, the last not committed

    def same_as_cleared(prompt: list[int], B: int, reused: int) -> None:
        got = _turn(a, prompt, block_size=B)
        assert got.stats.n_reused == reused
        assert got.tokens == _turn(b, prompt, block_size=B, reuse_prefix=False).tokens

    other = a.tokenize("goodbye world", add_bos=True, special=True)
    same_as_cleared(other, 4, 0)                        # another prompt
    _turn(a, p, block_size=4)
    same_as_cleared(p, 4, 0)                            # a prefix of the memory: cleared
    r = _turn(a, p, block_size=4)
    same_as_cleared(p + r.tokens[:20] + [p[1]] * 3, 3, len(p) + 20)  # continued at another B (no alignment)
    _turn(a, p, n=4, block_size=4)                      # one block: the memory is the prompt alone
    assert a.n_committed == len(p)
    same_as_cleared(p, 8, len(p))                       # all of it kept, nothing committed, L_last kept


def test_reuse_under_auto_and_in_chat(pair) -> None:
    a, b = pair
    p = a.tokenize("class Point:\n", add_bos=True, special=True)
    _recorded(a, p, "auto")
    kept = a.n_committed
    r1, _ = _recorded(a, p, "auto")  # the same prompt: kept only when the memory is the prompt alone
    assert r1.stats.n_reused == (len(p) if kept == len(p) else 0)
    msgs = [{"role": "user", "content": "hi there"}]
    t1 = a.chat(msgs, max_tokens=12, block_size=4)
    msgs += [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "and again"}]
    toks2 = a.chat_tokens(a.format_chat(msgs))   # the first exchange's own tokens, then the new text
    t2 = a.chat(msgs, max_tokens=12, block_size=4)
    assert t2.stats.n_reused > 0
    assert "reused" in t2.stats.format()
    # the reply is that of a cleared memory (cut where chat's end-of-turn tokens end it)
    fresh = b.generate(toks2, max_tokens=12, block_size=4, reuse_prefix=False)
    assert fresh.tokens[:len(t2.tokens)] == t2.tokens
    assert len(t2.tokens) == len(fresh.tokens) or t2.finish_reason == "stop"


def test_new_context_shares_the_model(tiny_artifacts) -> None:
    from clover_cpp import Clover, CloverError

    a = Clover(tiny_artifacts["f16"], n_ctx=256, n_threads=1, block_size=4)
    b = a.new_context(n_ctx=512)
    assert b.n_ctx() == 512 and b.block_size == 4 and b._model == a._model
    want = a.generate("hello", max_tokens=8).tokens
    a.close()
    assert b.generate("hello", max_tokens=8).tokens == want  # the model lives while b does
    with pytest.raises(CloverError, match="unknown"):
        b.new_context(nonsense=1)
    b.close()
    assert b._shared.handle is None  # freed with the last user


@pytest.mark.parametrize("pieces,stops,want", [
    (["hel", "lo wo", "rld"], ["lo w"], "hel"),
    (["a", "b", "c", "d"], ["bc"], "a"),
    (["ab", "cd"], ["x"], "abcd"),
    (["ab", "c"], ["cd"], "abc"),          # a held-back prefix comes out when the text ends
    (["END", "x"], ["END", "D"], ""),
])
def test_stop_matcher(pieces, stops, want) -> None:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert out == want


def test_stop_strings_cut_across_tokens(pair) -> None:
    a, _ = pair
    p = "def fibonacci(n):\n"
    full = a.generate(p, max_tokens=32, block_size=4, stop_at_eos=False)
    toks = [a.detokenize_text([t]) for t in full.tokens]
    # a stop string that starts inside one token and ends inside a later one
    i = next(k for k in range(2, len(toks) - 2) if len(toks[k]) >= 2 and toks[k + 1])
    start = len("".join(toks[:i])) + 1
    stop = full.text[start:start + len(toks[i]) + 1]
    want = full.text[:full.text.index(stop)]
    r = a.generate(p, max_tokens=32, block_size=4, stop_at_eos=False, stop=[stop, "\x00never"])
    assert r.text == want and r.finish_reason == "stop"
    streamed = "".join(a.generate(p, max_tokens=32, block_size=4, stop_at_eos=False, stop=stop, stream=True))
    assert streamed == want
    from clover_cpp import CloverError
    with pytest.raises(CloverError, match="stop"):
        a.generate(p, stop=[1])


def test_cli_reverse_prompt(tiny_artifacts) -> None:
    from click.testing import CliRunner

    from clover_cpp.cli import cli
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f16"], n_ctx=256, n_threads=1, block_size=4) as m:
        full = m.generate("hello", max_tokens=24, stop_at_eos=False).text
    stop = full[6:9]
    res = CliRunner().invoke(cli, ["run", "-m", str(tiny_artifacts["f16"]), "-p", "hello", "-n", "24",
                                   "--block-size", "4", "-c", "256", "-t", "1", "--ignore-eos", "--no-stats",
                                   "--no-visual", "--no-echo", "-r", stop], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert res.output == full[:full.index(stop)] + "\n"
