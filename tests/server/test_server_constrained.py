"""`clover serve`: log-probabilities, response_format (json_object / json_schema) and grammar,
with the official openai client. The numbers are the library's (Clover.generate with the same
arguments); constrained requests decode autoregressively or with draft-self (stats say which);
50 constrained outputs of the default model all parse and validate."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clover_testkit.server_harness import InProcessServer

pytestmark = pytest.mark.needs_libclover

openai = pytest.importorskip("openai", reason="the test extra installs openai")
httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "def add(a, b):"}]


def test_chat_logprobs_are_the_librarys(tiny_server) -> None:
    s, local = tiny_server
    c = s.client()
    r = c.chat.completions.create(model="x", messages=MSGS, max_tokens=12, temperature=0.7, seed=5, logprobs=True,
                                  top_logprobs=3, extra_body={"block_size": 4, "ignore_eos": True})
    want = local.chat(MSGS, max_tokens=12, temperature=0.7, seed=5, logprobs=3, block_size=4, stop_at_eos=False,
                      reuse_prefix=False)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.tokens) == r.usage.completion_tokens == 12
    assert [x.logprob for x in content] == pytest.approx(want.logprobs, abs=1e-6)
    # the tokens' bytes spell the reply (a token may hold part of a character: bytes, not text)
    assert b"".join(bytes(x.bytes) for x in content).decode("utf-8", "replace") == r.choices[0].message.content \
        == want.text
    for x, top in zip(content, want.top_logprobs):
        assert len(x.top_logprobs) == 3 and [t.logprob for t in x.top_logprobs] == pytest.approx([lp for _, lp in top])
        assert all(a.logprob >= b.logprob for a, b in zip(x.top_logprobs, x.top_logprobs[1:]))
        assert bytes(x.bytes).decode("utf-8", "replace") == x.token and x.logprob <= 0.0
    # streamed: the same numbers, with the last chunk
    chunks = list(c.chat.completions.create(model="x", messages=MSGS, max_tokens=12, temperature=0.7, seed=5,
                                            logprobs=True, stream=True,
                                            extra_body={"block_size": 4, "ignore_eos": True}))
    streamed = [x.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx(want.logprobs, abs=1e-6)
    # without logprobs: none; top_logprobs alone is refused by name
    assert c.chat.completions.create(model="x", messages=MSGS, max_tokens=2).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        c.chat.completions.create(model="x", messages=MSGS, max_tokens=2, top_logprobs=2)


def test_completion_logprobs(tiny_server) -> None:
    s, local = tiny_server
    r = s.client().completions.create(model="x", prompt="class A:", max_tokens=8, temperature=0, logprobs=2,
                                      extra_body={"block_size": 4, "ignore_eos": True})
    want = local.generate("class A:", max_tokens=8, logprobs=2, block_size=4, stop_at_eos=False, reuse_prefix=False)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert len(lp.tokens) == len(want.tokens) == 8 and r.choices[0].text == want.text
    # (offsets from the prompt's start, as OpenAI's; each top dict: the 2 most probable and the token's own)
    assert lp.text_offset[0] == len("class A:") and len(lp.top_logprobs) == 8
    assert all(len(t) <= 3 and all(math.isfinite(v) for v in t.values()) for t in lp.top_logprobs)
    # (echo + logprobs: the prompt's tokens first, tests/server/test_server_choices.py)


def test_grammar_and_refusals(tiny_server) -> None:
    s, _ = tiny_server
    c = s.client()
    for seed in range(5):
        r = c.completions.create(model="x", prompt="answer:", max_tokens=8, temperature=1.0, seed=seed,
                                 extra_body={"grammar": 'root ::= "yes" | "no"'})
        assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
        assert r.model_extra["clover"]["grammar_mode"] == "ar"
    r = c.completions.create(model="x", prompt="answer:", max_tokens=8, temperature=0,
                             extra_body={"grammar": 'root ::= "yes" | "no"', "draft_self": True, "block_size": 4})
    assert r.choices[0].text in ("yes", "no") and r.model_extra["clover"]["grammar_mode"] == "draft-self"
    for kw, param in [(dict(extra_body={"grammar": "root ::= ("}), "grammar"),
                      (dict(extra_body={"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}),
                       "grammar"),
                      (dict(extra_body={"response_format": {"type": "json_schema"}}), "response_format"),
                      (dict(extra_body={"response_format": {"type": "xml"}}), "response_format"),
                      (dict(extra_body={"response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": {"type": 5}}}}),
                       "response_format")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="x", prompt="x", max_tokens=4, **kw)
        assert e.value.body["param"].startswith(param), (kw, e.value.body)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "ok"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 12 and type(obj["age"]) is int and type(obj["ok"]) is bool)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    from clover_convert import convert
    from clover_cpp import Clover

    gguf = tmp_path_factory.mktemp("default") / "clover-default-f16.gguf"
    convert(REPO / "models" / "clover-default", gguf, outtype="f16", progress=False)
    with Clover(gguf, n_ctx=1024, n_threads=1) as m:
        s = InProcessServer(m)
        yield s
        s.stop()


def test_fifty_constrained_outputs_of_the_default_model_parse(default_server) -> None:
    """A schema whose every output is bounded (short strings, integers of at most 16 digits,
    bounded whitespace): all 50 sampled outputs end (EOS) and validate, through chat and
    completions. json_object (unbounded): every output that ends parses."""
    c = default_server.client(timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    outs = []
    for seed in range(50):
        if seed % 2:
            r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "A person as JSON:"}],
                                          max_tokens=400, temperature=1.0, seed=seed, response_format=fmt)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        else:
            r = c.completions.create(model="x", prompt="person = ", max_tokens=400, temperature=1.0, seed=seed,
                                     extra_body={"response_format": fmt})
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert finish == "stop" and _valid(json.loads(text)), (seed, finish, text)
        assert r.model_extra["clover"]["grammar_mode"] == "ar"
        outs.append(text)
    assert len(set(outs)) > 10  # sampled, not one answer 50 times
    ended = 0
    for seed in range(10):
        r = c.completions.create(model="x", prompt="config = ", max_tokens=300, temperature=1.0, seed=seed,
                                 extra_body={"response_format": {"type": "json_object"}})
        if r.choices[0].finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(r.choices[0].text), dict), r.choices[0].text
    assert ended >= 1
