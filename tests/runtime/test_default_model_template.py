"""The default model's chat template (models/clover-default/tokenizer_config.json): a Qwen-style
one that renders tools, and that renders every conversation without tools byte for byte as the
plain ChatML template it replaced; and the default model, through its own template, answers
tool_choice "required" with a call its tool's schema accepts."""
from __future__ import annotations

import json
from itertools import product

import pytest

from clover_cpp.chat import render_chat
from clover_testkit.llama_tools import REPO, default_gguf  # noqa: F401 - a fixture

#: the default model's template before it rendered tools (kept here as the reference)
CHATML_BEFORE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"type": "string", "maxLength": 12}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def default_template() -> str:
    return json.loads((REPO / "models" / "clover-default" / "tokenizer_config.json").read_text())["chat_template"]


def _msg(role: str, content: str, **extra) -> dict:
    return {"role": role, "content": content, **extra}


CONVERSATIONS = [
    [],
    [_msg("user", "Hi")],
    [_msg("system", "Be terse."), _msg("user", "Hi")],
    [_msg("system", "Be terse."), _msg("user", "Hi"), _msg("assistant", "Hello."), _msg("user", "And?")],
    [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), _msg("assistant", "d")],
    [_msg("system", ""), _msg("user", ""), _msg("assistant", "")],
    [_msg("user", "x"), _msg("system", "a second system turn"), _msg("assistant", "y")],
    [_msg("assistant", "an assistant first")],
    [_msg("developer", "another role"), _msg("user", "u", name="ann")],
    [_msg("user", "multi\nline\n\n{{ not jinja }} <tool_call> é 字 \t")],
    [_msg("user", "q"), _msg("assistant", "r", tool_calls=[])],  # an empty tool_calls list: no calls
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_without_tools_it_renders_what_the_chatml_template_did(messages) -> None:
    """Byte for byte, with and without the generation prompt, with tools absent, None or empty."""
    new = default_template()
    for add_generation_prompt, tools in product((True, False), ({}, {"tools": None}, {"tools": []})):
        before = render_chat(messages, CHATML_BEFORE, add_generation_prompt=add_generation_prompt, **tools)
        assert render_chat(messages, new, add_generation_prompt=add_generation_prompt, **tools) == before


def test_with_tools_it_renders_the_qwen_markup() -> None:
    """As the Qwen tool template fixture (Qwen3's shape) renders the same conversation."""
    from clover_testkit.chat_templates import QWEN_TOOLS_TEMPLATE

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [_msg("system", "Be terse."), _msg("user", "Weather?"),
                {"role": "assistant", "content": None, "tool_calls": [call]},
                _msg("tool", "sunny", tool_call_id="c1"), _msg("tool", "22C"), _msg("user", "Thanks")]
    for msgs in (messages, messages[1:]):
        ours = render_chat(msgs, default_template(), tools=[WEATHER, TIME])
        assert ours == render_chat(msgs, QWEN_TOOLS_TEMPLATE, tools=[WEATHER, TIME])
    assert "<tools>\n" + json.dumps(WEATHER) in ours and "</tools>" in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C" in ours


@pytest.mark.needs_libclover
def test_the_default_model_answers_required_with_a_valid_call(default_gguf) -> None:  # noqa: F811
    jsonschema = pytest.importorskip("jsonschema")
    from clover_cpp import Clover

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    with Clover(default_gguf, n_ctx=1024, n_threads=1) as m:
        r = m.create_chat_completion([_msg("user", "Weather in Paris?")], tools=[WEATHER, TIME],
                                     tool_choice="required", max_tokens=64, temperature=0,
                                     parallel_tool_calls=False)
        assert "<tools>" in m.last_exchange.prompt  # rendered by the model's own template
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "tool_calls", choice["message"]
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
