"""llama-cpp-python's own test suite (the ``tests/`` of its 0.3.36 sdist, the one native/
builds from) run against :class:`Clover` in a child pytest through the thin fixture of
:mod:`clover_testkit.llama_cpp_suite` (``llama_cpp.Llama`` is Clover; the sdist's model
downloads are our tiny GGUFs; nothing is downloaded). Every test of the suite is in
:data:`SELECTED` (each must pass) or :data:`DESELECTED` (with why), so a new one in the suite or
a Clover change that breaks one fails here. The suite runs twice: on a clover GGUF and on its
qwen35moe twin (llama.cpp's own Qwen3.5-MoE architecture). Then focused tests of the compat
fixes the suite needed."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from clover_cpp import CloverValueError

pytestmark = pytest.mark.needs_libclover

HYBRID = "[llama_cpp_hybrid_model_path-False-True]"
TRANSFORMER = "[llama_cpp_transformer_model_path-False-False]"
RECURRENT = "[llama_cpp_recurrent_model_path-True-False]"
CACHE_TESTS = ("test_exact_cached_prompt_reuse_matches_fresh", "test_loaded_exact_cached_prompt_reuse_matches_fresh",
               "test_ram_cache_exact_prompt_hit_matches_fresh", "test_shorter_prompt_prefix_reuse_matches_fresh")

#: the suite's tests that run, each expected to pass
SELECTED = (
    "tests/test_llama.py::test_llama_cpp_version",
    # (llama-cpp-python's own Llama on our libllama: a vocab-only llama GGUF, not a model Clover loads)
    "tests/test_llama.py::test_llama_cpp_tokenization",
    "tests/test_llama.py::test_hybrid_model_prompt_cache_reset",
    *(f"tests/test_llama.py::{t}{HYBRID}" for t in CACHE_TESTS),
    "tests/test_llama.py::test_real_llama_embeddings",
    "tests/test_llama_chat_format.py::test_mistral_instruct",
    "tests/test_llama_chat_format.py::test_hf_tokenizer_config_str_to_chat_formatter",
    "tests/test_llama_grammar.py::test_grammar_from_string",
    "tests/test_llama_grammar.py::test_composed_pydantic_grammar",
    "tests/test_llama_grammar.py::test_grammar_anyof",
    "tests/test_llama_speculative.py::test_find_candidate_pred_tokens",
)

#: the suite's tests that do not run, and why
DESELECTED = {
    "tests/test_llama.py::test_real_model": "asserts Qwen3.5-0.8B's exact token ids ([9419, 11, 1814, 0])",
    "tests/test_llama.py::test_real_llama": "asserts Qwen3.5-0.8B's exact completions (' jumps over the lazy "
                                            "dog.', 'true'); its logits_processor Clover refuses by design",
    "tests/test_llama.py::test_real_llama_repeated_prompt_cache": "asserts Qwen3.5-0.8B's exact completion",
    "tests/test_llama.py::test_recurrent_model_prompt_cache_reset": "a pure recurrent model (mamba): Clover "
                                                                    "loads hybrid architectures only",
    **{f"tests/test_llama.py::{t}{RECURRENT}": "a pure recurrent model (mamba): Clover loads hybrid architectures "
                                               "only" for t in CACHE_TESTS},
    **{f"tests/test_llama.py::{t}{TRANSFORMER}": "a pure transformer (llama stories15M): Clover loads hybrid "
                                                 "architectures only" for t in CACHE_TESTS},
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    from clover_testkit.llama_cpp_suite import extract

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (the quantize extra) is not installed")
    try:
        return extract(tmp_path_factory.mktemp("llama-cpp-suite"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _outcomes(junit: Path) -> dict[str, str]:
    """test id (file::name) -> passed / failed / error / skipped, from pytest's junit XML."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        out[f"{file}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return out


