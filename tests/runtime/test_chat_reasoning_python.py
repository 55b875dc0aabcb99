"""Reasoning in the Python API, :meth:`Clover.create_chat_completion`'s ``reasoning_format``
(llama-server's values; "none" by default, as llama-cpp-python has no such argument): a tiny GGUF
carrying llama.cpp's Qwen3 template and a scripted ``<think>`` reply (the harness's ScriptedClover
writing it in pieces), read by chat.cpp's parser into ``message.reasoning_content``, streamed as
``reasoning_content`` deltas before the content; "none" leaves the thinking in the content."""
from __future__ import annotations

from pathlib import Path

import pytest

from clover_cpp.errors import CloverValueError

pytestmark = pytest.mark.needs_libclover

QWEN3 = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"
THINKING = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny."
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def thinker(tiny_artifacts, tmp_path_factory):
    """A real Clover with the Qwen3 template whose generation is the scripted reply."""
    if not QWEN3.is_file():
        pytest.skip("llama.cpp's Qwen3 template is not in this checkout")
    from clover_testkit import fuzz
    from clover_testkit.server_harness import ScriptedClover

    from clover_cpp import Clover

    gguf = fuzz.rewrite_gguf(tiny_artifacts["f32"], tmp_path_factory.mktemp("think") / "tiny-qwen3.gguf",
                             kv={"tokenizer.chat_template": QWEN3.read_text()})
    with Clover(gguf, n_ctx=2048, n_threads=1) as real:
        real.generate_chat = ScriptedClover(real, lambda prompt: THINKING).generate_chat
        yield real


def _streamed(model, **kw) -> tuple[str, str, list[dict]]:
    chunks = list(model.create_chat_completion(ASK, max_tokens=40, stream=True, **kw))
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), chunks)


def test_reasoning_content_whole_and_streamed(thinker) -> None:
    msg = thinker.create_chat_completion(ASK, max_tokens=40, reasoning_format="deepseek")["choices"][0]["message"]
    assert msg["content"] == "It is sunny." and msg["reasoning_content"].strip() == "The user wants Paris."
    assert "tool_calls" not in msg
    thought, content, chunks = _streamed(thinker, reasoning_format="deepseek")
    assert thought.strip() == "The user wants Paris." and content == "It is sunny."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])  # (the thinking comes first)


def test_none_by_default_leaves_the_thinking_in_the_content(thinker) -> None:
    for kw in ({}, {"reasoning_format": "none"}):
        msg = thinker.create_chat_completion(ASK, max_tokens=40, **kw)["choices"][0]["message"]
        assert msg["content"] == THINKING and "reasoning_content" not in msg
        thought, content, _ = _streamed(thinker, **kw)
        assert thought == "" and content == THINKING


def test_an_unknown_reasoning_format_is_refused(thinker) -> None:
    with pytest.raises(CloverValueError, match="reasoning_format"):
        thinker.create_chat_completion(ASK, max_tokens=4, reasoning_format="sometimes")


def test_a_reply_without_thinking_streams_through_unparsed(tiny_artifacts, tmp_path, thinker, parses) -> None:
    """reasoning_format asked for under a template with no thinking (Qwen2.5's): the pieces go
    straight out, chat.cpp's parser never runs (it ran once per piece before); under Qwen3's it
    reads the reply."""
    from clover_testkit import fuzz
    from clover_testkit.server_harness import ScriptedClover

    from clover_cpp import Clover

    qwen25 = QWEN3.with_name("Qwen-Qwen2.5-7B-Instruct.jinja")
    gguf = fuzz.rewrite_gguf(tiny_artifacts["f32"], tmp_path / "tiny-qwen25.gguf",
                             kv={"tokenizer.chat_template": qwen25.read_text()})
    with Clover(gguf, n_ctx=2048, n_threads=1) as real:
        real.generate_chat = ScriptedClover(real, lambda prompt: THINKING).generate_chat
        thought, content, chunks = _streamed(real, reasoning_format="deepseek")
    assert thought == "" and content == THINKING and len(chunks) > 10 and parses == []
    thought, content, _ = _streamed(thinker, reasoning_format="deepseek")
    assert content == "It is sunny." and len(parses) > 1
