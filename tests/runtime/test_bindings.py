"""The Python bindings (clover_cpp.Clover) on the tiny preset: generation, streaming, chat,
tokenizer, causal commits (committed-position logits, L_last), block logits and greedy
decoding against the numpy reference (spec v2: logits at t predict t+1, causal commits of any
length, decode blocks right after the prompt), errors, lifetime."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from clover_cpp import _native

pytestmark = pytest.mark.needs_libclover

PROMPTS = ["hello world", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="session")
def tiny(tiny_artifacts) -> tuple[Path, Path]:
    """(checkpoint folder, f32 GGUF) of the tiny preset."""
    return tiny_artifacts["ckpt"], tiny_artifacts["f32"]


@pytest.fixture(scope="session")
def cfg(tiny_artifacts) -> dict:
    """The tiny preset's config.json (token ids, vocabulary, training block size)."""
    return tiny_artifacts["cfg"]


@pytest.fixture(scope="session")
def ref(tiny):
    from clover_testkit.reference import CloverReference

    return CloverReference.from_pretrained(tiny[0])


@pytest.fixture(scope="module")
def _shared_model(tiny):
    from clover_cpp import Clover

    with Clover(tiny[1], n_ctx=1024, n_threads=1, flash_attn=False, kv_f32=True, block_size=8) as m:
        yield m


@pytest.fixture
def model(_shared_model):
    """The module's model at B = 8: a generate call with another block_size leaves the context
    at that B (clover_generate_params.block_size), and the tests compare block passes with the
    reference at B = 8 whichever tests ran before them on this worker."""
    _shared_model.block_size = 8
    return _shared_model


def _n_prompt(model, prompt: str) -> int:
    """Prompt tokens of a text prompt (generate tokenizes with add_special): the first decode
    block starts at this position."""
    return len(model.tokenize(prompt, add_bos=True, special=True))


def test_properties(model, cfg) -> None:
    assert model.n_vocab() == cfg["vocab_size"]
    assert model.train_block_size == cfg["block_size"] and model.block_size == 8
    assert model.mask_token == cfg["mask_token_id"] and model.eos_token == cfg["eos_token_id"]
    assert model.n_ctx() == 1024
    assert "<|im_start|>" in (model.chat_template or "")
    assert model.metadata.get("general.architecture") == "clover"
    assert model.metadata.get("no.such.key") is None
    assert "block_size=8" in repr(model)


