"""clover_testkit.routing_ties: the MoE routing tie behind llvmpipe's (and once RPC's) fork from
the CPU build at token 28 (tiny preset, prompt seed 7, B = 8), and the comparison that accepts
a fork only where the float64 reference shows such a tie."""
from __future__ import annotations

import numpy as np
import pytest

from clover_testkit.routing_ties import assert_same_tokens_up_to_a_tie, routing_margin

B = 8
# llvmpipe's greedy output (every layer on the device) and its canvases in the block at 45
VULKAN = [175, 513, 469, 69, 425, 93, 69, 425, 78, 419, 391, 572, 314, 101, 69, 387, 486, 206, 418, 475,
          550, 341, 475, 373, 308, 401, 160, 341, 457, 420, 332, 418, 172, 452, 341, 245, 172, 144, 418, 198]


@pytest.fixture(scope="module")
def case(tiny_artifacts):
    from clover_testkit.reference import CloverReference, generate

    cfg = tiny_artifacts["cfg"]
    ref = CloverReference.from_pretrained(tiny_artifacts["ckpt"])
    prompt = np.random.default_rng(7).integers(0, min(cfg["eos_token_id"], cfg["mask_token_id"]), 21).tolist()
    steps = []
    want = generate(ref, prompt, max_tokens=40, block_size=B, threshold=0.9, stop_at_eos=False,
                    step_callback=lambda at, c, _n: steps.append((at, c)) and False).tokens
    return ref, prompt, list(want), steps, cfg["mask_token_id"]


def test_the_pass_before_token_28_holds_a_router_tie(case) -> None:
    ref, prompt, want, _, M = case
    assert want[:28] == VULKAN[:28] and want[28] == 1   # the CPU build's output (tests/native/test_rpc.py: local)
    mem = ref.new_memory()
    ref.commit(mem, prompt + want[:24])
    assert routing_margin(ref, mem, [308, 401, 160, 341, M, M, M, 418], B) < 1e-6
    assert routing_margin(ref, mem, [308, 401, 160, 341, M, M, 101, 418], B) > 1e-3


def test_a_fork_at_a_tie_is_accepted(case) -> None:
    ref, prompt, want, _, M = case
    canvases = [[308, M, M, M, M, M, M, M], [308, M, M, 341, M, M, M, M], [308, M, M, 341, M, M, M, 418],
                [308, M, 160, 341, M, M, M, 418], [308, 401, 160, 341, M, M, M, 418],
                [308, 401, 160, 341, M, 420, M, 418], [308, 401, 160, 341, 457, 420, M, 418],
                [308, 401, 160, 341, 457, 420, 332, 418]]
    assert_same_tokens_up_to_a_tie(ref, prompt, VULKAN, want, [(45, c) for c in canvases], B, M)
    assert_same_tokens_up_to_a_tie(ref, prompt, want, want, [], B, M)


def test_a_fork_without_a_tie_is_refused(case) -> None:
    ref, prompt, want, steps, M = case
    forked = list(want)
    forked[18] = 3   # in the block at 37: its passes and the commits before it are far from a tie
    with pytest.raises(AssertionError, match="no router tie"):
        assert_same_tokens_up_to_a_tie(ref, prompt, forked, want, steps, B, M)
