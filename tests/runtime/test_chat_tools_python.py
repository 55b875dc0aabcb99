"""Tool calling in the Python API, :meth:`Clover.create_chat_completion` (llama-cpp-python's
signature): tools rendered by a tool-rendering chat template given with Clover(chat_template=...),
tool_choice "required" and a named function held to the tools' schemas by a grammar (the tiny
model never learnt tools, so every valid call is the grammar's doing), the OpenAI ``tool_calls``
message and finish_reason, streamed too; a template that renders no tools refuses them."""
from __future__ import annotations

import json

import pytest

from clover_cpp.errors import CloverValueError

pytestmark = pytest.mark.needs_libclover

CITY = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                                          "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, TIME)}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tiny_artifacts):
    from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE

    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1, chat_template=QWEN_TOOLS_TEMPLATE) as m:
        yield m


def _valid_calls(r: dict, max_tokens: int = 160) -> list[dict]:
    """The reply's calls, each naming an offered tool with arguments its schema accepts; parallel
    calls go on until the model stops or the budget cuts the next one ("length", as llama-server)."""
    jsonschema = pytest.importorskip("jsonschema")
    (choice,) = r["choices"]
    finish = choice["finish_reason"]
    assert finish == "tool_calls" or (finish == "length" and r["usage"]["completion_tokens"] == max_tokens), \
        choice["message"]
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return calls


def test_required_with_two_tools_is_a_valid_call(model) -> None:
    for seed in range(3):
        r = model.create_chat_completion(ASK, tools=[CITY, TIME], tool_choice="required", max_tokens=160,
                                         temperature=1.0, seed=seed, parallel_tool_calls=False)
        assert len(_valid_calls(r)) == 1
    assert model.last_exchange.prompt.endswith("<tool_call>\n")
    assert "get_time" in model.last_exchange.prompt  # the tools, as the template renders them


def test_a_named_choice_calls_that_tool_streamed_too(model) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = model.create_chat_completion(ASK, tools=[CITY, TIME], tool_choice=choice, max_tokens=160, temperature=0)
    (call,) = _valid_calls(r)
    assert call["function"]["name"] == "get_weather"
    chunks = list(model.create_chat_completion(ASK, tools=[CITY, TIME], tool_choice=choice, max_tokens=160,
                                               temperature=0, stream=True))
    deltas = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert {d["index"] for d in deltas} == {0} and deltas[0]["function"]["name"] == "get_weather"
    joined = "".join(d["function"]["arguments"] for d in deltas)  # (streamed as llama-server streams it)
    assert json.loads(joined) == json.loads(call["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    with pytest.raises(CloverValueError, match="tool_choice"):
        model.create_chat_completion(ASK, tools=[CITY], tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(CloverValueError, match="tool_choice"):
        model.create_chat_completion(ASK, tools=[CITY], tool_choice=choice, response_format={"type": "json_object"})


def test_tool_choice_none_renders_no_tools(model) -> None:
    r = model.create_chat_completion(ASK, tools=[CITY], tool_choice="none", max_tokens=4, temperature=0)
    assert "tool_calls" not in r["choices"][0]["message"]
    assert "get_weather" not in model.last_exchange.prompt


def test_a_template_without_tools_refuses_them(tiny_artifacts) -> None:
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1) as plain:
        with pytest.raises(CloverValueError, match="tools") as e:
            plain.create_chat_completion(ASK, tools=[CITY])
        assert e.value.param == "tools"
        with pytest.raises(CloverValueError, match="tool_choice"):
            plain.create_chat_completion(ASK, tool_choice="required")


def test_the_next_turn_renders_the_call_and_its_result(model) -> None:
    """The reply's message and a tool's result, appended to the messages, render as the template
    says (the call as it was made, the result in the tool's turn)."""
    r = model.create_chat_completion(ASK, tools=[CITY], tool_choice="required", max_tokens=160, temperature=0)
    message = r["choices"][0]["message"]
    (call,) = _valid_calls(r)
    turn = [*ASK, message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    model.create_chat_completion(turn, tools=[CITY], max_tokens=2, temperature=0)
    prompt = model.last_exchange.prompt
    assert call["function"]["arguments"] in prompt and "sunny" in prompt
