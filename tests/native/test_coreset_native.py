"""The block expert coreset in libclover's graph against the numpy reference:
block-pass logits with a coreset C (clover_set_coreset) within 1e-3 of CloverReference.block_pass
(coreset=C); greedy block diffusion token for token equal to reference.generate(coreset=C) (the
fused commit + pass: committed rows full routing, canvas rows the coreset); draft-self with a
coreset gives the output of block size 1; the setting's rules (clover_context_params.coreset,
clover_set_coreset). On the tiny preset (8 experts, top 2)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (CLI, F32_TOL, REPO, Ctx, L, Model, artifacts, model,  # noqa: E402, F401
                                           random_prompt, ref, relative_diff, vocab_hi)

pytestmark = pytest.mark.needs_libclover


def set_coreset(ctx: Ctx, C: int) -> None:
    eb, el = N.err_buffer()
    rc = L.clover_set_coreset(ctx.p, C, eb, el)
    assert rc == N.CLOVER_OK, eb.value.decode()
    assert L.clover_coreset(ctx.p) == C


@pytest.mark.parametrize("B", [4, 8])
@pytest.mark.parametrize("C", [1, 2, 3, 5, 8])
def test_block_pass_parity_with_coreset(model, ref, vocab_hi, B, C):
    mask = model.mask
    worst = 0.0
    with Ctx(model, B, n_ctx=256) as ctx:
        set_coreset(ctx, C)
        for n_prompt in (0, 5, B + 3):
            ctx.reset()
            mem = ref.new_memory()
            if n_prompt:
                prompt = random_prompt(7 * n_prompt + C, n_prompt, vocab_hi)
                ctx.commit(prompt)
                ref.commit(mem, prompt)
            rng = np.random.default_rng(B * 100 + C + n_prompt)
            for n in sorted({1, 2, B}):
                canvas = [mask if rng.random() < 0.5 else int(rng.integers(0, vocab_hi)) for _ in range(n)]
                d = relative_diff(ctx.block_pass(canvas), ref.block_pass(mem, canvas, B, coreset=C))
                worst = max(worst, d)
                assert d <= F32_TOL, (n_prompt, n, d)
        # the coreset changes canvases (C < E, n >= 2), and off again gives full routing
        if C < 3:
            canvas = [mask, 3, mask, 7] + [mask] * (B - 4)
            full = ref.block_pass(mem, canvas, B)
            assert not np.allclose(ref.block_pass(mem, canvas, B, coreset=C), full, atol=1e-3)
            set_coreset(ctx, 0)
            assert relative_diff(ctx.block_pass(canvas), full) <= F32_TOL
    print(f"coreset C={C} B={B}: worst relative block-pass difference {worst:.2e}")


@pytest.mark.parametrize("C", [1, 2, 4])
def test_greedy_block_diffusion_with_coreset_matches_reference(model, ref, vocab_hi, C):
    from clover_testkit.reference import generate
    prompt = random_prompt(500 + C, 6, vocab_hi)
    with Ctx(model, 4, n_ctx=256) as ctx:
        set_coreset(ctx, C)
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=16, threshold=0.5, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
    want = generate(ref, prompt, max_tokens=16, block_size=4, threshold=0.5, stop_at_eos=False, coreset=C)
    assert toks == want.tokens
    assert st.n_steps == want.n_steps


@pytest.mark.parametrize("C", [1, 2])
def test_draft_self_with_coreset_is_block_size_1(model, vocab_hi, C):
    prompt = random_prompt(900 + C, 5, vocab_hi)
    with Ctx(model, 1, n_ctx=256) as ar:
        rc, want, _, msg = ar.generate(prompt, max_tokens=24, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
    with Ctx(model, 8, n_ctx=256) as ctx:
        set_coreset(ctx, C)
        rc, got, st, msg = ctx.generate(prompt, max_tokens=24, stop_at_eos=False, draft_self=1)
        assert rc == N.CLOVER_OK, msg
        assert st.n_verifications > 0
    assert got == want


def test_coreset_rules(model, artifacts):
    eb, el = N.err_buffer()
    cp = L.clover_context_default_params()
    assert cp.coreset == N.CLOVER_CORESET_MODEL
    cp.coreset = -3
    assert L.clover_context_params_check(ctypes.byref(cp), eb, el) == N.CLOVER_ERR_INVALID_ARG
    assert eb.value.decode() == "coreset must be >= 0 (0 = off), -1 (the model's default) or -2 (auto), got -3"
    with Ctx(model, 4, n_ctx=64) as ctx:
        assert L.clover_coreset(ctx.p) == 0  # the tiny GGUF has no clover.expert_coreset: off
        assert L.clover_set_coreset(ctx.p, -3, eb, el) == N.CLOVER_ERR_INVALID_ARG
        assert "coreset must be >= 0" in eb.value.decode()
        set_coreset(ctx, 3)
        assert L.clover_set_coreset(ctx.p, N.CLOVER_CORESET_MODEL, eb, el) == N.CLOVER_OK
        assert L.clover_coreset(ctx.p) == 0
    assert L.clover_set_coreset(None, 2, eb, el) == N.CLOVER_ERR_INVALID_ARG
    assert L.clover_coreset(None) == -1


def test_gguf_default_coreset(tmp_path):
    """config.json's expert_coreset -> the GGUF's clover.expert_coreset -> a context's default."""
    from clover_convert import convert
    from clover_testkit.checkpoints import write_checkpoint

    write_checkpoint(tmp_path / "ck", preset="tiny", dtype="f32", config_overrides={"expert_coreset": 3})
    convert(tmp_path / "ck", tmp_path / "m.gguf", outtype="f32", progress=False)
    m = Model(tmp_path / "m.gguf")
    try:
        buf = ctypes.create_string_buffer(32)
        assert L.clover_model_meta(m.p, b"clover.expert_coreset", buf, 32) > 0 and buf.value == b"3"
        with Ctx(m, 4, n_ctx=64) as ctx:
            assert L.clover_coreset(ctx.p) == 3
            set_coreset(ctx, 0)
            eb, el = N.err_buffer()
            assert L.clover_set_coreset(ctx.p, N.CLOVER_CORESET_MODEL, eb, el) == N.CLOVER_OK
            assert L.clover_coreset(ctx.p) == 3
    finally:
        m.close()
    from clover_cpp import Clover

    with Clover(tmp_path / "m.gguf", n_ctx=64, n_threads=1, block_size=4) as c:  # the stats: "model" resolved
        assert c.generate([5, 6], max_tokens=4).stats.coreset == 3
        assert "coreset 3" in c.generate([5, 6], max_tokens=4).stats.format()
        assert c.generate([5, 6], max_tokens=4, coreset=None).stats.coreset == 0


