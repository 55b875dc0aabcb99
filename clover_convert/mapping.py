"""The Clover HF -> GGUF mapping: THE tensor table (and, re-exported from
:mod:`clover_convert.config`, the config validation and our GGUF keys).

The two modules are the single source of truth in code for ``spec/gguf-layout.md``. Another
published checkpoint layout should be a change of ``TENSOR_TABLE`` (and perhaps a
transform), not of the converter.

Table rows
----------
Each :class:`Rule` maps one HF tensor name pattern to one GGUF name and says

* ``scope``   -- which layers have it: ``global``, ``layer`` (every layer), ``gdn``
  (GatedDeltaNet / ``linear_attention`` layers), ``attn`` (``full_attention`` layers),
  ``moe`` (every layer), ``experts`` (every layer, stacked over experts), ``canvas`` (every layer
  when the config has a canvas FFN, ``canvas_ffn_intermediate_size`` > 0);
* ``shape``   -- the HF shape expected from the config (a function of :class:`CloverConfig`);
* ``out``     -- the GGUF shape when it differs (squeezes), else the HF shape;
* ``fn``      -- an element-wise transform, applied in float32:
    - ``plus1``   ``w + 1``: the RMSNorm1p norms (``x/rms * (1 + w)``) are stored as
      plain-multiplier weights, so the loader uses an ordinary RMSNorm;
    - ``neg_exp`` ``-exp(A_log)``: ``ssm_a`` is the decay rate A itself (negative);
* ``perm``    -- a value-head permutation (the "(V)" rows of spec/gguf-layout.md): HF stores value
  heads grouped by key head (head j uses key head j // r); ggml broadcasts key heads
  tiled (position p uses key head p % Hk). New head position p holds original head
  ``(p % Hk) * r + p // Hk`` (:func:`v_head_order`). Kinds:
    - ``rows_qkv`` rows of the fused q/k/v (and conv channel) dimension: the q and k
      channels (the first ``2*Hk*dk``) stay, the v channels move in units of dv;
    - ``rows_dv``  rows in units of dv (``attn_gate``);
    - ``rows_1``   rows in units of 1 (``ssm_beta/alpha/mix``);
    - ``cols_dv``  the last dimension in units of dv (``ssm_out``);
    - ``cols_1``   the last dimension in units of 1 (``ssm_dt``, ``ssm_a``, the columns
      of ``ssm_block_calib``);
  Permutations (and squeezes) move values without changing them, so a bf16 source
  copied to bf16 keeps its exact bits.
* ``f32``     -- the tensor stays float32 whatever ``--outtype`` (routers, norms, conv
  taps, the small per-head SSM vectors); every 1-D tensor stays f32 too.

* ``layout``  -- ``None`` (every checkpoint) or the block operator whose checkpoints have the row
  (``cfg.block_operator``: ours, ``clover-mix-calib``, or the release's, ``release-bd-softmax``);
  ``marker`` rows say which one a checkpoint has (:func:`detect_block_operator`);
* ``alt_shape`` -- a second HF shape accepted (the release's ``conv_right_weight`` as [C, R] or
  [C, 1, R]); ``any_shape`` -- the shape is not public: kept as the checkpoint has it (the
  release's ``bd_softmax_*``; ``shape`` is then only what the fixtures write).

Squeezes: ``conv1d.weight`` [C,1,K] -> [C,K], ``conv1d_lookahead.weight`` [C,1,R] -> [C,R],
``shared_expert_gate.weight`` [1,H] -> [H].

Experts (``scope == "experts"``): the GGUF tensor is ``[E, ...]`` stacked over experts
j, built from per-expert tensors (``hf`` with ``{j}``) or, when the layer has the fused
form, from a slice of the fused tensor (``fused`` = (name, which) where which is
``"first"``/``"second"`` half of dim 1, or ``"all"``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np

from . import config as _config
from .config import *  # noqa: F401,F403 - the config half of the mapping, re-exported (one import for both)
from .config import BLOCK_OPERATOR_CLOVER, BLOCK_OPERATOR_RELEASE, CloverConfig, ConversionError  # used here

__all__ = ["Rule", "TENSOR_TABLE", "hf_tensor_shapes", "keeps_f32", "F32_ONLY", "v_head_order", "perm_index",
           "apply_fn", "detect_block_operator", *_config.__all__]


# ---------------------------------------------------------------------------
# the table

Shape = Callable[[CloverConfig], tuple[int, ...]]


@dataclass(frozen=True)
class Rule:
    hf: str                      # HF name; {i} layer, {j} expert
    gguf: str                    # GGUF name; {i} layer
    scope: str                   # global | layer | gdn | attn | moe | experts
    shape: Shape                 # expected HF shape (per expert for "experts")
    out: Shape | None = None     # GGUF shape when different (squeeze); stacked: [E, *out]
    fn: str | None = None        # None | "plus1" | "neg_exp"
    perm: str | None = None      # None | rows_qkv | rows_dv | rows_1 | cols_dv | cols_1
    f32: bool = False            # always stored as F32
    fused: tuple[str, str] | None = None  # experts: (fused HF name, "first"|"second"|"all")
    fused_shape: Shape | None = None      # experts: shape of the fused HF tensor
    optional: bool = False       # may be absent (e.g. lm_head when tied, lookahead when R == 0)
    layout: str | None = None    # None: every checkpoint; else only where cfg.block_operator is this
    marker: bool = False         # present = the checkpoint has this block operator (detect_block_operator)
    alt_shape: Shape | None = None  # a second HF shape accepted (same values; stored as ``out``)
    any_shape: bool = False      # the shape is not public: kept as in the checkpoint (``shape`` is the fixtures')


L_ = "model.layers.{i}."
GA = L_ + "linear_attn."
SA = L_ + "self_attn."
ML = L_ + "mlp."

TENSOR_TABLE: list[Rule] = [
    # -- global
    Rule("model.embed_tokens.weight", "token_embd.weight", "global", lambda c: (c.V, c.H)),
    Rule("model.norm.weight", "output_norm.weight", "global", lambda c: (c.H,), fn="plus1", f32=True),
    Rule("lm_head.weight", "output.weight", "global", lambda c: (c.V, c.H), optional=True),  # absent when tied
    # -- every layer
    Rule(L_ + "input_layernorm.weight", "blk.{i}.attn_norm.weight", "layer", lambda c: (c.H,), fn="plus1", f32=True),
    Rule(L_ + "post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight", "layer",
         lambda c: (c.H,), fn="plus1", f32=True),
    # -- GatedDeltaNet layers
    Rule(GA + "in_proj_qkv.weight", "blk.{i}.attn_qkv.weight", "gdn", lambda c: (c.C, c.H), perm="rows_qkv"),
    Rule(GA + "in_proj_z.weight", "blk.{i}.attn_gate.weight", "gdn", lambda c: (c.Hv * c.dv, c.H), perm="rows_dv"),
    Rule(GA + "in_proj_b.weight", "blk.{i}.ssm_beta.weight", "gdn", lambda c: (c.Hv, c.H), perm="rows_1"),
    Rule(GA + "in_proj_a.weight", "blk.{i}.ssm_alpha.weight", "gdn", lambda c: (c.Hv, c.H), perm="rows_1"),
    Rule(GA + "in_proj_m.weight", "blk.{i}.ssm_mix.weight", "gdn", lambda c: (c.Hv, c.H), perm="rows_1",
         layout=BLOCK_OPERATOR_CLOVER, marker=True),
    Rule(GA + "conv1d.weight", "blk.{i}.ssm_conv1d.weight", "gdn", lambda c: (c.C, 1, c.K),
         out=lambda c: (c.C, c.K), perm="rows_qkv", f32=True),
    Rule(GA + "conv1d_lookahead.weight", "blk.{i}.ssm_conv1d_look.weight", "gdn", lambda c: (c.C, 1, c.R),
         out=lambda c: (c.C, c.R), perm="rows_qkv", f32=True, layout=BLOCK_OPERATOR_CLOVER),  # none when R == 0
    # the release's right (look-ahead) conv: R = K - 1 taps, tap j on token t+1+j, [C, K-1] or [C, 1, K-1]
    Rule(GA + "conv_right_weight", "blk.{i}.ssm_conv1d_look.weight", "gdn", lambda c: (c.C, c.R),
         out=lambda c: (c.C, c.R), perm="rows_qkv", f32=True, layout=BLOCK_OPERATOR_RELEASE,
         alt_shape=lambda c: (c.C, 1, c.R)),
    Rule(GA + "dt_bias", "blk.{i}.ssm_dt.bias", "gdn", lambda c: (c.Hv,), perm="cols_1", f32=True),
    Rule(GA + "A_log", "blk.{i}.ssm_a", "gdn", lambda c: (c.Hv,), fn="neg_exp", perm="cols_1", f32=True),
    Rule(GA + "block_calib", "blk.{i}.ssm_block_calib", "gdn", lambda c: (2, c.Hv), perm="cols_1", f32=True,
         layout=BLOCK_OPERATOR_CLOVER, marker=True),
    # the release's block softmax (math not public): kept as they are (shape and value-head order of
    # the checkpoint, F32), never run; the fixtures write [Hv]
    Rule(GA + "bd_softmax_logit_scale", "blk.{i}.ssm_bd_logit_scale", "gdn", lambda c: (c.Hv,), f32=True,
         layout=BLOCK_OPERATOR_RELEASE, marker=True, any_shape=True),
    Rule(GA + "bd_softmax_history_bias", "blk.{i}.ssm_bd_history_bias", "gdn", lambda c: (c.Hv,), f32=True,
         layout=BLOCK_OPERATOR_RELEASE, marker=True, any_shape=True),
    Rule(GA + "bd_softmax_history_c", "blk.{i}.ssm_bd_history_c", "gdn", lambda c: (c.Hv,), f32=True,
         layout=BLOCK_OPERATOR_RELEASE, marker=True, any_shape=True),
    Rule(GA + "norm.weight", "blk.{i}.ssm_norm.weight", "gdn", lambda c: (c.dv,), f32=True),  # plain, no +1
    Rule(GA + "out_proj.weight", "blk.{i}.ssm_out.weight", "gdn", lambda c: (c.H, c.Hv * c.dv), perm="cols_dv"),
    # -- full-attention layers
    Rule(SA + "q_proj.weight", "blk.{i}.attn_q.weight", "attn", lambda c: (c.nh * c.dh * 2, c.H)),
    Rule(SA + "k_proj.weight", "blk.{i}.attn_k.weight", "attn", lambda c: (c.nkv * c.dh, c.H)),
    Rule(SA + "v_proj.weight", "blk.{i}.attn_v.weight", "attn", lambda c: (c.nkv * c.dh, c.H)),
    Rule(SA + "o_proj.weight", "blk.{i}.attn_output.weight", "attn", lambda c: (c.H, c.nh * c.dh)),
    Rule(SA + "q_norm.weight", "blk.{i}.attn_q_norm.weight", "attn", lambda c: (c.dh,), fn="plus1", f32=True),
    Rule(SA + "k_norm.weight", "blk.{i}.attn_k_norm.weight", "attn", lambda c: (c.dh,), fn="plus1", f32=True),
    # -- MoE
    Rule(ML + "gate.weight", "blk.{i}.ffn_gate_inp.weight", "moe", lambda c: (c.E, c.H), f32=True),
    Rule(ML + "experts.{j}.gate_proj.weight", "blk.{i}.ffn_gate_exps.weight", "experts", lambda c: (c.I, c.H),
         fused=(ML + "experts.gate_up_proj", "first"), fused_shape=lambda c: (c.E, 2 * c.I, c.H)),
    Rule(ML + "experts.{j}.up_proj.weight", "blk.{i}.ffn_up_exps.weight", "experts", lambda c: (c.I, c.H),
         fused=(ML + "experts.gate_up_proj", "second"), fused_shape=lambda c: (c.E, 2 * c.I, c.H)),
    Rule(ML + "experts.{j}.down_proj.weight", "blk.{i}.ffn_down_exps.weight", "experts", lambda c: (c.H, c.I),
         fused=(ML + "experts.down_proj", "all"), fused_shape=lambda c: (c.E, c.H, c.I)),
    Rule(ML + "shared_expert.gate_proj.weight", "blk.{i}.ffn_gate_shexp.weight", "moe", lambda c: (c.Is, c.H)),
    Rule(ML + "shared_expert.up_proj.weight", "blk.{i}.ffn_up_shexp.weight", "moe", lambda c: (c.Is, c.H)),
    Rule(ML + "shared_expert.down_proj.weight", "blk.{i}.ffn_down_shexp.weight", "moe", lambda c: (c.H, c.Is)),
    Rule(ML + "shared_expert_gate.weight", "blk.{i}.ffn_gate_inp_shexp.weight", "moe", lambda c: (1, c.H),
         out=lambda c: (c.H,), f32=True),
    # -- the canvas FFN (spec/model.md "The canvas FFN"): block-pass rows only, never a commit
    Rule(ML + "canvas_ffn.gate_proj.weight", "blk.{i}.ffn_gate_canvas.weight", "canvas", lambda c: (c.Ic, c.H)),
    Rule(ML + "canvas_ffn.up_proj.weight", "blk.{i}.ffn_up_canvas.weight", "canvas", lambda c: (c.Ic, c.H)),
    Rule(ML + "canvas_ffn.down_proj.weight", "blk.{i}.ffn_down_canvas.weight", "canvas", lambda c: (c.H, c.Ic)),
]

# GGUF names (with {i}) that are always F32, derived from the table (for tests and docs)
F32_ONLY: frozenset[str] = frozenset(r.gguf for r in TENSOR_TABLE if r.f32)


def keeps_f32(hf_name: str) -> bool:
    """Whether the converter stores this HF tensor as F32 whatever the output type (the table's
    f32 flag: norms, conv taps, dt bias, A, block calibration, the routers)."""
    return any(p.fullmatch(hf_name) for p in _F32_HF_PATTERNS)


_F32_HF_PATTERNS = [re.compile(re.escape(r.hf).replace(r"\{i\}", r"\d+").replace(r"\{j\}", r"\d+"))
                    for r in TENSOR_TABLE if r.f32]


def rule_applies(rule: Rule, cfg: CloverConfig, i: int | None) -> bool:
    if rule.layout is not None and rule.layout != cfg.block_operator:
        return False
    if rule.scope == "global":
        if rule.gguf == "output.weight":
            return not cfg.tie_word_embeddings
        return True
    assert i is not None
    if rule.scope == "gdn":
        if not cfg.is_recurrent(i):
            return False
        if rule.gguf.endswith("ssm_conv1d_look.weight") and cfg.R == 0:
            return False
        return True
    if rule.scope == "attn":
        return not cfg.is_recurrent(i)
    if rule.scope == "canvas":
        return cfg.canvas_ffn_intermediate_size > 0
    return True  # layer, moe, experts


def hf_tensor_shapes(cfg: CloverConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of a Clover checkpoint with this config and its shape, in checkpoint order
    (embeddings, the layers, the final norm, the head). The one tensor list of the project: the
    converter, the numpy reference, the checkpoint generator and train/ all read it from here."""
    out: dict[str, tuple[int, ...]] = {}

    def add(rule: Rule, i: int | None) -> None:
        if rule.scope != "experts":
            out[rule.hf.format(i=i)] = rule.shape(cfg)
        elif not fused_experts:
            for j in range(cfg.E):
                out[rule.hf.format(i=i, j=j)] = rule.shape(cfg)
        elif rule.fused and rule.fused[1] != "second":  # gate and up share one fused tensor
            assert rule.fused_shape is not None
            out[rule.fused[0].format(i=i)] = rule.fused_shape(cfg)

    first, *last = [r for r in TENSOR_TABLE if r.scope == "global"]
    add(first, None)
    for i in range(cfg.L):
        for r in TENSOR_TABLE:
            if r.scope != "global" and rule_applies(r, cfg, i):
                add(r, i)
    for r in last:
        if rule_applies(r, cfg, None):
            add(r, None)
    return out


