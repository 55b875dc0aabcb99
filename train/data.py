"""Corpus: this interpreter's own standard-library sources, a byte-level BPE, token cache.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except directories named
test/tests, idlelib, turtledemo, site-packages, __pycache__, plus pydoc_data (a 700 KB
prose dump) and encodings (charmap tables): both are data, not code. Held out: a
deterministic 2% of files, ``sha1(relative path) % 100 < 2``.

Documents are joined as ``text + <|endoftext|>`` in sorted path order.

    python -m train.data --out train/runs/data       # tokenizer + tokens cache
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from clover_testkit import bpe

EXCLUDE_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__",
                "pydoc_data", "encodings"}
VOCAB_SIZE = 4096
HELDOUT_PERCENT = 2
# the BPE may be trained on a deterministic subset of the training files (every file whose
# sha1 % BPE_SUBSET_MOD == 0) when the corpus is large; see build().
BPE_SUBSET_MOD = 1


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def list_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths, sorted."""
    root = root or stdlib_root()
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if any(part in EXCLUDE_DIRS for part in Path(rel).parts[:-1]):
            continue
        (held if is_heldout(rel) else train).append(rel)
    return train, held


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def build(out: Path, vocab_size: int = VOCAB_SIZE, bpe_subset_mod: int = BPE_SUBSET_MOD,
          tokenizer_json: Path | None = None) -> dict:
    """tokenizer_json: encode with this (a model's tokenizer.json) instead of training the
    BPE: the token cache of an existing model."""
    out.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    train, held = list_files(root)
    t0 = time.time()
    sub = [r for r in train if int(hashlib.sha1(r.encode()).hexdigest(), 16) % bpe_subset_mod == 0]
    if tokenizer_json is not None:
        tok = Tokenizer.from_file(str(tokenizer_json))
        sub = []
    else:
        tok = bpe.train((read(root, r) for r in sub), vocab_size)
        bpe.write_tokenizer_files(out, tok)
    t_bpe = time.time() - t0
    eos = tok.token_to_id(bpe.EOS_TOKEN)
    stats = {}
    for name, files in (("train", train), ("heldout", held)):
        ids: list[int] = []
        starts = []
        for r in files:
            starts.append(len(ids))
            ids.extend(bpe.encode(tok, read(root, r)))
            ids.append(eos)
        np.save(out / f"{name}.npy", np.asarray(ids, dtype=np.int16 if vocab_size <= 32767 else np.int32))
        np.save(out / f"{name}_starts.npy", np.asarray(starts, dtype=np.int64))
        stats[name] = {"files": len(files), "tokens": len(ids),
                       "bytes": sum((root / r).stat().st_size for r in files)}
    meta = {"stdlib": str(root), "python": sys.version.split()[0], "vocab_size": tok.get_vocab_size(),
            "bpe_files": len(sub), "bpe_subset_mod": bpe_subset_mod, "bpe_seconds": round(t_bpe, 1),
            "exclude_dirs": sorted(EXCLUDE_DIRS), "heldout_files": held, **stats,
            "eos_token_id": eos, "mask_token_id": tok.token_to_id(bpe.MASK_TOKEN)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="train/runs/data")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--bpe-subset-mod", type=int, default=BPE_SUBSET_MOD)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="encode with this tokenizer.json (e.g. models/clover-default/tokenizer.json) "
                         "instead of training the BPE")
    a = ap.parse_args()
    meta = build(Path(a.out), a.vocab_size, a.bpe_subset_mod, a.tokenizer)
    print(json.dumps({k: v for k, v in meta.items() if k != "heldout_files"}, indent=1))


if __name__ == "__main__":
    main()
