"""Converter output before and after a change: the sha256 of the same files from two source trees.

    .venv/bin/python benchmarks/convert_identity.py --before /tmp/wt-OLD [--work DIR]

`--before` is a checkout of the older commit (e.g. `git worktree add /tmp/wt-OLD OLD`); the
after side is this tree. Writes fixture checkpoints once (presets tiny and small, f32 and bf16
weights, this tree's clover_testkit), converts each with both trees' `clover_convert` to every
outtype below (q4_k_m is the one-step quantizing convert), and prints one line per file: its
sha256 before and after and whether they are equal. Exits 1 when any file differs.
Both trees run in this Python environment and on the libraries of this tree's build/bin; the
editable install's finder is taken out so that the before tree's packages are the ones imported.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from clover_testkit.checkpoints import write_checkpoint  # noqa: E402

PRESETS = ("tiny", "small")
DTYPES = ("f32", "bf16")
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto", "q4_k_m")

# Runs `python -m clover_convert ARGS` with TREE's packages: the editable install's finder (which
# maps the package names to this checkout) is removed and TREE put first on sys.path.
_RUN_FROM_TREE = """
import runpy, sys
tree, args = sys.argv[1], sys.argv[2:]
sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__]
sys.path[:] = [tree] + [p for p in sys.path if p not in ("", tree, {repo!r})]
sys.argv = ["clover_convert", *args]
runpy.run_module("clover_convert", run_name="__main__")
"""


def convert(tree: Path, src: Path, out: Path, outtype: str) -> None:
    env = dict(os.environ, CLOVER_LIB_PATH=str(REPO / "build" / "bin"))
    env.pop("PYTHONPATH", None)
    code = _RUN_FROM_TREE.format(repo=str(REPO))
    args = [str(src), str(out), "--outtype", outtype, "-t", "1", "--no-progress"]
    p = subprocess.run([sys.executable, "-c", code, str(tree), *args], env=env, capture_output=True, text=True,
                       cwd=tree, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{tree}: convert {src.name} --outtype {outtype} failed:\n{p.stderr[-2000:]}")


def imported_from(tree: Path) -> str:
    """Where clover_convert is imported from under _RUN_FROM_TREE (to check the before tree is used)."""
    code = _RUN_FROM_TREE.split("runpy.run_module")[0] + "import clover_convert; print(clover_convert.__file__)\n"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code.format(repo=str(REPO)), str(tree)], env=env, cwd=tree,
                          capture_output=True, text=True, check=True).stdout.strip()


def sha256(p: Path) -> str:
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the older commit")
    ap.add_argument("--work", type=Path, default=None, help="folder for checkpoints and outputs (default: temporary)")
    a = ap.parse_args()
    before = a.before.resolve()
    for tree in (before, REPO):
        where = imported_from(tree)
        if not where.startswith(str(tree) + os.sep):
            sys.exit(f"clover_convert for {tree} is imported from {where}")
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        differ = 0
        for preset in PRESETS:
            for dtype in DTYPES:
                src = work / f"ck-{preset}-{dtype}"
                write_checkpoint(src, preset=preset, dtype=dtype)
                for outtype in OUTTYPES:
                    name = f"{preset}-{dtype}-{outtype}.gguf"
                    shas = []
                    for side, tree in (("before", before), ("after", REPO)):
                        out = work / side / name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.unlink(missing_ok=True)
                        convert(tree, src, out, outtype)
                        shas.append(sha256(out))
                    same = shas[0] == shas[1]
                    differ += not same
                    print(f"{name:28s} {shas[0][:16]} {shas[1][:16]} {'equal' if same else 'DIFFERENT'}", flush=True)
        n = len(PRESETS) * len(DTYPES) * len(OUTTYPES)
        print(f"{n - differ} of {n} files byte-identical")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
