"""The converter's input check: a checkpoint folder's files are regular files (the output rules
every writer follows are clover_cpp._files', shared with the runtime)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from clover_cpp._files import file_kind


#: what the converter reads from a checkpoint folder (besides the shards an index names)
_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".jinja")


def check_regular_inputs(folder: Path, error: type[Exception]) -> None:
    """Refuse a checkpoint folder whose files the converter reads (JSON, safetensors, the chat
    template) include a FIFO, a device or a socket, before anything is opened."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise error(f"{folder}: cannot list: {e.strerror or e}") from None
    for p in entries:
        if p.name.endswith(_CHECKPOINT_SUFFIXES):
            try:
                mode = os.stat(p).st_mode
            except OSError:
                continue  # a dangling link: the reader says "not found" in its own words
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                raise error(f"{p}: is {file_kind(mode)}, not a regular file")
