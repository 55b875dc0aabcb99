"""llama.cpp's own tools, built from our patched tree by ./dev.sh setup (build/bin), run a clover GGUF
causally: llama-server's /completion and /v1/chat/completions, llama-cli in conversation mode with
piped input and llama-completion give Clover's B = 1 greedy text; llama-tokenize gives Clover's
tokens; llama-perplexity gives `clover perplexity`'s figure and +/-; llama-quantize, llama-imatrix
and llama-gguf-split write files that Clover and llama.cpp decode alike. (llama-bench:
tests/native/test_causal_path.py.) Each test skips, saying so, when its tool is not built in build/bin
(CLOVER_LLAMA_TOOLS_BIN: another build's bin folder)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clover_testkit.llama_tools import (N_CTX, PROMPT, default_gguf, run_logged_tool,  # noqa: F401
                                       run_tool, tool)
from clover_testkit.presets import FIXTURE_TEXT

pytestmark = pytest.mark.needs_libclover

N_PREDICT = 24
CHAT = [[{"role": "user", "content": "Write a function that adds two numbers."}],
        [{"role": "user", "content": "Hello"}]]
# plain text with special-token text in it: llama-perplexity does not parse it, llama-tokenize does
# (unless --no-parse-special)
SPECIAL_TEXT = (FIXTURE_TEXT + "<|im_end|>\n<|im_start|>user\n<|mask|> done<|endoftext|>\n") * 2


def llama_completion(gguf: Path) -> str:
    """llama-completion's greedy text: whole, since its performance report, logged after it, came out."""
    return run_logged_tool([tool("llama-completion"), "-m", gguf, "-p", PROMPT, "-n", N_PREDICT, "--temp", 0,
                            "-t", 1, "-c", N_CTX, "-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup"],
                           last_line="common_perf_print:").stdout


def clover_b1(gguf: Path, prompt: str) -> str:
    """Clover's B = 1 greedy text (autoregressive decoding, stopping at EOS)."""
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=N_CTX, n_threads=1, block_size=1) as m:
        return m.generate(prompt, max_tokens=N_PREDICT, block_size=1, temperature=0).text


