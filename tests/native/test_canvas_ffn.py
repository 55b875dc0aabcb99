"""The canvas FFN (spec/model.md, "The canvas FFN") end to end: a tiny checkpoint with one converts
(the GGUF key and tensors), libclover's block-pass logits equal the numpy reference's (1e-3, f32)
and differ from those of the same model without it, committed-position logits are the causal
model's (the canvas FFN never runs on a commit), greedy block diffusion (the fused commit + pass)
is token for token reference.generate, and draft-self gives block size 1's output."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import F32_TOL, Ctx, Model, random_prompt, relative_diff

pytestmark = pytest.mark.needs_libclover

WIDTH = 24  # the canvas FFN's width (the tiny preset's H is smaller: every shape is checked)


@pytest.fixture(scope="module")
def canvas_artifacts(tmp_path_factory):
    from clover_convert import convert
    from clover_testkit.checkpoints import write_checkpoint

    d = tmp_path_factory.mktemp("canvas")
    cfg = write_checkpoint(d / "ck", preset="tiny", dtype="f32", seed=3,
                           config_overrides={"canvas_ffn_intermediate_size": WIDTH})
    convert(d / "ck", d / "canvas-f32.gguf", outtype="f32", progress=False)
    return {"ckpt": d / "ck", "f32": d / "canvas-f32.gguf", "cfg": cfg}


@pytest.fixture(scope="module")
def cref(canvas_artifacts):
    from clover_testkit.reference import CloverReference

    return CloverReference.from_pretrained(canvas_artifacts["ckpt"])


def ordinary(cfg) -> int:
    """Token ids below this are ordinary (the specials sit at the top of the vocabulary)."""
    return min(cfg.eos_token_id, cfg.mask_token_id)


@pytest.fixture(scope="module")
def cmodel(canvas_artifacts):
    m = Model(canvas_artifacts["f32"])
    yield m
    m.close()


def test_gguf_has_the_canvas_ffn(canvas_artifacts, cref):
    from gguf import GGUFReader

    r = GGUFReader(str(canvas_artifacts["f32"]))
    field = r.fields["clover.canvas_feed_forward_length"]
    assert int(field.parts[field.data[0]][0]) == WIDTH
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    H = cref.cfg.hidden_size
    for i in range(cref.cfg.num_hidden_layers):
        assert names[f"blk.{i}.ffn_gate_canvas.weight"] == (H, WIDTH)   # ggml order: [in, out]
        assert names[f"blk.{i}.ffn_up_canvas.weight"] == (H, WIDTH)
        assert names[f"blk.{i}.ffn_down_canvas.weight"] == (WIDTH, H)


@pytest.mark.parametrize("B", [4, 8])
def test_block_pass_and_commit_parity(cmodel, cref, B):
    vocab_hi = ordinary(cref.cfg)
    without = dataclasses.replace(cref.cfg, canvas_ffn_intermediate_size=0)
    from clover_testkit.reference import CloverReference
    plain = CloverReference(without, {k: v for k, v in cref.w.items() if ".canvas_ffn." not in k})
    mask = cmodel.mask
    with Ctx(cmodel, B, n_ctx=256) as ctx:
        for n_prompt in (0, 5, B + 3):
            ctx.reset()
            mem = cref.new_memory()
            if n_prompt:
                prompt = random_prompt(11 * n_prompt + B, n_prompt, vocab_hi)
                got = ctx.commit_logits(prompt)
                want = cref.commit(mem, prompt)
                assert relative_diff(got, want) <= F32_TOL
                # a commit is the causal model's: the canvas FFN is not in it
                assert relative_diff(want, plain.commit(plain.new_memory(), prompt)) <= 1e-12
            rng = np.random.default_rng(B * 10 + n_prompt)
            for n in sorted({1, 2, B}):
                canvas = [mask if rng.random() < 0.5 else int(rng.integers(0, vocab_hi)) for _ in range(n)]
                want = cref.block_pass(mem, canvas, B)
                assert relative_diff(ctx.block_pass(canvas), want) <= F32_TOL, (n_prompt, n)
                # ... and a block pass is not: the test would see a graph that left it out
                assert not np.allclose(want, plain.block_pass(mem, canvas, B), atol=1e-3)


def test_greedy_block_diffusion_matches_reference(cmodel, cref):
    from clover_testkit.reference import generate

    prompt = random_prompt(77, 6, ordinary(cref.cfg))
    with Ctx(cmodel, 4, n_ctx=256) as ctx:
        rc, toks, st, msg = ctx.generate(prompt, max_tokens=16, threshold=0.5, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
    want = generate(cref, prompt, max_tokens=16, block_size=4, threshold=0.5, stop_at_eos=False)
    assert toks == want.tokens
    assert st.n_steps == want.n_steps


def test_draft_self_is_block_size_1(cmodel, cref):
    prompt = random_prompt(91, 5, ordinary(cref.cfg))
    with Ctx(cmodel, 1, n_ctx=256) as ar:
        rc, want, _, msg = ar.generate(prompt, max_tokens=24, stop_at_eos=False)
        assert rc == N.CLOVER_OK, msg
    with Ctx(cmodel, 8, n_ctx=256) as ctx:
        rc, got, st, msg = ctx.generate(prompt, max_tokens=24, stop_at_eos=False, draft_self=1)
        assert rc == N.CLOVER_OK, msg
    assert got == want
    assert st.n_verifications > 0
