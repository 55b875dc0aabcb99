"""Hugging Face Clover checkpoint -> GGUF, streaming.

``convert(src, out, ...)`` plans the whole conversion from the config and the safetensors
headers (no weights read), writes the GGUF header, metadata and tensor infos, then
writes the tensor data one tensor at a time, reading the source just before it is needed
(the safetensors library's partial reads of the memory-mapped files) and releasing the
mappings as it goes. A stacked expert tensor is built in one preallocated output array,
expert by expert, and every tensor is read and converted in row chunks, so peak memory is
about the largest output tensor plus a few tens of MB, not the model size.

Output is written to hidden temporary files next to the output and renamed into place
at the end; on any failure or interruption the temporaries are removed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES, GGML_QUANT_VERSION

from . import mapping
from .mapping import (
    ARCH,
    CloverConfig,
    ConversionError,
    Rule,
    apply_fn,
    parse_config,
    perm_index,
    rule_applies,
)
from .safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointError, CheckpointReader, f32_to_bf16, read_header
from clover_cpp._files import check_output, clean_stale_temps, fmt_bytes, temp_path

from .outputs import check_regular_inputs
from .tokenizer import TokenizerInfo, add_tokenizer, load_tokenizer

__all__ = [
    "convert",
    "plan_conversion",
    "ConversionPlan",
    "TensorPlan",
    "ConversionError",
    "CheckpointError",
    "parse_size",
    "OUTTYPES",
    "HUB_PATTERNS",
]

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto")
_QTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
_FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
}
SUPPORTED_SRC_DTYPES = ("F32", "F16", "BF16")
HUB_PATTERNS = [
    "*.safetensors",
    INDEX_NAME,
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

CHUNK_ELEMS = 4 * 1024 * 1024          # source elements in the chunks of all workers together
RELEASE_BYTES = 64 * 1024 * 1024       # unmap the sources after touching this many bytes
WRITEBACK_BYTES = 256 * 1024 * 1024    # start writing the output to disk after this many bytes


# ---------------------------------------------------------------------------
# small helpers


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


_STORE_DTYPE = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16, QT.Q8_0: np.uint8}


def _shape_str(s: Iterable[int] | None) -> str:
    return "?" if s is None else "[" + ", ".join(str(d) for d in s) + "]"


def _name_list(names: list[str], n: int = 6) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" (and {len(names) - n} more)" if len(names) > n else "")


# ---------------------------------------------------------------------------
# source inventory


class _Inventory:
    """Names, shapes and dtypes of the source tensors, and lazy access to the data."""

    def __init__(self, reader: CheckpointReader | None, virtual: dict[str, tuple[tuple[int, ...] | None, str]] | None):
        self.reader = reader
        self.virtual = virtual

    @property
    def is_virtual(self) -> bool:
        return self.reader is None

    def names(self) -> list[str]:
        return self.reader.names() if self.reader is not None else list(self.virtual or {})

    def __contains__(self, name: str) -> bool:
        if self.reader is not None:
            return name in self.reader
        return name in (self.virtual or {})

    def shape(self, name: str) -> tuple[int, ...] | None:
        if self.reader is not None:
            return tuple(self.reader.shape(name))
        return self.virtual[name][0]  # type: ignore[index]

    def dtype(self, name: str) -> str:
        if self.reader is not None:
            return self.reader.dtype(name)
        return self.virtual[name][1]  # type: ignore[index]


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """Shapes and dtypes from a safetensors header alone (the data may be absent, which the
    safetensors library refuses: this is for dry runs on headers-only files)."""
    read = read_header(path)
    if read is None:
        return None
    out = {}
    for name, info in read[1].items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not isinstance(info.get("dtype"), str):
            return None
        out[name] = (tuple(int(d) for d in info["shape"]), info["dtype"])
    return out


def _virtual_inventory(folder: Path) -> dict[str, tuple[tuple[int, ...] | None, str]] | None:
    """Dry run without the weights: the tensor list from the index json and/or the
    safetensors headers (files may hold only their header, shards may be missing).

    Tensors in missing shards get shape None (the planner takes the shape the config
    implies) and dtype "?" (guessed later from metadata.total_size). A key
    "__total_size__" carries the index total_size. None when nothing usable is found."""
    p = folder / INDEX_NAME
    out: dict[str, tuple[tuple[int, ...] | None, str]] = {}
    if p.exists():
        try:
            index = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{p}: not valid JSON: {e}") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise ConversionError(f"{p}: no 'weight_map' object")
        if not all(isinstance(v, str) for v in wm.values()):
            raise ConversionError(f"{p}: every 'weight_map' value must be a shard file name")
        meta = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
        headers: dict[str, dict | None] = {}
        for fname in set(wm.values()):
            fp = folder / str(fname)
            headers[fname] = _read_header(fp) if fp.exists() else None
        for name, fname in wm.items():
            h = headers.get(fname)
            out[name] = h[name] if h is not None and name in h else (None, "?")
        total = meta.get("total_size")
        out["__total_size__"] = ((int(total),) if isinstance(total, int) else None, "meta")  # removed by caller
        return out
    h = _read_header(folder / SINGLE_NAME)
    return dict(h) if h is not None else None


def _open_inventory(folder: Path, dry_run: bool, hub_meta: dict | None = None) -> _Inventory:
    if dry_run and hub_meta is not None and not (folder / SINGLE_NAME).exists() and not (folder / INDEX_NAME).exists():
        return _Inventory(None, {k: (tuple(v[0]), v[1]) for k, v in hub_meta.items()})
    try:
        return _Inventory(CheckpointReader(folder), None)
    except CheckpointError:
        if not dry_run:
            raise
        # a dry run also works on headers only / an index whose shards are absent
        virtual = _virtual_inventory(folder)
        if virtual is None:
            raise
        return _Inventory(None, virtual)


# ---------------------------------------------------------------------------
# plan


@dataclass
class Piece:
    """One source slab of an output tensor: the tensor hf, or in a fused expert tensor, the rows
    row0.. (as many as the output piece has) of expert ``expert``."""

    hf: str
    expert: int | None = None
    row0: int = 0


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]        # numpy order, final
    qtype: QT
    nbytes: int
    pieces: list[Piece]           # one per expert when stacked
    stacked: bool
    rule: Rule
    src_dtype: str
    row_perm: np.ndarray | None = field(default=None, repr=False)
    col_perm: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_params(self) -> int:
        return math.prod(self.shape)


@dataclass
class ConversionPlan:
    src: str
    folder: Path
    out: Path
    outtype: str                  # resolved (never "auto")
    config: CloverConfig
    tokenizer: TokenizerInfo
    tensors: list[TensorPlan]
    shard_paths: list[Path]
    split_max_size: int | None
    dry_run: bool
    virtual: bool = False         # planned without the weights (index / headers only)
    elapsed_s: float = 0.0
    src_bytes: int = 0            # bytes of source tensor data

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


NO_MASK_WARNING = ("warning: config.json names no mask_token_id (the release publishes none): the GGUF runs causally "
                   "only (block size 1); to enable draft-self, add \"mask_token_id\" (its mask token's id) to "
                   "config.json and convert again")


def _load_config(folder: Path) -> CloverConfig:
    p = folder / "config.json"
    if not p.exists():
        raise ConversionError(f"{folder}: config.json not found")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{p}: not valid JSON: {e}") from None
    return parse_config(cfg)


def _plan_tensors(cfg: CloverConfig, inv: _Inventory) -> list[tuple[Rule, str, tuple[int, ...], list[Piece], bool, str]]:
    """Match the table against the checkpoint. Returns (rule, gguf name, final shape,
    pieces, stacked, source dtype) per output tensor; raises on missing / unexpected /
    misshapen / unsupported tensors."""
    names = inv.names()
    consumed: set[str] = set()
    missing: list[str] = []
    bad_shape: list[str] = []
    bad_dtype: list[str] = []
    rows: list[tuple[Rule, str, tuple[int, ...], list[Piece], bool, str]] = []

    def take(name: str, shape: tuple[int, ...] | None, alt: tuple[int, ...] | None = None) -> str | None:
        """shape None: any shape of at most 4 dimensions (kept as it is); alt: a second shape accepted."""
        if name not in inv:
            missing.append(name)
            return None
        consumed.add(name)
        got = inv.shape(name)
        if got is not None and shape is None and len(got) > 4:
            bad_shape.append(f"tensor {name}: expected at most 4 dimensions, got shape {_shape_str(got)}")
        elif got is not None and shape is not None and tuple(got) != tuple(shape) and \
                (alt is None or tuple(got) != tuple(alt)):
            also = f" or {_shape_str(alt)}" if alt is not None else ""
            bad_shape.append(f"tensor {name}: expected shape {_shape_str(shape)}{also}, got {_shape_str(got)}")
        dt = inv.dtype(name)
        if dt not in SUPPORTED_SRC_DTYPES and dt != "?":
            bad_dtype.append(f"tensor {name} has unsupported dtype {dt} (supported: F32, F16, BF16)")
        return dt

    def layer_rows(i: int | None) -> None:
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
                    dt = take(hf, None)
                    got = inv.shape(hf) if hf in inv else None
                    final = (tuple(got) or (1,)) if got is not None else tuple(final)
                else:
                    dt = take(hf, shape, rule.alt_shape(cfg) if rule.alt_shape else None)
                rows.append((rule, gname, tuple(final), [Piece(hf)], False, dt or "?"))
                continue
            assert rule.fused is not None and rule.fused_shape is not None
            fused_names = {r.fused[0].format(i=i) for r in mapping.TENSOR_TABLE if r.fused}
            use_fused = any(n in inv for n in fused_names)
            E, I = cfg.E, cfg.I
            if use_fused:
                fname = rule.fused[0].format(i=i)
                dt = take(fname, rule.fused_shape(cfg))
                row0 = I if rule.fused[1] == "second" else 0  # "first" / "all" start at row 0
                pieces = [Piece(fname, j, row0) for j in range(E)]
            else:
                pieces = []
                dts = set()
                for j in range(E):
                    hf = rule.hf.format(i=i, j=j)
                    d = take(hf, shape)
                    if d:
                        dts.add(d)
                    pieces.append(Piece(hf))
                dt = "BF16" if "BF16" in dts else (sorted(dts)[0] if dts else "?")
            rows.append((rule, gname, (E, *final), pieces, True, dt or "?"))

    layer_rows(None)
    for i in range(cfg.L):
        layer_rows(i)

    if missing:
        raise ConversionError(f"missing tensor(s): {_name_list(missing)}")
    unexpected = [n for n in names if n not in consumed]
    if unexpected:
        raise ConversionError(f"unexpected tensor(s): {_name_list(unexpected)}")
    if bad_shape:
        raise ConversionError(bad_shape[0] + (f" (and {len(bad_shape) - 1} more)" if len(bad_shape) > 1 else ""))
    if bad_dtype:
        raise ConversionError(bad_dtype[0] + (f" (and {len(bad_dtype) - 1} more)" if len(bad_dtype) > 1 else ""))
    return rows


def _out_qtype(rule: Rule, final: tuple[int, ...], stacked: bool, want: QT) -> QT:
    if rule.f32 or len(final) == 1:
        return QT.F32
    if want == QT.Q8_0 and final[-1] % GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        return QT.F16
    return want


def _resolve_source(src: str | os.PathLike, dry_run: bool) -> tuple[Path, str, dict | None]:
    s = str(src)
    p = Path(s).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConversionError(f"{s}: not a folder")
        return p, s, None
    if not _HUB_ID.match(s) or s.startswith((".", "~")):
        raise ConversionError(f"{s}: no such folder (and not a Hugging Face repo id org/name)")
    folder, meta = _download(s, dry_run)
    return folder, s, meta


def _download(repo: str, dry_run: bool) -> tuple[Path, dict | None]:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
        )
    except ImportError as e:  # pragma: no cover
        raise ConversionError(f"{repo}: huggingface_hub is needed to fetch from the hub ({e})") from None
    patterns = [p for p in HUB_PATTERNS if not (dry_run and p == "*.safetensors")]
    try:
        folder = Path(snapshot_download(repo_id=repo, allow_patterns=patterns))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if constants.HF_HUB_OFFLINE:
            raise ConversionError(
                f"{repo}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it first or unset HF_HUB_OFFLINE"
            ) from None
        raise ConversionError(f"{repo}: cannot reach the Hugging Face hub and the repo is not cached") from None
    except RepositoryNotFoundError:
        raise ConversionError(f"{repo}: no such repository on the Hugging Face hub (or no access)") from None
    except HfHubHTTPError as e:
        raise ConversionError(f"{repo}: download failed: {e}") from None
    except OSError as e:
        raise ConversionError(f"{repo}: download failed: {e}") from None
    if dry_run and not (folder / INDEX_NAME).exists() and not (folder / SINGLE_NAME).exists():
        # a single-file repo: read just the safetensors header over HTTP
        try:
            from huggingface_hub import get_safetensors_metadata

            meta = get_safetensors_metadata(repo)
            tensors = {
                n: (list(info.shape), info.dtype)
                for fm in meta.files_metadata.values()
                for n, info in fm.tensors.items()
            }
        except Exception as e:  # noqa: BLE001 - any failure is a user-facing one-liner
            raise ConversionError(f"{repo}: cannot read the safetensors headers for a dry run: {e}") from None
        return folder, tensors
    return folder, None


def _default_out_name(folder: Path, src: str, outtype: str) -> str:
    base = src.rstrip("/").split("/")[-1] if not Path(src).exists() else folder.resolve().name
    return f"{base}-{outtype}.gguf"


class _TempShardWriter(GGUFWriter):
    """A GGUFWriter whose files are temporaries next to the final shard names (renamed into place
    once everything is written): GGUFWriter opens the names format_shard_names gives, so the
    temporaries are substituted there (``temps``: final path -> temporary)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.temps: dict[Path, Path] = {}

    def format_shard_names(self, path: Path) -> list[Path]:
        return [self.temps.get(p, p) for p in super().format_shard_names(path)]

    def lay_out_tensor_data(self) -> dict[str, tuple[int, int]]:
        """After write_ti_data_to_file: where each tensor's bytes go, name -> (fd, offset), laid
        out as write_tensor_data lays them (each at the next multiple of the alignment, padding
        after the last). Every file is sized to its end now, so the padding is the zeros of
        the holes, and the tensors can be written in any order, from any thread (os.pwrite)."""
        assert self.fout is not None
        where: dict[str, tuple[int, int]] = {}
        for f, tensors in zip(self.fout, self.tensors):
            f.flush()
            pos = f.tell()
            for name, ti in tensors.items():
                pos = self.ggml_pad(pos, self.data_alignment)
                where[name] = (f.fileno(), pos)
                pos += ti.nbytes
            os.ftruncate(f.fileno(), self.ggml_pad(pos, self.data_alignment) if tensors else pos)
        return where


