"""A tiny random model for the reference's tests: its config (TINY, 4 layers, 64 tokens) and
random weights for every tensor of the one tensor list, scaled so that activations stay O(1)."""

from __future__ import annotations

import math

import numpy as np

from clover_testkit.reference import CloverConfig, hf_tensor_shapes

MASK, EOS = 63, 62

TINY = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=4, full_attention_interval=4,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, linear_conv_lookahead=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
    rope_theta=10000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, norm_topk_prob=True, rms_norm_eps=1e-6,
    block_size=4, mask_token_id=MASK, eos_token_id=EOS, tie_word_embeddings=False,
)


def make_weights(cfg: CloverConfig, seed: int = 0, fused: bool = False) -> dict[str, np.ndarray]:
    """Random weights for every tensor of the one tensor list (hf_tensor_shapes), scaled so
    that activations stay O(1)."""
    rng = np.random.default_rng(seed)
    lin = lambda o, i: rng.normal(0, 1 / math.sqrt(i), (o, i)).astype(np.float32)  # noqa: E731
    vec = lambda n, s=0.1: rng.normal(0, s, (n,)).astype(np.float32)  # noqa: E731
    w: dict[str, np.ndarray] = {}
    for name, shape in hf_tensor_shapes(cfg, tied=False, fused_experts=True).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w[name] = np.stack([lin(shape[1], shape[2]) for _ in range(shape[0])])
        elif name == "model.embed_tokens.weight":
            w[name] = rng.normal(0, 1, shape).astype(np.float32)
        elif name == "lm_head.weight":
            w[name] = 3 * lin(*shape)
        elif "conv1d" in name:
            w[name] = rng.normal(0, 0.5, shape).astype(np.float32)
        elif name.endswith(("dt_bias", "A_log")):
            w[name] = vec(shape[0], 0.5)
        elif name.endswith("block_calib"):
            w[name] = np.stack([1 + vec(shape[1], 0.3), vec(shape[1], 0.5)]).astype(np.float32)
        elif name.endswith("linear_attn.norm.weight"):
            w[name] = 1 + vec(shape[0])
        elif len(shape) == 1:
            w[name] = vec(shape[0])
        else:
            w[name] = lin(*shape)
    if not fused:  # the same values, one tensor per expert
        I = cfg.moe_intermediate_size
        for i in range(cfg.num_hidden_layers):
            m = f"model.layers.{i}.mlp.experts."
            gate_up, down = w.pop(m + "gate_up_proj"), w.pop(m + "down_proj")
            for e in range(cfg.num_experts):
                w[m + f"{e}.gate_proj.weight"] = gate_up[e, :I]
                w[m + f"{e}.up_proj.weight"] = gate_up[e, I:]
                w[m + f"{e}.down_proj.weight"] = down[e]
    return w
