"""`clover serve` speaks llama-server's dialect: POST /completion (its fields and reply shapes,
streamed or not), GET /slots, /tokenize and /detokenize; on the tiny preset, a `clover serve`
subprocess as in test_server.py."""

from __future__ import annotations

import json
import time

import pytest

from clover_testkit.server_harness import Server

pytestmark = pytest.mark.needs_libclover

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

PROMPT = "def fibonacci(n):\n"
GREEDY = {"temperature": 0, "block_size": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    s = Server(tiny_artifacts["f32"], "--parallel", "2", "-t", "1")
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def sse(server, path: str, body: dict) -> list[str]:
    """The data lines of a streamed reply."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_completion_equals_v1_completions(server) -> None:
    want = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, **GREEDY}).json()
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 24, "return_tokens": True, **GREEDY})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == want["choices"][0]["text"]
    assert got["stop"] is True and got["stop_type"] == "limit" and got["stopping_word"] == ""
    assert got["tokens_predicted"] == len(got["tokens"]) == want["usage"]["completion_tokens"] == 24
    assert got["tokens_evaluated"] == want["usage"]["prompt_tokens"]
    assert got["generation_settings"]["n_predict"] == 24 and got["generation_settings"]["n_ctx"] == 1024
    assert got["timings"]["predicted_n"] == 24
    assert got["timings"]["prompt_n"] + got["timings"]["cache_n"] == got["tokens_evaluated"]
    # the same prompt as token ids; a stop word ends it as llama-server says
    ids = post(server, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    by_ids = post(server, "/completion", {"prompt": ids, "n_predict": 24, **GREEDY}).json()
    assert by_ids["content"] == got["content"] and by_ids["tokens"] == []  # (return_tokens off)
    word = got["content"][5:8]
    cut = post(server, "/completion", {"prompt": PROMPT, "n_predict": 24, "stop": [word], **GREEDY}).json()
    assert cut["content"] == got["content"][:got["content"].index(word)]
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    zero = post(server, "/completion", {"prompt": PROMPT, "n_predict": 0}).json()
    assert (zero["content"], zero["tokens_predicted"], zero["stop_type"]) == ("", 0, "limit")


def test_cache_prompt(tiny_artifacts) -> None:
    """A prompt that continues a context's memory (the last prompt and its reply's tokens) reuses
    it; cache_prompt: false reads every token again, to the same text (one context: the one that
    holds the memory)."""
    server = Server(tiny_artifacts["f32"], "--parallel", "1", "-t", "1")
    try:
        check_cache_prompt(server)
    finally:
        server.stop()


def check_cache_prompt(server) -> None:
    ids = post(server, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    first = post(server, "/completion", {"prompt": ids, "n_predict": 16, "return_tokens": True, **GREEDY}).json()
    body = {"prompt": ids + first["tokens"], "n_predict": 8, **GREEDY}
    again = post(server, "/completion", body).json()
    assert again["tokens_cached"] > len(ids) and again["timings"]["cache_n"] == again["tokens_cached"]
    post(server, "/completion", {"prompt": ids, "n_predict": 16, **GREEDY})  # the memory as before
    fresh = post(server, "/completion", {**body, "cache_prompt": False}).json()
    assert fresh["tokens_cached"] == 0 and fresh["timings"]["prompt_n"] == fresh["tokens_evaluated"]
    assert fresh["content"] == again["content"]


def test_streaming_shape(server) -> None:
    body = {"prompt": PROMPT, "n_predict": 24, **GREEDY}
    whole = post(server, "/completion", body).json()
    lines = sse(server, "/completion", {**body, "stream": True})
    assert "[DONE]" not in lines  # llama-server's /completion stream ends with its stop: true object
    events = [json.loads(x) for x in lines]
    *pieces, last = events
    assert all(e["stop"] is False for e in pieces) and sum(bool(e["content"]) for e in pieces) > 1
    assert "".join(e["content"] for e in pieces) == whole["content"]
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == 24 and last["tokens_evaluated"] == whole["tokens_evaluated"]
    assert set(last["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"}


@pytest.mark.parametrize("body,param", [
    ({"min_p": 1.5}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"),
    ({"mirostat": 3}, "mirostat"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
    ({"dynatemp_range": -0.5}, "dynatemp_range"),
    ({"min_keep": -1}, "min_keep"),
    ({"n_probs": 3}, "n_probs"),
    ({"id_slot": 1}, "id_slot"),
    ({"samplers": ["top_k", "bogus"]}, "samplers"),
    ({"n_predict": -2}, "n_predict"),
    ({"n_predict": 5000}, "n_predict"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"cache_prompt": "yes"}, "cache_prompt"),
])
def test_a_field_not_honoured_is_named(server, body, param) -> None:
    r = post(server, "/completion", {"prompt": "x", "n_predict": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_sampler_chain_fields_are_honoured(server, tiny_artifacts) -> None:
    """llama-server's sampler fields run llama.cpp's samplers: the reply is Clover.generate's with them."""
    from clover_cpp import Clover

    chain = {"repeat_penalty": 1.5, "presence_penalty": 0.5, "repeat_last_n": 32, "logit_bias": [[5, False]],
             "samplers": ["penalties", "top_k", "temperature"], "dynatemp_range": 0.5, "min_keep": 2}
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "return_tokens": True, **GREEDY, **chain})
    assert r.status_code == 200, r.text
    plain = post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "return_tokens": True, **GREEDY}).json()
    assert r.json()["tokens"] != plain["tokens"] and 5 not in r.json()["tokens"]
    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1) as m:
        want = m.generate(PROMPT, max_tokens=16, temperature=0, block_size=4, stop_at_eos=False, repeat_penalty=1.5,
                          presence_penalty=0.5, repeat_last_n=32, logit_bias={5: float("-inf")},
                          samplers="penalties;top_k;temperature", dynatemp_range=0.5, min_keep=2)
    assert r.json()["tokens"] == want.tokens


