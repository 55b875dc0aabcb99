"""Fixtures shared by the test modules: the tiny preset as a checkpoint and as GGUFs."""
from pathlib import Path

import numpy as np
import pytest


def pytest_configure(config: pytest.Config) -> None:
    import signal

    config.addinivalue_line("markers", "needs_libclover: skipped when libclover is not built")
    config.addinivalue_line("markers", "xdist_group(name): run on one pytest-xdist worker (--dist loadgroup)")
    # a shell starts background jobs (`cmd &`) with SIGINT ignored, and every child would inherit
    # that: the Ctrl-C tests need children in which SIGINT does what it does at a terminal
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def xdist_group_kept(request: pytest.FixtureRequest) -> None:
    """Under pytest-xdist's --dist loadgroup, a test marked xdist_group carries its group in its
    node id. Without it (pytest-xdist issue 1386) the groups are split across workers, and two of
    them would build the wheel in build/ at the same time: fail those tests, saying why."""
    item = request.node
    if getattr(request.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail("pytest-xdist lost this test's xdist_group (this pytest / pytest-xdist pair breaks "
                    "--dist loadgroup): install the versions pyproject.toml's test extra names", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def private_calibration_cache(tmp_path_factory: pytest.TempPathFactory):
    """block_size="auto" keeps its cost curve in $CLOVER_CACHE_DIR: never the user's cache."""
    import os

    old = os.environ.get("CLOVER_CACHE_DIR")
    os.environ["CLOVER_CACHE_DIR"] = str(tmp_path_factory.mktemp("clover-cache"))
    yield
    if old is None:
        os.environ.pop("CLOVER_CACHE_DIR", None)
    else:
        os.environ["CLOVER_CACHE_DIR"] = old


# the longest tests (a wheel built and installed in a fresh venv, the README tour) go first, so
# that pytest-xdist's workers do not all wait for one that started them last
SLOW_FIRST = ("test_packaging.py", "test_readme.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow modules first; skip the tests marked needs_libclover, with the reason, when the
    library is missing."""
    from clover_cpp import _native

    items.sort(key=lambda item: item.path.name not in SLOW_FIRST)  # stable: the rest keep their order

    try:
        _native.find_library()
        return
    except _native.CloverLibraryNotFound as e:  # pragma: no cover - depends on the build
        skip = pytest.mark.skip(reason=f"libclover is not built ({e})")
    for item in items:
        if item.get_closest_marker("needs_libclover"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_server(tiny_artifacts):
    """The tiny f32 model served in process (clover_testkit.server_harness.InProcessServer), and a
    context of the same model to compare its replies with: (server, context)."""
    from clover_cpp import Clover
    from clover_testkit.server_harness import InProcessServer

    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1) as m:
        local = m.new_context()
        s = InProcessServer(m)
        yield s, local
        s.stop()
        local.close()


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny preset (f32 checkpoint) converted once to f32, f16 and q8_0 GGUFs."""
    from clover_convert import convert
    from clover_testkit.checkpoints import write_checkpoint

    d = tmp_path_factory.mktemp("tiny")
    ckpt = d / "ck"
    cfg = write_checkpoint(ckpt, preset="tiny", dtype="f32")
    ggufs = {}
    for outtype in ("f32", "f16", "q8_0"):
        ggufs[outtype] = d / f"tiny-{outtype}.gguf"
        convert(ckpt, ggufs[outtype], outtype=outtype, progress=False)
    return {"dir": d, "ckpt": ckpt, "cfg": cfg, **ggufs}


@pytest.fixture(scope="session")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid GGUF of another architecture ('llama')."""
    import gguf

    path = tmp_path_factory.mktemp("foreign") / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def fx(tmp_path_factory: pytest.TempPathFactory):
    """The converter tests' tiny checkpoints and their GGUFs, each made once a session
    (clover_testkit.converted_gguf.Fixtures)."""
    from clover_testkit.converted_gguf import Fixtures

    return Fixtures(tmp_path_factory.mktemp("convert"))


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts chat.cpp's parser handle is asked to read (ChatParser.parse counted)."""
    from clover_cpp.chat_format import ChatParser

    seen: list[str] = []
    parse = ChatParser.parse

    def counted(self, text: str, *, partial: bool = False) -> dict:
        seen.append(text)
        return parse(self, text, partial=partial)

    monkeypatch.setattr(ChatParser, "parse", counted)
    return seen