def test_generate_result(model) -> None:
    from clover_testkit.reference import ubatch_tokens

    r = model.generate("hello world", max_tokens=20)
    assert len(r.tokens) == 20 and r.stats.n_generated == 20
    assert r.text == model.detokenize_text(r.tokens)
    s = r.stats
    assert s.finish_reason == "max_tokens" and r.finish_reason == "max_tokens"
    assert s.n_prompt == _n_prompt(model, "hello world")
    prompt_forwards = -(-s.n_prompt // ubatch_tokens(8))
    # blocks of 8, 8 and 4: the first two commits ride on the next block's first pass
    assert s.block_size == 8 and s.n_blocks == 3 and s.n_commits == 2 and s.n_decode_passes > 0
    assert s.n_forward == prompt_forwards + s.n_decode_passes
    assert s.tokens_per_forward == pytest.approx(20 / (s.n_forward - prompt_forwards))
    assert s.t_decode_ms > 0 and s.tokens_per_second > 0
    assert "tok/forward" in s.format()
    # token ids as the prompt give the same output
    r2 = model.generate(model.tokenize("hello world", add_bos=True, special=True), max_tokens=20)
    assert r2.tokens == r.tokens
    assert model.generate("hello", max_tokens=0).tokens == []


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("B", [1, 4, 8])
def test_stream_equals_generate(model, prompt: str, B: int) -> None:
    r = model.generate(prompt, max_tokens=24, block_size=B)
    stream = model.generate(prompt, max_tokens=24, block_size=B, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == r.text
    assert stream.result is not None and stream.result.tokens == r.tokens
    assert stream.result.text == r.text
    assert len(pieces) >= 1


def test_stream_really_streams(model) -> None:
    """The first piece arrives while the generation is still running."""
    gate = threading.Event()
    seen_first = []

    third = _n_prompt(model, "hello world") + 16  # blocks of 8 start right after the prompt

    def on_step(canvas, n_masked, block_start):
        if block_start >= third:  # third block: wait until the consumer saw a piece
            gate.wait(timeout=10)
        return False

    stream = model.generate("hello world", max_tokens=40, block_size=8, stream=True, on_step=on_step)
    it = iter(stream)
    first = next(it)
    seen_first.append(first)
    assert stream.result is None  # still running
    gate.set()
    rest = list(it)
    assert "".join(seen_first + rest) == stream.result.text


def test_stream_follows_the_canvas(model) -> None:
    """Pieces arrive after denoising steps, not once per block: once the block's unmasked
    prefix is non-empty, the consumer gets it while the block is still being denoised. The
    block starts right after the prompt: its position 0 is the first generated token."""
    kw = dict(max_tokens=24, block_size=32, threshold=1.0, stop_at_eos=False)
    # a prompt whose block gets position 0 while at least two positions are still masked (the
    # piece is pushed after that step; the consumer is awaited at the next one, mid-block)
    prompt = None
    for p in PROMPTS:
        steps: list[tuple[bool, int]] = []
        model.generate(p, **kw, on_step=lambda c, n, b: steps.append((c[0] != model.mask_token, n)))
        if any(u and n >= 2 for u, n in steps):
            prompt = p
            break
    assert prompt is not None, "no prompt unmasks position 0 before the block's last steps"
    gate = threading.Event()
    seen = {"prefix": False, "waited": None, "starts": set()}

    def on_step(canvas, n_masked, block_start):
        seen["starts"].add(block_start)
        if seen["prefix"] and n_masked > 0 and seen["waited"] is None:
            seen["waited"] = gate.wait(timeout=10)   # mid-block: the consumer must have a piece
        if canvas[0] != model.mask_token:
            seen["prefix"] = True
        return False

    stream = model.generate(prompt, **kw, stream=True, on_step=on_step)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        gate.set()
    assert "".join(pieces) == stream.result.text
    assert stream.result.stats.n_blocks == 1
    assert seen["starts"] == {_n_prompt(model, prompt)}
    assert seen["waited"] is True


def test_stream_close_cancels(model) -> None:
    stream = model.generate("hello world", max_tokens=200, block_size=4, stream=True)
    next(iter(stream))
    stream.close()
    assert stream.result is None or stream.result.finish_reason in ("cancelled", "max_tokens")
    # the model is usable afterwards
    assert len(model.generate("x", max_tokens=4).tokens) == 4


def test_on_step_sees_canvas_and_cancels(model) -> None:
    calls = []

    def on_step(canvas, n_masked, block_start):
        calls.append((list(canvas), n_masked, block_start))

    P = _n_prompt(model, "hello world")
    r = model.generate("hello world", max_tokens=20, block_size=8, on_step=on_step)
    assert calls and all(len(c) == 8 for c, _, _ in calls)
    # blocks of 8 from the end of the prompt; the last one's positions past the budget
    # (20 - 16 = 4 of 8 inside it) stay masked
    assert {b for _, _, b in calls} == {P, P + 8, P + 16}
    assert all(c.count(model.mask_token) == n for c, n, b in calls if b < P + 16)
    assert all(c.count(model.mask_token) == n + 4 and c[4:] == [model.mask_token] * 4
               for c, n, b in calls if b == P + 16)
    assert calls[-1][1] == 0
    # the canvases of finished blocks hold the output
    done = [c for c, n, _ in calls if n == 0]
    assert done[0] + done[1] + done[2][:4] == r.tokens

    r2 = model.generate("hello world", max_tokens=64, block_size=8,
                        on_step=lambda c, n, b: b >= P + 16)
    assert r2.finish_reason == "cancelled"
    assert r2.tokens == r.tokens[:16]  # blocks P and P + 8 finished; P + 16 was interrupted


def test_callback_exception_is_reraised(model) -> None:
    def boom(canvas, n_masked, block_start):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        model.generate("hello", max_tokens=8, on_step=boom)
    with pytest.raises(KeyError):
        list(model.generate("hello", max_tokens=8, on_step=boom, stream=True))
    with pytest.raises(ZeroDivisionError):
        model.generate("hello", max_tokens=8, on_block=lambda text, toks: 1 / 0)
    assert len(model.generate("hello", max_tokens=8).tokens) == 8


def test_seeded_sampling_is_deterministic(model) -> None:
    kw = dict(max_tokens=24, temperature=0.8, top_k=40, top_p=0.9)
    a = model.generate("hello", seed=1, **kw)
    b = model.generate("hello", seed=1, **kw)
    c = model.generate("hello", seed=2, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_max_steps_caps_the_steps(model) -> None:
    r = model.generate("hello world", max_tokens=24, block_size=8, threshold=1.0, max_steps=2)
    assert r.stats.n_decode_passes <= 2 * r.stats.n_blocks


def test_chat(model) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    prompt = model.format_chat(msgs)
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    r = model.chat(msgs, max_tokens=16)
    im_end = model.tokenize("<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1 and im_end[0] not in r.tokens
    full = model.generate(prompt, max_tokens=16)
    # the chat reply is the plain generation cut at the end-of-turn token
    cut = full.tokens[: full.tokens.index(im_end[0])] if im_end[0] in full.tokens else full.tokens
    assert r.tokens == cut
    streamed = "".join(model.chat(msgs, max_tokens=16, stream=True))
    assert streamed == r.text


def test_generate_chat_and_end_of_turn_tokens(model) -> None:
    """The public calls the CLI and server use: end_of_turn_tokens (the chat's stop ids) and
    generate_chat (a rendered prompt, continued from the last exchange, stopped at end of turn)."""
    im_end = model.tokenize("<|im_end|>", add_bos=False, special=True)
    eot = model.end_of_turn_tokens
    assert im_end[0] in eot and model.mask_token not in eot
    eot.append(-1)  # a copy: the object's list is not changed through it
    assert -1 not in model.end_of_turn_tokens
    msgs = [{"role": "user", "content": "hi"}]
    text = model.format_chat(msgs)
    r = model.generate_chat(text, max_tokens=16)
    assert r.tokens == model.chat(msgs, max_tokens=16).tokens
    assert not set(r.tokens) & set(model.end_of_turn_tokens)
    # the next turn continues the exchange: its tokens start with the last prompt's and reply's
    nxt = model.format_chat(msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "more"}])
    assert model.chat_tokens(nxt)[: len(model.chat_tokens(text)) + len(r.tokens)] == model.chat_tokens(text) + r.tokens
    r2 = model.generate_chat(nxt, max_tokens=4)
    assert r2.stats.n_reused > len(model.tokenize(text, add_bos=True, special=True))  # the prompt and part of the reply
    assert "".join(model.generate_chat(text, max_tokens=16, stream=True)) == r.text
    with pytest.raises(TypeError):
        model.generate_chat(msgs)


@pytest.mark.parametrize("text", ["hello world", "def fibonacci(n):\n    return n", "  spaces  and\ttabs",
                                  "ünïcödé ✓", "<|im_start|>user\nhi<|im_end|>"])
def test_tokenize_round_trip(model, text: str) -> None:
    toks = model.tokenize(text, add_bos=False, special=True)
    assert toks and all(0 <= t < model.n_vocab() for t in toks)
    assert model.detokenize_text(toks, special=True) == text


def test_tokenize_matches_tokenizers(model, tiny) -> None:
    """llama.cpp's gpt2 + qwen2 tokenizer (from the GGUF) splits text as `tokenizers` does (from
    the checkpoint's tokenizer.json, which clover_testkit.bpe trained)."""
    from tokenizers import Tokenizer

    from clover_testkit.presets import FIXTURE_TEXT

    hf = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
    for text in [FIXTURE_TEXT, *PROMPTS, "It's what they'd say: WE'RE here, I'll go. 12345 + 678",
                 "  spaces  and\ttabs\r\n\n   trailing  ", "ünïcödé ✓ 日本語のテキスト 🎉 \x01\x7f",
                 "<|im_start|>user\nhi<|im_end|>\n<|mask|><|endoftext|>"]:
        assert model.tokenize(text, add_bos=False, special=True) == hf.encode(text, add_special_tokens=False).ids, text


def test_tokenize_special(model, tiny) -> None:
    from tokenizers import Tokenizer

    im_start = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")).token_to_id("<|im_start|>")
    assert im_start is not None
    assert model.tokenize("<|im_start|>", add_bos=False, special=True) == [im_start]
    assert len(model.tokenize("<|im_start|>", add_bos=False, special=False)) > 1
    assert model.detokenize_text([im_start]) == "" and model.detokenize_text([im_start], special=True) == "<|im_start|>"
    assert model.tokenize("", add_bos=False, special=True) == []
    assert model.detokenize_text([]) == ""


def _rel_ok(got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    return float(np.abs(got - want).max()) <= tol * float(np.abs(want).max())


def test_block_logits_match_reference(model, ref) -> None:
    B, mask = 8, model.mask_token
    # commit_before: any number of tokens (no block alignment); the canvas starts right after
    before = model.tokenize("The quick brown fox jumps over the lazy dog, twice.", add_bos=False, special=True)[:13]
    assert len(before) == 13
    for toks in ([5, 6, 7, mask, mask], [mask] * 8, [100]):
        got = model.block_logits(toks, commit_before=before)
        assert model.n_committed == len(before)
        mem = ref.new_memory()
        ref.commit(mem, before)
        want = ref.block_pass(mem, toks, B)
        assert got.shape == (len(toks), model.n_vocab()) and got.dtype == np.float32
        # f32 weights, f32 KV cache, no flash attention: float rounding only
        assert _rel_ok(got, want, 1e-4)
    # against an empty memory
    model.reset()
    assert model.n_committed == 0
    got = model.block_logits([1, 2, 3])
    want = ref.block_pass(ref.new_memory(), [1, 2, 3], B)
    assert _rel_ok(got, want, 1e-4)


def test_commit_and_last_logits(model, ref) -> None:
    """Clover.commit is causal: its logits are the reference's committed-position logits (row t
    predicts t + 1), last_logits is their last row, and commits split any way add up."""
    from clover_cpp import CloverError

    model.reset()
    with pytest.raises(CloverError):          # nothing committed: no L_last
        model.last_logits()
    first, second = list(range(20)), list(range(20, 31))
    got = model.commit(first, logits=True)
    assert model.n_committed == 20
    mem = ref.new_memory()
    want = ref.commit(mem, first)
    assert got.shape == (20, model.n_vocab()) and got.dtype == np.float32
    assert _rel_ok(got, want, 1e-4)
    assert np.array_equal(model.last_logits(), got[-1])
    assert model.commit(second) is None       # without logits
    assert model.n_committed == 31
    want2 = ref.commit(mem, second)
    assert _rel_ok(model.last_logits(), want2[-1], 1e-4)
    got = model.block_logits([1, 2])
    want = ref.block_pass(mem, [1, 2], 8)
    assert _rel_ok(got, want, 1e-4)
    # the same text in one commit, and token by token
    model.reset()
    one = model.commit(first + second, logits=True)
    assert _rel_ok(one, ref.commit(ref.new_memory(), first + second), 1e-4)
    model.reset()
    tbt = np.concatenate([model.commit([t], logits=True) for t in first + second])
    assert np.abs(tbt - one).max() <= 1e-5 * np.abs(one).max()
    model.reset()
    assert model.n_committed == 0
    with pytest.raises(CloverError):
        model.last_logits()


def test_block_logits_default_kv_cache(tiny, ref) -> None:
    """The default (f16 KV cache, automatic flash attention) stays close to the reference."""
    from clover_cpp import Clover

    with Clover(tiny[1], n_ctx=256, n_threads=1) as m:
        mask = m.mask_token
        before = list(range(30, 47))
        got = m.block_logits([3, mask, mask, 4], commit_before=before)
        mem = ref.new_memory()
        committed = ref.commit(mem, before)
        want = ref.block_pass(mem, [3, mask, mask, 4], 8)
        assert _rel_ok(got, want, 2e-3)
        assert _rel_ok(m.last_logits(), committed[-1], 2e-3)


@pytest.mark.parametrize("threshold", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("B", [1, 4, 8])
def test_greedy_equals_reference(model, ref, B: int, threshold: float) -> None:
    from clover_testkit.reference import generate

    for prompt in PROMPTS:
        toks = model.tokenize(prompt, add_bos=True, special=True)
        want = generate(ref, toks, max_tokens=16, block_size=B, threshold=threshold)
        got = model.generate(toks, max_tokens=16, block_size=B, threshold=threshold)
        assert got.tokens == want.tokens, (prompt, B, threshold)
        assert got.stats.n_decode_passes == want.n_steps
        assert got.stats.n_forward == want.n_forward
        assert got.stats.n_commits == want.n_commits
        assert got.stats.tokens_per_forward == pytest.approx(want.tokens_per_forward)
        if B == 1:  # autoregressive: no pass, one forward per token after the first
            assert want.n_steps == 0 and want.n_commits == len(want.tokens) - 1


def test_errors(model, tiny, tmp_path: Path) -> None:
    from clover_cpp import Clover, CloverError

    bad = [dict(threshold=2.0), dict(threshold=-0.1), dict(block_size=0), dict(temperature=-1),
           dict(top_p=-0.1), dict(top_p=1.5), dict(top_k=-1), dict(max_steps=-1), dict(max_tokens=-1),
           dict(max_tokens=1.5), dict(temperature=float("inf")), dict(seed=-2), dict(seed=2**64)]
    for kw in bad:
        with pytest.raises(CloverError):
            model.generate("hello", **kw)
    with pytest.raises(CloverError, match="out of range"):
        model.generate([0, 99999])
    with pytest.raises(CloverError):  # context full: native message
        model.generate("hello", max_tokens=5000)
    with pytest.raises(CloverError) as ei:
        model.block_logits(list(range(9)))  # more than B tokens
    assert ei.value.message and ei.value.status == _native.CLOVER_ERR_INVALID_ARG
    with pytest.raises(CloverError) as ei:  # an empty prompt: nothing predicts the first block
        model.generate([], max_tokens=4)
    assert ei.value.status == _native.CLOVER_ERR_INVALID_ARG and "empty prompt" in ei.value.message
    with pytest.raises(CloverError) as ei:
        model.commit([])
    assert ei.value.status == _native.CLOVER_ERR_INVALID_ARG
    with pytest.raises(CloverError):
        model.commit([0, 99999])
    # no block alignment any more: commit_before of any length
    assert model.block_logits([1], commit_before=[1, 2, 3]).shape == (1, model.n_vocab())
    assert model.n_committed == 3
    # loading
    with pytest.raises(CloverError, match="no such file"):
        Clover(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CloverError, match="not a GGUF"):
        Clover(junk)
    with pytest.raises(CloverError):
        Clover(tiny[1], n_ctx=2)
    with Clover(tiny[1], n_ctx=0, n_threads=1) as m:  # (llama.cpp's n_ctx = 0: the model's training context)
        assert m.n_ctx() == m.n_ctx_train >= 3
    with pytest.raises(CloverError):
        Clover(tiny[1], block_size=0)
    assert issubclass(CloverError, RuntimeError)


def test_wrong_architecture(llama_gguf: Path) -> None:
    from clover_cpp import Clover, CloverError

    with pytest.raises(CloverError, match="not a 'clover' model"):
        Clover(llama_gguf)


def test_two_models_and_close(tiny) -> None:
    from clover_cpp import Clover, CloverError

    a = Clover(tiny[1], n_ctx=256, n_threads=1, flash_attn=False, kv_f32=True, block_size=8)
    b = Clover(tiny[1], n_ctx=256, n_threads=1, block_size=4, flash_attn=False, kv_f32=True)
    assert a.block_size == 8 and b.block_size == 4
    ra = a.generate("hello", max_tokens=12)
    rb = b.generate("hello", max_tokens=12)
    assert ra.tokens == a.generate("hello", max_tokens=12).tokens
    assert rb.tokens == a.generate("hello", max_tokens=12, block_size=4).tokens
    a.close()
    a.close()  # harmless
    assert a.closed and not b.closed
    with pytest.raises(CloverError, match="closed"):
        a.generate("hello")
    assert b.generate("hello", max_tokens=12).tokens == rb.tokens
    with b:
        pass
    assert b.closed
    b.close()


def test_quantize_api(tiny, tmp_path: Path) -> None:
    from clover_cpp import Clover, quantize
    from clover_cpp.quant import QuantizeError

    out = quantize(tiny[1], tmp_path / "q8.gguf", "Q8_0", n_threads=1)
    assert out.is_file() and out.stat().st_size < tiny[1].stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with Clover(out, n_ctx=256, n_threads=1) as m:
        assert len(m.generate("hello", max_tokens=8).tokens) == 8
    with pytest.raises(QuantizeError, match="already exists"):
        quantize(tiny[1], out, "Q8_0")
    with pytest.raises(QuantizeError, match="unknown"):
        quantize(tiny[1], tmp_path / "x.gguf", "Q9_9")


# ---------------------------------------------------------------- llama-cpp-python shims

def _llama_signature(name: str):
    import inspect

    from clover_cpp._lib import import_llama_cpp

    return inspect.signature(getattr(import_llama_cpp().Llama, name))


@pytest.mark.parametrize("name", ["create_completion", "create_chat_completion"])
def test_shims_take_llama_cpp_pythons_arguments(name: str) -> None:
    # code written for llama_cpp.Llama calls these by keyword: every one of its parameters exists
    # here, with its default where Clover has the knob (the sampling defaults are Llama's)
    import inspect

    from clover_cpp import Clover

    ours = inspect.signature(getattr(Clover, name)).parameters
    theirs = _llama_signature(name).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for p in ("temperature", "top_p", "top_k", "max_tokens", "seed", "stream"):
        assert ours[p].default == theirs[p].default, p


def test_create_completion(model) -> None:
    r = model.create_completion("hello world", max_tokens=6, temperature=0)
    want = model.generate("hello world", max_tokens=6)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and isinstance(r["created"], int)
    (c,) = r["choices"]
    assert c["text"] == want.text and c["index"] == 0 and c["finish_reason"] == "length" and c["logprobs"] is None
    assert r["usage"] == {"prompt_tokens": want.stats.n_prompt, "completion_tokens": 6,
                          "total_tokens": want.stats.n_prompt + 6}
    assert model("hello world", max_tokens=6, temperature=0)["choices"][0]["text"] == want.text  # Llama.__call__
    assert model.create_completion("hello world", max_tokens=6, temperature=0, echo=True)["choices"][0]["text"] == \
        "hello world" + want.text
    chunks = list(model.create_completion("hello world", max_tokens=6, temperature=0, stream=True))
    assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == want.text
    assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    # max_tokens None: until EOS or the end of the context (whole blocks of the default B)
    r = model.create_completion("hello world", max_tokens=None, temperature=0)
    assert r["usage"]["total_tokens"] <= model.n_ctx() and r["choices"][0]["finish_reason"] in ("stop", "length")
    # sampling with a seed reproduces; without one it is random, as Llama's
    a = model.create_completion("hello", max_tokens=12, seed=11)
    assert a["choices"][0]["text"] == model.create_completion("hello", max_tokens=12, seed=11)["choices"][0]["text"]


def test_create_chat_completion(model) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = model.create_chat_completion(msgs, max_tokens=6, temperature=0)
    want = model.chat(msgs, max_tokens=6)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    (c,) = r["choices"]
    assert c["message"] == {"role": "assistant", "content": want.text} and c["finish_reason"] in ("stop", "length")
    assert r["usage"]["completion_tokens"] == len(want.tokens)
    chunks = list(model.create_chat_completion(msgs, max_tokens=6, temperature=0, stream=True))
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == want.text
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_shims_logprobs_and_refusals(model) -> None:
    from clover_cpp import CloverError

    r = model.create_completion("hello world", max_tokens=5, temperature=0, logprobs=2)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(x <= 0 for x in lp["token_logprobs"]) and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    r = model.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 and bytes(e["bytes"]) for e in content)
    # what Clover does not have is refused, naming the argument, unless left neutral; llama.cpp's
    # samplers are honoured (tests/native/test_sampler_chain.py), their bad values refused by name
    for kw in (dict(suffix="x"), dict(tfs_z=0.5), dict(min_p=1.5), dict(repeat_penalty=0.0), dict(mirostat_mode=3)):
        with pytest.raises(CloverError, match=next(iter(kw)).replace("_mode", "")):
            model.create_completion("hi", max_tokens=2, **kw)
    plain = model.create_completion("hi", max_tokens=1, temperature=0)["choices"][0]["text"]
    bias = {model.generate("hi", max_tokens=1, temperature=0).tokens[0]: float("-inf")}
    assert model.create_completion("hi", max_tokens=1, temperature=0, logit_bias=bias)["choices"][0]["text"] != plain
    model.create_completion("hi", max_tokens=2, min_p=0.0, repeat_penalty=1.3, logit_bias={})
    with pytest.raises(CloverError, match="tools"):  # a malformed tool (tool calling: test_chat_tools_python.py)
        model.create_chat_completion([{"role": "user", "content": "hi"}], tools=[{"type": "function"}])


def test_shims_stream_each_chunks_own_logprobs(model) -> None:
    """Streamed with logprobs, each chunk carries its own tokens' (llama-cpp-python's shape);
    joined, they are the unstreamed reply's, and the last chunk carries none."""
    kw = dict(max_tokens=10, temperature=0, logprobs=2, block_size=4)
    want = model.create_completion("hello world", **kw)["choices"][0]["logprobs"]
    chunks = [ch["choices"][0] for ch in model.create_completion("hello world", stream=True, **kw)]
    lps = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert len(lps) >= 2 and chunks[-1]["logprobs"] is None and chunks[-1]["finish_reason"] == "length"
    for k in want:
        assert [x for lp in lps for x in lp[k]] == want[k], k
    assert all(c["logprobs"] is not None and len(c["logprobs"]["tokens"]) >= 1 for c in chunks[:-1])
    # echo: the prompt's with the echo chunk
    echoed = [ch["choices"][0] for ch in model.create_completion("hello world", stream=True, echo=True, **kw)]
    scored = model.create_completion("hello world", echo=True, **kw)["choices"][0]["logprobs"]
    assert [x for c in echoed if c["logprobs"] for x in c["logprobs"]["token_logprobs"]] == scored["token_logprobs"]
    msgs = [{"role": "user", "content": "hi"}]
    ckw = dict(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, block_size=4)
    want_c = model.create_chat_completion(msgs, **ckw)["choices"][0]["logprobs"]["content"]
    chunks = [ch["choices"][0] for ch in model.create_chat_completion(msgs, stream=True, **ckw)]
    assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == want_c
    assert chunks[-1]["logprobs"] is None and sum(c["logprobs"] is not None for c in chunks) >= 2


def test_shims_grammar_and_response_format(model) -> None:
    import json

    from clover_cpp._lib import import_llama_cpp

    gbnf = 'root ::= "yes" | "no"'
    for g in (gbnf, import_llama_cpp().LlamaGrammar.from_string(gbnf, verbose=False)):
        r = model.create_completion("Answer:", max_tokens=8, temperature=0.8, seed=3, grammar=g)
        assert r["choices"][0]["text"] in ("yes", "no"), r["choices"][0]
    r = model.create_chat_completion([{"role": "user", "content": "a JSON object please"}], max_tokens=64,
                                     temperature=0, response_format={"type": "json_object"})
    text = r["choices"][0]["message"]["content"]
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # cut by max_tokens: a prefix of a JSON object
        assert text.lstrip().startswith("{"), text
