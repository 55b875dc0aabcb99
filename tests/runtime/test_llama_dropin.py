"""clover_cpp.Clover as a drop-in for llama-cpp-python's ``llama_cpp.Llama`` (0.3.36), on the
tiny preset: the signatures and return types of the calls a user touches (tokenizer, sizes,
special tokens, metadata, constructor arguments), save_state / load_state, embeddings and
from_pretrained. The installed llama_cpp package is the reference for the signatures."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from clover_cpp import CloverTypeError, CloverValueError

pytestmark = pytest.mark.needs_libclover


@pytest.fixture(scope="session")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f32"]


@pytest.fixture(scope="session")
def cfg(tiny_artifacts) -> dict:
    return tiny_artifacts["cfg"]


@pytest.fixture(scope="module")
def llm(gguf):
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=512, n_threads=1, block_size=4) as m:
        yield m


def _llama_signature(name: str) -> inspect.Signature | None:
    llama_cpp = pytest.importorskip("llama_cpp.llama")
    return inspect.signature(getattr(llama_cpp.Llama, name))


@pytest.mark.parametrize("name", ["tokenize", "detokenize", "n_ctx", "n_vocab", "n_embd", "token_eos", "token_bos",
                                  "token_nl", "save_state", "load_state", "create_embedding", "embed",
                                  "from_pretrained", "eval", "sample", "pooling_type"])
def test_parameters_are_llamas(name):
    """Each call takes llama-cpp-python's parameters, in its order, with its defaults."""
    from clover_cpp import Clover

    theirs = _llama_signature(name)
    ours = inspect.signature(getattr(Clover, name))
    want = [(p.name, p.default) for p in theirs.parameters.values() if p.kind is not p.VAR_KEYWORD]
    got = [(p.name, p.default) for p in ours.parameters.values() if p.kind is not p.KEYWORD_ONLY][:len(want)]
    assert got == want


def test_tokenize_as_llama(llm, cfg):
    """tokenize(bytes, add_bos=True, special=False) and detokenize -> bytes, as llama-cpp-python's."""
    text = b"hello <|im_start|> world"
    [im_start] = llm.tokenize(b"<|im_start|>", add_bos=False, special=True)
    plain = llm.tokenize(text, add_bos=False)
    parsed = llm.tokenize(text, add_bos=False, special=True)
    assert im_start in parsed and im_start not in plain
    assert llm.tokenize(b"hi", add_bos=False, special=True) == llm.tokenize("hi", add_bos=False, special=True)
    assert llm.tokenize(b"hi") == llm.tokenize(b"hi", True, False)  # (BOS as the model asks: the tiny one adds none)
    out = llm.detokenize(plain)
    assert isinstance(out, bytes) and out == text
    assert llm.detokenize(parsed, special=True) == text
    assert llm.detokenize(plain[2:], prev_tokens=plain[:2]) == llm.detokenize(plain)[len(llm.detokenize(plain[:2])):]
    assert llm.detokenize_text(plain) == text.decode()


def test_sizes_and_special_tokens(llm, cfg):
    assert llm.n_ctx() == 512 and llm.n_vocab() == cfg["vocab_size"] and llm.n_embd() == cfg["hidden_size"]
    assert llm.token_eos() == llm.eos_token == cfg["eos_token_id"]
    assert llm.token_bos() == llm.bos_token
    assert llm.detokenize([llm.token_nl()]) == b"\n"


def test_metadata_is_llamas_dict(llm, gguf):
    """Every non-array key, each value as llama.cpp renders it (what Llama.metadata holds)."""
    from gguf import GGUFReader, GGUFValueType

    md = llm.metadata
    assert isinstance(md, dict) and md["general.architecture"] == "clover"
    fields = {k: f for k, f in GGUFReader(gguf).fields.items() if not k.startswith("GGUF.")}
    arrays = {k for k, f in fields.items() if f.types[0] == GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in arrays and set(md) == set(fields) - arrays
    assert md["clover.embedding_length"] == str(fields["clover.embedding_length"].contents())
    md["x"] = "y"
    assert "x" not in llm.metadata  # (a copy)


def test_constructor_takes_llamas_arguments(gguf):
    """llama-cpp-python's constructor arguments: honoured, without effect where Clover sizes
    things itself (n_batch, n_ubatch, logits_all), or refused naming the argument."""
    from clover_cpp import Clover
    from clover_cpp.chat import CHATML_TEMPLATE

    with Clover(gguf, n_ctx=256, seed=7, n_batch=64, n_ubatch=64, logits_all=True, use_mlock=False, verbose=False,
                chat_format="chatml", chat_handler=None, split_mode=1, offload_kqv=True, n_threads=1,
                block_size=1) as m:
        assert m.n_ctx() == 256 and m.chat_template == CHATML_TEMPLATE
        a = m.create_completion("hello", max_tokens=8, temperature=0.9)
        b = m.create_completion("hello", max_tokens=8, temperature=0.9)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]  # (seed=7: the default seed of every call)
    refused = {"chat_handler": lambda: 0, "chat_format": "llama-2", "vocab_only": True, "lora_path": "x.gguf",
               "n_batch": 0, "pooling_type": 4}
    for name, value in refused.items():
        with pytest.raises(CloverValueError, match=name) as e:
            Clover(gguf, **{name: value})
        assert e.value.param == name
    with pytest.raises(CloverTypeError, match="no_such_argument"):
        Clover(gguf, no_such_argument=1)
    with pytest.raises(TypeError):
        Clover(gguf, 256, 1, 0, 4)  # (block_size, an extra, is keyword-only)


