#!/usr/bin/env python3
"""Fetch the pinned llama.cpp and apply our patch series to it.

The pinned tree is the one vendored in the llama-cpp-python 0.3.36 sdist
(vendor/llama.cpp, ggml 0.25.3). We download the sdist with pip, check its sha256,
extract vendor/llama.cpp into third_party/llama.cpp, apply native/patches/*.patch in
order and copy native/src/** over the tree. Re-running is safe: a stamp file records
the hash of the sdist + patches + new files, and the tree is rebuilt only when it changes.

    python native/scripts/setup_llama.py [--sdist PATH] [--dest DIR] [--force]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_REQ = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

NATIVE = Path(__file__).resolve().parent.parent  # native/ (this script is in native/scripts)
ROOT = NATIVE.parent
PATCHES = NATIVE / "patches"
NEW_FILES = NATIVE / "src"  # mirrors the llama.cpp tree (src/models/clover.cpp, ...)
CACHE = Path(os.environ.get("CLOVER_CACHE", Path.home() / ".cache" / "clover-cpp"))


class SetupError(Exception):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(explicit: Path | None) -> Path:
    """The sdist from --sdist, the cache, or pip download (verified either way)."""
    path = explicit or CACHE / SDIST_NAME
    if not path.exists():
        if explicit:
            raise SetupError(f"sdist not found: {explicit}")
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"downloading {SDIST_REQ} sdist ...", flush=True)
        # -I: inside pip's isolated build environment (pip install .) PYTHONPATH hides the
        # interpreter's own pip; the isolated mode sees it again
        cmd = [sys.executable, "-I", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SDIST_REQ, "-d", str(CACHE), "-q"]
        if subprocess.run(cmd).returncode != 0:
            raise SetupError(f"pip download of {SDIST_REQ} failed")
    digest = sha256(path)
    if digest != SDIST_SHA256:
        raise SetupError(f"{path}: sha256 {digest} does not match the pinned {SDIST_SHA256}")
    return path


def series() -> list[Path]:
    return sorted(PATCHES.glob("*.patch"))


def new_files() -> list[Path]:
    return sorted(p for p in NEW_FILES.rglob("*") if p.is_file()) if NEW_FILES.exists() else []


def stamp_of(sdist: Path) -> str:
    h = hashlib.sha256(SDIST_SHA256.encode())
    for p in series() + new_files():
        h.update(str(p.relative_to(NATIVE)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def extract(sdist: Path, dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".llama-", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(VENDOR_PREFIX) and (m.isfile() or m.isdir()):
                    m.name = m.name[len(VENDOR_PREFIX):]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        (tmp / ".git").unlink(missing_ok=True)  # a submodule pointer in the sdist
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def apply_patches(dest: Path) -> None:
    for patch in series():
        cmd = ["patch", "-p1", "--forward", "--batch", "-s", "-d", str(dest), "-i", str(patch)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SetupError(f"patch {patch.name} does not apply: {(res.stdout + res.stderr).strip()}")
        print(f"applied {patch.name}")
    for src in new_files():
        target = dest / src.relative_to(NEW_FILES)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
        print(f"added {src.relative_to(NEW_FILES)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help="a local copy of the pinned sdist")
    ap.add_argument("--dest", type=Path, default=ROOT / "third_party" / "llama.cpp")
    ap.add_argument("--force", action="store_true", help="re-extract even when up to date")
    args = ap.parse_args(argv)
    try:
        sdist = fetch_sdist(args.sdist)
        stamp = stamp_of(sdist)
        stamp_file = args.dest / ".clover-stamp"
        if not args.force and stamp_file.exists() and stamp_file.read_text() == stamp:
            print(f"llama.cpp at {args.dest} is up to date")
            return 0
        args.dest.parent.mkdir(parents=True, exist_ok=True)
        extract(sdist, args.dest)
        apply_patches(args.dest)
        stamp_file.write_text(stamp)
        print(f"llama.cpp ready at {args.dest}")
        return 0
    except (SetupError, OSError, tarfile.TarError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
