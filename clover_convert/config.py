"""config.json -> :class:`CloverConfig` (validated, one-line errors) and the GGUF keys of our own.

The first half of the Clover HF -> GGUF mapping (``spec/gguf-layout.md``): the hyperparameters
and what the GGUF says about the weights (semantics, block operator). The tensor table, the
other half, is :mod:`clover_convert.mapping`, which re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from clover_gguf.errors import UserFacingError
from clover_gguf.keys import (  # re-exported: the GGUF names of our own (one owner)
    ARCH,
    BLOCK_OPERATOR_CLOVER,
    BLOCK_OPERATOR_RELEASE,
    BLOCK_OPERATORS,
    KEY_BLOCK_OPERATOR,
    KEY_CANVAS_FFN_LENGTH,
    KEY_CONV_LOOKAHEAD,
    KEY_DIFFUSION_BLOCK_SIZE,
    KEY_RECURRENT_LAYERS,
    KEY_SEMANTICS,
    SEMANTICS,
)

__all__ = [
    "ConversionError",
    "CloverConfig",
    "parse_config",
    "ARCH",
    "KEY_RECURRENT_LAYERS",
    "KEY_CONV_LOOKAHEAD",
    "KEY_DIFFUSION_BLOCK_SIZE",
    "KEY_SEMANTICS",
    "CONFIG_SEMANTICS",
    "SEMANTICS",
    "KEY_BLOCK_OPERATOR",
    "KEY_CANVAS_FFN_LENGTH",
    "BLOCK_OPERATOR_CLOVER",
    "BLOCK_OPERATOR_RELEASE",
    "BLOCK_OPERATORS",
    "RELEASE_MODEL_TYPE",
    "RELEASE_ARCHITECTURE",
    "LAYER_TYPES",
]


class ConversionError(UserFacingError, ValueError):
    """A user-facing conversion error; the message is one line."""

    def __init__(self, msg: str):
        super().__init__(" ".join(str(msg).split()))


# ---------------------------------------------------------------------------
# config.json's identity keys (the GGUF's own keys are clover_gguf.keys', re-exported here)

# config.json's key saying which semantics the weights were trained for (gguf_keys.SEMANTICS,
# written as KEY_SEMANTICS); weights of the retired in-place semantics (spec v1) have no such key
CONFIG_SEMANTICS = "clover_semantics"
# the release's identity in config.json (its trunk config keys are Qwen3.5-MoE's, which we read)
RELEASE_MODEL_TYPE = "clover_moe"
RELEASE_ARCHITECTURE = "CloverMoeModelLM"


# ---------------------------------------------------------------------------
# config


LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class CloverConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    full_attention_interval: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    linear_conv_lookahead: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    block_size: int
    mask_token_id: int | None  # None: the release's config without one (causal only)
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    eos_token_ids: tuple[int, ...] = ()  # every EOS id (config.json may give a list); eos_token_id is the first
    clover_semantics: str = SEMANTICS     # CONFIG_SEMANTICS: what the weights were trained for
    num_shared_experts: int = 1           # the release's key (expert_shared_count); only 1 runs
    block_operator: str = BLOCK_OPERATOR_CLOVER  # KEY_BLOCK_OPERATOR: decided by the tensors (detect_block_operator)
    canvas_ffn_intermediate_size: int = 0  # KEY_CANVAS_FFN_LENGTH: the canvas FFN's width (spec/model.md); 0 = none

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "CloverConfig":
        """config.json (a dict) validated by :func:`parse_config`: the project's one way in."""
        return parse_config(cfg)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a config.json dict that from_dict reads back (every EOS id kept)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("raw", "eos_token_ids", "block_operator", "num_shared_experts")}
        d["layer_types"] = list(self.layer_types)
        if not self.canvas_ffn_intermediate_size:  # absent = none: configs without it read back the same
            d.pop("canvas_ffn_intermediate_size")
        if len(self.eos_token_ids) > 1:
            d["eos_token_id"] = list(self.eos_token_ids)
        return d

    # short names used by the table
    @property
    def H(self) -> int:
        return self.hidden_size

    @property
    def V(self) -> int:
        return self.vocab_size

    @property
    def L(self) -> int:
        return self.num_hidden_layers

    @property
    def Hk(self) -> int:
        return self.linear_num_key_heads

    @property
    def Hv(self) -> int:
        return self.linear_num_value_heads

    @property
    def dk(self) -> int:
        return self.linear_key_head_dim

    @property
    def dv(self) -> int:
        return self.linear_value_head_dim

    @property
    def r(self) -> int:
        return self.Hv // self.Hk

    @property
    def C(self) -> int:
        return 2 * self.Hk * self.dk + self.Hv * self.dv

    @property
    def K(self) -> int:
        return self.linear_conv_kernel_dim

    @property
    def R(self) -> int:
        return self.linear_conv_lookahead

    @property
    def E(self) -> int:
        return self.num_experts

    @property
    def I(self) -> int:  # noqa: E743
        return self.moe_intermediate_size

    @property
    def Is(self) -> int:
        return self.shared_expert_intermediate_size

    @property
    def Ic(self) -> int:
        return self.canvas_ffn_intermediate_size

    @property
    def nh(self) -> int:
        return self.num_attention_heads

    @property
    def nkv(self) -> int:
        return self.num_key_value_heads

    @property
    def dh(self) -> int:
        return self.head_dim

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    rotary_dim = rope_dims
    conv_dim = C

    def is_recurrent(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"


def _err(key: str, what: str, value: Any = None, *, show: bool = True) -> ConversionError:
    if show:
        return ConversionError(f"config.json: {key} {what}, got {value!r}")
    return ConversionError(f"config.json: {key} {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


MAX_INT = 2**31 - 1  # GGUF stores sizes as u32 and llama.cpp reads them into int32
MAX_F32 = 3.4e38


_RETRAIN = "retrain or re-export them with train/ of this version (python -m train.export --run RUN --out FOLDER)"


def _is_release(cfg: dict[str, Any]) -> bool:
    """config.json names the release's identity: model_type clover_moe, or (without a model_type)
    architectures CloverMoeModelLM."""
    mt, archs = cfg.get("model_type"), cfg.get("architectures")
    return mt == RELEASE_MODEL_TYPE or (mt is None and isinstance(archs, list) and RELEASE_ARCHITECTURE in archs)


def _check_semantics(cfg: dict[str, Any], model_type: Any) -> str:
    """config.json's CONFIG_SEMANTICS must be SEMANTICS. A ``model_type: "clover"`` config (a real
    config.json) must say so; a dict without model_type (a preset, a test's config) gets SEMANTICS.
    The release (clover_moe) has no such key: it is causal with the next-token shift (its GGUFs
    run causally in llama.cpp, perplexity included), which is SEMANTICS, so it gets SEMANTICS
    (and a key it does carry must say so)."""
    if CONFIG_SEMANTICS not in cfg:
        if model_type is None or _is_release(cfg):
            return SEMANTICS
        raise ConversionError(
            f'config.json has no "{CONFIG_SEMANTICS}": "{SEMANTICS}": these weights were trained for the '
            f"retired in-place semantics (spec v1); {_RETRAIN}"
        )
    v = cfg[CONFIG_SEMANTICS]
    if v != SEMANTICS:
        raise ConversionError(
            f'config.json: {CONFIG_SEMANTICS} must be "{SEMANTICS}" (spec v2), got {v!r}: these weights were '
            f"not trained for the semantics this version runs; {_RETRAIN}"
        )
    return SEMANTICS


def parse_config(cfg: dict[str, Any]) -> CloverConfig:
    """Validate config.json (a dict) and return a :class:`CloverConfig`.

    Raises ConversionError with a one-line message naming the offending key.
    """
    if not isinstance(cfg, dict):
        raise ConversionError("config.json: not a JSON object")
    mt = cfg.get("model_type")
    if mt is not None and mt not in ("clover", RELEASE_MODEL_TYPE):
        raise _err("model_type", f"must be 'clover' (or the release's '{RELEASE_MODEL_TYPE}')", mt)
    release = _is_release(cfg)
    if release and isinstance(cfg.get("text_config"), dict):
        # a Qwen3.5-MoE style config nests the trunk's keys; the outer ones (identity) win
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k != "text_config"}}
    semantics = _check_semantics(cfg, mt)

    def req_int(key: str, minimum: int = 1) -> int:
        if key not in cfg or cfg[key] is None:
            raise _err(key, "is missing", show=False)
        v = cfg[key]
        if not _is_int(v) or v < minimum or v > MAX_INT:
            what = "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}"
            raise _err(key, what if not _is_int(v) or v <= MAX_INT else f"must be at most {MAX_INT}", v)
        return v

    def opt_int(key: str, default: int | None, minimum: int = 1) -> int | None:
        v = cfg.get(key, default)
        if v is None:
            return None
        if not _is_int(v) or v < minimum or v > MAX_INT:
            what = "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}"
            raise _err(key, what if not _is_int(v) or v <= MAX_INT else f"must be at most {MAX_INT}", v)
        return v

    def opt_pos_float(key: str, default: float, src: dict[str, Any] | None = None) -> float:
        d = cfg if src is None else src
        v = d.get(key, default)
        if not _is_num(v) or v <= 0:
            raise _err(key, "must be a positive number", v)
        if v > MAX_F32:
            raise _err(key, f"must be at most {MAX_F32:g} (a 32-bit float)", v)
        return float(v)

    def opt_bool(key: str, default: bool) -> bool:
        v = cfg.get(key, default)
        if not isinstance(v, bool):
            raise _err(key, "must be true or false", v)
        return v

    V = req_int("vocab_size")
    H = req_int("hidden_size")
    L = req_int("num_hidden_layers")
    Hk = req_int("linear_num_key_heads")
    Hv = req_int("linear_num_value_heads")
    dk = req_int("linear_key_head_dim")
    dv = req_int("linear_value_head_dim")
    K = req_int("linear_conv_kernel_dim")
    # the release's right conv (conv_right_weight) has K - 1 taps and no config key
    R = opt_int("linear_conv_lookahead", K - 1 if release else 0, minimum=0)
    nh = req_int("num_attention_heads")
    nkv = req_int("num_key_value_heads")
    dh = req_int("head_dim")
    E = req_int("num_experts")
    k = req_int("num_experts_per_tok")
    I = req_int("moe_intermediate_size")  # noqa: E741
    Is = req_int("shared_expert_intermediate_size")
    # the release publishes no mask token: without one the file runs causally only (B = 1; draft-self
    # and block passes need it, the converter warns); our layout always names one
    mask = None if release and cfg.get("mask_token_id") is None else req_int("mask_token_id", minimum=0)
    fai = opt_int("full_attention_interval", 4)
    B0 = opt_int("block_size", 32)
    ctx = opt_int("max_position_embeddings", 262144)
    n_shared = opt_int("num_shared_experts", 1, minimum=0)
    canvas_ffn = opt_int("canvas_ffn_intermediate_size", 0, minimum=0)
    if release and canvas_ffn:
        raise _err("canvas_ffn_intermediate_size", "must be 0 for the release's layout (it has no canvas FFN)", canvas_ffn)
    if n_shared != 1:
        raise _err("num_shared_experts", "must be 1 (the graph has one gated shared expert)", n_shared)

    if Hv % Hk != 0:
        raise _err("linear_num_value_heads", f"must be a multiple of linear_num_key_heads ({Hk})", Hv)
    if dk != dv:
        raise _err("linear_value_head_dim", f"must equal linear_key_head_dim ({dk})", dv)
    if nh % nkv != 0:
        raise _err("num_attention_heads", f"must be a multiple of num_key_value_heads ({nkv})", nh)
    if k > E:
        raise _err("num_experts_per_tok", f"must be <= num_experts ({E})", k)
    if mask is not None and mask >= V:
        raise _err("mask_token_id", f"must be < vocab_size ({V})", mask)

    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    if "rope_theta" in cfg or rope_params is None or "rope_theta" not in rope_params:
        theta = opt_pos_float("rope_theta", 1e7)
    else:
        theta = opt_pos_float("rope_theta", 1e7, rope_params)
    if "partial_rotary_factor" not in cfg and rope_params is not None and "partial_rotary_factor" in rope_params:
        prf = rope_params["partial_rotary_factor"]
    else:
        prf = cfg.get("partial_rotary_factor", 0.25)
    if not _is_num(prf) or not (0 < prf <= 1):
        raise _err("partial_rotary_factor", "must be a number in (0, 1]", prf)
    if int(dh * prf) < 2 or int(dh * prf) % 2:
        raise _err("partial_rotary_factor", f"must give an even number >= 2 of rotary dims of head_dim {dh}", prf)
    eps = opt_pos_float("rms_norm_eps", 1e-6)
    if eps >= 1:
        raise _err("rms_norm_eps", "must be below 1", eps)
    norm_topk = opt_bool("norm_topk_prob", True)
    tied = opt_bool("tie_word_embeddings", False)

    lt = cfg.get("layer_types")
    if lt is None:
        layer_types = ["full_attention" if (i + 1) % fai == 0 else "linear_attention" for i in range(L)]
    else:
        if not isinstance(lt, list):
            raise _err("layer_types", "must be a list", lt)
        if len(lt) != L:
            raise _err("layer_types", f"must have num_hidden_layers ({L}) entries", len(lt))
        for i, t in enumerate(lt):
            if t not in LAYER_TYPES:
                raise ConversionError(
                    f"config.json: layer_types[{i}] is {t!r}, expected 'linear_attention' or 'full_attention'"
                )
        layer_types = list(lt)

    def token_ids(key: str) -> tuple[int, ...]:
        v = cfg.get(key)
        ids = tuple(v) if isinstance(v, (list, tuple)) else (() if v is None else (v,))
        if any(not _is_int(t) or t < 0 or t >= V for t in ids):
            raise _err(key, f"must be a token id in [0, {V})", v)
        return ids

    def token_id(key: str) -> int | None:
        ids = token_ids(key)
        return ids[0] if ids else None

    return CloverConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=L, layer_types=layer_types,
        full_attention_interval=fai, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=K,
        linear_conv_lookahead=R, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=dh,
        partial_rotary_factor=float(prf), rope_theta=theta, num_experts=E, num_experts_per_tok=k,
        moe_intermediate_size=I, shared_expert_intermediate_size=Is, norm_topk_prob=norm_topk,
        rms_norm_eps=eps, block_size=B0, mask_token_id=mask, eos_token_id=token_id("eos_token_id"),
        bos_token_id=token_id("bos_token_id"), pad_token_id=token_id("pad_token_id"),
        tie_word_embeddings=tied, max_position_embeddings=ctx, raw=cfg, eos_token_ids=token_ids("eos_token_id"),
        clover_semantics=semantics, num_shared_experts=n_shared, canvas_ffn_intermediate_size=canvas_ffn,
        block_operator=BLOCK_OPERATOR_RELEASE if release else BLOCK_OPERATOR_CLOVER,
    )
