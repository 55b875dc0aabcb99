"""GGUF tokenizer metadata from a Hugging Face ``tokenizer.json`` (byte-level BPE).

Writes what llama.cpp's ``gpt2`` tokenizer with the ``qwen2`` pre-tokenizer reads:

* ``tokenizer.ggml.model`` = "gpt2", ``tokenizer.ggml.pre`` = "qwen2";
* ``tokenizer.ggml.tokens``: id -> token string, holes and the tail up to the config's
  ``vocab_size`` filled with ``[PAD{i}]``;
* ``tokenizer.ggml.token_type``: NORMAL for BPE vocab entries, CONTROL for special added
  tokens, USER_DEFINED for non-special added tokens (as upstream's converter does),
  UNUSED for padding;
* ``tokenizer.ggml.merges``: "left right" strings;
* eos / padding / bos / mask ids and ``add_bos_token``; ``tokenizer.chat_template``.

The keys are written with gguf-py's typed ``GGUFWriter.add_*`` helpers. The files are read
here, not with ``gguf.vocab``: its ``BpeVocab`` types every added token CONTROL (a
non-special one such as ``<think>`` must stay USER_DEFINED, or llama.cpp hides it from the
text) and refuses id holes; its ``SpecialVocab`` takes the eos and bos ids from
tokenizer_config.json's token names before config.json's ids (ours: config.json, for eos
then generation_config.json, then the names), ignores generation_config.json, and drops a
malformed merges list, ``add_bos_token`` or ``chat_template`` (at most with a warning),
where we raise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType

from .config import CloverConfig, ConversionError
from .safetensors_io import require_inside

__all__ = ["TokenizerInfo", "load_tokenizer", "add_tokenizer"]


@dataclass
class TokenizerInfo:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    eos_id: int | None
    pad_id: int | None
    bos_id: int | None
    mask_id: int | None  # None: the release config names none (causal only)
    add_bos: bool
    chat_template: str | list[dict[str, str]] | None
    n_real: int  # tokens defined by tokenizer.json (the rest is padding)


def _read_json(path: Path) -> Any:
    require_inside(path, path.parent, ConversionError)  # a FIFO; a link out of the checkpoint
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON: {e}") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e}") from None


def _token_str(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def load_tokenizer(folder: Path, cfg: CloverConfig) -> TokenizerInfo:
    tj_path = folder / "tokenizer.json"
    if not tj_path.exists():
        raise ConversionError(f"{folder}: tokenizer.json not found")
    tj = _read_json(tj_path)
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"{tj_path}: no model.vocab object")
    if model.get("type", "BPE") != "BPE":
        raise ConversionError(f"{tj_path}: tokenizer model is {model.get('type')!r}, only BPE is supported")

    id_to_tok: dict[int, str] = {}
    types: dict[int, int] = {}
    for tok, i in model["vocab"].items():
        if not isinstance(i, int) or i < 0:
            raise ConversionError(f"{tj_path}: token {tok!r} has a bad id {i!r}")
        if i in id_to_tok:  # llama.cpp keeps one string per id: the other would vanish silently
            raise ConversionError(f"{tj_path}: token id {i} has two strings in model.vocab: "
                                  f"{id_to_tok[i]!r} and {tok!r}")
        id_to_tok[i] = tok
        types[i] = int(TokenType.NORMAL)
    added = tj.get("added_tokens") or []
    if not isinstance(added, list):
        raise ConversionError(f"{tj_path}: added_tokens must be a list")
    for at in added:
        if not isinstance(at, dict):
            raise ConversionError(f"{tj_path}: bad added token {at!r}")
        i, content = at.get("id"), at.get("content")
        if not isinstance(i, int) or i < 0 or not isinstance(content, str):
            raise ConversionError(f"{tj_path}: bad added token {at!r}")
        if i in id_to_tok and id_to_tok[i] != content:  # the same string again (vocab + added) is fine
            raise ConversionError(f"{tj_path}: token id {i} has two strings: {id_to_tok[i]!r} and "
                                  f"{content!r} (added_tokens)")
        id_to_tok[i] = content
        types[i] = int(TokenType.CONTROL if at.get("special") else TokenType.USER_DEFINED)

    seen: dict[str, int] = {}
    for i in sorted(id_to_tok):  # one string on two ids: the tokenizer could only ever produce one
        if id_to_tok[i] in seen:
            raise ConversionError(f"{tj_path}: token {id_to_tok[i]!r} has two ids: {seen[id_to_tok[i]]} and {i}")
        seen[id_to_tok[i]] = i
    n_real = max(id_to_tok) + 1 if id_to_tok else 0
    V = cfg.vocab_size
    if n_real > V:
        raise ConversionError(
            f"{tj_path}: tokenizer has token id {n_real - 1}, but config.json vocab_size is {V}"
        )
    tokens: list[str] = []
    ttypes: list[int] = []
    for i in range(V):
        if i in id_to_tok:
            tokens.append(id_to_tok[i])
            ttypes.append(types[i])
        else:
            tokens.append(f"[PAD{i}]")
            ttypes.append(int(TokenType.UNUSED))

    merges: list[str] = []
    raw_merges = model.get("merges") or []
    if not isinstance(raw_merges, list):
        raise ConversionError(f"{tj_path}: model.merges must be a list")
    for m in raw_merges:
        if isinstance(m, str):
            merges.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m):
            merges.append(f"{m[0]} {m[1]}")
        else:
            raise ConversionError(f"{tj_path}: bad merge entry {m!r}")

    tc_path = folder / "tokenizer_config.json"
    tc: dict[str, Any] = _read_json(tc_path) if tc_path.exists() else {}
    if not isinstance(tc, dict):
        raise ConversionError(f"{tc_path}: not a JSON object")
    gc_path = folder / "generation_config.json"
    gc: dict[str, Any] = _read_json(gc_path) if gc_path.exists() else {}
    if not isinstance(gc, dict):
        gc = {}

    tok_to_id = {t: i for i, t in id_to_tok.items()}

    def by_name(key: str) -> int | None:
        s = _token_str(tc.get(key))
        if s is None:
            return None
        if s not in tok_to_id:
            raise ConversionError(f"{tc_path}: {key} {s!r} is not in tokenizer.json")
        return tok_to_id[s]

    def first(v: Any) -> int | None:
        if isinstance(v, list):
            v = v[0] if v else None
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    eos = cfg.eos_token_id if cfg.eos_token_id is not None else first(gc.get("eos_token_id"))
    if eos is None:
        eos = by_name("eos_token")
    pad = by_name("pad_token")
    if pad is None:
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else first(gc.get("pad_token_id"))
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else by_name("bos_token")
    add_bos = tc.get("add_bos_token", False)
    if not isinstance(add_bos, bool):  # "false" (a string) must not read as true
        raise ConversionError(f"{tc_path}: add_bos_token must be true or false, got {add_bos!r}")

    template = tc.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.exists():
        require_inside(jinja, folder, ConversionError)  # a link to /etc/passwd would be served by /props
        template = jinja.read_text(encoding="utf-8")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template)
    if template is not None and not (isinstance(template, str) or named):
        raise ConversionError(f"{tc_path}: chat_template must be a string or a list of {{name, template}} objects")

    for name, v in (("eos", eos), ("padding", pad), ("bos", bos)):
        if v is not None and not (0 <= v < V):
            raise ConversionError(f"{name} token id {v} is outside the vocabulary (vocab_size {V})")

    return TokenizerInfo(
        tokens=tokens, types=ttypes, merges=merges, eos_id=eos, pad_id=pad, bos_id=bos,
        mask_id=cfg.mask_token_id, add_bos=add_bos, chat_template=template, n_real=n_real,
    )


def add_tokenizer(w: GGUFWriter, tok: TokenizerInfo) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.types)
    if tok.merges:
        w.add_token_merges(tok.merges)
    if tok.eos_id is not None:
        w.add_eos_token_id(tok.eos_id)
    if tok.pad_id is not None:
        w.add_pad_token_id(tok.pad_id)
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    if tok.mask_id is not None:
        w.add_mask_token_id(tok.mask_id)
    w.add_add_bos_token(tok.add_bos)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
