"""Synthetic Clover checkpoints in Hugging Face layout (test fixtures, benchmarks).

``write_checkpoint(folder, preset="tiny", ...)`` writes ``config.json``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and the
weights (``model.safetensors`` or shards + ``model.safetensors.index.json``), laid out
as ``spec/model.md`` describes, from a preset of :mod:`clover_testkit.presets` (its config,
tensor table, fixture tokenizer and deterministic weights).

CLI: ``python -m clover_testkit.checkpoints PRESET OUT [--dtype f32|bf16] [--shards N]
[--fused-experts] [--tied] [--seed N] [--dry-run]``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import click
import numpy as np

from clover_convert.safetensors_io import INDEX_NAME, SINGLE_NAME, write_safetensors_lazy

from . import bpe
from .presets import (PRESETS, count_params, init_weight, preset_config, preset_tokenizer, split_shards, tensor_plan,
                      write_json)

__all__ = ["write_checkpoint", "cli"]

_WRITABLE = ("tiny", "small", "release-tiny", "35b-a3b-slice")
_FUSED_OF = {"release-tiny": True}        # presets written with fused experts unless told otherwise


def _producer(name: str, shape: tuple[int, ...], cfg: dict[str, Any], seed: int, tied: bool) -> Callable[[], np.ndarray]:
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        E, I, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]

        def fused_gate_up() -> np.ndarray:
            out = np.empty((E, 2 * I, H), dtype=np.float32)
            for j in range(E):
                out[j, :I] = init_weight(f"{base}{j}.gate_proj.weight", (I, H), cfg, seed, tied)
                out[j, I:] = init_weight(f"{base}{j}.up_proj.weight", (I, H), cfg, seed, tied)
            return out

        return fused_gate_up
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        E, I, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]

        def fused_down() -> np.ndarray:
            out = np.empty((E, H, I), dtype=np.float32)
            for j in range(E):
                out[j] = init_weight(f"{base}{j}.down_proj.weight", (H, I), cfg, seed, tied)
            return out

        return fused_down
    return lambda: init_weight(name, shape, cfg, seed, tied)


def write_checkpoint(
    folder: str | os.PathLike,
    preset: str = "tiny",
    dtype: str = "f32",
    shards: int = 1,
    fused_experts: bool | None = None,
    tied: bool = False,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a synthetic checkpoint of a preset to folder; returns its config.

    Stale weight files (``model*.safetensors``, the index) in folder are removed first.
    ``fused_experts=None``: the preset's way (fused for release-tiny, per expert otherwise).
    """
    if preset == "35b-a3b-slice":
        from .true_dims import write_true_dims  # streamed in chunks, a 248,320-entry tokenizer
        return write_true_dims(folder, dtype, seed, shards, unsupported=(fused_experts, tied, config_overrides))
    if fused_experts is None:
        fused_experts = _FUSED_OF.get(preset, False)
    if preset not in _WRITABLE:
        if preset in PRESETS:
            n = count_params(preset_config(preset))
            raise ValueError(
                f"preset {preset!r} is too big to write ({n / 1e9:.1f}B parameters); "
                f"use preset_config/tensor_plan for a dry run, or one of {list(_WRITABLE)}"
            )
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    overrides = dict(config_overrides or {})
    overrides.setdefault("tie_word_embeddings", bool(tied))
    tied = bool(overrides["tie_word_embeddings"])
    cfg = preset_config(preset, overrides, dtype)
    tok = preset_tokenizer(preset)
    if cfg["vocab_size"] < tok.get_vocab_size():
        raise ValueError(f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer ({tok.get_vocab_size()})")

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in list(folder.glob("model*.safetensors")) + [folder / INDEX_NAME]:
        if old.exists():
            old.unlink()

    st_dtype = "F32" if dtype == "f32" else "BF16"
    itemsize = 4 if dtype == "f32" else 2
    plan = tensor_plan(cfg, fused_experts=fused_experts, tied=tied)
    meta = {"format": "pt"}

    def specs(group):
        return [(n, s, st_dtype, _producer(n, s, cfg, seed, tied)) for n, s in group]

    if shards == 1:
        write_safetensors_lazy(folder / SINGLE_NAME, specs(plan), meta)
    else:
        groups = split_shards(plan, itemsize, shards)
        weight_map: dict[str, str] = {}
        for k, group in enumerate(groups):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors_lazy(folder / fname, specs(group), meta)
            for n, _ in group:
                weight_map[n] = fname
        total = sum(math.prod(s) * itemsize for _, s in plan)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(folder / INDEX_NAME, index)

    write_json(folder / "config.json", dict(sorted(cfg.items())))
    gen = {
        "_from_model_config": False,
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "mask_token_id": cfg["mask_token_id"],
        "block_size": cfg["block_size"],
        "do_sample": False,
    }
    write_json(folder / "generation_config.json", gen)
    bpe.write_tokenizer_files(folder, tok)
    return cfg


# ---------------------------------------------------------------------------
# CLI


@click.command(help="Write a synthetic Clover checkpoint of PRESET to folder OUT.")
@click.argument("preset", type=click.Choice(sorted(PRESETS)))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True)
@click.option("--shards", type=int, default=1, show_default=True)
@click.option("--fused-experts", is_flag=True, help="fused experts.gate_up_proj / experts.down_proj")
@click.option("--tied", is_flag=True, help="tie lm_head to the embedding (no lm_head tensor)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dry-run", is_flag=True, help="print the parameter count only, write nothing")
def cli(preset, out, dtype, shards, fused_experts, tied, seed, dry_run):
    if dry_run or preset not in _WRITABLE:
        cfg = preset_config(preset, {"tie_word_embeddings": tied}, dtype)
        n = count_params(cfg)
        click.echo(f"{preset}: {n:,} parameters ({len(tensor_plan(cfg, fused_experts))} tensors)")
        if not dry_run:
            raise click.ClickException(f"preset {preset!r} is too big to write; use --dry-run")
        return
    try:
        cfg = write_checkpoint(out, preset, dtype, shards, fused_experts or None, tied, seed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    n = count_params(cfg)
    click.echo(f"{preset}: {n:,} parameters, vocab {cfg['vocab_size']}, written to {out}")


if __name__ == "__main__":
    cli()
