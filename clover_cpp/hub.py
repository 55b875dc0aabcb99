"""``Clover.from_pretrained``'s side of the Hugging Face Hub: a GGUF of a repository found by a
glob and fetched through huggingface_hub (its cache, its offline mode: with HF_HUB_OFFLINE=1 the
files are those of the cached snapshot and nothing is downloaded)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

from .errors import CloverError, CloverTypeError, CloverValueError

__all__ = ["pretrained_files"]


def _hub() -> SimpleNamespace:
    """The parts of huggingface_hub used here (optional: imported on first use)."""
    try:
        from huggingface_hub import HfApi, hf_hub_download, is_offline_mode, snapshot_download  # noqa: PLC0415
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError  # noqa: PLC0415
        from huggingface_hub.utils import validate_repo_id  # noqa: PLC0415
    except ImportError:
        raise CloverError("from_pretrained needs the huggingface-hub package (pip install huggingface-hub)") from None
    return SimpleNamespace(HfApi=HfApi, hf_hub_download=hf_hub_download, is_offline_mode=is_offline_mode,
                           snapshot_download=snapshot_download, HFValidationError=HFValidationError,
                           LocalEntryNotFoundError=LocalEntryNotFoundError, validate_repo_id=validate_repo_id)


def _repo_files(hub: SimpleNamespace, repo_id: str, local_dir: Path | None, cache_dir: Path | None) -> list[str]:
    """The repository's file paths ("sub/name.gguf"): the Hub's list; offline, or when the Hub
    cannot be asked, the cached snapshot's (local_dir's when given), as hf_hub_download falls
    back to its cache."""
    why = "HF_HUB_OFFLINE is set"
    if not hub.is_offline_mode():
        try:
            return list(hub.HfApi().list_repo_files(repo_id))
        except Exception as e:  # noqa: BLE001 - any failure of the Hub's (network, HTTP): the cache decides
            why = f"the Hub did not answer ({' '.join(str(e).split())[:200]})"
    if local_dir is None:
        try:
            local_dir = Path(hub.snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
        except hub.LocalEntryNotFoundError:
            raise CloverError(f"from_pretrained: {repo_id} is not in the Hugging Face cache and {why}") from None
    return sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*")
                  if p.is_file() and ".cache" not in p.relative_to(local_dir).parts)


def _one_match(files: list[str], pattern: str, repo_id: str) -> str:
    found = [f for f in files if fnmatch.fnmatch(f, pattern)]
    if len(found) != 1:
        what = "no file" if not found else f"{len(found)} files ({', '.join(found[:5])})"
        raise CloverValueError(f"from_pretrained: {what} in {repo_id} match {pattern!r}; its files: "
                               f"{', '.join(files[:20])}"[:500], param="filename")
    return found[0]


def pretrained_files(repo_id: str, filename: str, additional_files: list[str] | None = None,
                     local_dir: str | os.PathLike[str] | None = None,
                     cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local path of the one file of ``repo_id`` matching the glob ``filename`` (e.g.
    ``"*Q8_0.gguf"``), fetched (as each of ``additional_files``: the other shards) with
    huggingface_hub's hf_hub_download into ``local_dir`` or the cache; llama-cpp-python's rules."""
    if not isinstance(repo_id, str) or not isinstance(filename, str):
        raise CloverTypeError("from_pretrained: repo_id and filename must be strings (filename: a glob)")
    hub = _hub()
    try:
        hub.validate_repo_id(repo_id)
    except hub.HFValidationError as e:
        raise CloverValueError(f"from_pretrained: {e}", param="repo_id") from None
    local = Path(local_dir) if local_dir is not None else None
    cache = Path(cache_dir) if cache_dir is not None else None
    files = _repo_files(hub, repo_id, local, cache)
    paths = []
    for pattern in [filename, *(additional_files or [])]:
        name = PurePosixPath(_one_match(files, pattern, repo_id))
        sub = str(name.parent) if str(name.parent) != "." else None
        paths.append(Path(hub.hf_hub_download(repo_id, name.name, subfolder=sub, local_dir=local, cache_dir=cache)))
    return paths[0]
