"""llama-cpp-python's own tests (the ``tests/`` of its pinned sdist) run against :class:`Clover`.

:func:`extract` copies them (and the vocab-only GGUF that test_llama.py reads) out of the sdist
``native/scripts/setup_llama.py`` keeps; this module is also the pytest plugin that runs them
(``pytest -p clover_testkit.llama_cpp_suite``), a thin fixture:

* ``llama_cpp.Llama`` is :class:`CloverAsLlama` for each test, except those in :data:`REAL_LLAMA`
  (they read a llama GGUF, not a model Clover loads, through llama-cpp-python's own ``Llama``
  on our libllama);
* ``huggingface_hub.hf_hub_download`` answers the sdist's fixture files from our own GGUFs
  (:data:`STAND_INS`, paths in the environment) and fails loudly for any other: nothing is
  downloaded;
* the tests named in ``$CLOVER_SUITE_DESELECT`` are deselected;
* scipy (test_llama.py imports ``scipy.special.log_softmax`` and never calls it) is a stub
  when it is not installed.
"""

from __future__ import annotations

import inspect
import os
import sys
import tarfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SDIST_ROOT = "llama_cpp_python-0.3.36/"
VOCAB = "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"

#: the sdist's hf_hub_download(repo_id, filename) -> the environment variable naming our GGUF
STAND_INS = {
    ("tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF", "Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf"): "CLOVER_SUITE_HYBRID",
    ("CompendiumLabs/bge-small-en-v1.5-gguf", "bge-small-en-v1.5-q4_k_m.gguf"): "CLOVER_SUITE_EMBEDDING",
}

#: tests that keep llama-cpp-python's own Llama (on our libllama)
REAL_LLAMA = ("test_llama_cpp_tokenization",)


def extract(dest: Path) -> Path:
    """The sdist's tests/ and the vocab GGUF under ``dest`` (its root: the tests' working
    folder, as MODEL is relative to it). The sdist: the verified one native/scripts/setup_llama.py
    keeps in its cache (fetched there by ./dev.sh setup)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "native" / "scripts"))
    try:
        import setup_llama  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    sdist = setup_llama.CACHE / setup_llama.SDIST_NAME
    if not sdist.is_file():
        raise FileNotFoundError(f"{sdist}: not there (./dev.sh setup fetches it)")
    setup_llama.fetch_sdist(sdist)  # (verifies its sha256; an explicit path is never downloaded)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (
            m.name.startswith(SDIST_ROOT + "tests/") or m.name == SDIST_ROOT + VOCAB)]
        tar.extractall(dest, members=members, filter="data")
    return dest / SDIST_ROOT.rstrip("/")


def _stand_in(repo_id: str, filename: str, *args: object, **kwargs: object) -> str:
    env = STAND_INS.get((repo_id, filename))
    if env is None or not os.environ.get(env):
        raise RuntimeError(f"no download in this suite: {repo_id}/{filename} has no stand-in GGUF")
    return os.environ[env]


def _scipy_stub() -> None:
    special = types.ModuleType("scipy.special")
    special.log_softmax = lambda x, axis=None: x - np.log(np.sum(np.exp(x), axis=axis, keepdims=True))
    scipy = types.ModuleType("scipy")
    scipy.special = special
    sys.modules.update({"scipy": scipy, "scipy.special": special})


def pytest_configure(config: pytest.Config) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub  # noqa: PLC0415

    huggingface_hub.hf_hub_download = _stand_in  # (before the test modules import it)
    try:
        import scipy.special  # noqa: F401, PLC0415
    except ImportError:
        _scipy_stub()
    from clover_cpp._lib import import_llama_cpp  # noqa: PLC0415

    import_llama_cpp()  # llama_cpp on our libllama


def _clover_as_llama() -> type:
    from clover_cpp import Clover  # noqa: PLC0415

    tokens_call = inspect.signature(Clover.generate_tokens)

    class CloverAsLlama(Clover):
        """Clover, but a ``generate`` call made with ``Llama.generate``'s arguments is
        :meth:`Clover.generate_tokens` (llama-cpp-python's token generator; Clover's own
        ``generate``, which create_completion calls, is block diffusion, by design)."""

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            try:
                tokens_call.bind(self, *args, **kwargs)
            except TypeError:
                return Clover.generate(self, *args, **kwargs)
            return Clover.generate_tokens(self, *args, **kwargs)

        generate.__signature__ = inspect.signature(Clover.generate)  # type: ignore[attr-defined]

    return CloverAsLlama


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the test ids listed in $CLOVER_SUITE_DESELECT (one a line; exact ids, where
    pytest's --deselect takes prefixes: test_real_llama would drop test_real_llama_embeddings)."""
    drop = set(os.environ.get("CLOVER_SUITE_DESELECT", "").splitlines())
    gone = [i for i in items if i.nodeid in drop]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if i.nodeid not in drop]


@pytest.fixture(autouse=True)
def _llama_is_clover(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp  # noqa: PLC0415

    if request.node.originalname not in REAL_LLAMA:
        monkeypatch.setattr(llama_cpp, "Llama", _clover_as_llama())  # (llama_cpp.llama.Llama stays theirs)
