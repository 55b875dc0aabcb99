"""Tool calling in `clover serve`, with the official openai client: tools rendered by the model's
chat template (the Qwen tool template fixture), the reply's <tool_call> markup parsed into
tool_calls (whole and streamed), tool_choice none / auto / required / a named function, and
the next turn (the assistant's calls and the tool's result) rendered back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_testkit.server_harness import InProcessServer, ScriptedClover

pytestmark = pytest.mark.needs_libclover

openai = pytest.importorskip("openai", reason="the test extra installs openai")
httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tool_gguf(tiny_gguf: Path, dst: Path) -> Path:
    """The tiny GGUF with the Qwen tool-calling chat template (clover_testkit.chat_templates)."""
    from clover_testkit import fuzz  # the one GGUF rewriter
    from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE

    return fuzz.rewrite_gguf(tiny_gguf, dst, kv={"tokenizer.chat_template": QWEN_TOOLS_TEMPLATE})


@pytest.fixture(scope="module")
def gguf(tiny_artifacts, tmp_path_factory) -> Path:
    return tool_gguf(tiny_artifacts["f32"], tmp_path_factory.mktemp("tools") / "tiny-tools.gguf")


@pytest.fixture(scope="module")
def real(gguf):
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=1024, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def scripted(real):
    model = ScriptedClover(real, lambda prompt: "")
    s = InProcessServer(model)
    yield s, model
    s.stop()


def _say(model: ScriptedClover, text: str) -> None:
    model.script = lambda prompt: text


def _streamed_calls(chunks) -> list[tuple[int, str, str]]:
    """The streamed calls (index, name, arguments), each call's deltas joined: its first names it,
    the next ones carry more of its arguments (as llama-server streams them)."""
    calls: dict[int, list[str]] = {}
    for d in (tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []):
        name, args = calls.setdefault(d.index, ["", ""])
        assert not (name and d.function.name), "a call named twice"
        calls[d.index] = [name or d.function.name or "", args + (d.function.arguments or "")]
    return [(i, name, args) for i, (name, args) in sorted(calls.items())]


def test_tools_are_rendered_by_the_template(scripted, real) -> None:
    s, _ = scripted
    r = httpx.post(s.url + "/apply-template", json={"messages": ASK, "tools": [WEATHER]}).json()["prompt"]
    assert r == real.format_chat(ASK, tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in r and r.endswith("<|im_start|>assistant\n")
    none = httpx.post(s.url + "/apply-template", json={"messages": ASK, "tools": [WEATHER],
                                                       "tool_choice": "none"}).json()["prompt"]
    assert "<tools>" not in none and none == real.format_chat(ASK)


def test_tool_calls_whole_and_streamed(scripted) -> None:
    s, model = scripted
    c = s.client()
    _say(model, "Let me check.\n" + CALL)
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the content arrives without any of the markup, the call as a tool_calls delta
    chunks = list(c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content.strip() == "Let me check." and "<" not in content
    assert [(i, name, json.loads(args)) for i, name, args in _streamed_calls(chunks)] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_calls_xml_form_and_text_that_is_no_call(scripted) -> None:
    s, model = scripted
    c = s.client()
    two = CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>'
    _say(model, two)
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME])
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    assert r.choices[0].message.content is None
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    # Qwen3.5's XML form
    _say(model, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER])
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    # not JSON, or a function the request did not offer: the text stays content
    for text in ("<tool_call>\n{not json}\n</tool_call>",
                 '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'):
        _say(model, text)
        r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER])
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == text
        assert r.choices[0].finish_reason == "stop"
    # without tools in the request, markup is just text
    _say(model, CALL)
    r = c.chat.completions.create(model="x", messages=ASK)
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None


def test_tool_choice_required_and_named(scripted) -> None:
    s, model = scripted
    c = s.client()
    _say(model, '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    assert model.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    _say(model, '{"city": "Rome"}}\n</tool_call>')
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert model.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})


def test_the_next_turn_renders_calls_and_results(scripted) -> None:
    s, model = scripted
    c = s.client()
    _say(model, CALL)
    first = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER]).choices[0].message
    _say(model, "Sunny.")
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model="x", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "Sunny." and r.choices[0].finish_reason == "stop"
    assert CALL in model.prompts[-1]
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in model.prompts[-1]


def test_real_model_with_tools(real, tiny_artifacts) -> None:
    """The real tiny model, tools offered: a normal reply (it never learnt the markup), the
    prompt as the template renders it; a template without tools refuses them by name."""
    s = InProcessServer(real.new_context())
    try:
        c = s.client()
        r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0,
                                      extra_body={"block_size": 4})
        prompt = real.format_chat(ASK, tools=[WEATHER])
        assert r.usage.prompt_tokens == len(real.tokenize(prompt, add_bos=True, special=True))
        assert isinstance(r.choices[0].message.content, str)
    finally:
        s.stop()
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1) as plain:
        s = InProcessServer(plain)
        try:
            with pytest.raises(openai.BadRequestError, match="tools"):
                s.client().chat.completions.create(model="x", messages=ASK, tools=[WEATHER])
        finally:
            s.stop()


CITY = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                                          "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "days": {"type": "integer"}}}}}


def test_a_forced_call_of_the_real_model_follows_the_tools_schema(real) -> None:
    """tool_choice naming a function (or "required" with one tool): the reply starts with the
    call and its arguments follow the tool's JSON schema (a grammar), so even the tiny model,
    which never learnt tools, returns a call whose arguments validate - sampled, streamed too."""
    s = InProcessServer(real.new_context())
    try:
        c = s.client()
        choice = {"type": "function", "function": {"name": "get_weather"}}
        for seed in range(8):
            r = c.chat.completions.create(model="x", messages=ASK, tools=[CITY, TIME], max_tokens=200,
                                          temperature=1.0, seed=seed,
                                          tool_choice=choice if seed % 2 else "auto")
            if seed % 2 == 0:
                continue  # auto: the model may answer in text
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
            (call,) = r.choices[0].message.tool_calls
            args = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and set(args) == {"city", "days"}
            assert isinstance(args["city"], str) and len(args["city"]) <= 10 and type(args["days"]) is int
            assert r.model_extra["clover"]["grammar_mode"] == "ar"
        r = c.chat.completions.create(model="x", messages=ASK, tools=[CITY], tool_choice="required", max_tokens=200,
                                      temperature=0)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        r = c.chat.completions.create(model="x", messages=ASK, tools=[CITY], tool_choice=choice, max_tokens=200,
                                      temperature=0)
        chunks = list(c.chat.completions.create(model="x", messages=ASK, tools=[CITY], tool_choice=choice,
                                                max_tokens=200, temperature=0, stream=True))
        ((_, _, args),) = _streamed_calls(chunks)
        assert json.loads(args) == json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            c.chat.completions.create(model="x", messages=ASK, tools=[CITY], tool_choice=choice, max_tokens=20,
                                      response_format={"type": "json_object"})
    finally:
        s.stop()


PLACE = {"type": "object", "additionalProperties": False, "required": ["place"],
         "properties": {"place": {"$ref": "#/$defs/place"}}, "$defs": {"place": {
             "type": "object", "additionalProperties": False, "required": ["lat", "lon"],
             "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                            "lon": {"type": "integer", "minimum": -180, "maximum": 180}}}}}
LOCATE = {"type": "function", "function": {"name": "locate", "parameters": PLACE}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, TIME, LOCATE)}


def _valid_calls(r, max_tokens: int = 160) -> list:
    """The reply's calls, each naming an offered tool with arguments its schema accepts; parallel
    calls go on until the model stops or the budget cuts the next one ("length", as llama-server)."""
    jsonschema = pytest.importorskip("jsonschema")
    finish = r.choices[0].finish_reason
    assert finish == "tool_calls" or (finish == "length" and r.usage.completion_tokens == max_tokens), \
        r.choices[0].message
    calls = r.choices[0].message.tool_calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("tools", [[CITY, TIME], [CITY, TIME, LOCATE]], ids=["2 tools", "3 tools"])
def test_required_with_several_tools_is_a_call_of_one_of_them(real, tools) -> None:
    """tool_choice "required" with several tools: a grammar (an alternation of each tool's call,
    llama.cpp's converter on each schema, $defs kept per tool) makes the tiny model, which never
    learnt tools, reply with a valid call of one of them - sampled at several seeds, streamed too;
    parallel_tool_calls false: exactly one call, true: one or more."""
    s = InProcessServer(real.new_context())
    try:
        c = s.client()
        for seed in range(6):
            r = c.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                          max_tokens=160, temperature=1.0, seed=seed, parallel_tool_calls=False)
            assert len(_valid_calls(r)) == 1
            assert r.model_extra["clover"]["grammar_mode"] == "ar"
            r = c.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                          max_tokens=160, temperature=1.0, seed=seed)
            assert len(_valid_calls(r)) >= 1
        chunks = list(c.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                                max_tokens=160, temperature=1.0, seed=1, parallel_tool_calls=False,
                                                stream=True))
        ((_, name, args),) = _streamed_calls(chunks)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        whole = c.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                          max_tokens=160, temperature=1.0, seed=1, parallel_tool_calls=False)
        (call,) = _valid_calls(whole)
        assert (name, json.loads(args)) == \
            (call.function.name, json.loads(call.function.arguments))
    finally:
        s.stop()


def test_a_given_chat_template_renders_tools(tiny_artifacts) -> None:
    """A model whose own template renders no tools, given one that does (Clover(chat_template=...),
    the server's --chat-template): tools are rendered and "required" yields a valid call."""
    from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE

    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1, chat_template=QWEN_TOOLS_TEMPLATE) as m:
        s = InProcessServer(m)
        try:
            r = s.client().chat.completions.create(model="x", messages=ASK, tools=[CITY, TIME], tool_choice="required",
                                                   max_tokens=160, temperature=1.0, seed=3)
            assert len(_valid_calls(r)) >= 1
        finally:
            s.stop()


def test_a_tools_grammar_renames_the_rule_root_never_a_literal() -> None:
    """The converter's root becomes our call's rule; a value spelling root (an enum's " root ")
    stays as the schema says, forced by name or required."""
    from clover_cpp.server.tools import plan
    from clover_cpp.server.types import NamedChoice, Tool

    mode = Tool.model_validate({"type": "function", "function": {"name": "mode", "parameters": {
        "type": "object", "properties": {"m": {"enum": ["a root b", "[root]"]}}}}})
    named = NamedChoice.model_validate({"type": "function", "function": {"name": "mode"}})
    for choice in (named, "required"):
        g = plan([mode], choice, True, "{{ tools }}").grammar
        assert g is not None and '"\\"a root b\\""' in g and '"\\"[root]\\""' in g
        assert [line.split(" ::=")[0] for line in g.splitlines() if line.startswith("root ")] == ["root"]
