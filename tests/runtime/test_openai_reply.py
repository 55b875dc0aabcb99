"""clover_cpp.openai_reply: the one builder of OpenAI's completion and chat replies, used by
Clover.create_completion / create_chat_completion and by ``clover serve``. finish_reason's rule
(OpenAI's, llama-cpp-python 0.3.36's): "stop" when the reply was ended on purpose (EOS, a stop
token or string, a callback's cancel, which llama-cpp-python's stopping_criteria reports as
"stop" even on the budget's last token), "length" when the budget ran out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clover_cpp import openai_reply as reply
from clover_cpp.decoding import GenerationResult, GenerationStats

REPO = Path(__file__).resolve().parents[2]


def _result(reason: str, n_tokens: int) -> GenerationResult:
    return GenerationResult(text="x" * n_tokens, tokens=list(range(n_tokens)),
                            stats=GenerationStats(n_prompt=3, n_generated=n_tokens, finish_reason=reason))


@pytest.mark.parametrize("reason,n_tokens,want", [
    ("eos", 2, "stop"), ("stop", 4, "stop"), ("max_tokens", 4, "length"),
    ("cancelled", 4, "stop"), ("cancelled", 0, "stop"),
    ("", 0, "length"),  # max_tokens 0: libclover ran nothing, the budget is spent all the same
])
def test_finish_reason(reason: str, n_tokens: int, want: str) -> None:
    assert reply.finish_reason(_result(reason, n_tokens)) == want


@pytest.mark.parametrize("reason,want", [("eos", "tool_calls"), ("stop", "tool_calls"), ("max_tokens", "length")])
def test_finish_reason_with_tool_calls(reason: str, want: str) -> None:
    """A reply with calls finishes "tool_calls", unless the budget cut it (maybe inside its next call)."""
    assert reply.finish_reason(_result(reason, 4), tool_calls=True) == want


def test_usage_counts_each_prompt_once() -> None:
    rs = [_result("eos", 2), _result("eos", 3)]
    assert reply.usage(rs, per_prompt=2) == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert reply.usage(rs[:1], cached=False) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_reply_fields_have_one_builder() -> None:
    """Neither the llama-cpp-python calls nor the server write a reply's ids, finish reasons or
    choices themselves: no "finish_reason"/"cmpl-" literal outside openai_reply (the chat's
    "tool_calls" reason excepted), no finish_reason / usage function of their own."""
    users = {"compat.py": (), "server/app.py": ("tool_calls",), "server/generation.py": ("tool_calls",),
              "server/format.py": ()}
    for name, allowed in users.items():
        tree = ast.parse((REPO / "clover_cpp" / name).read_text(encoding="utf-8"))
        defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not defs & {"finish_reason", "usage", "chat_logprobs", "completion_logprobs"}, name
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value not in allowed:
                assert n.value not in ("finish_reason", "cmpl", "chatcmpl") and not n.value.startswith(
                    ("cmpl-", "chatcmpl-")), (name, n.value)


@pytest.fixture(scope="module")
def llm(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1, block_size=4) as m:
        yield m


@pytest.mark.needs_libclover
def test_a_callbacks_cancel_on_the_last_budget_block_is_stop(llm) -> None:
    """create_completion / create_chat_completion: a reply an on_block callback ended is "stop",
    also when its block spent the budget (the server's rule; it was "length" here before)."""
    kw = dict(max_tokens=4, temperature=0, block_size=4)
    full = llm.create_completion("hello world", **kw)
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 4
    cut = llm.create_completion("hello world", on_block=lambda text, tokens: True, **kw)
    assert cut["choices"][0]["text"] == full["choices"][0]["text"] and cut["choices"][0]["finish_reason"] == "stop"
    msgs = [{"role": "user", "content": "hi"}]
    full = llm.create_chat_completion(msgs, **kw)
    if full["choices"][0]["finish_reason"] == "length":  # (the tiny model may end its turn first)
        cut = llm.create_chat_completion(msgs, on_block=lambda text, tokens: True, **kw)
        assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.needs_libclover
def test_streamed_chunks_share_the_replys_head(llm) -> None:
    """Every chunk of a stream carries one id, created and model; the last one the finish reason."""
    chunks = list(llm.create_completion("hello world", max_tokens=4, temperature=0, stream=True, model="m"))
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-") and chunks[-1]["choices"][0]["finish_reason"] == "length"
    chunks = list(llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                                             stream=True))
    assert len({(c["id"], c["created"], c["object"]) for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