def detect_block_operator(cfg: CloverConfig, names: Iterable[str]) -> CloverConfig:
    """cfg with ``block_operator`` as the checkpoint's tensors say (the table's marker rows: Clover's
    in_proj_m / block_calib, the release's bd_softmax_*); the config's identity decides only when
    neither is there (then the missing tensors are reported). The release's layout has R = K - 1."""
    have = set(names)
    gdn = [i for i in range(cfg.L) if cfg.is_recurrent(i)]
    found = {r.layout for r in TENSOR_TABLE if r.marker and any(r.hf.format(i=i) in have for i in gdn)}
    if len(found) > 1:
        raise ConversionError(
            "the checkpoint has two block operators, Clover's (linear_attn.in_proj_m, linear_attn.block_calib) "
            "and the release's (linear_attn.bd_softmax_*): expected one"
        )
    op = found.pop() if found else cfg.block_operator
    R = cfg.R
    if op == BLOCK_OPERATOR_RELEASE and R != cfg.K - 1:
        if "linear_conv_lookahead" in cfg.raw:
            raise ConversionError(f"config.json: linear_conv_lookahead must be linear_conv_kernel_dim - 1 "
                                  f"({cfg.K - 1}) for the release's right conv (conv_right_weight), got {R!r}")
        R = cfg.K - 1
    return replace(cfg, block_operator=op, linear_conv_lookahead=R)


# ---------------------------------------------------------------------------
# transforms


def v_head_order(Hk: int, r: int) -> np.ndarray:
    """new value-head position p -> original head (p % Hk) * r + p // Hk."""
    p = np.arange(Hk * r)
    return (p % Hk) * r + p // Hk


def perm_index(kind: str | None, cfg: CloverConfig) -> np.ndarray | None:
    """Index array: new position -> source position along the permuted dimension."""
    if kind is None or cfg.r == 1:
        return None
    heads = v_head_order(cfg.Hk, cfg.r)
    unit = {"rows_qkv": cfg.dv, "rows_dv": cfg.dv, "cols_dv": cfg.dv, "rows_1": 1, "cols_1": 1}[kind]
    idx = (heads[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
    if kind == "rows_qkv":
        qk = 2 * cfg.Hk * cfg.dk
        idx = np.concatenate([np.arange(qk), qk + idx])
    return idx


def apply_fn(fn: str | None, x: np.ndarray) -> np.ndarray:
    """Element-wise transform of float32 data."""
    if fn is None:
        return x
    if fn == "plus1":
        return x + np.float32(1)
    if fn == "neg_exp":
        return -np.exp(x)
    raise ValueError(f"unknown transform {fn!r}")
