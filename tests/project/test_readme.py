"""The README and the pages in docs/ run: every `bash` and `python` block after the README's
"## A tour that runs", then every `bash` and `python` block of each page in docs/ (file-name
order), in order, in one shell (so a block may use what an earlier one started or wrote), in a
scratch folder that has the checkout's `.venv`, `build` and `models`, as on a fresh clone after
the two set-up commands. Before the tour the only runnable block is the set-up one.

A block that cannot run in a test (a hub download, a GPU build, a LAN, a long benchmark) is
fenced as `text`; every fence is `bash`, `python` or `text`, so nothing is skipped silently.
Also checked: the README stays short, its links and the pages' links point at files that
exist, and the tour's file names say what the files hold."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

REPO = Path(__file__).resolve().parents[2]
TOUR = "## A tour that runs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 250


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def _docs() -> list[Path]:
    return sorted(REPO.joinpath("docs").glob("*.md"))


def test_only_the_setup_block_precedes_the_tour() -> None:
    head, _ = REPO.joinpath("README.md").read_text().split(TOUR, 1)
    runnable = [code for lang, code in _blocks(head) if lang in ("bash", "sh", "python", "")]
    assert len(runnable) == 1 and "./dev.sh demo" in runnable[0] and "./dev.sh test" in runnable[0]


@pytest.mark.parametrize("page", ["README.md"] + [f"docs/{p.name}" for p in _docs()])
def test_every_fence_is_bash_python_or_text(page: str) -> None:
    text = REPO.joinpath(page).read_text()
    assert text.count("```") % 2 == 0, f"{page}: an unclosed fence"
    bad = [lang or "(none)" for lang, _ in _blocks(text) if lang not in ("bash", "text", "python")]
    assert not bad, f"{page}: fences must be bash, python (run) or text (not run), found {bad}"


def test_readme_is_short_and_its_links_resolve() -> None:
    """A newcomer's README: at most ~250 lines, the two commands on the first screen, the
    default model called what it is; every relative link of the README and of docs/ resolves."""
    readme = REPO.joinpath("README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    first_screen = "\n".join(readme.splitlines()[:60])
    assert "./dev.sh demo" in first_screen and "./dev.sh test" in first_screen
    assert "small demo model" in readme and "repetitive" in readme
    for page in [REPO / "README.md", *_docs()]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor in the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{page.relative_to(REPO)}: link to {target}, which does not exist"
    linked = set(LINK.findall(readme))
    for p in _docs():
        assert f"docs/{p.name}" in linked, f"docs/{p.name} is not linked from the README"


def test_readme_tour_and_docs_run(tmp_path: Path) -> None:
    _, tour = REPO.joinpath("README.md").read_text().split(TOUR, 1)
    sources = [("README.md", tour)] + [(f"docs/{p.name}", p.read_text()) for p in _docs()]
    script = ["set -euo pipefail"]
    n = 0
    for name, text in sources:
        for lang, code in _blocks(text):
            if lang == "text":
                continue
            n += 1
            script.append(f"echo '### block {n} ({name}, {lang})' >&2")
            script.append(code if lang == "bash" else f".venv/bin/python - <<'CLOVER_README_PY'\n{code}CLOVER_README_PY")
    assert n >= 8
    for name in (".venv", "build", "models"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if k not in ("CLOVER_LIB_PATH", "LLAMA_CPP_LIB_PATH")}
    env["CLOVER_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=600)  # ~30 s on 2 idle cores
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:  # servers a failed block left running (and a hung block)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        out, err = proc.communicate()
        started = re.findall(r"### block \d+ \(.*?\)", err)
        pytest.fail(f"timed out in {started[-1] if started else 'the first block'}:\n{err[-3000:]}\n{out[-1500:]}")
    assert proc.returncode == 0, f"a block failed:\n{err[-4000:]}\n{out[-2000:]}"
    assert f"### block {n} " in err
    made = {"clover-bf16.gguf": "BF16", "clover-q8_0.gguf": "Q8_0", "clover-q4_k_m.gguf": "Q4_K",
            "shards-00001-of-00004.gguf": None}
    from clover_gguf.reader import read_info

    for name, qtype in made.items():
        assert (tmp_path / name).is_file(), name
        if qtype:  # the name says what the file holds (the tour once wrote bf16 into clover-f16.gguf)
            assert qtype in read_info(tmp_path / name).type_counts, (name, read_info(tmp_path / name).type_counts)
    assert not (tmp_path / "plan.gguf").exists()  # a dry run writes nothing
    assert '"object":"chat.completion"' in out.replace(" ", "")  # the curl reply
    assert "\n----\n" in out  # clover chat, piped: the replies are separated
