"""Prefix reuse (a context keeps its committed memory across calls), contexts sharing one
model, and stop strings, on the tiny preset."""

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


@pytest.mark.parametrize("B", [1, 4, 8])
def test_extended_prompt_prefills_only_new_blocks(pair, B: int) -> None:
    a, b = pair
    p = a.tokenize("def fibonacci(n):\n", add_special=True)
    r1 = _turn(a, p, block_size=B)
    kept = a.n_committed
    assert kept >= len(p) // B * B + B and kept % B == 0
    p2 = p + r1.tokens + a.tokenize("\n\ndef main():\n")
    r2 = _turn(a, p2, block_size=B)
    assert r2.stats.n_reused == kept
    assert r2.stats.n_commits < (len(p2) + 24) // B  # the kept blocks were not committed again
    fresh = _turn(b, p2, block_size=B, reuse_prefix=False)
    assert fresh.stats.n_reused == 0
    assert r2.tokens == fresh.tokens
    # and the memories are the same: a block pass on both gives the same logits
    assert a.n_committed == b.n_committed
    probe = [5, 6, 7][: min(3, B)]
    la, lb = a.block_logits(probe), b.block_logits(probe)
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5 * float(np.abs(lb).max()))


def test_no_reuse_when_the_prompt_differs_or_is_unaligned(pair) -> None:
    a, b = pair
    p = a.tokenize("hello world, hello", add_special=True)
    _turn(a, p, block_size=4)
    assert a.n_committed > 0
    other = a.tokenize("goodbye world", add_special=True)
    r = _turn(a, other, block_size=4)
    assert r.stats.n_reused == 0
    assert r.tokens == _turn(b, other, block_size=4, reuse_prefix=False).tokens
    # committed length 8k is not a whole number of blocks of 3 -> start over
    p = a.tokenize("hello world, hello world, hello", add_special=True)
    _turn(a, p, block_size=4)
    r = _turn(a, p + [9, 9, 9], block_size=3)
    assert a.n_committed % 3 == 0 and r.stats.n_reused in (0, a.n_committed) and r.stats.n_reused % 3 == 0


def test_reuse_under_auto_and_in_chat(pair) -> None:
    a, _ = pair
    p = a.tokenize("class Point:\n", add_special=True)
    _turn(a, p, block_size="auto")
    kept = a.n_committed
    r1 = _turn(a, p, block_size="auto")  # the same prompt: memory is longer than it, so no reuse
    assert r1.stats.n_reused <= len(p)
    msgs = [{"role": "user", "content": "hi there"}]
    t1 = a.chat(msgs, max_tokens=12, block_size=4)
    msgs += [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "and again"}]
    t2 = a.chat(msgs, max_tokens=12, block_size=4)
    assert t2.stats.n_reused > 0 and kept >= 0
    assert "reused" in t2.stats.format()


def test_new_context_shares_the_model(tiny_artifacts) -> None:
    from clover_cpp import Clover, CloverError

    a = Clover(tiny_artifacts["f16"], n_ctx=256, n_threads=1, block_size=4)
    b = a.new_context(n_ctx=512)
    assert b.n_ctx == 512 and b.block_size == 4 and b._model == a._model
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
    toks = [a.detokenize([t]) for t in full.tokens]
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
                                   "--no-visual", "-r", stop], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert res.output == full[:full.index(stop)] + "\n"
