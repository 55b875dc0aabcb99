"""The presets of the synthetic Clover checkpoints (test fixtures, benchmarks): their configs,
their tensor tables (the converter's), their fixture tokenizers and the deterministic weights;
:mod:`clover_testkit.checkpoints` writes them (and :mod:`clover_testkit.true_dims` the 35B-A3B
slice).

Weights are random but deterministic: each tensor is drawn from
``np.random.default_rng([seed, crc32(name)])``, so the numbers do not depend on sharding, dtype
or the fused expert layout (the fused tensors stack the per-expert draws).

Scales keep activations O(1): Linear weights ~ N(0, 1/fan_in); (1+w) norm weights
~ N(0, 0.1); the plain GDN output norm ~ 1 + N(0, 0.1); conv taps ~ N(0, 0.3);
``A_log = log(U[1, 16])`` and ``dt_bias = softplus^-1(dt)``, dt log-uniform in
[1e-3, 1e-1] (Mamba's init); ``block_calib`` theta = ln(sqrt(dk)) + N(0, 0.1) (so the
in-block softmax temperature tau is about sqrt(dk) on unit-normed q, k) and
phi ~ N(0, 0.1); embeddings ~ N(0, 1) and lm_head ~ N(0, 4/H) (logits of std ~2); when
tied, the embedding takes the lm_head scale.

The tokenizer is a byte-level BPE (``clover_testkit.bpe``: Hugging Face ``tokenizers``' trainer)
trained deterministically on the fixed text embedded below, with specials ``<|endoftext|>``
(eos, pad), ``<|im_start|>``, ``<|im_end|>``, ``<|mask|>`` right after the BPE tokens. ``config.vocab_size`` rounds
the tokenizer size up (64 for tiny, 256 for small), as Qwen pads its embedding.
"""

from __future__ import annotations

import copy
import json
import math
import os
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from clover_convert.mapping import CONFIG_SEMANTICS, SEMANTICS

from . import bpe

__all__ = [
    "PRESETS",
    "HF_IDENTITY",
    "RELEASE_IDENTITY",
    "FIXTURE_TEXT",
    "preset_config",
    "tensor_plan",
    "count_params",
    "layer_types_of",
    "train_fixture_tokenizer",
    "preset_tokenizer",
    "weight_rng",
    "init_weight",
    "split_shards",
    "write_json",
]

# ---------------------------------------------------------------------------
# the fixed training text for the fixture tokenizers (never read from disk)

FIXTURE_TEXT = r'''
import os
import sys
from typing import Dict, List, Optional


class Block:
    """A block of tokens that is denoised in parallel and then committed."""

    def __init__(self, start: int, size: int, mask_id: int) -> None:
        self.start = start
        self.size = size
        self.tokens = [mask_id] * size
        self.fixed = [False] * size

    def masked(self) -> List[int]:
        return [i for i, t in enumerate(self.tokens) if not self.fixed[i]]

    def unmask(self, position: int, token: int) -> None:
        if self.fixed[position]:
            raise ValueError(f"position {position} is already fixed")
        self.tokens[position] = token
        self.fixed[position] = True

    def done(self) -> bool:
        return all(self.fixed)


def softmax(values: List[float]) -> List[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def argmax(values: List[float]) -> int:
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def read_config(path: str) -> Dict[str, object]:
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def count_words(text: str) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for word in text.split():
        word = word.strip(".,;:!?").lower()
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return counts


def fibonacci(n: int) -> List[int]:
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


def binary_search(items: List[int], target: int) -> Optional[int]:
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return None


if __name__ == "__main__":
    for line in sys.stdin:
        print(count_words(line))
    print(fibonacci(10))
    print(binary_search([1, 3, 5, 7, 9, 11], 7))

The model does not write one token at a time. It fills a block of masked positions in
parallel, keeps the tokens it is confident about, and repeats until the block is done.
Then the block is committed to memory and the next block begins. A recurrent state
holds the history, and attention inside the block lets the tokens of the block look at
each other in both directions. When the block size is one, this is the same as ordinary
autoregressive decoding, which makes a natural baseline for the speed of the model.

The quick brown fox jumps over the lazy dog. The lazy dog does not jump; it sleeps in
the sun all afternoon, and the fox runs back into the forest before the farmer comes
home. In the evening the farmer counts the chickens, finds that none are missing, and
goes to bed happy. This is a short story about patience, luck and a very lazy dog.

Write a function that returns the sum of the squares of the numbers in a list. Then
write a test for it: the sum of the squares of 1, 2 and 3 is 14, and the sum for an
empty list is 0. Explain what the function does when the list contains negative
numbers, and why the result is never negative.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: And how many people live there?
Assistant: About two million people live in the city itself, and more than ten million
in the whole metropolitan area.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828 1e-6 0x1F.
Symbols: + - * / = == != <= >= ( ) [ ] { } < > : ; , . ' " # @ % & | ^ ~ ` $ \ _
Accents: café, naïve, résumé, über, señor, façade, jalapeño, coöperate.
'''

