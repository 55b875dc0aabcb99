"""The conversion plan: everything but the data. ``plan_conversion`` validates the config, the
tokenizer and the tensor headers against the mapping's table and decides every output tensor's
name, shape, type, byte size and source slabs, the output files, and the GGUF writer (header,
metadata and tensor infos, built once here and opened by the converter). No weights are read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from clover_gguf.files import fmt_bytes

from . import mapping
from .config import CloverConfig, ConversionError, parse_config
from .gguf_writer import ShardWriter, build_writer
from .mapping import Rule, perm_index, rule_applies
from .safetensors_io import require_inside
from .source import Inventory, Source, check_regular_inputs, open_inventory, resolve_source
from .tensors import Piece, TensorPlan
from .tokenizer import TokenizerInfo, load_tokenizer

__all__ = ["OUTTYPES", "SUPPORTED_SRC_DTYPES", "NO_MASK_WARNING", "ConversionPlan",
           "parse_size", "tensor_nbytes", "out_path", "plan_conversion"]

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto")
_QTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
SUPPORTED_SRC_DTYPES = ("F32", "F16", "BF16")
_SRC_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}

NO_MASK_WARNING = ("warning: config.json names no mask_token_id (the release publishes none): the GGUF runs causally "
                   "only (block size 1); to enable draft-self, add \"mask_token_id\" (its mask token's id) to "
                   "config.json and convert again")


def parse_size(s: str | int | None) -> int | None:
    """'50M' -> 50_000_000, '2G' -> 2_000_000_000 (as upstream's --split-max-size); int passes."""
    if s is None:
        return None
    if isinstance(s, int) and not isinstance(s, bool):
        n = s
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)B?\s*", str(s), re.IGNORECASE)
        if not m:
            raise ConversionError(f"split size {s!r} is not a number with an optional K, M, G or T suffix")
        n = int(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2).upper()]
    if n <= 0:
        raise ConversionError(f"split size {s!r} must be positive")
    return n


def tensor_nbytes(shape: tuple[int, ...], qt: QT) -> int:
    bs, ts = GGML_QUANT_SIZES[qt]
    n = math.prod(shape)
    return n // bs * ts


def _shape_str(s: Iterable[int] | None) -> str:
    return "?" if s is None else "[" + ", ".join(str(d) for d in s) + "]"


def _name_list(names: list[str], n: int = 6) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" (and {len(names) - n} more)" if len(names) > n else "")


