"""Byte-level BPE: a deterministic trainer, an encoder/decoder, and HF tokenizer files.

This is what our test fixtures and the synthetic checkpoints use (see
``clover_testkit.checkpoints``). llama.cpp tokenizes natively from the GGUF; the encoder here
only serves our own tests and training.

Pieces:

* GPT-2's byte-to-unicode mapping (every byte becomes one printable character, so BPE
  tokens are plain strings and no byte is ever unknown).
* Qwen2's pre-tokenization regex (as in Qwen2's ``tokenizer.json``)::

      (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

  Python's ``re`` has no ``\\p{L}`` / ``\\p{N}``. We expand them to explicit character
  classes built from ``unicodedata`` (general categories L* and N*), once, on first use.
  This is exact up to Unicode-version differences between Python's ``unicodedata`` and
  the Oniguruma tables HF tokenizers / llama.cpp use, and up to ``\\s``: Python's
  ``\\s`` is ``str.isspace()``, which also counts the separators U+001C..U+001F as
  whitespace. Neither matters for the text we train and test on.
* ``train_bpe``: counts pairs over unique pre-token words (weighted by frequency) and
  updates the counts incrementally after each merge; the most frequent pair wins, ties go
  to the lexicographically smallest pair, so training is deterministic.
* ``Tokenizer``: encode (special tokens first, then pre-tokenize, then apply merges in
  rank order) and decode.
* ``write_tokenizer_files``: ``tokenizer.json`` (HF ``tokenizers`` format, BPE model,
  Split + ByteLevel pre-tokenizer like Qwen2's, ByteLevel decoder) and
  ``tokenizer_config.json`` (special tokens, ChatML chat template). No normalizer is
  written (Qwen2 uses NFC); our encoder and llama.cpp do not normalize either, so all
  three agree on every input.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import sys
import unicodedata
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "QWEN2_PATTERN",
    "CHATML_TEMPLATE",
    "EOS_TOKEN",
    "IM_START",
    "IM_END",
    "MASK_TOKEN",
    "SPECIAL_TOKENS",
    "bytes_to_unicode",
    "pretokenize",
    "train_bpe",
    "Tokenizer",
    "write_tokenizer_files",
]

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END, MASK_TOKEN)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# ---------------------------------------------------------------------------
# byte <-> unicode


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=None)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# ---------------------------------------------------------------------------
# pre-tokenization


def _class_ranges(prefix: str) -> str:
    """Regex class body of every code point whose general category starts with prefix."""
    out: list[str] = []
    cat = unicodedata.category
    start = None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and cat(chr(cp))[0] == prefix
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            end = cp - 1
            out.append(f"\\U{start:08x}" if start == end else f"\\U{start:08x}-\\U{end:08x}")
            start = None
    return "".join(out)


@lru_cache(maxsize=None)
def _pretok_re() -> re.Pattern[str]:
    L = _class_ranges("L")
    N = _class_ranges("N")
    pat = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
        rf"|[^\r\n{L}{N}]?[{L}]+"
        rf"|[{N}]"
        rf"| ?[^\s{L}{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    )
    return re.compile(pat)


def pretokenize(text: str) -> list[str]:
    """Split text like Qwen2's pre-tokenizer (see the module docstring)."""
    return _pretok_re().findall(text)


def _special_split_re(specials: Iterable[str]) -> re.Pattern[str] | None:
    specials = sorted(set(specials), key=lambda s: (-len(s), s))
    if not specials:
        return None
    return re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")


