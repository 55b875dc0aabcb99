"""Byte-level BPE tokenizers set up like Qwen2's, trained with Hugging Face ``tokenizers``.

The fixture tokenizers (``clover_testkit.checkpoints``) and the training corpus tokenizer
(``train/data.py``) come from here. ``train`` runs ``tokenizers``' BPE trainer behind Qwen2's
pre-tokenizer (the split regex below, then ByteLevel), with no normalizer (llama.cpp does not
normalize either). The ids: the 256 byte tokens (in ``tokenizers``' alphabet order), one token per
merge, then ``SPECIAL_TOKENS`` in that order. The trainer is deterministic: the same texts and
sizes give the same ``tokenizer.json``, byte for byte. Encoding and decoding are the returned
``tokenizers.Tokenizer``'s own; the GGUF converter turns its ``tokenizer.json`` into llama.cpp's
"gpt2" tokenizer with the "qwen2" pre-tokenizer, which tokenizes the same way.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "QWEN2_PATTERN",
    "CHATML_TEMPLATE",
    "EOS_TOKEN",
    "IM_START",
    "IM_END",
    "MASK_TOKEN",
    "SPECIAL_TOKENS",
    "train",
    "encode",
    "write_tokenizer_files",
]

# Qwen2's pre-tokenizer regex (as in Qwen2's tokenizer.json)
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

_SPECIAL_RE = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))


def train(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE trained on texts.

    ``vocab_size`` counts everything (256 bytes + merges + the special tokens); training stops
    early when no pair occurs ``min_frequency`` times. Special-token text in the texts is cut
    out before training (it never takes part in merges), as encoding treats it.
    """
    n_bpe = vocab_size - len(SPECIAL_TOKENS)
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(SPECIAL_TOKENS)} specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((piece for text in texts for piece in _SPECIAL_RE.split(text)), trainer)
    # added after training, so they take the ids right after the BPE vocabulary
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of text (special-token text becomes its single id; no BOS/EOS added)."""
    return tok.encode(text, add_special_tokens=False).ids


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_tokenizer_files(folder: str | os.PathLike, tok: Tokenizer, chat_template: str | None = CHATML_TEMPLATE,
                          model_max_length: int = 131072) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (nothing else) to folder:
    eos = pad = ``EOS_TOKEN``, mask = ``MASK_TOKEN``, no BOS, the given chat template."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    added = dict(sorted(tok.get_added_tokens_decoder().items()))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in added.items()
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write(folder / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    _write(folder / "tokenizer_config.json", json.dumps(config, ensure_ascii=False, indent=2) + "\n")
