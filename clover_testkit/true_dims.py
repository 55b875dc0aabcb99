"""The 35B-A3B shape, sliced: every real width, 4 layers, the real vocabulary.

Preset ``35b-a3b-slice`` (registered in :mod:`clover_testkit.presets`, written by
:mod:`clover_testkit.checkpoints`): the config of preset ``35b-a3b`` (the dimensions of
/work/shared/clover-architecture.md: hidden 2048, 256 experts top-8 + 1 shared of width 512,
attention 16 heads / 2 KV heads of head_dim 256, GDN 16 key / 32 value heads of 128, vocabulary 248,320) with ``num_hidden_layers = 4``: three GDN layers and one full
attention layer, one period of the real layer pattern (``full_attention_interval`` 4), so the
40-layer model is ten of these slices plus the same embedding and head.

``write_true_dims(folder)`` writes it as a bf16 Hugging Face checkpoint of about 8.7 GB
(4.35 B parameters: 256 experts x 3 x 2048 x 512 per layer, and two 248,320 x 2048 matrices)
tensor by tensor: the weights are ``clover_testkit.presets``' (the same per-tensor draws and
scales, so a value does not depend on the file layout) and the two vocabulary matrices are drawn
in row chunks from the same generator stream, so memory stays at one expert matrix or one chunk
(about 64 MB) whatever the size. Experts are written per expert (the Hugging Face layout).

The tokenizer has exactly 248,320 entries: the fixture BPE of preset ``small`` (bytes + merges
trained on the fixture text, ``clover_testkit.bpe``) continued by synthetic merges (lower-case
letter strings of growing length, with and without the byte-level space 'Ġ', each merging its
prefix with its last letter) up to 248,316 BPE tokens, then the four special tokens. Building it
takes about a second.

CLI: ``python -m clover_testkit.checkpoints 35b-a3b-slice OUT [--dtype bf16] [--seed N]``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import string
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from clover_convert.safetensors_io import INDEX_NAME, SINGLE_NAME, f32_to_bf16

from . import bpe
from .presets import (init_weight, preset_config, split_shards, tensor_plan, train_fixture_tokenizer, weight_rng,
                      write_json)

__all__ = ["PRESET", "SLICE_LAYERS", "REAL_DIMS", "slice_config", "slice_tokenizer", "write_true_dims",
           "tensor_bytes"]

PRESET = "35b-a3b-slice"
SLICE_LAYERS = 4
# the real model's dimensions (clover-architecture.md), what the slice must keep
REAL_DIMS: dict[str, int] = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "block_size": 32,
}
_CHUNK_ELEMS = 16 << 20  # rows of a vocabulary matrix drawn at a time: 64 MB of f32



# ---------------------------------------------------------------------------
# tokenizer


def _synthetic_tokens() -> Iterator[str]:
    """'Ġa'..'Ġz', then letter strings of length 2, 3, ... each bare and after 'Ġ'."""
    letters = string.ascii_lowercase
    for c in letters:
        yield "Ġ" + c
    for n in itertools.count(2):
        for t in itertools.product(letters, repeat=n):
            s = "".join(t)
            yield s
            yield "Ġ" + s


@lru_cache(maxsize=2)
def _slice_tokenizer_json(vocab_size: int) -> str:
    j = json.loads(train_fixture_tokenizer("small").to_str())
    vocab: dict[str, int] = j["model"]["vocab"]
    merges: list[list[str]] = j["model"]["merges"]
    n_bpe = vocab_size - len(bpe.SPECIAL_TOKENS)
    if len(vocab) > n_bpe:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the fixture tokenizer")
    gen = _synthetic_tokens()
    while len(vocab) < n_bpe:
        s = next(gen)
        if s not in vocab:  # every prefix is in already (shorter strings come first)
            vocab[s] = len(vocab)
            merges.append([s[:-1], s[-1]])
    for k, added in enumerate(j["added_tokens"]):  # the specials right after the BPE tokens
        added["id"] = n_bpe + k
    return json.dumps(j, ensure_ascii=False)


def slice_tokenizer(vocab_size: int = REAL_DIMS["vocab_size"]) -> Tokenizer:
    """The fixture tokenizer grown to exactly ``vocab_size`` entries (a new object each call)."""
    return Tokenizer.from_str(_slice_tokenizer_json(vocab_size))


# ---------------------------------------------------------------------------
# config and tensors


def slice_config(dtype: str = "bf16") -> dict[str, Any]:
    """config.json of the slice, token ids from its tokenizer."""
    tok = slice_tokenizer()
    ids = {"eos_token_id": tok.token_to_id(bpe.EOS_TOKEN), "pad_token_id": tok.token_to_id(bpe.EOS_TOKEN),
           "mask_token_id": tok.token_to_id(bpe.MASK_TOKEN)}
    return preset_config(PRESET, ids, dtype)


def tensor_bytes(cfg: dict[str, Any], itemsize: int = 2) -> int:
    return sum(math.prod(s) for _, s in tensor_plan(cfg)) * itemsize


def _chunks(name: str, shape: tuple[int, ...], cfg: dict[str, Any], seed: int) -> Iterator[np.ndarray]:
    """A tensor's f32 values in row chunks: the generator's own values (presets.init_weight); the
    two vocabulary matrices drawn chunk by chunk from the same stream with the same scale."""
    if name not in ("model.embed_tokens.weight", "lm_head.weight"):
        yield init_weight(name, shape, cfg, seed, False)
        return
    rng = weight_rng(seed, name)
    std = np.float32(1.0 if name == "model.embed_tokens.weight" else 2.0 / math.sqrt(cfg["hidden_size"]))
    rows = max(1, _CHUNK_ELEMS // shape[1])
    for r0 in range(0, shape[0], rows):
        x = rng.standard_normal((min(rows, shape[0] - r0), shape[1]), dtype=np.float32)
        x *= std
        yield x


def _write_file(path: Path, plan: list[tuple[str, tuple[int, ...]]], cfg: dict[str, Any], seed: int, dtype: str,
                progress: Callable[[str], None] | None) -> None:
    """One safetensors file, streamed chunk by chunk (the format: 8-byte header length, the JSON
    header padded to 8 bytes, the data in header order); written to a temporary name first."""
    st, itemsize = ("BF16", 2) if dtype == "bf16" else ("F32", 4)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in plan:
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for k, (name, shape) in enumerate(plan):
                for x in _chunks(name, shape, cfg, seed):
                    data = f32_to_bf16(x) if dtype == "bf16" else np.ascontiguousarray(x, dtype=np.float32)
                    f.write(memoryview(data.reshape(-1)).cast("B"))
                if progress is not None and (k % 256 == 0 or k == len(plan) - 1):
                    progress(f"{path.name}: {k + 1}/{len(plan)} tensors")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_true_dims(folder: str | os.PathLike, dtype: str = "bf16", seed: int = 0, shards: int = 1,
                    progress: Callable[[str], None] | None = None, unsupported: tuple[Any, ...] = ()
                    ) -> dict[str, Any]:
    """Write the slice to folder (config, generation config, tokenizer, weights); returns its
    config. ``shards`` > 1 writes ``model-0000k-of-0000n.safetensors`` + the index.
    ``unsupported``: write_checkpoint's fused_experts, tied and config_overrides, refused when set
    (the slice is the real layout: per-expert tensors, an lm_head, the preset's config)."""
    if any(unsupported):
        raise ValueError(f"preset {PRESET!r} is written with per-expert tensors, untied, without config "
                         "overrides (--fused-experts / --tied / overrides are not supported)")
    if dtype not in ("bf16", "f32"):
        raise ValueError(f"dtype must be bf16 or f32, not {dtype!r}")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    cfg = slice_config(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in list(folder.glob("model*.safetensors")) + [folder / INDEX_NAME]:
        if old.exists():
            old.unlink()
    plan = tensor_plan(cfg)
    itemsize = 2 if dtype == "bf16" else 4
    if shards == 1:
        _write_file(folder / SINGLE_NAME, plan, cfg, seed, dtype, progress)
    else:
        weight_map: dict[str, str] = {}
        for k, group in enumerate(split_shards(plan, itemsize, shards)):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            _write_file(folder / fname, group, cfg, seed, dtype, progress)
            weight_map.update({n: fname for n, _ in group})
        write_json(folder / INDEX_NAME, {"metadata": {"total_size": tensor_bytes(cfg, itemsize)},
                                         "weight_map": dict(sorted(weight_map.items()))})
    write_json(folder / "config.json", dict(sorted(cfg.items())))
    write_json(folder / "generation_config.json", {
        "_from_model_config": False, "bos_token_id": None, "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"], "mask_token_id": cfg["mask_token_id"],
        "block_size": cfg["block_size"], "do_sample": False})
    bpe.write_tokenizer_files(folder, slice_tokenizer())
    return cfg
