"""tests/vulkan: run when the libclover under test has a Vulkan device (`./dev.sh vulkan` builds
build-vulkan/ and runs them on it, with llama.cpp's llvmpipe settings); skipped, with the reason,
otherwise. With CLOVER_VULKAN_BUILD set (./dev.sh vulkan and CI set it) a missing Vulkan device
fails them instead: CI must not pass by skipping."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
#: the CPU build the Vulkan results are compared with (./dev.sh setup's build/)
CPU_LIB = Path(os.environ.get("CLOVER_CPU_LIB_PATH", REPO / "build" / "bin" / "libclover.so"))


def ggml_devices() -> list[tuple[str, str]]:
    """(name, description) of every ggml device of the libclover this process loads, or [] when
    there is none (libclover not built)."""
    from clover_cpp import _native as N

    try:
        path = N.find_library()
        N.lib()
    except Exception:  # noqa: BLE001 - no library: nothing to list
        return []
    # libggml next to libclover is the one libclover loaded (the same file: dlopen returns it)
    g = ctypes.CDLL(str(path.parent / "libggml.so"))
    g.ggml_backend_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    g.ggml_backend_dev_get.restype = ctypes.c_void_p
    for f in (g.ggml_backend_dev_name, g.ggml_backend_dev_description):
        f.argtypes = [ctypes.c_void_p]
        f.restype = ctypes.c_char_p
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        out.append((g.ggml_backend_dev_name(d).decode(), g.ggml_backend_dev_description(d).decode()))
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [it for it in items if here in it.path.parents]
    if not mine:
        return
    devices = ggml_devices()
    if any(name.startswith("Vulkan") for name, _ in devices):
        return
    from clover_cpp import _native as N

    try:
        lib = str(N.find_library())
    except Exception as e:  # noqa: BLE001
        lib = f"none ({e})"
    why = (f"the libclover under test ({lib}) has no Vulkan device (devices: "
           f"{', '.join(n for n, _ in devices) or 'none'}): `./dev.sh vulkan` builds build-vulkan/ and runs "
           "these tests on it")
    if os.environ.get("CLOVER_VULKAN_BUILD"):
        raise pytest.UsageError(f"CLOVER_VULKAN_BUILD is set but {why}")
    for it in mine:
        it.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def vulkan_device() -> tuple[str, str]:
    return next(d for d in ggml_devices() if d[0].startswith("Vulkan"))


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory: pytest.TempPathFactory):
    """run(model, context_kwargs, jobs) -> the CPU build's results (tests/vulkan/cpu_build.py in a
    subprocess over CPU_LIB), one array per job."""
    if not CPU_LIB.is_file():
        pytest.fail(f"the CPU build's libclover ({CPU_LIB}) is missing: ./dev.sh setup builds it", pytrace=False)
    d = tmp_path_factory.mktemp("cpu-build")
    n = [0]

    def run(model: Path, context: dict, jobs: list[dict]) -> list[np.ndarray]:
        n[0] += 1
        spec, out = d / f"jobs{n[0]}.json", d / f"out{n[0]}.npz"
        spec.write_text(json.dumps({"model": str(model), "context": context, "jobs": jobs}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_VK")}
        env["CLOVER_LIB_PATH"] = str(CPU_LIB)
        res = subprocess.run([sys.executable, str(Path(__file__).with_name("cpu_build.py")), str(spec), str(out)],
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        z = np.load(out)
        return [z[f"job{i}"] for i in range(len(jobs))]
    return run