class _WriteBack:
    """Starts writing a file's new bytes to disk as they come, without waiting for them (Linux's
    POSIX_FADV_DONTNEED starts the write-back of dirty pages, and drops pages already written):
    the disk works while the next tensors are converted, the final fsync has little left to
    wait for, and a big conversion does not fill the page cache."""

    def __init__(self) -> None:
        self._ranges: dict[int, tuple[int, int]] = {}  # fd -> (dropped up to, write-back started up to)

    def written_up_to(self, fd: int, end: int) -> None:
        """The file's bytes before ``end`` are all written (to the page cache)."""
        if not hasattr(os, "posix_fadvise"):
            return
        dropped, started = self._ranges.get(fd, (0, 0))
        if end - started >= WRITEBACK_BYTES:
            # from the range started last time (written by now, mostly: dropped) to the end
            os.posix_fadvise(fd, dropped, end - dropped, os.POSIX_FADV_DONTNEED)
            self._ranges[fd] = (started, end)


def _build_writer(plan_rows: list[TensorPlan], cfg: CloverConfig, tok: TokenizerInfo, outtype: str,
                  model_name: str, split_max_size: int | None, folder: Path | None = None) -> _TempShardWriter:
    w = _TempShardWriter(None, ARCH, split_max_size=split_max_size or 0)
    for t in plan_rows:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    add_identity(w, folder, model_name)
    add_metadata(w, cfg, tok, outtype)
    return w