def test_load_state_continues_exactly(llm):
    """A generation after load_state equals the one without the calls in between (greedy), and
    reads none of the saved prompt again."""
    prompt = llm.tokenize(b"def fibonacci(n):", add_bos=True, special=True)
    first = llm.generate(prompt, max_tokens=12, block_size=1, stop_at_eos=False)
    state = llm.save_state()
    assert state.n_tokens == len(state.input_ids) > len(prompt) and state.scores.shape == (1, llm.n_vocab())
    assert isinstance(state.llama_state, bytes) and state.llama_state_size == len(state.llama_state)
    go_on = prompt + list(first.tokens)
    want = llm.generate(go_on, max_tokens=12, block_size=1, stop_at_eos=False)
    llm.generate("something else entirely", max_tokens=8, block_size=4)  # (the memory is another text's now)
    llm.load_state(state)
    assert llm.committed_tokens == list(state.input_ids) and llm.n_tokens == state.n_tokens
    assert abs(llm.last_logits() - state.scores[0]).max() == 0
    got = llm.generate(go_on, max_tokens=12, block_size=1, stop_at_eos=False)
    assert got.tokens == want.tokens and got.stats.n_reused == want.stats.n_reused == state.n_tokens


class _NoDecode:
    """libclover with its decoding calls refused: a load that ran a forward pass would raise."""

    def __init__(self, L):
        self._L = L

    def __getattr__(self, name):
        if name in ("clover_commit", "clover_commit_logits", "clover_generate", "clover_block_pass"):
            raise AssertionError(f"load_state called {name}")
        return getattr(self._L, name)


def test_load_state_reads_no_token_into_another_context(llm, gguf, monkeypatch):
    """The state's bytes alone make the memory: a new context (another block size) loads it without a
    forward pass, with input_ids blanked, and its next generation equals the first context's; the
    prompt is all reused (no prefill forward)."""
    from clover_cpp import Clover
    from clover_cpp import _native as N

    prompt = llm.tokenize(b"The quick brown fox", add_bos=True, special=True)
    llm.reset()
    llm.commit(prompt)
    state = llm.save_state()
    want = llm.generate(prompt, max_tokens=10, block_size=1, stop_at_eos=False)
    assert want.stats.n_reused == len(prompt)
    state.input_ids[:] = 0
    with Clover(gguf, n_ctx=512, n_threads=1, block_size=2) as other:
        real = N.lib()
        monkeypatch.setattr(N, "lib", lambda: _NoDecode(real))
        other.load_state(state)
        monkeypatch.setattr(N, "lib", lambda: real)
        assert other.committed_tokens == prompt
        got = other.generate(prompt, max_tokens=10, block_size=1, stop_at_eos=False)
    assert got.tokens == want.tokens and got.stats.n_reused == len(prompt) and got.stats.n_prompt == len(prompt)


def test_load_state_refuses_foreign_states(llm):
    from clover_cpp.compat import LlamaState

    foreign = LlamaState(llm.save_state().input_ids, llm.save_state().scores, 0, b"\x01\x02", 2, 0)
    with pytest.raises(CloverValueError, match="load_state"):
        llm.load_state(foreign)


def _with_bytes(state, data: bytes):
    from clover_cpp.compat import LlamaState

    return LlamaState(state.input_ids, state.scores, state.n_tokens, data, len(data), state.seed)