def test_neutral_values_are_accepted(server) -> None:
    body = {"prompt": PROMPT, "n_predict": 8, **GREEDY}
    plain = post(server, "/completion", body).json()["content"]
    neutral = {"min_p": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 64, "typical_p": 1.0, "n_probs": 0,
               "mirostat": 0, "id_slot": -1, "logit_bias": [], "n_keep": 0,
               "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "min_keep": 0}
    r = post(server, "/completion", {**body, **neutral})
    assert r.status_code == 200 and r.json()["content"] == plain


def test_grammar_and_json_schema(server) -> None:
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200 and r.json()["content"] in ("yes", "no"), r.text
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 32, "temperature": 0,
                                     "json_schema": {"type": "boolean"}})
    assert r.status_code == 200 and r.json()["content"] in ("true", "false"), r.text


def slots_when(server, idle: bool) -> list[dict]:
    """GET /slots once every context is idle (idle=True) or one is busy (False), within 20 s."""
    deadline = time.monotonic() + 20
    while True:
        got = httpx.get(server.url + "/slots", timeout=10).json()
        if all(not s["is_processing"] for s in got) == idle:
            return got
        assert time.monotonic() < deadline, f"/slots stayed {got}"
        time.sleep(0.05)


def test_slots_while_a_request_runs(server) -> None:
    idle = slots_when(server, idle=True)
    assert [s["id"] for s in idle] == [0, 1] and all(s["n_ctx"] == 1024 for s in idle)
    # threshold 1.0 with B = 500: a 500-token pass per token, seconds of work
    body = {"prompt": "hello", "n_predict": 500, "stream": True, "block_size": 500, "threshold": 1.0,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped line iterator closes the stream (the client leaves)
        first = json.loads(next(line for line in lines if line.startswith("data:"))[len("data: "):])
        busy = [s for s in slots_when(server, idle=False) if s["is_processing"]]
        assert [s["id"] for s in busy] == [first["id_slot"]]
    slots_when(server, idle=True)  # the client left: its generation is cancelled, the context given back


def test_tokenize_detokenize_round_trip(server) -> None:
    text = "def add(a, b):\n    return a + b"
    toks = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    assert post(server, "/detokenize", {"tokens": toks}).json()["content"] == text
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces) == text


def test_props_has_llama_servers_keys(server) -> None:
    p = httpx.get(server.url + "/props", timeout=10).json()
    assert p["total_slots"] == 2 and p["default_generation_settings"]["n_ctx"] == 1024