@pytest.mark.parametrize("arch", ["clover", "qwen35moe"])
def test_llama_cpp_pythons_suite_passes_on_clover(suite, tiny_artifacts, tmp_path, arch):
    gguf = tiny_artifacts["f32"]
    if arch == "qwen35moe":
        from clover_testkit.qwen35moe import qwen35moe_from_clover

        qwen35moe_from_clover(gguf, gguf := tmp_path / "qwen35moe.gguf")
    (suite / "pytest.ini").write_text("[pytest]\n")
    junit = tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "clover_testkit.llama_cpp_suite", "-p", "no:cacheprovider",
           "-c", str(suite / "pytest.ini"), "--rootdir", str(suite), "-q", f"--junitxml={junit}", "tests"]
    env = {**os.environ, "CLOVER_SUITE_HYBRID": str(gguf), "CLOVER_SUITE_EMBEDDING": str(gguf),
           "CLOVER_SUITE_DESELECT": "\n".join(DESELECTED)}
    p = subprocess.run(cmd, cwd=suite, env=env, capture_output=True, text=True, timeout=600)
    got = _outcomes(junit) if junit.is_file() else {}
    assert got == dict.fromkeys(SELECTED, "passed"), p.stdout[-6000:] + p.stderr[-2000:]
    assert p.returncode == 0


# -- the compat fixes the suite needed, each on its own

@pytest.fixture(scope="module")
def llm(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=128, n_threads=1, block_size=4) as m:
        yield m


def test_generate_tokens_is_llamas_generate(llm):
    """Llama.generate's parameters; greedy tokens are eval + sample's, each committed on resume;
    a memory holding the prompt (or a prefix of it) is kept, another is cleared."""
    import llama_cpp.llama

    theirs = inspect.signature(llama_cpp.llama.Llama.generate).parameters
    ours = inspect.signature(type(llm).generate_tokens).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]
    prompt = llm.tokenize(b"def f(x):", add_bos=True, special=True)
    llm.reset()
    llm.eval(prompt)
    want = [llm.sample(temp=0.0)]
    for _ in range(2):
        llm.eval(want[-1:])
        want.append(llm.sample(temp=0.0))
    for before in ([], prompt[:2], prompt, [7, 8, 9]):
        llm.reset()
        llm.eval(before)
        g = llm.generate_tokens(prompt, temp=0.0)
        assert [next(g) for _ in range(3)] == want
        assert llm.n_tokens == len(prompt) + 2 and llm.input_ids.tolist() == prompt + want[:2]


def test_generate_tokens_refuses_what_it_cannot_do(llm):
    with pytest.raises(CloverValueError, match="stopping_criteria"):
        next(llm.generate_tokens([1, 2], stopping_criteria=[lambda ids, logits: False]))
    g = llm.generate_tokens([1, 2], temp=0.0)
    next(g)
    with pytest.raises(CloverValueError, match="sent into the generator"):
        g.send([3])


def test_sample_takes_the_last_positions_idx(llm):
    llm.reset()
    llm.eval([1, 2, 3])
    assert llm.sample(temp=0.0, idx=2) == llm.sample(temp=0.0)
    with pytest.raises(CloverValueError, match="idx=1 is not supported"):
        llm.sample(temp=0.0, idx=1)


def test_input_ids_and_memory_kind(llm):
    llm.reset()
    llm.eval([4, 5])
    assert llm.input_ids.dtype.name == "int32" and llm.input_ids[:llm.n_tokens].tolist() == [4, 5]
    assert llm._is_hybrid is True and llm._is_recurrent is False


def test_n_threads_batch_is_n_threads_or_none(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=64, n_threads=2, n_threads_batch=2):
        pass
    with pytest.raises(CloverValueError, match="n_threads_batch=3"):
        Clover(tiny_artifacts["f32"], n_ctx=64, n_threads=2, n_threads_batch=3)


def test_embeddings_with_llama_cpp_llama_patched(tiny_artifacts, monkeypatch):
    """embed() loads llama_cpp.llama.Llama, not whatever the package's name points at (the suite
    makes it Clover)."""
    import llama_cpp

    from clover_cpp import Clover

    monkeypatch.setattr(llama_cpp, "Llama", Clover)
    with Clover(tiny_artifacts["f32"], n_ctx=64, n_threads=1, embedding=True) as m:
        assert len(m.embed("hello")) == m.n_embd()