def clover_chat_b1(gguf: Path, turns: list[str]) -> list[str]:
    """Clover's B = 1 greedy replies to the user turns, each turn after the earlier replies."""
    from clover_cpp import Clover

    messages, replies = [], []
    with Clover(gguf, n_ctx=N_CTX, n_threads=1, block_size=1) as m:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            r = m.create_chat_completion(messages, max_tokens=N_PREDICT, temperature=0, block_size=1)
            replies.append(r["choices"][0]["message"]["content"])
            messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(default_gguf):
    """llama-server on the default model: its base URL."""
    exe = tool("llama-server")
    port = free_port()
    proc = subprocess.Popen([str(exe), "-m", str(default_gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", "1", "-c", str(N_CTX), "-np", "1", "--no-warmup"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "llama-server exited:\n" + proc.stdout.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_llama_server_completion_is_clover_b1(llama_server, default_gguf):
    r = httpx.post(llama_server + "/completion", json={"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    want = clover_b1(default_gguf, PROMPT)
    assert want.strip(), "pick another prompt: B = 1 says nothing"
    assert r.json()["content"] == want


@pytest.mark.parametrize("messages", CHAT)
def test_llama_server_chat_completion_is_clover_b1(llama_server, default_gguf, messages):
    r = httpx.post(llama_server + "/v1/chat/completions",
                   json={"messages": messages, "max_tokens": N_PREDICT, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    want = clover_chat_b1(default_gguf, [messages[-1]["content"]])[0]
    assert want.strip(), "pick another message: B = 1 says nothing"
    assert r.json()["choices"][0]["message"]["content"] == want


def test_llama_cli_conversation_with_piped_input_is_clover_b1(default_gguf, tmp_path):
    """llama-cli (conversation mode: the model's chat template, one user turn per input line, the
    earlier turns kept) reading two turns from a pipe: the transcript it writes (-o) has Clover's
    B = 1 replies to the same conversation."""
    turns = [m[0]["content"] for m in CHAT]
    out = tmp_path / "transcript.txt"
    run_tool([tool("llama-cli"), "-m", default_gguf, "-n", N_PREDICT, "--temp", 0, "-t", 1, "-c", N_CTX,
              "--simple-io", "--no-warmup", "-o", out], input="".join(t + "\n" for t in turns))
    # (llama-cli's transcript: a reply that does not end with a newline gets one, then an empty line)
    replies = [r if r.endswith("\n") else r + "\n" for r in clover_chat_b1(default_gguf, turns)]
    assert out.read_text(encoding="utf-8") == "".join(f"User:\n{t}\n\nAssistant:\n{r}\n" for t, r in zip(turns, replies))


def test_llama_completion_is_clover_b1(default_gguf):
    assert llama_completion(default_gguf).strip() == clover_b1(default_gguf, PROMPT).strip()


@pytest.mark.parametrize("parse_special", [True, False])
def test_llama_tokenize_is_clover_tokenize(default_gguf, tmp_path, parse_special):
    from clover_cpp import Clover

    text = tmp_path / "text.txt"
    text.write_text(SPECIAL_TEXT, encoding="utf-8")
    res = run_tool([tool("llama-tokenize"), "-m", default_gguf, "-f", text, "--ids", "--no-escape", "--log-disable",
                    *([] if parse_special else ["--no-parse-special"])])
    with Clover(default_gguf, n_ctx=64, n_threads=1) as m:
        want = m.tokenize(SPECIAL_TEXT, add_bos=True, special=parse_special)
        special = m.tokenize("<|im_end|>", add_bos=False, special=True)
    assert json.loads(res.stdout.strip().splitlines()[-1]) == want
    assert (special[0] in want) == parse_special  # the text's special tokens, parsed or not


def _final_estimate(output: str) -> tuple[float, float]:
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    assert final, "no 'Final estimate' line:\n" + output[-3000:]
    return float(final.group(1)), float(final.group(2))


@pytest.mark.parametrize("chunks", [None, 2])
def test_clover_perplexity_is_llama_perplexity(default_gguf, tmp_path, chunks):
    """Same file, same -c (and --chunks): the same tokens (special-token text not parsed, the
    file read as -f reads it), the same figure and the same +/-."""
    text = tmp_path / "text.txt"
    text.write_text(SPECIAL_TEXT, encoding="utf-8")
    c = 64
    more = [] if chunks is None else ["--chunks", chunks]
    res = run_logged_tool([tool("llama-perplexity"), "-m", default_gguf, "-f", text, "-c", c, "-b", c, "-t", 1, *more],
                          last_line="Final estimate")
    llama_ppl, llama_pm = _final_estimate(res.stdout + res.stderr)
    n_chunks = re.search(r"calculating perplexity over (\d+) chunks", res.stdout + res.stderr)
    ours = run_tool([sys.executable, "-m", "clover_cpp.cli", "perplexity", "-m", default_gguf, "-f", text,
                     "-c", c, "-t", 1, *more])
    ppl, pm = _final_estimate(ours.stdout)
    assert ppl == pytest.approx(llama_ppl, rel=1e-4)
    assert pm == pytest.approx(llama_pm, rel=1e-3, abs=1e-5)
    assert f"({n_chunks.group(1)} chunks of {c} tokens" in ours.stdout
    if chunks is not None:
        assert int(n_chunks.group(1)) == chunks


def test_llama_quantize_and_gguf_split_files_decode_alike(default_gguf, tmp_path):
    """llama-quantize's Q8_0 of a clover GGUF, split by llama-gguf-split into shards: Clover loads
    the shards, and its B = 1 text is llama-completion's on them."""
    import gguf

    q8 = tmp_path / "q8.gguf"
    run_tool([tool("llama-quantize"), default_gguf, q8, "Q8_0", 1])
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(q8).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    run_tool([tool("llama-gguf-split"), "--split", "--split-max-tensors", 16, q8, tmp_path / "q8"])
    shards = sorted(tmp_path.glob("q8-*-of-*.gguf"))
    assert len(shards) > 1
    assert llama_completion(shards[0]).strip() == clover_b1(shards[0], PROMPT).strip()


def test_llama_imatrix_runs_a_clover_gguf(default_gguf, tmp_path):
    """llama-imatrix over a text (causal decoding): an importance matrix for the routed experts
    that llama-quantize takes."""
    import gguf

    text = tmp_path / "text.txt"
    text.write_text(FIXTURE_TEXT * 2, encoding="utf-8")
    im = tmp_path / "imatrix.gguf"
    run_tool([tool("llama-imatrix"), "-m", default_gguf, "-f", text, "-c", 64, "-b", 64, "-t", 1, "--chunks", 4,
              "-o", im, "--no-ppl"])
    names = {t.name for t in gguf.GGUFReader(im).tensors}
    assert "blk.0.ffn_gate_exps.weight.in_sum2" in names
    run_tool([tool("llama-quantize"), "--imatrix", im, default_gguf, tmp_path / "q4.gguf", "Q4_K_M", 1])
