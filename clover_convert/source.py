"""A conversion's source: a local checkpoint folder or a Hugging Face repo id (fetched into the
hub cache), and the inventory of its tensors (names, shapes, dtypes) from the safetensors
headers; for a dry run without the weights, from the index json and whatever headers are there.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from clover_gguf.files import file_kind

from .config import ConversionError
from .safetensors_io import (
    INDEX_NAME, SINGLE_NAME, CheckpointError, CheckpointReader, checkpoint_roots, read_header, require_inside)

__all__ = ["HUB_PATTERNS", "Source", "TensorHeader", "Inventory", "resolve_source", "open_inventory",
           "check_regular_inputs"]

#: what a hub download fetches (a dry run leaves out the weights)
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

#: what the converter reads from a checkpoint folder (besides the shards an index names)
_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".jinja")
#: and by name (gguf-py's Metadata reads the model card's front matter into general.*)
_CHECKPOINT_NAMES = ("README.md",)


class TensorHeader(NamedTuple):
    """A source tensor as a header describes it."""

    shape: tuple[int, ...] | None  # None: its shard is absent (the planner takes the config's shape)
    dtype: str                     # safetensors' name (BF16, F32, ...); "?" when its shard is absent


@dataclass
class Source:
    """Where the checkpoint is: ``src`` as given, ``folder`` holding it (the hub cache's snapshot
    for a repo id), ``hub_headers`` the tensors of a single-file hub repo read over HTTP (a dry
    run that downloads no weights), else None."""

    src: str
    folder: Path
    local: bool
    hub_headers: dict[str, TensorHeader] | None = None

    @property
    def model_name(self) -> str:
        """The name the GGUF's identity is made from: the folder's, or the repo id."""
        return self.folder.resolve().name if self.local else self.src

    def out_name(self, outtype: str) -> str:
        """The default output file name: NAME-OUTTYPE.gguf."""
        base = self.folder.resolve().name if self.local else self.src.rstrip("/").split("/")[-1]
        return f"{base}-{outtype}.gguf"

    def files(self) -> list[Path]:
        """Every file under the folder (an output may be none of them)."""
        return [p for p in self.folder.rglob("*") if p.is_file()] if self.folder.is_dir() else []


def resolve_source(src: str | os.PathLike, dry_run: bool) -> Source:
    """A local folder as it is; a repo id ``org/name`` through the hub cache (downloaded)."""
    s = str(src)
    p = Path(s).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConversionError(f"{s}: not a folder")
        return Source(s, p, local=True)
    if not _HUB_ID.match(s) or s.startswith((".", "~")):
        raise ConversionError(f"{s}: no such folder (and not a Hugging Face repo id org/name)")
    folder, headers = _download(s, dry_run)
    return Source(s, folder, local=False, hub_headers=headers)


def _download(repo: str, dry_run: bool) -> tuple[Path, dict[str, TensorHeader] | None]:
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
                n: TensorHeader(tuple(info.shape), info.dtype)
                for fm in meta.files_metadata.values()
                for n, info in fm.tensors.items()
            }
        except Exception as e:  # noqa: BLE001 - any failure is a user-facing one-liner
            raise ConversionError(f"{repo}: cannot read the safetensors headers for a dry run: {e}") from None
        return folder, tensors
    return folder, None


def check_regular_inputs(folder: Path, error: type[Exception]) -> None:
    """Refuse a checkpoint folder whose files the converter (or gguf-py's model-card reader)
    reads (JSON, safetensors, the chat template, README.md) include a FIFO, a device or a
    socket, before anything is opened (a FIFO would block a read forever), or a link that
    resolves outside the folder (a ``chat_template.jinja`` linked to ``/etc/passwd`` or
    ``/proc/self/environ`` would be embedded in the GGUF, and ``clover serve`` hands the
    template to any client). A hub cache snapshot's links into its repo's blobs are
    its own files. Each reader checks its file again (:func:`require_inside`)."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise error(f"{folder}: cannot list: {e.strerror or e}") from None
    roots = checkpoint_roots(folder)
    for p in entries:
        if p.name.endswith(_CHECKPOINT_SUFFIXES) or p.name in _CHECKPOINT_NAMES:
            if p.is_symlink():
                require_inside(p, folder, error, roots)
            try:
                mode = os.stat(p).st_mode
            except OSError:
                continue  # a dangling link: the reader says "not found" in its own words
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                raise error(f"{p}: is {file_kind(mode)}, not a regular file")


# ---------------------------------------------------------------------------
# inventory


class Inventory:
    """Names, shapes and dtypes of the source tensors: from the checkpoint's reader, or (a dry
    run without the weights: ``reader`` None) from ``headers``, with the index's ``total_size``
    (bytes of tensor data) when it gives one."""

    def __init__(self, reader: CheckpointReader | None, headers: dict[str, TensorHeader] | None = None,
                 total_size: int | None = None):
        self.reader = reader
        self.headers = headers or {}
        self.total_size = total_size

    @property
    def is_virtual(self) -> bool:
        return self.reader is None

    def names(self) -> list[str]:
        return self.reader.names() if self.reader is not None else list(self.headers)

    def __contains__(self, name: str) -> bool:
        return name in self.reader if self.reader is not None else name in self.headers

    def shape(self, name: str) -> tuple[int, ...] | None:
        return tuple(self.reader.shape(name)) if self.reader is not None else self.headers[name].shape

    def dtype(self, name: str) -> str:
        return self.reader.dtype(name) if self.reader is not None else self.headers[name].dtype

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def _read_header(path: Path) -> dict[str, TensorHeader] | None:
    """Shapes and dtypes from a safetensors header alone (the data may be absent, which the
    safetensors library refuses: this is for dry runs on headers-only files)."""
    read = read_header(path)
    if read is None:
        return None
    _data_start, header = read
    out = {}
    for name, info in header.items():
        if name == "__metadata__":  # the format's own key: not a tensor
            continue
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not isinstance(info.get("dtype"), str):
            return None
        out[name] = TensorHeader(tuple(int(d) for d in info["shape"]), info["dtype"])
    return out


def _headers_inventory(folder: Path) -> Inventory | None:
    """Dry run without the weights: the tensor list from the index json and/or the safetensors
    headers (files may hold only their header, shards may be missing). Tensors in missing
    shards have no shape and dtype "?" (guessed later from the index's total_size). None when
    nothing usable is found."""
    p = folder / INDEX_NAME
    if not p.exists():
        require_inside(folder / SINGLE_NAME, folder, ConversionError)
        h = _read_header(folder / SINGLE_NAME)
        return Inventory(None, h) if h is not None else None
    require_inside(p, folder, ConversionError)
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
    headers: dict[str, dict[str, TensorHeader] | None] = {}
    for fname in set(wm.values()):
        if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
            raise ConversionError(f"{p}: bad shard file name {fname!r}")
        fp = folder / str(fname)
        require_inside(fp, folder, ConversionError)
        headers[fname] = _read_header(fp) if fp.exists() else None
    tensors: dict[str, TensorHeader] = {}
    for name, fname in wm.items():
        h = headers.get(fname)
        tensors[name] = h[name] if h is not None and name in h else TensorHeader(None, "?")
    total = meta.get("total_size")
    return Inventory(None, tensors, total if isinstance(total, int) else None)


def open_inventory(source: Source, dry_run: bool) -> Inventory:
    """The source's tensors: the checkpoint's reader; a dry run also works on headers only, an
    index whose shards are absent, or a single-file hub repo's header read over HTTP."""
    folder = source.folder
    if dry_run and source.hub_headers is not None and not (folder / SINGLE_NAME).exists() \
            and not (folder / INDEX_NAME).exists():
        return Inventory(None, dict(source.hub_headers))
    try:
        return Inventory(CheckpointReader(folder))
    except CheckpointError:
        if not dry_run:
            raise
        inv = _headers_inventory(folder)
        if inv is None:
            raise
        return inv
