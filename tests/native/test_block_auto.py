"""block_size = "auto": B chosen per block from the cost curve and the running tokens per
pass. Whatever schedule it picks, the tokens and the counters must equal the numpy reference
replaying that schedule: blocks start right after the prompt and right after each other (no
alignment), and a switch keeps the memory, which is the causal processing of the committed
text whatever the B of the blocks that wrote it (spec/decoding.md, spec v2)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest


pytestmark = pytest.mark.needs_libclover

PROMPTS = ["hello world", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog."]
# cheap single tokens, costly B = 2: B = 1 first, then one B = 2 probe, then (with confident
# blocks, each size doubling the last one's tokens per pass) 4 and 8, the best once tokens per
# pass is known
SWITCHING = {1: 1.0, 2: 1.9, 4: 2.0, 8: 2.2, 16: 10.0, 32: 20.0}  # a pass; a fused step costs the same
ONLY_4 = {1: 50.0, 2: 50.0, 4: 1.0, 8: 50.0, 16: 50.0, 32: 50.0}
ONLY_32 = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0, 32: 0.1}


@pytest.fixture(scope="module")
def ref(tiny_artifacts):
    from clover_testkit.reference import CloverReference

    return CloverReference.from_pretrained(tiny_artifacts["ckpt"])


@pytest.fixture()
def model(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1, flash_attn=False, kv_f32=True) as m:
        yield m


def run_recording(model, toks, **kw):
    """generate(block_size="auto") and the B and start of each decode block, from the step callback.
    Block diffusion only (draft_self=False) unless kw says otherwise: these schedules are replayed
    by the numpy reference."""
    kw.setdefault("draft_self", False)
    blocks: list[tuple[int, int]] = []

    def on_step(canvas, n_masked, block_start):
        if not blocks or blocks[-1][0] != block_start:
            blocks.append((block_start, len(canvas)))

    r = model.generate(toks, block_size="auto", on_step=on_step, stop_at_eos=False, **kw)
    return r, [b for _, b in blocks], [s for s, _ in blocks]


def assert_blocks_follow_the_prompt(n_prompt: int, sched: list[int], starts: list[int]) -> None:
    """Spec v2: the first block starts right after the prompt, each next one right after the last."""
    assert starts == [n_prompt + sum(sched[:k]) for k in range(len(sched))], (n_prompt, sched, starts)


def assert_equals_reference(r, want) -> None:
    assert r.tokens == want.tokens
    assert r.stats.n_decode_passes == want.n_steps
    assert r.stats.n_commits == want.n_commits
    assert r.stats.n_forward == want.n_forward
    assert r.stats.tokens_per_forward == pytest.approx(want.tokens_per_forward)


def test_cost_curve_with_one_best_size_is_that_size(model) -> None:
    model.set_cost_curve(ONLY_4)
    for prompt in PROMPTS:
        toks = model.tokenize(prompt, add_bos=False, special=True)
        r, sched, _ = run_recording(model, toks, max_tokens=20, threshold=0.9)
        want = model.generate(toks, max_tokens=20, block_size=4, threshold=0.9, stop_at_eos=False)
        assert set(sched) == {4} and r.stats.block_size == 4 and r.stats.n_block_switches == 0
        assert r.tokens == want.tokens


@pytest.mark.parametrize("threshold", [0.0, 0.9])
def test_switches_equal_reference_schedule(model, ref, threshold: float) -> None:
    from clover_testkit.reference import generate

    switched = 0
    for prompt in PROMPTS:
        model.set_cost_curve(SWITCHING, SWITCHING)   # also resets the running tokens per pass
        toks = model.tokenize(prompt, add_bos=False, special=True)
        r, sched, starts = run_recording(model, toks, max_tokens=40, threshold=threshold)
        assert_blocks_follow_the_prompt(len(toks), sched, starts)
        assert r.stats.n_block_switches == sum(a != b for a, b in zip(sched, sched[1:]))
        assert r.stats.n_blocks == len(sched) and r.stats.block_size == sched[-1]
        want = generate(ref, toks, max_tokens=40, block_size=0, threshold=threshold, stop_at_eos=False,
                        block_schedule=sched)
        assert_equals_reference(r, want)
        # the memory: the prompt and every block but the last, whatever their sizes
        assert model.n_committed == len(toks) + sum(sched[:-1])
        switched += r.stats.n_block_switches
        if threshold == 0.0:   # every block in one pass: B = 1, the B = 2 probe, then up to B = 8
            assert sched[:4] == [1, 2, 4, 8] and set(sched[3:]) == {8}, sched
    assert switched >= 2


@pytest.mark.parametrize("threshold", [0.0, 0.9])
def test_same_call_ten_times_under_changing_cost_curves(model, ref, tiny_artifacts, threshold: float) -> None:
    """One greedy call made ten times in one process with block_size="auto", after a
    calibration, the cost curve changed between calls (and once left with the running figures
    of the call before): each output equals the reference replaying the schedule the run
    reported, a curve set afresh gives the same schedule and tokens every time it is set, and
    the memory left behind is the causal processing of the committed text whatever the B of
    the blocks that wrote it."""
    from clover_testkit.reference import generate

    measured = model.calibrate(fused=True)
    curves = {"measured": ({b: v[0] for b, v in measured.items()}, {b: v[1] for b, v in measured.items()}),
              "switching": (SWITCHING, SWITCHING), "only 4": (ONLY_4, None), "only 32": (ONLY_32, ONLY_32)}
    plan = ["measured", "switching", "only 4", "measured", "only 32", None, "switching", "only 4", "only 32",
            "measured"]   # None: keep the curve and the running tokens per pass of the call before
    toks = model.tokenize("def fibonacci(n):", add_bos=True, special=True)
    fresh = model.new_context(block_size=1)   # the same weights, another memory
    want_by_sched: dict[tuple[int, ...], list[int]] = {}
    got_by_curve: dict[str, tuple[list[int], list[int]]] = {}
    try:
        for name in plan:
            if name is not None:
                model.set_cost_curve(*curves[name])
            r, sched, starts = run_recording(model, toks, max_tokens=40, threshold=threshold)
            assert_blocks_follow_the_prompt(len(toks), sched, starts)
            assert sum(sched[:-1]) < 40 <= sum(sched)
            if tuple(sched) not in want_by_sched:
                want = generate(ref, toks, max_tokens=40, block_size=0, threshold=threshold, stop_at_eos=False,
                                block_schedule=sched)
                assert_equals_reference(r, want)
                want_by_sched[tuple(sched)] = want.tokens
            assert r.tokens == want_by_sched[tuple(sched)], (name, sched)
            if name is not None:
                assert got_by_curve.setdefault(name, (sched, r.tokens)) == (sched, r.tokens), name
            # the memory: prompt + every block but the last, as one causal pass over that text
            text = toks + r.tokens[:sum(sched[:-1])]
            assert model.n_committed == len(text)
            fresh.reset()
            fresh.commit(text)
            want_last = fresh.last_logits()
            np.testing.assert_allclose(model.last_logits(), want_last, rtol=0,
                                       atol=1e-5 * float(np.abs(want_last).max()))
    finally:
        fresh.close()
    assert len(want_by_sched) >= 3, list(want_by_sched)   # the curves did make different schedules


def test_calibrate_and_auto_from_scratch(model) -> None:

    curve = model.calibrate()
    assert sorted(curve) == [1, 2, 4, 8, 16, 32] and all(v > 0 for v in curve.values())
    r = model.generate("hello world", max_tokens=24, block_size="auto", stop_at_eos=False)
    assert len(r.tokens) == 24 and r.stats.block_size in curve


@pytest.mark.parametrize("curve", [{}, {2: 1.0}, {1: 1.0, 4: 1.0}, {1: 0.0}, {1: float("inf")}, {1: 1.0, 2: -1.0}])
def test_bad_cost_curve(model, curve) -> None:
    from clover_cpp import CloverError

    with pytest.raises(CloverError, match="cost curve|bad arguments|curve must be"):
        model.set_cost_curve(curve)


def test_cli_block_size_auto(tiny_artifacts) -> None:
    r = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "run", "-m", str(tiny_artifacts["f16"]), "-p",
                        "hello", "-n", "12", "--block-size", "auto", "--ignore-eos", "--stats"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[clover] B=" in r.stderr and "generated=12 tok" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "run", "-m", str(tiny_artifacts["f16"]), "-p",
                          "hello", "--block-size", "often"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "'often'" in bad.stderr


def test_calibration_disk_cache(tiny_artifacts, tmp_path, monkeypatch, capfd) -> None:
    """The cost curve is measured once per model file / backend / build / threads and read
    back by the next start; a corrupt or stale entry is measured again, with a warning, and
    replaced."""
    from clover_cpp import Clover

    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path / "cache"))

    def first_call() -> str:
        with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1) as m:
            return m.generate("hello", max_tokens=4).stats.calibration

    assert first_call() == "measured"
    entries = list((tmp_path / "cache").glob("calibration-*.txt"))
    assert len(entries) == 1
    assert first_call() == "cached"
    capfd.readouterr()
    good = entries[0].read_text()
    for bad in ("garbage\n", good.replace("cost 4 ", "cost 4 nan "), good.replace("threads 1 ", "threads 7 "),
                good.rsplit("end", 1)[0]):
        entries[0].write_text(bad)
        assert first_call() == "measured"
        assert "is stale" in capfd.readouterr().err
        assert first_call() == "cached"     # replaced by a good entry
    # another thread count is another entry
    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=2) as m:
        assert m.generate("hello", max_tokens=4).stats.calibration == "measured"
    assert len(list((tmp_path / "cache").glob("calibration-*.txt"))) == 2
    assert not list((tmp_path / "cache").glob("*.tmp*"))


def test_second_run_does_not_calibrate(tiny_artifacts, tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner

    from clover_cpp.cli import cli

    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path / "cache"))
    args = ["run", "-m", str(tiny_artifacts["f32"]), "-p", "hello", "-n", "8", "-t", "1", "--no-visual"]
    runs = [CliRunner().invoke(cli, args) for _ in range(2)]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert "cost curve measured" in runs[0].stderr and "cost curve cached" in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout


@pytest.mark.parametrize("n_ctx, max_tokens", [(256, 253), (64, 61)])
def test_auto_blocks_always_fit_the_context(tiny_artifacts, n_ctx: int, max_tokens: int) -> None:
    """A curve that favours B = 32 must not pick a B whose blocks run past n_ctx: blocks start
    right after the prompt, so prompt + whole blocks must fit (found with n_ctx 256: a failed
    decode after 7 blocks; with n_ctx 64 a canvas ran past the context)."""
    from clover_cpp import Clover

    sizes = [1, 2, 4, 8, 16, 32]
    curve = {b: (0.1 if b == 32 else 10.0) for b in sizes}
    with Clover(tiny_artifacts["f32"], n_ctx=n_ctx, n_threads=1) as m:
        m.set_cost_curve(curve, curve)
        prompt = [5, 6, 7]
        r, sched, starts = run_recording(m, prompt, max_tokens=max_tokens, threshold=0.0)
        assert r.stats.n_generated == max_tokens
        assert_blocks_follow_the_prompt(len(prompt), sched, starts)
        assert all(s + b <= n_ctx for s, b in zip(starts, sched)), (starts, sched)


@pytest.mark.parametrize("n_ctx", [3, 40])
def test_auto_on_a_small_context(tiny_artifacts, n_ctx: int) -> None:
    """The calibration measures a commit of B fused with a pass of B: auto's candidates keep 2B
    within n_ctx (a 40-position context aborted the process in llama.cpp's batch check)."""
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=n_ctx, n_threads=1) as m:
        curve = m.calibrate(fused=True)
        assert max(curve) == max(1, 2 ** ((n_ctx // 2).bit_length() - 1)) and all(f > 0 for _, f in curve.values())
        r = m.generate([5], max_tokens=n_ctx - 1, block_size="auto", stop_at_eos=False)
        assert r.stats.n_generated == n_ctx - 1


# ------------------------------------------------------------------ auto among B = 1, diffusion, draft-self
# Draft-self's cost per token comes from the cost curve (a verification forward ~ a pass of 2B)
# and its measured acceptance (one probe block measures it); on the random tiny model a draft
# keeps about only its first token, so a verification yields about 2 tokens for 2 forwards.
CHEAP_BLOCKS = {1: 10.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0}   # single tokens cost 10x a pass
CHEAP_TOKENS = {1: 1.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0, 32: 10.0}


def _b1(model, toks, n):
    return model.generate(toks, max_tokens=n, block_size=1, stop_at_eos=False).tokens


def test_auto_lossless_picks_draft_self_when_it_is_cheaper(model) -> None:
    """draft_self=True with block_size="auto": B = 1 or draft-self only (both give the B = 1
    output); with single tokens 10x a pass, draft-self (about 2 tokens per 2 forwards of ~1)
    wins once its probe block has measured the acceptance, and the stats say so."""
    for prompt in PROMPTS:
        model.set_cost_curve(CHEAP_BLOCKS, CHEAP_BLOCKS)
        toks = model.tokenize(prompt, add_bos=False, special=True)
        r = model.generate(toks, max_tokens=40, block_size="auto", draft_self=True, stop_at_eos=False)
        s = r.stats
        assert r.tokens == _b1(model, toks, 40)
        assert s.mode == "draft-self" and s.block_size > 1 and s.n_blocks_diffusion == 0
        assert s.n_blocks_draft_self > s.n_blocks_ar and s.n_verifications > 0
        assert "draft-self" in s.format()


def test_auto_never_keeps_a_mode_slower_than_block_size_1(model) -> None:
    """With single tokens cheap, neither draft-self nor block diffusion may stay: after the
    one probe block each (diffusion at B = 2, draft-self at B = 8), every block is B = 1 (the
    10% switching margin does not keep a mode that is slower than B = 1)."""
    for kw in (dict(draft_self=True), dict(draft_self=None), dict(draft_self=None, threshold=0.0)):
        model.set_cost_curve(CHEAP_TOKENS, CHEAP_TOKENS)
        toks = model.tokenize(PROMPTS[1], add_bos=False, special=True)
        blocks: list[int] = []
        r = model.generate(toks, max_tokens=40, block_size="auto", stop_at_eos=False,
                           on_step=lambda canvas, n_masked, start: blocks.append(len(canvas)), **kw)
        s = r.stats
        assert s.mode == "autoregressive" and s.block_size == 1, (kw, s)
        assert s.n_blocks_draft_self <= 1 and s.n_blocks_diffusion <= 1, (kw, s)   # the probes only
        assert s.n_blocks_ar >= 40 - 8 - 2, (kw, s)
        if kw["draft_self"]:
            assert r.tokens == _b1(model, toks, 40)   # lossless modes only: the B = 1 output
        # the same context keeps its measured figures: no probe the second time
        r2 = model.generate(toks, max_tokens=40, block_size="auto", stop_at_eos=False, **kw)
        assert r2.stats.n_blocks_ar == r2.stats.n_blocks and r2.stats.mode == "autoregressive", (kw, r2.stats)


def test_auto_picks_diffusion_when_it_is_cheapest(model) -> None:
    """draft_self=None (auto): all three modes. A curve whose only cheap forward is a pass of 4
    (B = 4's diffusion: one pass per block at threshold 0; draft-self at B = 4 verifies with a
    forward of 8 tokens, which is dear) makes auto settle on block diffusion at B = 4."""
    model.set_cost_curve(ONLY_4, ONLY_4)
    toks = model.tokenize(PROMPTS[0], add_bos=False, special=True)
    r = model.generate(toks, max_tokens=40, block_size="auto", threshold=0.0, stop_at_eos=False)
    s = r.stats
    assert s.mode == "diffusion" and s.block_size == 4, s
    assert s.n_blocks_diffusion > s.n_blocks_draft_self + s.n_blocks_ar, s
    assert "diffusion" in s.format()


def test_auto_mode_follows_the_measured_acceptance(model) -> None:
    """The same curve, two acceptances: at temperature 50 draft and verifier are near uniform,
    so most drafts are kept whole (many tokens per forward) and auto settles on draft-self;
    greedy, the random model's drafts keep about their first token only (about one token per
    forward, each dearer than B = 1's), and the same curve brings B = 1 back."""
    curve = {1: 3.0, 2: 4.0, 4: 4.0, 8: 4.0, 16: 4.0, 32: 4.0}   # a pass of up to 32 costs 4/3 of one token
    toks = model.tokenize(PROMPTS[2], add_bos=False, special=True)
    model.set_cost_curve(curve, curve)
    hot = model.generate(toks, max_tokens=60, block_size="auto", draft_self=True, temperature=50.0, seed=3,
                         stop_at_eos=False)
    assert hot.stats.mode == "draft-self" and hot.stats.n_accepted > hot.stats.n_verifications, hot.stats
    model.set_cost_curve(curve, curve)
    cold = model.generate(toks, max_tokens=60, block_size="auto", draft_self=True, stop_at_eos=False)
    assert cold.stats.mode == "autoregressive" and cold.stats.n_blocks_draft_self <= 1, cold.stats
    assert cold.tokens == _b1(model, toks, 60)


def test_auto_spends_no_block_on_draft_self_that_cannot_pay(model) -> None:
    """A cost curve linear in tokens (a pass of B costs B single tokens, like a small model on
    a CPU): a verification forward of 2B tokens for at most B tokens can never beat B = 1, so
    auto does not even probe draft-self; the output is B = 1's."""
    linear = {b: float(b) for b in (1, 2, 4, 8, 16, 32)}
    model.set_cost_curve(linear, linear)
    toks = model.tokenize(PROMPTS[0], add_bos=False, special=True)
    r = model.generate(toks, max_tokens=30, block_size="auto", draft_self=True, stop_at_eos=False)
    assert r.stats.n_blocks_draft_self == 0 and r.stats.mode == "autoregressive", r.stats
    assert r.tokens == _b1(model, toks, 30)


def test_draft_self_drops_the_canvas_that_would_not_pay(model) -> None:
    """A verification carries the next draft's canvas only when, by the cost curve and the
    measured acceptance, a whole draft is likely enough to use it: on a curve linear in tokens
    with the random model's acceptance (drafts keep about their first token), no verification
    carries one, so every draft has a pass of its own (passes == verifications); the output is
    still B = 1's. Without a curve every verification that leaves a block to draft carries one."""
    toks = model.tokenize(PROMPTS[1], add_bos=False, special=True)
    free = model.generate(toks, max_tokens=40, block_size=4, draft_self=True, stop_at_eos=False)
    assert free.stats.n_decode_passes > free.stats.n_verifications   # canvases rode on verifications
    linear = {b: float(b) for b in (1, 2, 4, 8, 16, 32)}
    model.set_cost_curve(linear, linear)
    model.generate(toks, max_tokens=40, block_size=4, draft_self=True, stop_at_eos=False)  # measures acceptance
    r = model.generate(toks, max_tokens=40, block_size=4, draft_self=True, stop_at_eos=False)
    assert r.tokens == free.tokens == _b1(model, toks, 40)
    assert r.stats.n_decode_passes == r.stats.n_verifications, r.stats


def test_auto_leaves_a_mode_measured_slower_than_block_size_1(tiny_artifacts, tmp_path, monkeypatch) -> None:
    """A measured cost curve (the disk cache) may no longer hold: here one that claims a block of
    32 nearly free and single tokens dear. Auto follows it into draft-self, but it also times the
    blocks it runs (wall time per token, a B = 1 block measuring B = 1 when needed), and once
    draft-self is measured slower than B = 1 it goes back to B = 1 for good: a handful of
    draft-self blocks, then B = 1, whose output it keeps (lossless modes)."""
    from clover_cpp import Clover

    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path / "cache"))
    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1) as m:
        assert m.generate("hello", max_tokens=2, block_size="auto").stats.calibration == "measured"
    entry = next((tmp_path / "cache").glob("calibration-*.txt"))
    stale = {1: 100.0, 2: 50.0, 4: 50.0, 8: 50.0, 16: 50.0, 32: 0.001}
    lines = [f"cost {b} {stale[b]:.6f} {stale[b]:.6f}" if ln.startswith(f"cost {b} ") else ln
             for ln in entry.read_text().splitlines() for b in [int(ln.split()[1]) if ln.startswith("cost ") else 0]]
    entry.write_text("\n".join(lines) + "\n")
    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1) as m:
        toks = m.tokenize(PROMPTS[1], add_bos=False, special=True)
        r = m.generate(toks, max_tokens=40, block_size="auto", draft_self=True, stop_at_eos=False)
        s = r.stats
        assert s.calibration == "cached"
        assert s.mode == "autoregressive" and 1 <= s.n_blocks_draft_self <= 3, s
        assert r.tokens == _b1(m, toks, 40)
        # the curve set by hand instead is taken as it is: draft-self stays
        m.set_cost_curve(stale, stale)
        assert m.generate(toks, max_tokens=40, block_size="auto", draft_self=True,
                          stop_at_eos=False).stats.mode == "draft-self"