def test_load_state_refuses_damaged_bytes_with_one_line(llm):
    """Truncated, extended, bit-flipped (header, tokens, llama.cpp's bytes) or empty: one CloverValueError
    line, and the memory as it was."""
    prompt = llm.tokenize(b"hello world", add_bos=True, special=True)
    llm.reset()
    llm.commit(prompt)
    state = llm.save_state()
    data = state.llama_state
    flipped = []
    for at in (9, 40, 90, len(data) // 2, len(data) - 1):  # version, header fields, tokens, body, last byte
        b = bytearray(data)
        b[at] ^= 0x5A
        flipped.append(bytes(b))
    for bad in [b"", data[:10], data[:100], data[:-1], data + b"\0", *flipped]:
        with pytest.raises(CloverValueError, match=r"^load_state: state: ") as e:
            llm.load_state(_with_bytes(state, bad))
        assert "\n" not in str(e.value)
        assert llm.committed_tokens == prompt
    llm.load_state(state)  # (the good bytes still load)
    assert llm.committed_tokens == prompt


def test_load_state_refuses_another_models_or_kv_types_state(llm, tiny_artifacts):
    from clover_cpp import Clover

    llm.reset()
    llm.commit(llm.tokenize(b"hi", add_bos=True, special=True))
    state = llm.save_state()
    with Clover(tiny_artifacts["q8_0"], n_ctx=512, n_threads=1, block_size=4) as q8:
        with pytest.raises(CloverValueError, match="another model's"):
            q8.load_state(state)
    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1, block_size=4, kv_f32=True, flash_attn=False) as f32:
        with pytest.raises(CloverValueError, match="KV cache is f16, this context's f32"):
            f32.load_state(state)


def test_empty_state_round_trip(llm):
    llm.reset()
    state = llm.save_state()
    assert state.n_tokens == 0 and state.scores.shape == (0, llm.n_vocab())
    llm.commit(llm.tokenize(b"x", add_bos=True, special=True))
    llm.load_state(state)
    assert llm.committed_tokens == []


def test_embeddings(gguf):
    """create_embedding / embed: llama.cpp's pooling of the causal pass's final hidden states
    (mean by default); with LAST pooling the output head applied to the embedding gives the
    logits of the prompt's last position, as Clover's causal commit computes them."""
    pytest.importorskip("llama_cpp")
    import numpy as np
    from gguf import GGUFReader

    from clover_cpp import Clover

    with Clover(gguf, n_ctx=256, n_threads=1, block_size=1) as plain:
        with pytest.raises(CloverValueError, match="embedding=True"):
            plain.embed("hello")
    with Clover(gguf, n_ctx=256, n_threads=1, embedding=True) as m:
        assert m.pooling_type() == 1  # (LLAMA_POOLING_TYPE_MEAN: the default)
        r = m.create_embedding(["hello world", "def f(x):"])
        assert r["object"] == "list" and [d["index"] for d in r["data"]] == [0, 1]
        assert all(d["object"] == "embedding" and len(d["embedding"]) == m.n_embd() for d in r["data"])
        toks = [m.tokenize(t.encode()) for t in ("hello world", "def f(x):")]
        assert r["usage"] == {"prompt_tokens": sum(map(len, toks)), "total_tokens": sum(map(len, toks))}
        assert r["model"] == str(gguf)
        one = m.embed("hello world", normalize=True)
        assert abs(np.linalg.norm(one) - 1) < 1e-5
    with Clover(gguf, n_ctx=256, n_threads=1, embedding=True, pooling_type=3) as m:
        assert m.pooling_type() == 3
        last = np.array(m.embed("hello world"), np.float32)
        toks = m.tokenize(b"hello world")
        logits = m.commit(toks, logits=True)[-1]
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    head = np.asarray(tensors.get("output.weight", tensors["token_embd.weight"]).data, np.float32)
    assert abs(head @ last - logits).max() < 1e-3 * max(1.0, abs(logits).max())


