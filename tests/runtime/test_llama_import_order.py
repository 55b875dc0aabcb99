"""llama-cpp-python's ``llama_cpp`` next to ``clover_cpp``: imported first it loads our
libllama (it failed: "Shared library with base name 'llama' not found"), through the finder that
packaging/_clover_cpp_llama.pth installs; imported after a ``Clover`` loaded, it leaves
libclover's log callback in place (its own printed llama.cpp's debug lines, ``set_canvas: ...``,
a few per block); and llama.cpp's warning about the positions a block pass decodes again
(``find_slot: non-consecutive token position``) is a debug line for libclover. Each case runs in
a child process: the callback and the import are per process."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

if importlib.util.find_spec("llama_cpp") is None:  # (importing it here would load a library)
    pytest.skip("llama-cpp-python (the quantize extra) is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
PER_BLOCK = ("set_canvas", "set_expert_coreset", "find_slot")

GENERATE = """
from clover_cpp import Clover
llm = Clover({gguf!r}, n_ctx=256, n_threads=1{verbose})
for kw in (dict(block_size=4), dict(block_size=4, draft_self=True)):
    llm.generate("def f(x):", max_tokens=12, **kw)
print("generated")
"""


def _env() -> dict[str, str]:
    """This environment, without the LLAMA_CPP_LIB_PATH an earlier import of clover_cpp set."""
    return {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}


def _run(code: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0 and "generated" in p.stdout, p.stderr
    return p


def _site_with_the_hook(tmp_path: Path) -> Path:
    """A site folder holding what the install puts beside the packages (CMakeLists.txt)."""
    d = tmp_path / "site"
    d.mkdir()
    for f in ("_clover_cpp_llama.py", "_clover_cpp_llama.pth"):
        shutil.copy(REPO / "packaging" / f, d / f)
    return d


def _our_libllama() -> str:
    from clover_cpp._lib import llama_lib_path

    return str(llama_lib_path())


def test_llama_cpp_imported_first_loads_our_libllama(tmp_path: Path, tiny_artifacts) -> None:
    site = _site_with_the_hook(tmp_path)
    p = _run(f"import site; site.addsitedir({str(site)!r})\n"
             "import llama_cpp\nprint('lib', llama_cpp.llama_cpp._lib._name)\n"
             + GENERATE.format(gguf=str(tiny_artifacts["f32"]), verbose=""))
    assert f"lib {_our_libllama()}" in p.stdout.splitlines()
    assert p.stderr == "", p.stderr


def test_without_the_hook_llama_cpp_first_fails() -> None:
    """What the hook is for (llama-cpp-python installed without its own library, as ours is)."""
    p = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path += {sysconfig.get_paths()['purelib']!r},;"
                        "import llama_cpp"], capture_output=True, text=True, timeout=60, env=_env())
    own = Path(sysconfig.get_paths()["purelib"]) / "llama_cpp" / "lib"
    if any(own.glob("*llama*")):
        pytest.skip(f"llama-cpp-python has its own library ({own})")
    assert p.returncode != 0 and "Shared library with base name 'llama' not found" in p.stderr, p.stderr


def test_the_installed_environment_has_the_hook() -> None:
    purelib = Path(sysconfig.get_paths()["purelib"])
    if not (purelib / "_clover_cpp_llama.pth").is_file():
        pytest.skip("clover-cpp was installed before the hook existed: ./dev.sh setup installs it")
    p = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_cpp._lib._name)"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert p.returncode == 0 and p.stdout.strip() == _our_libllama(), p.stderr


@pytest.mark.parametrize("when", ["after-load", "before-load"])
def test_llama_cpp_imported_next_to_clover_logs_nothing_per_block(tiny_artifacts, when: str) -> None:
    code = GENERATE.format(gguf=str(tiny_artifacts["f32"]), verbose="")
    at = code.index("for kw" if when == "after-load" else "llm = Clover")
    p = _run(code[:at] + "import llama_cpp\n" + code[at:])
    assert p.stderr == "", p.stderr


def test_warnings_show_no_per_block_line(tiny_artifacts) -> None:
    """Clover(verbose=True): llama.cpp's warnings and errors, but not one line per block."""
    p = _run(GENERATE.format(gguf=str(tiny_artifacts["f32"]), verbose=", verbose=True"))
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith(PER_BLOCK)], p.stderr


def test_debug_level_still_shows_them(tiny_artifacts) -> None:
    p = _run("import clover_cpp; clover_cpp.set_verbosity(2)\n"
             + GENERATE.format(gguf=str(tiny_artifacts["f32"]), verbose=""))
    assert "set_canvas: " in p.stderr and "find_slot: non-consecutive token position" in p.stderr
