"""The block expert coreset (spec/model.md, "MoE") with every layer on the Vulkan device: a block
pass's canvas rows route among the C experts their aggregated router elects, on the device as in
the float64 numpy reference; the count of distinct experts (expert_stats, read from the device's
ffn_moe_topk tensors) is at most C; draft-self with the coreset still gives B = 1's tokens.
Tolerance: tests/vulkan/test_vulkan.py's against the reference (why there)."""
from __future__ import annotations

import numpy as np
import pytest

from clover_cpp import Clover

pytestmark = [pytest.mark.needs_libclover, pytest.mark.xdist_group("vulkan")]

CTX = dict(n_ctx=1024, n_threads=2, kv_f32=True, flash_attn=False, n_gpu_layers=-1)
VS_REF_TOL = 1e-3
C = 4   # of the tiny preset's 8 experts (top-2)


def _prompt(cfg: dict, seed: int, n: int) -> list[int]:
    hi = min(cfg["eos_token_id"], cfg["mask_token_id"])
    return np.random.default_rng(seed).integers(0, hi, n).tolist()


@pytest.fixture(scope="module")
def gguf(tiny_artifacts):
    return tiny_artifacts["f32"]


def test_coreset_pass_on_the_device_equals_the_reference(gguf, tiny_artifacts) -> None:
    from clover_testkit.reference import CloverReference

    cfg = tiny_artifacts["cfg"]
    ref = CloverReference.from_pretrained(tiny_artifacts["ckpt"])
    with Clover(gguf, **CTX, coreset=C, expert_stats=True) as m:
        assert m.coreset == C
        for B, n_before in ((8, 0), (16, 19)):
            toks = _prompt(cfg, 300 + B, n_before + B)
            with m.new_context(block_size=B, expert_stats=True) as c:
                c.coreset = C
                got = c.block_logits(toks[n_before:], commit_before=toks[:n_before])
                counted = c.expert_stats()
            mem = ref.new_memory()
            if n_before:
                ref.commit(mem, toks[:n_before])
            want = ref.block_pass(mem, toks[n_before:], B, coreset=C)
            full = ref.block_pass(mem, toks[n_before:], B)
            gap = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
            assert gap <= VS_REF_TOL, (B, n_before, gap)
            assert not np.allclose(want, full, atol=1e-3), "the coreset changed nothing: the test proves nothing"
            assert counted.n_expert_passes == 1 and 0 < counted.experts_per_pass <= C, counted


def test_draft_self_with_the_coreset_equals_block_size_1_on_the_device(gguf, tiny_artifacts) -> None:
    cfg = tiny_artifacts["cfg"]
    with Clover(gguf, **CTX, coreset=6) as m:  # (auto measures: on llvmpipe, a CPU, likely off)
        for seed in range(2):
            prompt = _prompt(cfg, 70 + seed, 5 + 9 * seed)
            ar = m.generate(prompt, max_tokens=33, block_size=1, stop_at_eos=False).tokens
            ds = m.generate(prompt, max_tokens=33, block_size=8, draft_self=True, stop_at_eos=False)
            assert ds.tokens == ar, seed
            assert ds.stats.coreset == 6