# ---------------------------------------------------------------------------
# presets

# what every Clover config.json says about itself (shared with train/export.py)
HF_IDENTITY: dict[str, Any] = {
    "model_type": "clover",
    "architectures": ["CloverForBlockDiffusion"],
    CONFIG_SEMANTICS: SEMANTICS,  # the semantics the weights are for (spec/model.md); without it they are refused
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}

_COMMON: dict[str, Any] = {
    **HF_IDENTITY,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "bos_token_id": None,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_COMMON,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_conv_lookahead": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "block_size": 8,
        "max_position_embeddings": 4096,
    },
    "small": {
        **_COMMON,
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "linear_conv_lookahead": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "block_size": 32,
        "max_position_embeddings": 32768,
    },
    "35b-a3b": {
        **_COMMON,
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "linear_conv_lookahead": 3,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "block_size": 32,
        "max_position_embeddings": 262144,
        # token ids come from the real tokenizer, which this preset does not have
        "mask_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    },
}

# The released checkpoint's layout (docs/release-checkpoint.md): identity CloverMoeModelLM /
# clover_moe, Qwen3.5-MoE config keys (rope_parameters nested, layer_types, num_shared_experts, no
# clover_semantics, no linear_conv_lookahead: the right conv has K - 1 taps), fused experts, and per
# GDN layer conv_right_weight [C, K-1] plus bd_softmax_logit_scale / history_bias / history_c (here
# [Hv]) instead of our in_proj_m, conv1d_lookahead and block_calib. mask_token_id and block_size
# are our keys (the release's are not public). The shape of tiny.
RELEASE_IDENTITY: dict[str, Any] = {
    "model_type": "clover_moe",
    "architectures": ["CloverMoeModelLM"],
    "auto_map": {"AutoConfig": "configuration_clover.CloverMoeConfig",
                 "AutoModelForCausalLM": "modeling_clover.CloverMoeModelLM"},
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}
PRESETS["release-tiny"] = {
    **RELEASE_IDENTITY,
    **{k: v for k, v in PRESETS["tiny"].items() if k not in (*HF_IDENTITY, "linear_conv_lookahead",
                                                             "rope_theta", "partial_rotary_factor")},
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "num_shared_experts": 1,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}
# the 35B-A3B widths and vocabulary, 4 layers (3 GDN + 1 attention): clover_testkit.true_dims writes it
PRESETS["35b-a3b-slice"] = {**PRESETS["35b-a3b"], "num_hidden_layers": 4}

# BPE vocabulary target (bytes + merges + specials) and config vocab rounding, per preset
# (small also merges pairs seen once, to get a larger vocabulary out of the same text)
_TOKENIZER_SIZE = {"tiny": 256 + 300 + len(bpe.SPECIAL_TOKENS), "small": 256 + 1000 + len(bpe.SPECIAL_TOKENS)}
_MIN_FREQUENCY = {"tiny": 2, "small": 1}
_VOCAB_ROUND = {"tiny": 64, "small": 256}
_TOKENIZER_OF = {"release-tiny": "tiny"}  # presets that share another's fixture tokenizer


@lru_cache(maxsize=None)
def _trained(preset: str) -> str:
    return bpe.train([FIXTURE_TEXT], _TOKENIZER_SIZE[preset], _MIN_FREQUENCY[preset]).to_str()


def preset_tokenizer(preset: str) -> Tokenizer:
    """The fixture tokenizer a preset is written with (release-tiny shares tiny's)."""
    return train_fixture_tokenizer(_TOKENIZER_OF.get(preset, preset))


def train_fixture_tokenizer(preset: str = "tiny") -> Tokenizer:
    """A preset's tokenizer, trained on FIXTURE_TEXT (trained once, a new object each call)."""
    if preset not in _TOKENIZER_SIZE:
        raise ValueError(f"preset {preset!r} has no fixture tokenizer (have {sorted(_TOKENIZER_SIZE)})")
    return Tokenizer.from_str(_trained(preset))