def _first_of(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


# ---------------------------------------------------------------------------
# the plan


@dataclass
class ConversionPlan:
    source: Source = field(repr=False)
    out: Path
    outtype: str                  # resolved (never "auto")
    config: CloverConfig
    tokenizer: TokenizerInfo
    tensors: list[TensorPlan]
    shard_paths: list[Path]
    split_max_size: int | None
    dry_run: bool
    writer: ShardWriter = field(repr=False)  # header, metadata and tensor infos of the output, not yet opened
    virtual: bool = False         # planned without the weights (index / headers only)
    elapsed_s: float = 0.0
    src_bytes: int = 0            # bytes of source tensor data

    @property
    def src(self) -> str:
        """The source as given (a folder or a hub repo id)."""
        return self.source.src

    @property
    def folder(self) -> Path:
        """The folder the checkpoint is read from (the hub cache's for a repo id)."""
        return self.source.folder

    @property
    def total_params(self) -> int:
        return sum(t.n_params for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def largest_tensor(self) -> TensorPlan:
        return max(self.tensors, key=lambda t: t.nbytes)

    def format(self) -> str:
        w = max(len(t.name) for t in self.tensors)
        lines = [f"{'name':<{w}}  {'shape':<22} {'type':<5} {'bytes':>14}"]
        for t in self.tensors:
            lines.append(f"{t.name:<{w}}  {_shape_str(t.shape):<22} {t.qtype.name:<5} {t.nbytes:>14}")
        files = ", ".join(str(p) for p in self.shard_paths)
        lines.append(
            f"total: {len(self.tensors)} tensors, {self.total_params} parameters "
            f"({self.total_params / 1e9:.3f} B), {self.total_bytes} bytes ({fmt_bytes(self.total_bytes)}), "
            f"outtype {self.outtype}, {len(self.shard_paths)} file(s): {files}"
        )
        if self.virtual:
            lines.append("note: weights absent; planned from the index / safetensors headers and config.json")
        return "\n".join(lines)

    def summary(self) -> str:
        verb = "would write" if self.dry_run else "wrote"
        return (
            f"{verb} {len(self.tensors)} tensors, {self.total_params} parameters, "
            f"{fmt_bytes(self.total_bytes)} ({self.outtype}) to "
            + ", ".join(str(p) for p in self.shard_paths)
            + ("" if self.dry_run else f" in {self.elapsed_s:.1f} s")
        )


# ---------------------------------------------------------------------------
# matching the table against the checkpoint


@dataclass
class _Match:
    """An output tensor as the table and the checkpoint give it (its type is decided later)."""

    rule: Rule
    name: str                     # GGUF name
    shape: tuple[int, ...]        # final (numpy order)
    pieces: list[Piece]
    stacked: bool
    src_dtype: str                # "?" when unknown (a dry run whose shard is absent)


def load_config(folder: Path) -> CloverConfig:
    p = folder / "config.json"
    if not p.exists():
        raise ConversionError(f"{folder}: config.json not found")
    require_inside(p, folder, ConversionError)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{p}: not valid JSON: {e}") from None
    return parse_config(cfg)


class _Matcher:
    """Matches the table against the checkpoint, collecting every missing, unexpected,
    misshapen or unsupported tensor, reported as one line at the end."""

    def __init__(self, cfg: CloverConfig, inv: Inventory):
        self.cfg, self.inv = cfg, inv
        self.consumed: set[str] = set()
        self.missing: list[str] = []
        self.bad_shape: list[str] = []
        self.bad_dtype: list[str] = []
        self.matches: list[_Match] = []

    def take(self, name: str, shape: tuple[int, ...] | None, alt: tuple[int, ...] | None = None) -> str | None:
        """The source dtype of tensor name, checked against shape (None: any shape of at most 4
        dimensions, kept as it is; alt: a second shape accepted). None when it is missing."""
        inv = self.inv
        if name not in inv:
            self.missing.append(name)
            return None
        self.consumed.add(name)
        got = inv.shape(name)
        if got is not None and shape is None and len(got) > 4:
            self.bad_shape.append(f"tensor {name}: expected at most 4 dimensions, got shape {_shape_str(got)}")
        elif got is not None and shape is not None and tuple(got) != tuple(shape) and \
                (alt is None or tuple(got) != tuple(alt)):
            also = f" or {_shape_str(alt)}" if alt is not None else ""
            self.bad_shape.append(f"tensor {name}: expected shape {_shape_str(shape)}{also}, got {_shape_str(got)}")
        dt = inv.dtype(name)
        if dt not in SUPPORTED_SRC_DTYPES and dt != "?":
            self.bad_dtype.append(f"tensor {name} has unsupported dtype {dt} (supported: F32, F16, BF16)")
        return dt

    def layer(self, i: int | None) -> None:
        """The tensors of layer i (None: the global ones)."""
        cfg, inv = self.cfg, self.inv
        for rule in mapping.TENSOR_TABLE:  # (read at call time: one table, see hf_tensor_shapes)
            if (rule.scope == "global") != (i is None):
                continue
            gname = rule.gguf.format(i=i)
            if not rule_applies(rule, cfg, i):
                continue  # e.g. lm_head of a tied model, lookahead taps when R == 0
            shape = rule.shape(cfg)
            final = rule.out(cfg) if rule.out else shape
            if rule.scope != "experts":
                hf = rule.hf.format(i=i)
                if rule.any_shape:  # kept as the checkpoint has it (a 0-d tensor as [1])
                    dt = self.take(hf, None)
                    got = inv.shape(hf) if hf in inv else None
                    final = (tuple(got) or (1,)) if got is not None else tuple(final)
                else:
                    dt = self.take(hf, shape, rule.alt_shape(cfg) if rule.alt_shape else None)
                self.matches.append(_Match(rule, gname, tuple(final), [Piece(hf)], False, dt or "?"))
                continue
            self.matches.append(self._experts(rule, gname, i, shape, final))

    def _experts(self, rule: Rule, gname: str, i: int | None, shape: tuple[int, ...],
                 final: tuple[int, ...]) -> _Match:
        """A stacked expert tensor, from the layer's fused tensor when it has one, else per expert."""
        cfg, inv = self.cfg, self.inv
        assert rule.fused is not None and rule.fused_shape is not None
        fused_names = {r.fused[0].format(i=i) for r in mapping.TENSOR_TABLE if r.fused}
        E, I = cfg.E, cfg.I
        if any(n in inv for n in fused_names):
            fname = rule.fused[0].format(i=i)
            dt = self.take(fname, rule.fused_shape(cfg))
            row0 = I if rule.fused[1] == "second" else 0  # "first" / "all" start at row 0
            pieces = [Piece(fname, j, row0) for j in range(E)]
        else:
            pieces = []
            dts = set()
            for j in range(E):
                hf = rule.hf.format(i=i, j=j)
                d = self.take(hf, shape)
                if d:
                    dts.add(d)
                pieces.append(Piece(hf))
            dt = "BF16" if "BF16" in dts else (sorted(dts)[0] if dts else "?")
        return _Match(rule, gname, (E, *final), pieces, True, dt or "?")

    def result(self) -> list[_Match]:
        """Every output tensor; raises the first problem of the first kind found (and how many more)."""
        if self.missing:
            raise ConversionError(f"missing tensor(s): {_name_list(self.missing)}")
        unexpected = [n for n in self.inv.names() if n not in self.consumed]
        if unexpected:
            raise ConversionError(f"unexpected tensor(s): {_name_list(unexpected)}")
        if self.bad_shape:
            raise ConversionError(_first_of(self.bad_shape))
        if self.bad_dtype:
            raise ConversionError(_first_of(self.bad_dtype))
        return self.matches


def _match_tensors(cfg: CloverConfig, inv: Inventory) -> list[_Match]:
    m = _Matcher(cfg, inv)
    m.layer(None)
    for i in range(cfg.L):
        m.layer(i)
    return m.result()


def _guess_unknown_dtypes(matches: list[_Match], total_size: int | None) -> None:
    """A dry run with missing shards: their tensors get the dtype of the headers we have, else a
    guess from the index's total_size (about 2 bytes per parameter -> BF16, 4 -> F32)."""
    known = {m.src_dtype for m in matches if m.src_dtype in SUPPORTED_SRC_DTYPES}
    n_src = sum(math.prod(m.shape) for m in matches)
    if known:
        guess = "BF16" if "BF16" in known else sorted(known)[0]
    elif total_size and n_src and total_size / n_src > 3:
        guess = "F32"
    else:
        guess = "BF16"
    for m in matches:
        if m.src_dtype not in SUPPORTED_SRC_DTYPES:
            m.src_dtype = guess


def _out_qtype(rule: Rule, final: tuple[int, ...], want: QT) -> QT:
    if rule.f32 or len(final) == 1:
        return QT.F32
    if want == QT.Q8_0 and final[-1] % GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        return QT.F16
    return want


def _tensor_plan(m: _Match, want: QT, cfg: CloverConfig) -> TensorPlan:
    qt = _out_qtype(m.rule, m.shape, want)
    t = TensorPlan(name=m.name, shape=m.shape, qtype=qt, nbytes=tensor_nbytes(m.shape, qt), pieces=m.pieces,
                   stacked=m.stacked, rule=m.rule, src_dtype=m.src_dtype)
    if m.rule.perm is not None:
        idx = perm_index(m.rule.perm, cfg)
        if m.rule.perm.startswith("rows"):
            t.row_perm = idx
        else:
            t.col_perm = idx
    return t


def out_path(source: Source, out: str | os.PathLike | None, outtype: str) -> Path:
    """OUT as given; a folder (or none: the current one) gets the default file name."""
    if out is None:
        return Path.cwd() / source.out_name(outtype)
    p = Path(out).expanduser()
    if str(out).endswith(("/", os.sep)) and not p.is_dir():
        raise ConversionError(f"{out}: output folder does not exist")
    return p / source.out_name(outtype) if p.is_dir() else p


def plan_conversion(
    src: str | os.PathLike,
    out: str | os.PathLike | None = None,
    outtype: str = "auto",
    split_max_size: int | str | None = None,
    dry_run: bool = True,
) -> ConversionPlan:
    """Everything but the data: validates config, tokenizer and tensor headers."""
    outtype = outtype.lower()
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    split = parse_size(split_max_size)
    source = resolve_source(src, dry_run)
    check_regular_inputs(source.folder, ConversionError)  # a FIFO would block a read forever
    cfg = load_config(source.folder)
    tok = load_tokenizer(source.folder, cfg)
    inv = open_inventory(source, dry_run)
    try:
        cfg = mapping.detect_block_operator(cfg, inv.names())  # Clover's block operator or the release's
        matches = _match_tensors(cfg, inv)
    finally:
        inv.close()
    if inv.is_virtual:
        _guess_unknown_dtypes(matches, inv.total_size)

    resolved = outtype
    if outtype == "auto":
        resolved = "bf16" if any(m.src_dtype == "BF16" for m in matches) else "f16"
    want = _QTYPES[resolved]
    tensors = [_tensor_plan(m, want, cfg) for m in matches]
    src_bytes = sum(math.prod(m.shape) * _SRC_ITEMSIZE.get(m.src_dtype, 2) for m in matches)

    out_p = out_path(source, out, resolved)
    writer = build_writer(tensors, cfg, tok, resolved, source.model_name, split, source.folder)
    return ConversionPlan(
        source=source, out=out_p, outtype=resolved, config=cfg, tokenizer=tok, tensors=tensors,
        shard_paths=writer.format_shard_names(out_p), split_max_size=split, dry_run=dry_run, writer=writer,
        virtual=inv.is_virtual, src_bytes=src_bytes,
    )
