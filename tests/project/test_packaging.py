"""The package as users install it: `pip wheel .` (scikit-build-core: the patched llama.cpp,
libclover and the tools built by CMake and shipped inside the package), installed into a fresh
virtual environment outside the repository, then `clover demo` and a Python generate from
there, with nothing of the checkout on the paths."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# one worker builds the wheel once for both tests (pytest-xdist --dist loadgroup)
pytestmark = [pytest.mark.needs_libclover, pytest.mark.xdist_group("wheel")]

REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CLOVER_LIB_PATH", "LLAMA_CPP_LIB_PATH", "PYTHONPATH", "CLOVER_DEMO_MODEL", "VIRTUAL_ENV")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: the backend comes from this environment and the build reuses build/
    # (incremental); a fresh machine's `pip install .` does the same build from scratch
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-build-isolation", "--no-deps",
                        "-q", "-w", str(out)], capture_output=True, text=True, timeout=1800, env=_clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("clover_cpp-*.whl")
    return whl


def test_wheel_carries_the_native_parts(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    lib = {"libclover", "libllama", "libllama-common", "libggml", "libggml-base", "libggml-cpu", "libggml-rpc"}
    for stem in lib:
        assert any(n.startswith(f"clover_cpp/lib/{stem}.") for n in names), stem
    for tool in ("clover-cli", "ggml-rpc-server"):
        assert f"clover_cpp/lib/{tool}" in names
    assert "clover_cpp/models/clover-default/model.safetensors" in names
    assert "clover_convert/converter.py" in names and "clover_cpp/model.py" in names
    assert "clover_gguf/reader.py" in names  # the package both import
    assert "clover_cpp/cli/__init__.py" in names and "clover_cpp/demo.py" in names
    assert "clover_cpp/server/static/index.html" in names and "clover_cpp/server/static/app.js" in names
    # the product only: the test kit stays in the repository, and tokenizers (its fixture
    # tokenizers' trainer) is no runtime dependency
    assert not any(n.startswith(("tests/", "train/", "third_party/", "build/", "clover_testkit/")) for n in names)
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [ln for ln in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if ln.startswith("Requires-Dist:")]
    assert all("extra ==" in ln for ln in requires if ln.split()[1].startswith("tokenizers")), requires


def test_fresh_venv_runs_demo_and_python(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip costs seconds): this environment's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=900, env=_clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    env = _clean_env(CLOVER_CACHE_DIR=str(tmp_path / "cache"))
    run = dict(capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # outside the repository
    r = subprocess.run([str(venv / "bin" / "clover"), "demo", "-n", "12", "--no-compare", "--no-visual"], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "generated=12 tok" in r.stderr and "models/clover-default" in r.stderr
    code = ("import clover_cpp._native as N; from clover_cpp import Clover; from clover_cpp.demo import demo_model;"
            "import importlib.util as u; assert u.find_spec('clover_testkit') is None;"
            "import pathlib, sys; lib = N.find_library(); print(lib);"
            "path, _ = demo_model(pathlib.Path(sys.argv[1]));"
            "m = Clover(path, n_threads=1); r = m.generate('def add(a, b):', max_tokens=8, stop_at_eos=False);"
            "print(len(r.tokens), repr(r.text))")
    r = subprocess.run([str(py), "-c", code, str(tmp_path / "cache")], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    lib, line = r.stdout.splitlines()[:2]
    assert Path(lib).resolve().is_relative_to(venv.resolve()), lib  # the installed library, not build/
    assert line.startswith("8 ")
    # the wheel's libclover finds its libllama and ggml next to it, wherever the venv is
    r = subprocess.run(["ldd", lib], capture_output=True, text=True, env=env)
    assert "not found" not in r.stdout and str(REPO) not in r.stdout, r.stdout