def _hub_cache(root: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """A Hugging Face cache (huggingface_hub's layout) holding one snapshot of ``repo_id``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name, src in files.items():
        dst = repo / "snapshots" / commit / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    return root


def _offline(code: str, cache: Path) -> "subprocess.CompletedProcess[str]":
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "home")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_from_pretrained_reads_the_offline_cache(gguf, tmp_path):
    """from_pretrained(repo_id, glob) with HF_HUB_OFFLINE=1: the cached snapshot's file, no
    network; a glob matching none, or several, is one line naming them."""
    pytest.importorskip("huggingface_hub")
    cache = _hub_cache(tmp_path / "hub", "tiny-org/tiny-clover-GGUF",
                       {"tiny-f32.gguf": gguf, "more/tiny-copy.gguf": gguf, "README.md": gguf.parent / "ck" / "config.json"})
    r = _offline("from clover_cpp import Clover\n"
                 "with Clover.from_pretrained('tiny-org/tiny-clover-GGUF', '*f32.gguf', n_ctx=64, n_threads=1) as m:\n"
                 "    print(m.metadata['general.architecture'], m.n_ctx(), m.model_path)\n", cache)
    assert r.returncode == 0, r.stderr
    arch, n_ctx, path = r.stdout.split()
    assert (arch, n_ctx) == ("clover", "64") and Path(path).is_relative_to(cache)
    r = _offline("from clover_cpp import Clover\n"
                 "try:\n    Clover.from_pretrained('tiny-org/tiny-clover-GGUF', '*.gguf')\n"
                 "except ValueError as e:\n    print(e)\n", cache)
    assert "2 files" in r.stdout and "more/tiny-copy.gguf" in r.stdout
    r = _offline("from clover_cpp import Clover, CloverError\n"
                 "try:\n    Clover.from_pretrained('tiny-org/absent', '*.gguf')\n"
                 "except CloverError as e:\n    print(e)\n", cache)
    assert r.stdout.startswith("from_pretrained: tiny-org/absent is not in the Hugging Face cache")


def test_eval_and_sample(llm):
    """eval(tokens) then sample(): llama-cpp-python's loop; temp=0 is the greedy token of
    Clover's own B = 1 generation, a seed makes draws repeat."""
    pytest.importorskip("llama_cpp")
    prompt = llm.tokenize(b"def fibonacci(n):", add_bos=True, special=True)
    want = llm.generate(prompt, max_tokens=6, block_size=1, stop_at_eos=False).tokens
    llm.reset()
    llm.eval(prompt)
    got = []
    for _ in range(6):
        got.append(llm.sample(temp=0.0))
        llm.eval(got[-1:])
    assert got == list(want)
    llm.set_seed(11)
    draws = {llm.sample(temp=1.5, top_k=0, top_p=1.0, min_p=0.0) for _ in range(3)}
    assert len(draws) == 1 and llm.mask_token not in draws
    with pytest.raises(CloverValueError, match="grammar"):
        llm.sample(grammar="root ::= \"a\"")
    llm.set_seed(-1)


def test_llama_cpp_python_readme_usage(gguf):
    """llama-cpp-python's README usage, with Clover imported as Llama: the same calls run and
    return the same shapes."""
    from clover_cpp import Clover as Llama

    llm = Llama(model_path=str(gguf), n_ctx=256, n_threads=1, seed=1337, verbose=False, n_batch=512, n_gpu_layers=0)
    try:
        out = llm("Q: Name the planets in the solar system? A: ", max_tokens=8, stop=["Q:", "\n"], echo=True)
        assert out["object"] == "text_completion" and out["choices"][0]["text"].startswith("Q: Name the planets")
        assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        chat = llm.create_chat_completion(messages=[{"role": "system", "content": "You are an assistant."},
                                                    {"role": "user", "content": "Describe this image in detail."}],
                                          max_tokens=8)
        assert chat["choices"][0]["message"]["role"] == "assistant"
        toks = llm.tokenize(b"hi", add_bos=False, special=True)
        assert llm.detokenize(toks) == b"hi" and 0 <= llm.token_eos() < llm.n_vocab() and llm.n_ctx() == 256
    finally:
        llm.close()


def test_tokenizer_and_set_cache(gguf):
    """``tokenizer()`` is a LlamaTokenizer-like object; ``set_cache`` with llama-cpp-python's own
    LlamaRAMCache: each completion's state is cached, a prompt that continues a cached one is
    looked up there (the memory then starts from that state) and gives the uncached text."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from clover_cpp import Clover

    class Counting(llama_cpp.LlamaRAMCache):
        hits = 0

        def __getitem__(self, key):
            got = super().__getitem__(key)
            Counting.hits += 1
            return got

    with Clover(gguf, n_ctx=256, n_threads=1, block_size=1) as m:  # (B = 1: the same text every call)
        t = m.tokenizer()
        ids = t.encode("def f(x):")
        assert ids == m.tokenize(b"def f(x):", add_bos=True, special=True) and t.decode(ids) == "def f(x):"
        assert t.detokenize(t.tokenize(b"abc", add_bos=False)) == b"abc"
        first = m.create_completion("def f(x):", max_tokens=6, temperature=0)["choices"][0]["text"]
        more = "def f(x):" + first + "\n"
        want = m.create_completion(more, max_tokens=6, temperature=0)["choices"][0]["text"]
        cache = Counting(capacity_bytes=1 << 28)
        m.set_cache(cache)
        m.reset()
        assert m.create_completion("def f(x):", max_tokens=6, temperature=0)["choices"][0]["text"] == first
        assert len(cache.cache_state) == 1 and Counting.hits == 0
        m.reset()  # (the memory is empty: only the cache holds the first exchange)
        assert m.create_completion(more, max_tokens=6, temperature=0)["choices"][0]["text"] == want
        assert Counting.hits == 1
        m.set_cache(None)
        assert m.cache is None
