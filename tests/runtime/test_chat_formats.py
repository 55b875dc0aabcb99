"""Tool-call parsing by llama.cpp's common/chat.cpp through libclover (native/libclover/clover-chat.h,
clover_cpp.chat_format): the markup each model family's template makes its model write - Hermes /
Qwen JSON, Qwen3-Coder and Qwen3.5's XML, Llama 3.x's JSON, Mistral's [TOOL_CALLS] - parsed into
OpenAI tool calls, whole and partial, and what ToolStream streams of it. No generation: the
replies are written here, the templates are llama.cpp's own (models/templates) and ours."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE

pytestmark = pytest.mark.needs_libclover

TEMPLATES = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "models" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = {"city": "Paris", "days": 2}
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")

# (template, a reply calling get_weather(city="Paris", days=2) in the template's markup)
FORMATS = {
    "ours (Qwen/Hermes JSON)": (QWEN_TOOLS_TEMPLATE,
                                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
    "Hermes 2 Pro": ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
    "Qwen3-Coder XML": ("Qwen3-Coder.jinja", XML_CALL),
    "Qwen3.5 XML": ("Qwen3.5-4B.jinja", XML_CALL),
    "Llama 3.1 JSON": ("meta-llama-Llama-3.1-8B-Instruct.jinja",
                       '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    "Llama 3.2 JSON": ("meta-llama-Llama-3.2-3B-Instruct.jinja",
                       '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    "Mistral [TOOL_CALLS]": ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
                             '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, '
                             '"id": "abcDEF123"}]'),
}


def _template(name_or_source: str) -> str:
    if "{" in name_or_source:
        return name_or_source
    path = TEMPLATES / name_or_source
    if not path.is_file():
        pytest.skip(f"llama.cpp's {name_or_source} is not in this checkout")
    return path.read_text()


@pytest.fixture(params=list(FORMATS), ids=list(FORMATS))
def fmt(request):
    tmpl, reply = FORMATS[request.param]
    return _template(tmpl), reply


def test_a_reply_in_the_templates_markup_is_a_call(fmt) -> None:
    from clover_cpp.chat_format import chat_params, parse_reply

    tmpl, reply = fmt
    p = chat_params(tmpl, messages=ASK, tools=[WEATHER, TIME])
    assert p["parser"] and p["format_name"].startswith("peg")
    msg = parse_reply(p, reply)
    (call,) = msg["tool_calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == ARGS
    assert msg["content"].strip() in ("", "<think>")  # (Qwen3.5's generation prompt opens a think block)


def test_a_partial_reply_never_gives_a_broken_call(fmt) -> None:
    """Every cut of the reply parses (partial): a call whose arguments are cut off has arguments
    that are the start of the whole call's, never another name; the whole reply's arguments
    extend every partial reading's."""
    from clover_cpp.chat_format import chat_params, parse_reply

    tmpl, reply = fmt
    p = chat_params(tmpl, messages=ASK, tools=[WEATHER, TIME])
    whole = parse_reply(p, reply)["tool_calls"][0]["arguments"]
    for cut in range(len(reply)):
        calls = parse_reply(p, reply[:cut], partial=True)["tool_calls"]
        assert len(calls) <= 1, (cut, calls)
        for c in calls:
            assert c["name"] == "get_weather" and whole.startswith(c["arguments"]), (cut, c)


