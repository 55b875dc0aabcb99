"""``clover inspect``'s report of a GGUF header (read by :mod:`clover_gguf.reader`), and the
metadata keys llama.cpp lists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from clover_gguf.files import fmt_bytes as human_bytes
from clover_gguf.keys import ARCH
from clover_gguf.reader import GGUFInfo, TensorSummary

__all__ = ["format_info", "human_bytes", "human_count"]


def human_count(n: float) -> str:
    for unit, d in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= d:
            return f"{n / d:.2f}{unit}"
    return str(int(n))


def format_info(info: GGUFInfo, all_tensors: bool = False) -> str:
    md = info.metadata
    lines = [f"file:          {info.path}",
             f"size:          {human_bytes(info.file_size)} ({info.file_size} bytes), GGUF v{info.version}",
             f"architecture:  {info.architecture}"]
    if md.get("general.name"):
        lines.append(f"name:          {md['general.name']}")
    if "general.file_type" in md:
        lines.append(f"file type:     {_ftype_name(md['general.file_type'])}")
    if info.architecture == ARCH:
        layout, op = info.layout()
        lines.append(f"layout:        {layout}, block operator {op}")
        lines.append("runs:          " + "; ".join(f"{k}: {v}" for k, v in info.capabilities().items()))
    lines.append("hyperparameters:")
    for k, v in sorted(info.hparams().items()):
        lines.append(f"  {k:34s} {_fmt(v)}")
    tc = info.type_counts
    lines.append(f"tensors:       {len(info.tensors)} ({human_count(info.n_params)} parameters, "
                 f"{human_bytes(sum(t.n_bytes for t in info.tensors))} of data); types: "
                 + ", ".join(f"{k} x{v}" for k, v in sorted(tc.items())))
    shown = info.tensors if all_tensors else _summarise(info.tensors)
    for t in shown:
        lines.append(f"  {t.name:44s} {str(list(t.shape)):22s} {t.type}")
    tok_model = md.get("tokenizer.ggml.model")
    if tok_model is not None:
        tokens = md.get("tokenizer.ggml.tokens")
        n_vocab = tokens if isinstance(tokens, str) else (len(tokens) if isinstance(tokens, list) else "?")
        if isinstance(n_vocab, str) and n_vocab.startswith("["):
            n_vocab = n_vocab.strip("[]").split()[0]
        parts = [f"model {tok_model}", f"pre {md.get('tokenizer.ggml.pre', '-')}", f"vocab {n_vocab}"]
        for key, label in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("padding_token_id", "pad"),
                           ("mask_token_id", "mask")):
            if f"tokenizer.ggml.{key}" in md:
                parts.append(f"{label} {md[f'tokenizer.ggml.{key}']}")
        parts.append("chat template: " + ("yes" if md.get("tokenizer.chat_template") else "no"))
        lines.append("tokenizer:     " + ", ".join(parts))
    else:
        lines.append("tokenizer:     none")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.7g}"
    return str(v)


def _ftype_name(v: Any) -> str:
    """general.file_type by gguf-py's names: 15 -> 'Q4_K_M (15)'."""
    from gguf import LlamaFileType  # noqa: PLC0415

    try:
        name = LlamaFileType(v).name
    except ValueError:
        return str(v)
    return f"{name.removeprefix('MOSTLY_').removeprefix('ALL_')} ({v})"


def _summarise(tensors: list[TensorSummary]) -> list[TensorSummary]:
    """Global tensors plus the tensors of the first layer of each distinct layer kind."""
    import re  # noqa: PLC0415

    out: list[TensorSummary] = []
    seen_kinds: dict[frozenset[str], int] = {}
    by_layer: dict[int, list[TensorSummary]] = {}
    for t in tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(t)
        else:
            out.append(t)
    for i in sorted(by_layer):
        kind = frozenset(re.sub(r"^blk\.\d+\.", "", t.name) for t in by_layer[i])
        if kind not in seen_kinds:
            seen_kinds[kind] = i
            out.extend(by_layer[i])
    return out
