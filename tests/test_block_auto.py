"""block_size = "auto": B chosen per block from the cost curve and the running tokens per
pass. Whatever schedule it picks, the tokens must equal the numpy reference replaying that
schedule (blocks stay aligned, and a switch keeps the memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest


pytestmark = pytest.mark.needs_libclover

PROMPTS = ["hello world", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog."]
# cheap single tokens, costly B = 2: B = 1 first, then one B = 2 probe, then (with confident
# blocks) B = 8, the best once tokens per pass is known
SWITCHING = {1: 1.0, 2: 1.9, 4: 2.0, 8: 2.2, 16: 10.0, 32: 20.0}  # a pass; a fused step costs the same


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
    """generate(block_size="auto") and the B of each decode block, from the step callback."""
    blocks: list[tuple[int, int]] = []

    def on_step(canvas, n_masked, block_start):
        if not blocks or blocks[-1][0] != block_start:
            blocks.append((block_start, len(canvas)))

    r = model.generate(toks, block_size="auto", on_step=on_step, stop_at_eos=False, **kw)
    return r, [b for _, b in blocks], [s for s, _ in blocks]


def test_cost_curve_with_one_best_size_is_that_size(model) -> None:
    model.set_cost_curve({1: 50.0, 2: 50.0, 4: 1.0, 8: 50.0, 16: 50.0, 32: 50.0})
    for prompt in PROMPTS:
        toks = model.tokenize(prompt)
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
        toks = model.tokenize(prompt)
        r, sched, starts = run_recording(model, toks, max_tokens=40, threshold=threshold)
        assert all(s % b == 0 for s, b in zip(starts, sched)), "blocks must stay aligned"
        assert r.stats.n_block_switches == sum(a != b for a, b in zip(sched, sched[1:]))
        want = generate(ref, toks, max_tokens=40, block_size=0, threshold=threshold, stop_at_eos=False,
                        block_schedule=sched)
        assert r.tokens == want.tokens, (prompt, sched)
        assert r.stats.n_decode_passes == want.n_steps
        switched += r.stats.n_block_switches
        if threshold == 0.0:   # every block in one pass: B = 1, the B = 2 probe, then B = 8
            assert sched[0] == 1 and 2 in sched and sched[-1] == 8, sched
    assert switched >= 2


def test_calibrate_and_auto_from_scratch(model) -> None:
    curve = model.calibrate()
    assert sorted(curve) == [1, 2, 4, 8, 16, 32] and all(v > 0 for v in curve.values())
    r = model.generate("hello world", max_tokens=24, block_size="auto", stop_at_eos=False)
    assert len(r.tokens) == 24 and r.stats.block_size in curve


@pytest.mark.parametrize("curve", [{}, {2: 1.0}, {1: 1.0, 4: 1.0}, {1: 0.0}, {1: float("inf")}, {1: 1.0, 2: -1.0}])
def test_bad_cost_curve(model, curve) -> None:
    from clover_cpp import CloverError

    with pytest.raises(CloverError, match="cost curve|bad arguments"):
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
        assert "stale or corrupt" in capfd.readouterr().err
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