def layer_types_of(num_layers: int, interval: int) -> list[str]:
    return [
        "full_attention" if interval > 0 and (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _validate(cfg: dict[str, Any]) -> None:
    """The project's one config validator (the converter's); token ids may come later."""
    from clover_convert.mapping import parse_config

    parse_config({**cfg, "mask_token_id": cfg.get("mask_token_id") or 0})


def preset_config(preset: str, config_overrides: dict[str, Any] | None = None, dtype: str = "f32") -> dict[str, Any]:
    """The config.json dict of a preset (token ids from its fixture tokenizer)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"dtype must be f32 or bf16, not {dtype!r}")
    cfg = copy.deepcopy(PRESETS[preset])
    tok_preset = _TOKENIZER_OF.get(preset, preset)
    if tok_preset in _TOKENIZER_SIZE:
        tok = train_fixture_tokenizer(tok_preset)
        cfg["vocab_size"] = _round_up(tok.get_vocab_size(), _VOCAB_ROUND[tok_preset])
        cfg["eos_token_id"] = tok.token_to_id(bpe.EOS_TOKEN)
        cfg["pad_token_id"] = tok.token_to_id(bpe.EOS_TOKEN)
        cfg["mask_token_id"] = tok.token_to_id(bpe.MASK_TOKEN)
    cfg["torch_dtype"] = "float32" if dtype == "f32" else "bfloat16"
    overrides = dict(config_overrides or {})
    cfg.update(overrides)
    if "layer_types" not in overrides:
        cfg["layer_types"] = layer_types_of(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    _validate(cfg)
    return cfg


# ---------------------------------------------------------------------------
# tensors


def tensor_plan(config: dict[str, Any], fused_experts: bool = False, tied: bool | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Every HF tensor name and shape of a Clover checkpoint, in file order (the converter's
    table: clover_convert.mapping.hf_tensor_shapes). ``tied=None`` takes
    ``config["tie_word_embeddings"]``."""
    from clover_convert.mapping import hf_tensor_shapes, parse_config

    if tied is None:
        tied = bool(config.get("tie_word_embeddings", False))
    # (the tensors do not depend on the token ids, which a preset gets from its tokenizer later)
    cfg = {**config, "tie_word_embeddings": bool(tied), "mask_token_id": config.get("mask_token_id") or 0}
    if "layer_types" not in cfg:
        cfg["layer_types"] = layer_types_of(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    return list(hf_tensor_shapes(parse_config(cfg), fused_experts).items())


def count_params(config: dict[str, Any], tied: bool | None = None) -> int:
    return sum(math.prod(s) for _, s in tensor_plan(config, tied=tied))


def weight_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def init_weight(name: str, shape: tuple[int, ...], cfg: dict[str, Any], seed: int, tied: bool) -> np.ndarray:
    """Deterministic f32 values of one (unfused) tensor."""
    rng = weight_rng(seed, name)
    H = cfg["hidden_size"]
    leaf = name.rsplit(".", 2)
    short = name.split("linear_attn.")[-1] if "linear_attn." in name else name

    def normal(std: float, mean: float = 0.0) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(std)
        if mean:
            x += np.float32(mean)
        return x

    if name == "model.embed_tokens.weight":
        return normal(2.0 / math.sqrt(H) if tied else 1.0)
    if name == "lm_head.weight":
        return normal(2.0 / math.sqrt(H))
    if "linear_attn." in name:
        if short in ("conv1d.weight", "conv1d_lookahead.weight", "conv_right_weight"):
            return normal(0.3)
        if short == "A_log":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if short == "dt_bias":
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        if short == "block_calib":
            dk = cfg["linear_key_head_dim"]
            out = np.empty(shape, dtype=np.float32)
            out[0] = math.log(math.sqrt(dk)) + 0.1 * rng.standard_normal(shape[1])
            out[1] = 0.1 * rng.standard_normal(shape[1])
            return out
        if short == "norm.weight":
            return normal(0.1, 1.0)
    if len(shape) == 1 or leaf[-2].endswith("norm"):
        return normal(0.1)  # (1 + w) norms
    # Linear weights [out, in]
    return normal(1.0 / math.sqrt(shape[-1]))


def split_shards(plan: list[tuple[str, tuple[int, ...]]], itemsize: int, shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Contiguous groups of roughly equal byte size, none empty."""
    if shards > len(plan):
        raise ValueError(f"cannot split {len(plan)} tensors into {shards} shards")
    sizes = [math.prod(s) * itemsize for _, s in plan]
    total = sum(sizes)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shards)]
    acc = 0
    g = 0
    for idx, (item, size) in enumerate(zip(plan, sizes)):
        remaining_items = len(plan) - idx
        remaining_groups = shards - g
        # move on when this group is full, or when every later group needs one item
        if groups[g] and g < shards - 1 and (acc >= total * (g + 1) / shards or remaining_items < remaining_groups):
            g += 1
        groups[g].append(item)
        acc += size
    assert all(groups), "empty shard"
    return groups


def write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
