"""Output files that cannot lose data: the rules every writer of this project follows (convert,
quantize, imatrix), and the file checks its readers share (``clover inspect``).

Shared by the runtime (clover_cpp) and the converter (clover_convert), which never import each
other.

- An output is written to a hidden temporary file next to it and renamed into place, so a
  reader sees the old file or the new one, never a partial one.
- An existing output is replaced only with ``force``, and never when it is not a regular file
  (a device node, a FIFO, a folder, a link to one) or when it is one of the inputs.
- Every file read or replaced is a regular file (or a link to one): a FIFO would block the
  reader forever (and Ctrl-C with it), a device never ends; they are refused up front.
- An output is never any file of the input, every shard of a split one included.
- Temporary files are named ``.NAME.<pid>.<tag>.tmp``; one whose process is gone (a run that
  was killed) is removed by the next write of NAME, with a note.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path


def file_kind(mode: int) -> str:
    """What a non-regular file is, for a one-line message: "a FIFO", "a device", ..."""
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a file")


def require_regular(path: str | os.PathLike[str], error: type[Exception], missing_ok: bool = True) -> None:
    """Raise ``error`` (one line) when path exists and is not a regular file (links followed).

    Checked before opening: open() of a FIFO blocks until a writer comes, and no signal handler
    runs meanwhile in Python's main thread."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if missing_ok:
            return
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: is {file_kind(mode)}, not a regular file")


_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_gguf_files(path: Path) -> list[Path]:
    """Every file of a split GGUF (NAME-0000i-of-0000n.gguf, as llama.cpp names and loads them)
    given any one of them; [path] for a single file."""
    m = _SPLIT.match(path.name)
    if not m or int(m["n"]) < 1:
        return [path]
    n = int(m["n"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def check_output(out: Path, inputs: Iterable[Path], force: bool, error: type[Exception]) -> None:
    """Raise ``error`` (one line) when writing ``out`` could destroy something."""
    if str(out).endswith(os.sep) or (out.exists() and out.is_dir()):
        raise error(f"{out}: is a folder" if out.exists() else f"{out}: output folder does not exist")
    if not out.parent.is_dir():
        raise error(f"{out.parent}: output folder does not exist")
    for p in (f for i in inputs for f in split_gguf_files(Path(i))):
        try:
            same = p.exists() and out.exists() and os.path.samefile(p, out)
        except OSError:
            same = False
        if same or out.resolve() == p.resolve():
            raise error(f"{out} is one of the inputs ({p}); choose another output path")
    if out.exists() or out.is_symlink():
        try:
            mode = os.stat(out).st_mode
        except OSError:
            mode = 0
        if not stat.S_ISREG(mode):
            raise error(f"{out} exists and is not a regular file; refusing to replace it")
        if not force:
            raise error(f"{out} already exists (use --force to overwrite)")


def temp_path(out: Path) -> Path:
    """A fresh temporary path next to out (same file system, so the rename is atomic)."""
    return out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def clean_stale_temps(out: Path, log=None) -> list[Path]:
    """Remove the temporary files of out left by runs whose process no longer exists."""
    removed = []
    for p in out.parent.glob(f".{out.name}.*.tmp"):
        parts = p.name[len(out.name) + 2:].split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        try:
            os.kill(pid, 0)
            continue  # still running (another writer)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            p.unlink()
            removed.append(p)
            (log or (lambda s: print(s, file=sys.stderr)))(
                f"note: removed {p.name}, left by an interrupted run (pid {pid})")
        except OSError:
            pass
    return removed


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as file managers show sizes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: the loop returns at TiB")