def test_python_knobs(artifacts, vocab_hi):
    """Clover(coreset=...), Clover.coreset, generate(coreset=...) (the context's setting back after
    the call), stats.coreset (the one in effect), the refusals (libclover's message, param "coreset")."""
    from clover_cpp import Clover, CloverValueError

    prompt = random_prompt(77, 6, vocab_hi)
    with Clover(artifacts["f32"], n_ctx=128, n_threads=2, block_size=4, kv_f32=True, flash_attn=False) as m:
        assert m.coreset == 0
        full = m.generate(prompt, max_tokens=12, block_size=4, threshold=0.0, stop_at_eos=False, seed=0)
        one = m.generate(prompt, max_tokens=12, block_size=4, threshold=0.0, stop_at_eos=False, seed=0, coreset=1)
        assert m.coreset == 0
        m.coreset = 1
        assert m.coreset == 1
        again = m.generate(prompt, max_tokens=12, block_size=4, threshold=0.0, stop_at_eos=False, seed=0)
        assert again.tokens == one.tokens
        off = m.generate(prompt, max_tokens=12, block_size=4, threshold=0.0, stop_at_eos=False, seed=0, coreset=None)
        assert off.tokens == full.tokens and m.coreset == 1
        # the stats say the coreset in effect: the call's, else the context's
        assert [r.stats.coreset for r in (full, one, again, off)] == [0, 1, 1, 0]
        assert m.generate(prompt, max_tokens=4, coreset=3).stats.coreset == 3
        m.coreset = "model"
        assert m.coreset == 0
        with pytest.raises(CloverValueError) as e:
            m.coreset = -4
        assert e.value.param == "coreset" and "coreset must be >= 0" in str(e.value)
        with pytest.raises(CloverValueError):
            m.generate(prompt, max_tokens=4, coreset="lots")
    with Clover(artifacts["f32"], n_ctx=128, n_threads=2, block_size=4, coreset=2) as m:
        assert m.coreset == 2
        assert m.generate(prompt, max_tokens=4).stats.coreset == 2
        assert m.generate(prompt, max_tokens=4, coreset="model").stats.coreset == 0  # (no clover.expert_coreset)
    with pytest.raises(CloverValueError) as e:
        Clover.check_generate_args(coreset=-5)
    assert e.value.param == "coreset"


def test_cli_flag(artifacts):
    """--coreset on clover run (a refused value: one line naming the flag) and clover-cli."""
    import subprocess

    base = [str(REPO / ".venv" / "bin" / "clover"), "run", "-m", str(artifacts["f32"]), "-p", "hello", "-n", "4",
            "--no-visual", "--block-size", "4"]
    ok = subprocess.run(base + ["--coreset", "2"], capture_output=True, text=True, errors="replace", timeout=300)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base + ["--coreset", "-3"], capture_output=True, text=True, errors="replace", timeout=300)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--coreset" in bad.stderr and "coreset must be >= 0" in bad.stderr
    if CLI.exists():
        r = subprocess.run([str(CLI), "-m", str(artifacts["f32"]), "-p", "hello", "-n", "4", "--block-size", "4",
                            "--coreset", "1"], capture_output=True, text=True, errors="replace", timeout=300)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([str(CLI), "-m", str(artifacts["f32"]), "-p", "hello", "-n", "4", "--coreset", "-3"],
                           capture_output=True, text=True, errors="replace", timeout=300)
        assert r.returncode != 0 and "coreset must be >= 0" in r.stderr