def test_auto_starts_a_generation_at_block_size_1_once_diffusion_was_measured_slower(
        tiny_artifacts, tmp_path, monkeypatch) -> None:
    """The measurements outlive a generation (they belong to the context): once block diffusion
    was timed slower than B = 1, the next generate() starts at B = 1 too. Its first block is never
    timed (it carries no commit), so a stale curve that keeps choosing diffusion for first blocks
    would otherwise pay one slow block per call (a confident model after a run of explicit B)."""
    from clover_cpp import Clover

    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path / "cache"))
    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1) as m:
        assert m.generate("hello", max_tokens=2, block_size="auto").stats.calibration == "measured"
    entry = next((tmp_path / "cache").glob("calibration-*.txt"))
    stale = {1: 100.0, 2: 50.0, 4: 50.0, 8: 50.0, 16: 50.0, 32: 0.001}
    lines = [f"cost {b} {stale[b]:.6f} {stale[b]:.6f}" if ln.startswith(f"cost {b} ") else ln
             for ln in entry.read_text().splitlines() for b in [int(ln.split()[1]) if ln.startswith("cost ") else 0]]
    entry.write_text("\n".join(lines) + "\n")
    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1) as m:
        toks = m.tokenize(PROMPTS[1], add_bos=False, special=True)
        first = m.generate(toks, max_tokens=96, block_size="auto", draft_self=False, stop_at_eos=False).stats
        assert first.calibration == "cached" and first.n_blocks_diffusion >= 2 and first.mode == "autoregressive", first
        again = m.generate(toks, max_tokens=40, block_size="auto", draft_self=False, stop_at_eos=False)
        assert again.stats.n_blocks_diffusion == 0, again.stats
        assert again.tokens == _b1(m, toks, 40)
