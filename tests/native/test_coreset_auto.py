"""coreset "auto" decided from measurements (spec/decoding.md, "The block expert coreset"): the first C of 3 k,
4 k, 6 k below E whose block pass is at least 10% faster than full routing's and whose argmax
agrees with full routing's on at least 95% of the rows, else off; decided once per context, at
its first generation, and kept in the calibration cache. The measurements are injected here
(clover_set_coreset_probe), so the rule is tested without timing. On the tiny preset (8 experts,
top 2) the only candidate is 6."""
from __future__ import annotations

import ctypes

import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import Ctx, L, artifacts, model, random_prompt, vocab_hi  # noqa: F401

pytestmark = pytest.mark.needs_libclover


def probe(ctx: Ctx, full_ms: float, figures: dict[int, tuple[float, float]]) -> None:
    """figures: C -> (its pass ms, its argmax agreement with full routing)."""
    Cs = list(figures)
    arr = lambda t, v: (t * max(len(v), 1))(*v)  # noqa: E731
    assert L.clover_set_coreset_probe(ctx.p, full_ms, arr(ctypes.c_int32, Cs), arr(ctypes.c_double, [figures[c][0] for c in Cs]),
                                      arr(ctypes.c_double, [figures[c][1] for c in Cs]), len(Cs)) == N.CLOVER_OK


def decide(model, prompt, full_ms: float, figures: dict[int, tuple[float, float]]) -> tuple[int, int]:
    """A fresh context with coreset auto and the injected figures: clover_coreset before its first
    generation, and the C that generation used."""
    eb, el = N.err_buffer()
    with Ctx(model, 4, n_ctx=128) as ctx:
        assert L.clover_set_coreset(ctx.p, N.CLOVER_CORESET_AUTO, eb, el) == N.CLOVER_OK
        before = L.clover_coreset(ctx.p)
        probe(ctx, full_ms, figures)
        rc, _, _, err = ctx.generate(prompt, max_tokens=4)
        assert rc == N.CLOVER_OK, err
        return before, L.clover_coreset(ctx.p)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_off_when_the_coreset_makes_no_pass_faster(model, vocab_hi, cache):
    # the CPU's case (docs/benchmarks.md): fewer expert bytes, the same time; quality is not enough
    prompt = random_prompt(1, 6, vocab_hi)
    assert decide(model, prompt, 10.0, {6: (9.5, 1.0)}) == (N.CLOVER_CORESET_AUTO, 0)


def test_three_k_when_faster_and_agreeing(model, vocab_hi, cache):
    prompt = random_prompt(2, 6, vocab_hi)
    assert decide(model, prompt, 10.0, {6: (9.0, 0.95)}) == (N.CLOVER_CORESET_AUTO, 6)


@pytest.mark.parametrize("figures, want", [
    ({6: (5.0, 0.9)}, 0),                     # disagrees: no larger candidate below E = 8
    # several candidates (injected as a larger model has them): the first that passes both
    ({6: (5.0, 0.9), 7: (6.0, 0.97)}, 7),
    ({6: (5.0, 0.9), 7: (9.5, 0.99)}, 0),     # the larger one agrees but is not 10% faster
])
def test_quality_picks_a_larger_C_or_off(model, vocab_hi, cache, figures, want):
    assert decide(model, random_prompt(3, 6, vocab_hi), 10.0, figures)[1] == want


def test_decision_cached_and_an_old_entry_measured_again(model, vocab_hi, cache):
    prompt = random_prompt(4, 6, vocab_hi)
    assert decide(model, prompt, 10.0, {6: (5.0, 1.0)})[1] == 6
    entries = [p for p in cache.iterdir() if "coreset auto B" in p.read_text()]
    assert len(entries) == 1 and entries[0].read_text().endswith("coreset 6\nend\n")
    # read back: another context of the same placement takes the cached 6 whatever its figures say
    assert decide(model, prompt, 10.0, {6: (10.0, 0.0)})[1] == 6
    # an entry without the decision (or an impossible one) is measured again, never a crash
    for tail in ("end\n", "coreset 5\nend\n", "coreset\n", ""):
        text = entries[0].read_text()
        entries[0].write_text(text[: text.rindex("coreset 6")] + tail if "coreset 6" in text else text)
        assert decide(model, prompt, 10.0, {6: (10.0, 0.0)})[1] == 0
        assert entries[0].read_text().endswith("coreset 0\nend\n")
        entries[0].write_text(entries[0].read_text().replace("coreset 0\n", "coreset 6\n"))


def test_decided_once_per_context(model, vocab_hi, cache):
    eb, el = N.err_buffer()
    prompt = random_prompt(5, 6, vocab_hi)
    with Ctx(model, 4, n_ctx=128) as ctx:
        assert L.clover_set_coreset(ctx.p, N.CLOVER_CORESET_AUTO, eb, el) == N.CLOVER_OK
        probe(ctx, 10.0, {6: (5.0, 1.0)})
        assert ctx.generate(prompt, max_tokens=4)[0] == N.CLOVER_OK and L.clover_coreset(ctx.p) == 6
        assert L.clover_set_coreset(ctx.p, 0, eb, el) == N.CLOVER_OK and L.clover_coreset(ctx.p) == 0
        # auto again: the context's decision, at once (no measuring, no pending -2)
        assert L.clover_set_coreset(ctx.p, N.CLOVER_CORESET_AUTO, eb, el) == N.CLOVER_OK and L.clover_coreset(ctx.p) == 6


def test_measured_on_this_machine(model, vocab_hi, cache):
    """Not a timing test: whatever this machine measures, the decision is off or 6 and a block
    pass with it runs."""
    eb, el = N.err_buffer()
    with Ctx(model, 4, n_ctx=128) as ctx:
        assert L.clover_set_coreset(ctx.p, N.CLOVER_CORESET_AUTO, eb, el) == N.CLOVER_OK
        rc, toks, _, err = ctx.generate(random_prompt(6, 6, vocab_hi), max_tokens=4)
        assert rc == N.CLOVER_OK, err
        assert len(toks) >= 1 and L.clover_coreset(ctx.p) in (0, 6)
