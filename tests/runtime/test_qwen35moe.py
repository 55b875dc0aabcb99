"""GGUFs of architecture ``qwen35moe`` (what Qwen3.5/3.6-MoE conversions, the release's among them,
write) run in Clover, the command lines and the server: causal decoding on llama.cpp's own graph,
with prefix reuse across turns; block diffusion and draft-self are refused with one line (that graph
has no canvas). The fixtures (clover_testkit.qwen35moe) are the default model's Hugging Face checkpoint as a
Qwen3.5-MoE one converted by upstream llama.cpp's own convert_hf_to_gguf.py (torch: the test extra
installs it), and the default model's GGUF twin written with gguf-py (the same weights less Clover's
own tensors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clover_testkit.llama_tools import default_gguf  # noqa: F401 - a fixture

pytestmark = pytest.mark.needs_libclover


@pytest.fixture(scope="module")
def twin(default_gguf, tmp_path_factory) -> Path:  # noqa: F811
    from clover_testkit.qwen35moe import qwen35moe_from_clover

    out = tmp_path_factory.mktemp("qwen35moe") / "default-qwen35moe-f16.gguf"
    qwen35moe_from_clover(default_gguf, out)
    return out


@pytest.fixture(scope="module")
def upstream_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("torch", reason="upstream's convert_hf_to_gguf.py needs torch (the test extra)")
    from clover_testkit.llama_tools import REPO
    from clover_testkit.qwen35moe import qwen35moe_checkpoint, upstream_convert

    d = tmp_path_factory.mktemp("qwen35moe-upstream")
    qwen35moe_checkpoint(REPO / "models" / "clover-default", d / "ckpt")
    upstream_convert(d / "ckpt", d / "qwen35moe-f16.gguf")
    return d / "qwen35moe-f16.gguf"


def _as_llama_cpp_python_decodes(gguf: Path) -> None:
    """Clover's causal commit logits equal llama-cpp-python's (llama.cpp's own decode, on the same
    libllama and file; flash attention off in both, llama-cpp-python's default) within 1e-4 of the
    largest, and greedy B = 1 gives its greedy tokens."""
    import itertools

    llama_cpp = pytest.importorskip("llama_cpp")
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=256, n_threads=1, flash_attn=False) as m:
        toks = m.tokenize(b"def parse(self, text):\n    ", add_bos=True, special=True)
        ours = m.commit(toks, logits=True)
        r = m.generate(toks, max_tokens=6, stop_at_eos=False, reuse_prefix=False)
        assert r.stats.block_size == 1 and r.stats.mode == "autoregressive"
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(toks)
        theirs = np.array(llm.scores[:len(toks)], np.float32)
        llm.reset()
        greedy = list(itertools.islice(llm.generate(toks, temp=0.0), 6))
    finally:
        llm.close()
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-4 * max(1.0, float(np.abs(theirs).max()))
    assert r.tokens == greedy


def test_a_gguf_of_upstreams_converter_runs(upstream_gguf) -> None:
    """What convert_hf_to_gguf.py writes for a Qwen3.5-MoE checkpoint (its chat template included)
    loads, decodes causally as llama-cpp-python does, and chats."""
    from clover_cpp import Clover

    _as_llama_cpp_python_decodes(upstream_gguf)
    with Clover(upstream_gguf, n_ctx=256, n_threads=1) as m:
        chat = m.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert chat["choices"][0]["message"]["role"] == "assistant"


def test_causal_decoding_equals_upstream(twin) -> None:
    _as_llama_cpp_python_decodes(twin)


def test_block_diffusion_and_draft_self_are_refused_in_one_line(twin) -> None:
    from clover_cpp import Clover, CloverValueError

    with Clover(twin, n_ctx=256, n_threads=1) as m:
        for kw in ({"block_size": 4}, {"block_size": 8, "draft_self": True}):
            with pytest.raises(CloverValueError) as e:
                m.generate("def f():", max_tokens=8, **kw)
            msg = str(e.value)
            assert "'qwen35moe'" in msg and "block size 1" in msg and "\n" not in msg, msg
        r = m.generate("def f():", max_tokens=8, block_size="auto", stop_at_eos=False)
        assert r.stats.n_generated == 8 and r.stats.block_size == 1


def test_prefix_reuse_across_turns(twin) -> None:
    from clover_cpp import Clover

    with Clover(twin, n_ctx=256, n_threads=1) as m:
        first = m.tokenize(b"def alpha(x):\n", add_bos=True, special=True)
        a = m.generate(first, max_tokens=6, stop_at_eos=False, reuse_prefix=False)
        then = m.committed_tokens + m.tokenize(b"    return x\n", add_bos=False, special=True)
        b = m.generate(then, max_tokens=6, stop_at_eos=False)
        assert b.stats.n_reused > len(first)
        c = m.generate(then, max_tokens=6, stop_at_eos=False, reuse_prefix=False)
        assert a.stats.n_generated == 6 and b.tokens == c.tokens


def test_the_command_lines_run_it(twin, tmp_path) -> None:
    cli = Path(__file__).resolve().parents[2] / "build" / "bin" / "clover-cli"
    runs = [[sys.executable, "-m", "clover_cpp.cli", "inspect", str(twin)],
            [sys.executable, "-m", "clover_cpp.cli", "run", "-m", str(twin), "-p", "def f():", "-n", "4", "-t", "1"]]
    if cli.exists():
        runs.append([str(cli), "-m", str(twin), "-p", "def f():", "-n", "4", "-t", "1"])
    for cmd in runs:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert p.returncode == 0, (cmd, p.stderr[-1500:])
    p = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "run", "-m", str(twin), "-p", "x", "-n", "4",
                        "--block-size", "4"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1 and "'qwen35moe'" in lines[0], p.stderr[-1500:]


def test_the_server_serves_it(twin) -> None:
    import httpx

    from clover_testkit.server_harness import Server

    s = Server(twin, "-t", "1")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "def f():", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text[:300]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "def f():", "max_tokens": 4, "block_size": 4},
                       timeout=60)
        assert r.status_code == 400 and "'qwen35moe'" in r.json()["error"]["message"], r.text[:300]
    finally:
        s.stop()
