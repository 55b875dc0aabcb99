"""The README runs: every `bash` and `python` block after "## A tour that runs", in order, in one
shell (so a block may use what an earlier one started or wrote), in a scratch folder that has
the checkout's `.venv`, `build` and `models`, as on a fresh clone after the two set-up commands.
Before the tour the only runnable block is the set-up one; other blocks must be `text`."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

REPO = Path(__file__).resolve().parents[1]
TOUR = "## A tour that runs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def test_only_the_setup_block_precedes_the_tour() -> None:
    head, _ = REPO.joinpath("README.md").read_text().split(TOUR, 1)
    runnable = [code for lang, code in _blocks(head) if lang in ("bash", "sh", "python", "")]
    assert len(runnable) == 1 and "./dev.sh demo" in runnable[0] and "./dev.sh test" in runnable[0]
    assert all(lang in ("bash", "text", "python") for lang, _ in _blocks(REPO.joinpath("README.md").read_text()))


def test_readme_tour_runs(tmp_path: Path) -> None:
    _, tour = REPO.joinpath("README.md").read_text().split(TOUR, 1)
    script = ["set -euo pipefail"]
    n = 0
    for lang, code in _blocks(tour):
        if lang == "text":
            continue
        n += 1
        script.append(f"echo '### README block {n} ({lang})' >&2")
        script.append(code if lang == "bash" else f".venv/bin/python - <<'CLOVER_README_PY'\n{code}CLOVER_README_PY")
    assert n >= 10
    for name in (".venv", "build", "models"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if k not in ("CLOVER_LIB_PATH", "LLAMA_CPP_LIB_PATH")}
    env["CLOVER_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        try:  # servers a failed block left running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"README block failed:\n{err[-4000:]}\n{out[-2000:]}"
    assert f"### README block {n} " in err
    for made in ("clover-f16.gguf", "clover-q8_0.gguf", "clover-q4_k_m.gguf", "shards-00001-of-00003.gguf"):
        assert (tmp_path / made).is_file(), made
    assert not (tmp_path / "plan.gguf").exists()  # a dry run writes nothing
    assert '"object":"chat.completion"' in out.replace(" ", "")  # the curl reply
