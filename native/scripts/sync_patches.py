#!/usr/bin/env python3
"""Work on the patch series as git commits, and write them back.

    python native/scripts/sync_patches.py checkout DIR   # DIR: the pristine pinned tree as a git repo
                                                 # (commit "upstream"), native/patches applied
                                                 # with `git am`, one commit each
    python native/scripts/sync_patches.py export DIR     # DIR's commits since "upstream" ->
                                                 # native/patches/NNNN-*.patch (the old series
                                                 # is replaced)

Edit, reorder or split commits in DIR with git (rebase -i, commit --amend), then export. The
pinned tree is llama.cpp as vendored in the llama-cpp-python sdist of setup_llama.py (upstream
commit UPSTREAM_COMMIT); new files (src/models/clover.cpp) stay in native/src, copied over the
tree after the series, so that the model's graph is edited as a normal file.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from setup_llama import PATCHES, SetupError, extract, fetch_sdist, series

#: the upstream llama.cpp commit of the pinned tree (llama-cpp-python 0.3.36's CHANGELOG)
UPSTREAM_COMMIT = "0c1e57098"
GIT = ["git", "-c", "user.name=clover", "-c", "user.email=dev@clover", "-c", "commit.gpgsign=false"]


def git(repo: Path, *args: str) -> str:
    res = subprocess.run([*GIT, "-C", str(repo), *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise SetupError(f"git {' '.join(args)}: {(res.stdout + res.stderr).strip()}")
    return res.stdout


def checkout(dest: Path) -> None:
    if dest.exists():
        raise SetupError(f"{dest} exists: give a new folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    extract(fetch_sdist(None), dest)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"upstream llama.cpp {UPSTREAM_COMMIT} (llama-cpp-python 0.3.36 vendor tree)")
    git(dest, "tag", "upstream")
    for patch in series():
        git(dest, "am", "-q", "--keep-cr", str(patch))
    print(f"{dest}: upstream + {len(series())} commits; edit them with git, then `export {dest}`")


def export(src: Path) -> None:
    out = git(src, "format-patch", "--zero-commit", "--no-signature", "-o", str(src / ".clover-export"),
              "upstream..HEAD")
    new = [Path(line) for line in out.split()]
    if not new:
        raise SetupError(f"{src}: no commits since 'upstream'")
    for old in series():
        old.unlink()
    for p in new:
        p.rename(PATCHES / p.name)
    (src / ".clover-export").rmdir()
    print("\n".join(f"wrote native/patches/{p.name}" for p in new))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["checkout", "export"])
    ap.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    try:
        (checkout if args.action == "checkout" else export)(args.dir.resolve())
        return 0
    except (SetupError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