def test_a_whole_reply_off_the_format_is_refused_one_line() -> None:
    from clover_cpp.chat_format import ChatFormatError, chat_params, parse_reply

    p = chat_params(QWEN_TOOLS_TEMPLATE, tools=[WEATHER])
    with pytest.raises(ChatFormatError, match="does not match") as e:
        parse_reply(p, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>')
    assert "\n" not in str(e.value)
    assert parse_reply(p, "just text") == {"role": "assistant", "content": "just text",
                                           "reasoning_content": "", "tool_calls": []}


@pytest.mark.parametrize("request_json, words", [
    (b"{not json", "not valid JSON"),
    (b'{"messages": []}', "template"),
    (b'{"template": "{{ x", "tools": []}', ""),
    (b'{"template": "x", "tool_choice": "sometimes"}', "tool_choice"),
    (b'{"template": "x", "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": []}', "nope"),
])
def test_bad_requests_are_one_line_errors(request_json, words) -> None:
    """The C functions catch everything: a bad request is CLOVER_ERR_INVALID_ARG with one line."""
    import ctypes

    from clover_cpp import _native as N

    err, err_len = N.err_buffer()
    out = ctypes.c_char_p()
    status = N.clover_chat_params(request_json, ctypes.byref(out), err, err_len)
    assert status == N.CLOVER_ERR_INVALID_ARG and out.value is None
    msg = err.value.decode()
    assert msg and "\n" not in msg and words in msg
    assert N.clover_chat_parse(b'{"text": "x", "format": 99}', ctypes.byref(out), err, err_len) \
        == N.CLOVER_ERR_INVALID_ARG
    assert N.clover_chat_parse(None, ctypes.byref(out), err, err_len) == N.CLOVER_ERR_INVALID_ARG


@pytest.mark.parametrize("name", ["Qwen3-Coder XML", "Qwen3.5 XML", "Llama 3.1 JSON", "Mistral [TOOL_CALLS]",
                                  "ours (Qwen/Hermes JSON)"])
def test_tool_stream_deltas_join_to_the_whole_call(name) -> None:
    """ToolStream, fed the reply a few characters at a time (as a model streams it), sends the
    call as llama-server does (its id, name and the start of its arguments, then more of them),
    and the deltas joined are the whole reply's call (reply_message)."""
    from clover_cpp import tool_calls

    tmpl, reply = FORMATS[name]
    tp = tool_calls.plan([WEATHER, TIME], "auto", False, _template(tmpl))
    ts = tool_calls.ToolStream(tp)
    events = [ev for i in range(0, len(reply), 3) for ev in ts.feed(reply[i:i + 3])] + ts.finish()
    content = "".join(v for kind, v in events if kind == "content")
    deltas = [v for kind, v in events if kind == "call"]
    assert {i for i, _ in deltas} == {0} and len(deltas) > 1  # streamed, not in one piece
    first = deltas[0][1]
    assert first["type"] == "function" and first["id"].startswith(("call_", "abc"))
    assert first["function"]["name"] == "get_weather"
    assert all("name" not in d["function"] and "id" not in d for _, d in deltas[1:])
    joined = "".join(d["function"]["arguments"] for _, d in deltas)
    assert json.loads(joined) == ARGS
    content_whole, (call,) = ts.message()
    assert call["id"] == first["id"] and call["function"]["arguments"] == joined
    assert content.strip() == (content_whole or "")
    msg = tool_calls.reply_message(reply, tp)
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == ARGS


def test_a_long_streamed_reply_loads_the_parser_once(monkeypatch) -> None:
    """A streamed reply is parsed again whole at each piece (as llama-server does), from a parser
    loaded once per reply (clover_chat_parser_new), never from its serialized form per piece: a
    20k-character reply in 8-character pieces stays well under seconds (a generous bound: the
    serialized parser reloaded per piece made it quadratic)."""
    import time

    from clover_cpp import chat_format, tool_calls

    tp = tool_calls.plan([WEATHER, TIME], "auto", False, _template("Qwen3-Coder.jinja"))
    loads = {"handle": 0, "serialized": 0}
    real_init, real_call = chat_format.ChatParser.__init__, chat_format._call

    def counted_init(self, params):
        loads["handle"] += 1
        real_init(self, params)

    def counted_call(name, request):
        loads["serialized"] += name == "clover_chat_parse"
        return real_call(name, request)

    monkeypatch.setattr(chat_format.ChatParser, "__init__", counted_init)
    monkeypatch.setattr(chat_format, "_call", counted_call)
    reply = "word " * 4000 + XML_CALL
    start = time.monotonic()
    ts = tool_calls.ToolStream(tp)
    events = [ev for i in range(0, len(reply), 8) for ev in ts.feed(reply[i:i + 8])] + ts.finish()
    assert time.monotonic() - start < 5.0
    assert loads == {"handle": 1, "serialized": 0}
    assert "".join(v for kind, v in events if kind == "content").strip() == ("word " * 4000).strip()
    assert json.loads(ts.message()[1][0]["function"]["arguments"]) == ARGS


def test_the_parser_handle_refuses_bad_input_in_one_line() -> None:
    import ctypes

    from clover_cpp import _native as N
    from clover_cpp.chat_format import ChatFormatError, ChatParser

    with pytest.raises(ChatFormatError, match="not one of chat.cpp's"):
        ChatParser({"format": 99, "parser": "", "generation_prompt": ""})
    err, err_len = N.err_buffer()
    handle = ctypes.c_void_p()
    assert N.clover_chat_parser_new(b"{not json", ctypes.byref(handle), err, err_len) == N.CLOVER_ERR_INVALID_ARG and not handle
    parser = ChatParser({"format": 0, "parser": "", "generation_prompt": ""})
    assert parser.parse("plain")["content"] == "plain"
    parser.close()
    with pytest.raises(ChatFormatError, match="closed"):
        parser.parse("plain")


def test_a_refused_reply_prints_nothing() -> None:
    """chat.cpp logs a reply off its format ("unparsed ... output") through common/log, on
    stderr; libclover shows it at debug verbosity only: a reply read by our fallback is quiet."""
    import subprocess
    import sys

    script = f"""
from clover_cpp import tool_calls
from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE
tp = tool_calls.plan([{WEATHER!r}], "auto", False, QWEN_TOOLS_TEMPLATE)
reply = '<tool_call>\\n{{"name": "get_weather", "arguments": "{{\\\\"city\\\\": \\\\"Paris\\\\"}}"}}\\n</tool_call> more'
msg = tool_calls.reply_message(reply, tp)
assert msg["tool_calls"][0]["function"]["name"] == "get_weather", msg
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert r.stderr == ""


THINK_REPLY = "<think>\nThe user wants Paris.\n</think>\n\n"


@pytest.mark.parametrize("reasoning_format", ["deepseek", "auto"])
def test_reasoning_content_from_a_qwen3_reply(reasoning_format) -> None:
    """reasoning_format as llama-server's: other than "none", a Qwen3 reply's <think> block is
    the message's reasoning_content (the C functions, reply_message, ToolStream's deltas); "none"
    leaves it in the content."""
    from clover_cpp import tool_calls
    from clover_cpp.chat_format import chat_params, parse_reply

    tmpl = _template("Qwen-Qwen3-0.6B.jinja")
    plain = THINK_REPLY + "It is sunny."
    msg = parse_reply(chat_params(tmpl, messages=ASK, reasoning_format=reasoning_format), plain)
    assert msg["reasoning_content"].strip() == "The user wants Paris." and msg["content"] == "It is sunny."
    assert parse_reply(chat_params(tmpl, messages=ASK), plain)["content"] == plain  # ("none")

    tp = tool_calls.plan(None, None, False, tmpl, reasoning_format)
    assert tool_calls.reply_message(plain, tp) == {"role": "assistant", "content": "It is sunny.",
                                                   "reasoning_content": msg["reasoning_content"]}
    assert tool_calls.reply_message(plain, tool_calls.plan(None, None, False, tmpl)) == \
        {"role": "assistant", "content": plain}

    reply = THINK_REPLY + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    tp = tool_calls.plan([WEATHER, TIME], "auto", False, tmpl, reasoning_format)
    ts = tool_calls.ToolStream(tp)
    events = [ev for i in range(0, len(reply), 3) for ev in ts.feed(reply[i:i + 3])] + ts.finish()
    kinds = [kind for kind, _ in events]
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert "".join(v for kind, v in events if kind == "reasoning").strip() == "The user wants Paris."
    assert "".join(d["function"]["arguments"] for kind, (_, d) in
                   ((k, v) for k, v in events if k == "call")) == ts.message()[1][0]["function"]["arguments"]
    whole = tool_calls.reply_message(reply, tp)
    assert whole["reasoning_content"].strip() == "The user wants Paris." and whole["content"] is None
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == ARGS


def test_an_unknown_reasoning_format_is_refused() -> None:
    from clover_cpp import tool_calls
    from clover_cpp.errors import CloverValueError

    with pytest.raises(CloverValueError, match="reasoning_format"):
        tool_calls.plan(None, None, False, QWEN_TOOLS_TEMPLATE, "sometimes")