def add_identity(w: GGUFWriter, folder: Path | None, model_name: str) -> None:
    """general.name, basename, size_label, finetune, version, license, ... as the hub and
    llama.cpp's own converter fill them: gguf-py's Metadata reads the model card (README.md
    front matter), config.json and the name; the size label counts the tensors (MoE: 8x1.2M)."""
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, folder if folder and folder.is_dir() else None, model_name, total)
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    meta.set_gguf_meta_model(w)


def add_metadata(w: GGUFWriter, cfg: CloverConfig, tok: TokenizerInfo, outtype: str) -> None:
    """Every key of spec/gguf-layout.md but the identity ones (add_identity): gguf-py's typed
    helpers for the standard keys, mapping.KEY_* for our own."""
    w.add_file_type(int(_FILE_TYPES[outtype]))
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.H)
    w.add_block_count(cfg.L)
    w.add_feed_forward_length(cfg.I)
    w.add_head_count(cfg.nh)
    w.add_head_count_kv(cfg.nkv)
    w.add_key_length(cfg.dh)
    w.add_value_length(cfg.dh)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_value(mapping.KEY_RECURRENT_LAYERS.format(arch=w.arch), [cfg.is_recurrent(i) for i in range(cfg.L)],
                    gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_full_attention_interval(cfg.full_attention_interval)
    w.add_rope_dimension_count(cfg.rope_dims)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_expert_count(cfg.E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.I)
    w.add_expert_shared_feed_forward_length(cfg.Is)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_ssm_conv_kernel(cfg.K)
    w.add_uint32(mapping.KEY_CONV_LOOKAHEAD.format(arch=w.arch), cfg.R)
    w.add_ssm_state_size(cfg.dk)
    w.add_ssm_group_count(cfg.Hk)
    w.add_ssm_time_step_rank(cfg.Hv)
    w.add_ssm_inner_size(cfg.Hv * cfg.dv)
    w.add_uint32(mapping.KEY_DIFFUSION_BLOCK_SIZE.format(arch=w.arch), cfg.block_size)
    w.add_string(mapping.KEY_SEMANTICS.format(arch=w.arch), cfg.clover_semantics)
    w.add_string(mapping.KEY_BLOCK_OPERATOR.format(arch=w.arch), cfg.block_operator)
    w.add_expert_shared_count(cfg.num_shared_experts)
    add_tokenizer(w, tok)


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
    folder, src_s, hub_meta = _resolve_source(src, dry_run)
    check_regular_inputs(folder, ConversionError)  # a FIFO would block a read forever (issue 28)
    cfg = _load_config(folder)
    tok = load_tokenizer(folder, cfg)
    inv = _open_inventory(folder, dry_run, hub_meta)
    cfg = mapping.detect_block_operator(cfg, inv.names())  # Clover's block operator or the release's
    total_size = None
    if inv.virtual is not None and "__total_size__" in inv.virtual:
        ts = inv.virtual.pop("__total_size__")[0]
        total_size = ts[0] if ts else None
    try:
        rows = _plan_tensors(cfg, inv)
    finally:
        if inv.reader is not None:
            inv.reader.close()

    if inv.is_virtual:
        # unknown dtypes (missing shards): those of the headers we have, else a guess
        # from the index total_size (about 2 bytes per parameter -> BF16, 4 -> F32)
        known = {r[5] for r in rows if r[5] in SUPPORTED_SRC_DTYPES}
        n_src = sum(math.prod(r[2]) for r in rows)
        if known:
            guess = "BF16" if "BF16" in known else sorted(known)[0]
        elif total_size and n_src and total_size / n_src > 3:
            guess = "F32"
        else:
            guess = "BF16"
        rows = [(r[0], r[1], r[2], r[3], r[4], r[5] if r[5] in SUPPORTED_SRC_DTYPES else guess) for r in rows]

    src_dtypes = {r[5] for r in rows}
    resolved = outtype
    if outtype == "auto":
        resolved = "bf16" if "BF16" in src_dtypes else "f16"
    want = _QTYPES[resolved]

    tensors: list[TensorPlan] = []
    src_bytes = 0
    itemsize = {"F32": 4, "F16": 2, "BF16": 2}
    for rule, gname, final, pieces, stacked, sdt in rows:
        qt = _out_qtype(rule, final, stacked, want)
        t = TensorPlan(
            name=gname, shape=tuple(final), qtype=qt, nbytes=tensor_nbytes(final, qt), pieces=pieces,
            stacked=stacked, rule=rule, src_dtype=sdt, row_perm=None, col_perm=None,
        )
        if rule.perm is not None:
            idx = perm_index(rule.perm, cfg)
            if rule.perm.startswith("rows"):
                t.row_perm = idx
            else:
                t.col_perm = idx
        tensors.append(t)
        src_bytes += math.prod(final) * itemsize.get(sdt, 2)

    if out is None:
        out_p = Path.cwd() / _default_out_name(folder, src_s, resolved)
    else:
        out_p = Path(out).expanduser()
        if str(out).endswith(("/", os.sep)) and not out_p.is_dir():
            raise ConversionError(f"{out}: output folder does not exist")
        if out_p.is_dir():
            out_p = out_p / _default_out_name(folder, src_s, resolved)
    model_name = folder.resolve().name if Path(src_s).exists() else src_s.split("/")[-1]
    w = _build_writer(tensors, cfg, tok, resolved, model_name, split, folder)
    shard_paths = w.format_shard_names(out_p)
    return ConversionPlan(
        src=src_s, folder=folder, out=out_p, outtype=resolved, config=cfg, tokenizer=tok, tensors=tensors,
        shard_paths=shard_paths, split_max_size=split, dry_run=dry_run, virtual=inv.is_virtual,
        src_bytes=src_bytes,
    )


# ---------------------------------------------------------------------------
# data


class _Filler:
    """Converts source slabs straight into the output file, chunk by chunk, on every core:
    each chunk is read in place (a view of the source's memory map), cast into a buffer of its
    worker's (reused) and written at its place in the file (os.pwrite). Numpy's casts and file
    writes release the GIL, so the workers cast and write at once, and nothing of the size of
    a tensor is held: before, a tensor was converted into one of two tensor-sized buffers and
    written by one thread while the next was converted, and the cores waited on each other."""

    def __init__(self, reader: CheckpointReader):
        self.nonfinite: dict[str, int] = {}  # tensor -> NaN/Inf values seen in the source
        self.beyond_f16: dict[str, int] = {}  # tensor -> finite values that became +-inf in f16
        self.reader = reader
        self.touched = 0
        self.read_bytes = 0
        self._local = threading.local()  # each worker's output buffer
        self._workers = os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="clover-chunk")

    def _count(self, nbytes: int) -> None:
        """Account for touched source bytes; past RELEASE_BYTES, drop the memory maps so that
        the touched source pages leave our RSS (the next read maps the file again; views that
        chunks still read keep the old map until they are done)."""
        self.touched += nbytes
        self.read_bytes += nbytes
        if self.touched >= RELEASE_BYTES:
            self.reader.close()
            self.touched = 0

    def _rows(self, piece: Piece, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of the slab (its first axis), a view."""
        rows = slice(piece.row0 + r0, piece.row0 + r1)
        return self.reader.view(piece.hf, (rows,) if piece.expert is None else (piece.expert, rows))

    def submit(self, t: TensorPlan, fd: int, offset: int) -> list[Future]:
        """Queue the tensor's chunks, to be written to fd at offset; wait() for them. A stacked
        tensor's experts are slabs of their own, one after the other in the file."""
        piece_shape = t.shape[1:] if t.stacked else t.shape
        shape2 = (1, piece_shape[0]) if len(piece_shape) == 1 else (piece_shape[0], math.prod(piece_shape[1:]))
        rows, cols = shape2
        assert t.stacked or len(t.pieces) == 1, t.name
        slab_bytes = t.nbytes // len(t.pieces)
        row_bytes = slab_bytes // max(rows, 1)  # of the output
        step = max(1, self._chunk_elems() // max(cols, 1))
        return [self._pool.submit(self._fill_rows, piece, shape2, t, r0, min(rows, r0 + step),
                                  fd, offset + j * slab_bytes + r0 * row_bytes, row_bytes)
                for j, piece in enumerate(t.pieces) for r0 in range(0, rows, step)]

    def wait(self, t: TensorPlan, jobs: list[Future]) -> None:
        """Wait for a tensor's chunks (the first error is raised, the rest are cancelled)."""
        try:
            for job in jobs:
                nbytes, bad, beyond = job.result()
                if bad:
                    self.nonfinite[t.name] = self.nonfinite.get(t.name, 0) + bad
                if beyond:
                    self.beyond_f16[t.name] = self.beyond_f16.get(t.name, 0) + beyond
                self._count(nbytes)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise

    def _chunk_elems(self) -> int:
        """Source elements per chunk: CHUNK_ELEMS shared by the workers. Each worker holds its
        chunk's output, and a chunk that is not a plain cast (a permutation, a transform, bf16
        rounding, quantization) makes temporaries of several times its size, so what the
        chunks hold is the same on 2 cores or 64: the memory bound (2x the largest tensor +
        300 MB) holds on any machine. (Bigger chunks for plain casts were no faster here.)"""
        return max(CHUNK_ELEMS // self._workers, min(CHUNK_ELEMS, 1 << 16))

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This worker's output buffer, at least nbytes long (reused: no page faults)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def _fill_rows(self, piece: Piece, shape2: tuple[int, int], t: TensorPlan, r0: int, r1: int,
                   fd: int, offset: int, row_bytes: int) -> tuple[int, int, int]:
        """Rows r0:r1 of the slab, converted (row_bytes of output each) and written to fd at
        offset: (source bytes read, NaN/Inf values among them, finite ones past the f16 range
        when the output is f16)."""
        rows, cols = shape2
        sdt = self.reader.dtype(piece.hf)
        if r1 - r0 == rows:  # one chunk: the whole slab
            block = self._rows(piece, 0, rows) if piece.expert is not None else self.reader.view(piece.hf)
            block = block.reshape(shape2)
            if t.row_perm is not None:
                block = block[t.row_perm]
        else:  # a slab of 2+ dims whose first axis is the rows; value heads come in runs of rows
            want = t.row_perm[r0:r1] if t.row_perm is not None else np.arange(r0, r1)
            runs = np.split(want, np.flatnonzero(np.diff(want) != 1) + 1)
            parts = [self._rows(piece, int(run[0]), int(run[-1]) + 1) for run in runs]
            block = (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(r1 - r0, cols)
        if t.col_perm is not None:
            block = block[:, t.col_perm]
        out = self._buffer((r1 - r0) * row_bytes)
        _convert_into(out.view(_STORE_DTYPE[t.qtype]).reshape(r1 - r0, -1), block, sdt, t.qtype, t.rule.fn)
        self._write(fd, out, offset)
        return (block.nbytes, *_scan_source(block, sdt, to_f16=t.qtype == QT.F16 and t.rule.fn is None))

    def _write(self, fd, data: np.ndarray, offset: int) -> None:
        """A converted chunk to its place (a subclass may put it elsewhere: quantize_stream's in memory)."""
        _pwrite_all(fd, data, offset)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


_SEEK_AND_WRITE = threading.Lock()  # where os.pwrite is missing (Windows)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """All of data at offset (pwrite may write less than asked). Without os.pwrite (Windows), a
    seek and a write under one lock do the same."""
    view = memoryview(data).cast("B")
    while view:
        if hasattr(os, "pwrite"):
            n = os.pwrite(fd, view, offset)
        else:
            with _SEEK_AND_WRITE:
                os.lseek(fd, offset, os.SEEK_SET)
                n = os.write(fd, view)
        view, offset = view[n:], offset + n


# per source dtype: its bits, its exponent's bits, and the exponent of [2^15, 2^16) (f16's top
# binade: from there up a value can round past 65504)
_EXPONENT = {"BF16": (np.uint16, 0x7F80, 0x4700), "F16": (np.uint16, 0x7C00, None),
             "F32": (np.uint32, 0x7F800000, 0x47000000)}
F16_OVERFLOW = 65520.0  # from here up f32 (and bf16) values round to inf in f16 (65504 + half an ulp)


def _scan_source(block: np.ndarray, sdt: str, to_f16: bool) -> tuple[int, int]:
    """(NaN / Inf values, finite values that f16 turns into +-inf when to_f16) in a source
    block. One fast pass over the exponent bits (their max) says whether to count at all."""
    if sdt not in _EXPONENT or block.size == 0:
        return 0, 0
    bits, ones, f16_top = _EXPONENT[sdt]
    exponent = block.view(bits) & bits(ones)
    top = exponent.max()
    nonfinite = int(np.count_nonzero(exponent == ones)) if top == ones else 0
    beyond = 0
    if to_f16 and f16_top is not None and top >= f16_top:
        x = np.abs(block.view(ml_dtypes.bfloat16).astype(np.float32) if sdt == "BF16" else block)
        beyond = int(np.count_nonzero((x >= F16_OVERFLOW) & np.isfinite(x)))
    return nonfinite, beyond


def _is_plain_cast(sdt: str, qt: QT, fn: str | None) -> bool:
    """A source dtype to qt that numpy casts (or copies) in one pass, with nothing allocated."""
    return fn is None and (qt in (QT.F32, QT.F16) or (qt == QT.BF16 and sdt == "BF16"))


def _convert_into(dst: np.ndarray, block: np.ndarray, sdt: str, qt: QT, fn: str | None) -> None:
    """dst = block converted to qt: a plain cast (or copy) in one pass straight into dst; a
    transform, bf16 rounding of wider floats (NaN payloads kept) or quantization go through
    _convert_block."""
    if _is_plain_cast(sdt, qt, fn):
        src = block.view(ml_dtypes.bfloat16) if sdt == "BF16" and qt != QT.BF16 else block
        with np.errstate(over="ignore"):  # values past f16's range: counted by _scan_source
            np.copyto(dst, src, casting="unsafe")  # numpy's (ml_dtypes') cast, the same as astype
    else:
        dst[...] = _convert_block(block, sdt, qt, fn)


def _convert_block(block: np.ndarray, sdt: str, qt: QT, fn: str | None) -> np.ndarray:
    """The block through float32: transformed (fn), then rounded or quantized to qt."""
    x = block.view(ml_dtypes.bfloat16).astype(np.float32) if sdt == "BF16" else block.astype(np.float32)
    x = apply_fn(fn, x)
    if qt == QT.F32:
        return x
    if qt == QT.F16:
        return x.astype(np.float16)
    if qt == QT.BF16:
        return f32_to_bf16(x)
    if qt == QT.Q8_0:
        return gguf.quants.quantize(np.ascontiguousarray(x), QT.Q8_0)
    raise ConversionError(f"unsupported output type {qt.name}")


def _check_disk(plan: ConversionPlan) -> None:
    need = plan.total_bytes + len(plan.tensors) * 64 + sum(len(s) + 16 for s in plan.tokenizer.tokens) + \
        sum(len(s) + 16 for s in plan.tokenizer.merges) + (1 << 20)
    try:
        free = shutil.disk_usage(plan.out.parent).free
    except OSError as e:
        raise ConversionError(f"{plan.out.parent}: cannot check free space: {e}") from None
    if free < need:
        raise ConversionError(
            f"not enough free disk space in {plan.out.parent}: need {fmt_bytes(need)}, have {fmt_bytes(free)}"
        )


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike | None = None,
    outtype: str = "auto",
    split_max_size: int | str | None = None,
    dry_run: bool = False,
    force: bool = False,
    progress: bool = True,
) -> ConversionPlan:
    """Convert a Clover checkpoint (folder or hub id ``org/name``) to GGUF.

    Returns the :class:`ConversionPlan` (tensor list, shard paths, totals). With
    ``dry_run`` nothing is read beyond headers and nothing is written.
    Raises ConversionError / CheckpointError (one-line messages) on bad input.
    """
    t0 = time.monotonic()
    plan = plan_conversion(src, out, outtype, split_max_size, dry_run=dry_run)
    if plan.config.mask_token_id is None:
        print(NO_MASK_WARNING, file=sys.stderr)
    if dry_run:
        return plan

    out_dir = plan.out.parent
    inputs = [p for p in plan.folder.rglob("*") if p.is_file()] if plan.folder.is_dir() else []
    for p in plan.shard_paths:
        check_output(Path(p), inputs, force, ConversionError)
        clean_stale_temps(Path(p))
    _check_disk(plan)

    reader = CheckpointReader(plan.folder)
    cfg = plan.config
    w = _build_writer(plan.tensors, cfg, plan.tokenizer, plan.outtype,
                      plan.src if not Path(plan.src).exists() else plan.folder.resolve().name, plan.split_max_size,
                      plan.folder)
    tmps = [temp_path(Path(p)) for p in plan.shard_paths]
    w.temps = dict(zip(map(Path, plan.shard_paths), tmps))
    bar = None
    try:
        w.open_output_file(Path(plan.out))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        where = w.lay_out_tensor_data()
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="Converting", leave=False)
        # the chunks of two tensors queued at a time, so that no worker waits between tensors
        filler, write_back, queued = _Filler(reader), _WriteBack(), deque()

        def finish(t: TensorPlan, jobs: list[Future]) -> None:
            filler.wait(t, jobs)
            fd, offset = where[t.name]
            write_back.written_up_to(fd, offset + t.nbytes)
            if bar is not None:
                bar.set_postfix_str(t.name, refresh=False)
                bar.update(t.nbytes)

        try:
            for t in plan.tensors:
                queued.append((t, filler.submit(t, *where[t.name])))
                if len(queued) == 2:
                    finish(*queued.popleft())
            while queued:
                finish(*queued.popleft())
        except BaseException:
            for _, jobs in queued:
                for job in jobs:
                    job.cancel()
            raise
        finally:
            filler.close()
        w.flush()
        for f in w.fout:
            os.fsync(f.fileno())
        w.close()
        reader.close()
        for tp, final in zip(tmps, plan.shard_paths):
            os.replace(tp, final)
        for name, n in filler.nonfinite.items():  # converted as they are, but the user should know
            print(f"warning: {name}: {n} NaN/Inf value(s) in the checkpoint", file=sys.stderr)
        for name, n in filler.beyond_f16.items():
            print(f"warning: {name}: {n} value(s) past the f16 range (+-65504) written as +-inf "
                  "(--outtype bf16 or f32 keeps them)", file=sys.stderr)
    except BaseException:
        try:
            w.close()
        except Exception:  # noqa: BLE001
            pass
        reader.close()
        for tp in tmps:
            try:
                tp.unlink()
            except FileNotFoundError:
                pass
        raise
    finally:
        if bar is not None:
            bar.close()
    plan.elapsed_s = time.monotonic() - t0
    return plan
