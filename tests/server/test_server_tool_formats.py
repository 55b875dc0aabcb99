"""`clover serve` with a model whose template uses another tool-call markup than ours: a tiny
GGUF carrying llama.cpp's Qwen3-Coder template (the XML form Qwen3.5-MoE's GGUFs write), a
scripted reply in that markup, read by llama.cpp's chat.cpp parser into tool_calls - whole, and
streamed as llama-server streams them (the call's name first, then its arguments piece by piece),
the deltas joined giving the whole call - with the official openai client."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_testkit.server_harness import InProcessServer, ScriptedClover

pytestmark = pytest.mark.needs_libclover

openai = pytest.importorskip("openai", reason="the test extra installs openai")

TEMPLATE = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "models" / "templates" / "Qwen3-Coder.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
REPLY = ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def scripted(tiny_artifacts, tmp_path_factory):
    if not TEMPLATE.is_file():
        pytest.skip("llama.cpp's Qwen3-Coder template is not in this checkout")
    from clover_testkit import fuzz

    from clover_cpp import Clover

    gguf = fuzz.rewrite_gguf(tiny_artifacts["f32"], tmp_path_factory.mktemp("xml") / "tiny-xml-tools.gguf",
                             kv={"tokenizer.chat_template": TEMPLATE.read_text()})
    with Clover(gguf, n_ctx=2048, n_threads=1) as real:
        model = ScriptedClover(real, lambda prompt: REPLY)
        s = InProcessServer(model)
        yield s, model
        s.stop()


def test_an_xml_call_whole_and_streamed(scripted) -> None:
    s, model = scripted
    c = s.client()
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER])
    assert "<tools>" in model.prompts[-1] and "get_weather" in model.prompts[-1]  # the template rendered them
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "I will look."
    (call,) = msg.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    chunks = list(c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content.strip() == "I will look." and "<" not in content
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1 and {d.index for d in deltas} == {0}
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_text_in_no_markup_stays_content(scripted) -> None:
    s, model = scripted
    model.script = lambda prompt: "It is sunny in Paris."
    try:
        r = s.client().chat.completions.create(model="x", messages=ASK, tools=[WEATHER])
    finally:
        model.script = lambda prompt: REPLY
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_required_and_named_follow_the_templates_own_markup(scripted) -> None:
    """tool_choice "required" / a named function under the XML template: no prefill of our JSON
    form; llama.cpp's grammar of the template's markup instead (clover_chat_params' grammar, its
    generation prompt cut off; like llama-server's, it lets text come before the call, so the
    tiny model, which never learnt tools, is only shown to decode under it), and the XML call the
    model writes is read back."""
    from clover_cpp import tool_calls

    s, model = scripted
    c = s.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        tp = tool_calls.plan([WEATHER, TIME], choice, False, TEMPLATE.read_text())
        assert tp.prefill == "" and tp.grammar and "<|im_start|>" not in tp.grammar.split("root ::=")[1].split("\n")[0]
        r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
        assert model.prompts[-1].endswith("<|im_start|>assistant\n")
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    real = InProcessServer(model._real.new_context())
    try:
        for choice in ("required", named):
            r = real.client().chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                      max_tokens=40, temperature=1.0, seed=0)
            assert r.choices[0].finish_reason in ("tool_calls", "length")
    finally:
        real.stop()


QWEN3 = TEMPLATE.parent / "Qwen-Qwen3-0.6B.jinja"
THINKING = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny."


@pytest.fixture(scope="module")
def thinker(tiny_artifacts, tmp_path_factory):
    if not QWEN3.is_file():
        pytest.skip("llama.cpp's Qwen3 template is not in this checkout")
    from clover_testkit import fuzz

    from clover_cpp import Clover

    gguf = fuzz.rewrite_gguf(tiny_artifacts["f32"], tmp_path_factory.mktemp("think") / "tiny-qwen3.gguf",
                             kv={"tokenizer.chat_template": QWEN3.read_text()})
    with Clover(gguf, n_ctx=2048, n_threads=1) as real:
        model = ScriptedClover(real, lambda prompt: THINKING)
        s = InProcessServer(model)
        yield s, model
        s.stop()


def test_reasoning_content_whole_and_streamed(thinker) -> None:
    """As llama-server (its default --reasoning-format deepseek): a Qwen3 reply's <think> block
    is the message's reasoning_content, streamed as reasoning_content deltas before the content;
    the request's reasoning_format "none" leaves it in the content; an unknown one is a 400."""
    c = thinker[0].client()
    msg = c.chat.completions.create(model="x", messages=ASK).choices[0].message
    assert msg.content == "It is sunny." and msg.model_extra["reasoning_content"].strip() == "The user wants Paris."

    chunks = list(c.chat.completions.create(model="x", messages=ASK, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert thought.strip() == "The user wants Paris."
    assert "".join(d.content or "" for d in deltas) == "It is sunny."

    plain = c.chat.completions.create(model="x", messages=ASK, extra_body={"reasoning_format": "none"})
    assert plain.choices[0].message.content == THINKING
    with pytest.raises(openai.BadRequestError, match="reasoning_format"):
        c.chat.completions.create(model="x", messages=ASK, extra_body={"reasoning_format": "sometimes"})


def test_the_servers_reasoning_format_is_the_default(thinker) -> None:
    """create_app's reasoning_format (clover serve --reasoning-format) is what a request without
    one gets; the flag takes llama-server's values only."""
    import subprocess
    import sys

    s = InProcessServer(thinker[1], reasoning_format="none")
    try:
        assert s.client().chat.completions.create(model="x", messages=ASK).choices[0].message.content == THINKING
    finally:
        s.stop()
    r = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "serve", "--reasoning-format", "sometimes", "x.gguf"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--reasoning-format" in r.stderr and "Traceback" not in r.stderr


def test_a_reply_without_tools_or_thinking_streams_through_unparsed(scripted, thinker, parses) -> None:
    """No tools, and a template with no thinking (Qwen3-Coder's) under the server's default
    reasoning_format (deepseek): the pieces go straight out, chat.cpp's parser never runs (it ran
    once per piece before); Qwen3's thinking template still has the reply read by it."""
    s, model = scripted
    plain = "It is sunny in Paris, <think>says</think> the forecast, for the next two days.\n"
    model.script = lambda prompt: plain
    try:
        chunks = list(s.client().chat.completions.create(model="x", messages=ASK, stream=True))
    finally:
        model.script = lambda prompt: REPLY
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == plain and len(pieces) == -(-len(plain) // model.piece)
    assert parses == []

    chunks = list(thinker[0].client().chat.completions.create(model="x", messages=ASK, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "It is sunny."
    assert len(parses) > 1