# ---------------------------------------------------------------------------
# training


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    min_frequency: int = 2,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE.

    ``vocab_size`` counts everything: the 256 byte tokens (ids 0..255 in byte order),
    one token per merge, then the special tokens (ids right after the BPE vocabulary, in
    the order given). Training stops early when no pair occurs ``min_frequency`` times,
    so the result may be smaller than asked. Special tokens in the texts are not split
    into bytes and never take part in merges.

    Returns ``(vocab, merges)``: token string -> id, and merges in rank order.
    """
    special_tokens = list(special_tokens)
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError("duplicate special tokens")
    n_bpe = vocab_size - len(special_tokens)
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(special_tokens)} specials")
    enc = bytes_to_unicode()
    split = _special_split_re(special_tokens)
    specials = set(special_tokens)

    counts: Counter[str] = Counter()
    for text in texts:
        chunks = split.split(text) if split else [text]
        for chunk in chunks:
            if not chunk or chunk in specials:
                continue
            counts.update(pretokenize(chunk))

    # unique words as symbol lists, in a deterministic order
    words: list[list[str]] = []
    freqs: list[int] = []
    for w in sorted(counts):
        words.append([enc[b] for b in w.encode("utf-8")])
        freqs.append(counts[w])

    pair_count: dict[tuple[str, str], int] = {}
    pair_where: dict[tuple[str, str], set[int]] = {}
    for i, (syms, f) in enumerate(zip(words, freqs)):
        for p in zip(syms, syms[1:]):
            pair_count[p] = pair_count.get(p, 0) + f
            pair_where.setdefault(p, set()).add(i)
    heap = [(-c, p[0], p[1]) for p, c in pair_count.items()]
    heapq.heapify(heap)

    vocab: dict[str, int] = {enc[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    while len(vocab) < n_bpe and heap:
        negc, a, b = heapq.heappop(heap)
        pair = (a, b)
        c = pair_count.get(pair, 0)
        if c != -negc or c <= 0:
            continue  # stale entry
        if c < min_frequency:
            break
        new = a + b
        merges.append(pair)
        if new not in vocab:
            vocab[new] = len(vocab)
        changed: set[tuple[str, str]] = set()
        for i in sorted(pair_where.pop(pair, ())):
            old = words[i]
            f = freqs[i]
            merged: list[str] = []
            j = 0
            n = len(old)
            while j < n:
                if j + 1 < n and old[j] == a and old[j + 1] == b:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(old[j])
                    j += 1
            old_pairs = list(zip(old, old[1:]))
            new_pairs = list(zip(merged, merged[1:]))
            for p in old_pairs:
                pair_count[p] -= f
                changed.add(p)
            for p in new_pairs:
                pair_count[p] = pair_count.get(p, 0) + f
                changed.add(p)
            new_set = set(new_pairs)
            for p in set(old_pairs) - new_set:
                if p != pair and p in pair_where:
                    pair_where[p].discard(i)
            for p in new_set:
                pair_where.setdefault(p, set()).add(i)
            words[i] = merged
        pair_count.pop(pair, None)
        for p in changed:
            c2 = pair_count.get(p, 0)
            if c2 > 0:
                heapq.heappush(heap, (-c2, p[0], p[1]))
            else:
                pair_count.pop(p, None)
                pair_where.pop(p, None)

    for s in special_tokens:
        if s in vocab:
            raise ValueError(f"special token {s!r} collides with a BPE token")
        vocab[s] = len(vocab)
    return vocab, merges


# ---------------------------------------------------------------------------
# encoding


class Tokenizer:
    """Byte-level BPE encoder/decoder over a vocab and ranked merges."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        special_tokens: Sequence[str] = SPECIAL_TOKENS,
    ):
        self.vocab = dict(vocab)
        self.merges = [tuple(m) for m in merges]
        self.special_tokens = [s for s in special_tokens]
        for s in self.special_tokens:
            if s not in self.vocab:
                raise ValueError(f"special token {s!r} is not in the vocab")
        self.ranks = {m: i for i, m in enumerate(self.merges)}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self._special_ids = {self.vocab[s] for s in self.special_tokens}
        self._split = _special_split_re(self.special_tokens)
        self._enc = bytes_to_unicode()
        self._dec = _unicode_to_bytes()
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def token_to_id(self, token: str) -> int:
        return self.vocab[token]

    def _bpe(self, word: str) -> list[str]:
        syms = list(word)
        ranks = self.ranks
        while len(syms) > 1:
            best = None
            best_rank = None
            for p in zip(syms, syms[1:]):
                r = ranks.get(p)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = p, r
            if best is None:
                break
            a, b = best
            merged: list[str] = []
            j = 0
            n = len(syms)
            while j < n:
                if j + 1 < n and syms[j] == a and syms[j + 1] == b:
                    merged.append(a + b)
                    j += 2
                else:
                    merged.append(syms[j])
                    j += 1
            syms = merged
        return syms

    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            mapped = "".join(self._enc[b] for b in word.encode("utf-8"))
            ids = [self.vocab[t] for t in self._bpe(mapped)]
            if len(self._cache) < 100_000:
                self._cache[word] = ids
        return ids

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of text; special tokens in text become single ids when allowed."""
        out: list[int] = []
        chunks = self._split.split(text) if (allow_special and self._split) else [text]
        for chunk in chunks:
            if not chunk:
                continue
            if allow_special and chunk in self.vocab and chunk in self.special_tokens:
                out.append(self.vocab[chunk])
                continue
            for w in pretokenize(chunk):
                out.extend(self._encode_word(w))
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            tok = self.id_to_token.get(i)
            if tok is None:
                raise ValueError(f"token id {i} is not in the vocab")
            if i in self._special_ids:
                if buf:
                    parts.append(buf.decode("utf-8", errors="replace"))
                    buf = bytearray()
                if not skip_special_tokens:
                    parts.append(tok)
            else:
                buf.extend(self._dec[c] for c in tok)
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a tokenizer.json written by ``write_tokenizer_files`` (or a Qwen2-like one)."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        model = data["model"]
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        vocab = dict(model["vocab"])
        specials = []
        for t in data.get("added_tokens", []):
            vocab.setdefault(t["content"], t["id"])
            if t.get("special"):
                specials.append(t["content"])
        return cls(vocab, merges, specials)


# ---------------------------------------------------------------------------
# files


def _dump_json(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_tokenizer_files(
    folder: str | os.PathLike,
    vocab: dict[str, int],
    merges: Sequence[tuple[str, str]],
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    chat_template: str | None = CHATML_TEMPLATE,
    *,
    eos_token: str | None = EOS_TOKEN,
    pad_token: str | None = EOS_TOKEN,
    mask_token: str | None = MASK_TOKEN,
    model_max_length: int = 131072,
) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (nothing else) to folder.

    ``vocab`` holds the BPE tokens and the special tokens; specials go to
    ``added_tokens`` (special=True) and stay out of the BPE model's vocab.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = list(special_tokens)
    for s in specials:
        if s not in vocab:
            raise ValueError(f"special token {s!r} is not in the vocab")
    for role, tok in (("eos", eos_token), ("pad", pad_token), ("mask", mask_token)):
        if tok is not None and tok not in specials:
            raise ValueError(f"{role} token {tok!r} is not a special token")
    special_set = set(specials)
    bpe_vocab = {t: i for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special_set}
    added = [
        {
            "id": vocab[s],
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s in sorted(specials, key=lambda s: vocab[s])
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": bpe_vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in added
        },
        "additional_special_tokens": [s for s in specials if s not in (eos_token, pad_token, mask_token)],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        "mask_token": mask_token,
        "model_max_length": model_max_length,
        "pad_token": pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _dump_json(folder / "tokenizer.json", tokenizer_json)
    _dump_json(folder / "tokenizer_config.json", config)
