"""`clover serve` with real clients: the official openai package and plain HTTP (httpx), on the
tiny preset. Each server is a `clover serve` subprocess on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clover_testkit.server_harness import Server
from clover_testkit.server_harness import post as _post

pytestmark = pytest.mark.needs_libclover

openai = pytest.importorskip("openai", reason="the test extra installs openai")
httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

GREEDY = {"temperature": 0, "extra_body": {"block_size": 4}}


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f32"]


@pytest.fixture(scope="module")
def server(gguf):
    s = Server(gguf, "--parallel", "2", "-t", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(gguf):
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=1024, n_threads=1) as m:
        yield m


MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def add(a, b):"}]


def test_chat_matches_clover_chat(server, local) -> None:
    c = server.client()
    r = c.chat.completions.create(model="x", messages=MSGS, max_tokens=16, **GREEDY)
    want = local.chat(MSGS, max_tokens=16, block_size=4, reuse_prefix=False)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "max_tokens" else "stop")
    n_prompt = len(local.tokenize(local.format_chat(MSGS), add_bos=True, special=True))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == n_prompt + len(want.tokens)
    # streaming gives the same text, in more than one piece
    chunks = list(c.chat.completions.create(model="x", messages=MSGS, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.text
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want.tokens)


def test_completions_match_generate(server, local) -> None:
    c = server.client()
    prompt = "def fibonacci(n):\n"
    want = local.generate(prompt, max_tokens=24, block_size=4, stop_at_eos=False)
    r = c.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0,
                             extra_body={"block_size": 4, "ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="x", prompt=prompt, max_tokens=24, temperature=0, stream=True,
        extra_body={"block_size": 4, "ignore_eos": True}))
    assert streamed == want.text
    # token ids as the prompt, and the models list
    ids = local.tokenize(prompt, add_bos=True, special=True)
    assert c.completions.create(model="x", prompt=ids, max_tokens=24, temperature=0,
                                extra_body={"block_size": 4, "ignore_eos": True}).choices[0].text == want.text
    assert [m.id for m in c.models.list().data] == [local.metadata.get("general.name") or Path(local.model_path).stem]


def test_stop_strings_and_seeds(server, local) -> None:
    c = server.client()
    prompt = "class Point:\n"
    full = local.generate(prompt, max_tokens=32, block_size=4, stop_at_eos=False).text
    stop = full[7:10]
    r = c.completions.create(model="x", prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                             extra_body={"block_size": 4, "ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="x", prompt=prompt, max_tokens=32, temperature=0, stop=stop, stream=True,
        extra_body={"block_size": 4, "ignore_eos": True}))
    assert streamed == full[:full.index(stop)]

    def sample(seed: int) -> str:
        return c.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=1.0, seed=seed,
                                    extra_body={"block_size": 4, "ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    ({"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "block_size": 0}, "block_size"),
    ({"prompt": "x", "block_size": "big"}, "block_size"),
    ({"prompt": "x", "threshold": 2}, "threshold"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": "hello " * 1100}, None),  # longer than the context
    ({}, "prompt"),
])
def test_errors_are_openai_shaped(server, body, param) -> None:
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param in (err["param"] or "") or param in err["message"]


def test_the_budget_fits_by_the_runtimes_rule(server, local) -> None:
    """prompt + max_tokens must fit n_ctx as Clover.room says: with a fixed block size, in whole
    blocks (a budget that fits only token by token is a 400 context_length_exceeded naming
    max_tokens); the room itself is granted; auto needs no whole blocks."""
    ids = (local.tokenize("def f(x):\n    return x\n" * 200, add_bos=True, special=True))[:950]
    assert len(ids) == 950
    room = local.room(950, block_size=32)
    assert room == (1024 - 950) // 32 * 32 < 1024 - 950
    body = {"prompt": ids, "block_size": 32, "temperature": 0, "ignore_eos": True}
    r = _post(server, "/v1/completions", {**body, "max_tokens": 1024 - 950})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", r.text
    assert "blocks of 32" in err["message"]
    r = _post(server, "/v1/completions", {**body, "max_tokens": room})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room, r.text
    r = _post(server, "/v1/completions", {**body, "block_size": "auto", "max_tokens": 1024 - 950})
    assert r.status_code == 200, r.text


def test_chat_errors(server) -> None:
    assert _post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert _post(server, "/v1/chat/completions", {"messages": [{"content": "no role"}]}).status_code == 400
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_disconnect_cancels_and_server_goes_on(server) -> None:
    before = server.metrics()
    body = {"prompt": "hello", "max_tokens": 900, "stream": True, "block_size": 1, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data:")
            if got >= 3:
                break
    deadline = time.time() + 10
    while time.time() < deadline:
        after = server.metrics()
        if after["clover_cancelled_total"] > before["clover_cancelled_total"] and after["clover_contexts_busy"] == 0:
            break
        time.sleep(0.05)
    assert after["clover_cancelled_total"] == before["clover_cancelled_total"] + 1
    assert after["clover_completion_tokens_total"] - before["clover_completion_tokens_total"] < 900
    r = server.client().completions.create(model="x", prompt="hi", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens > 0


def test_concurrent_clients_parallel_2(server) -> None:
    c = server.client(timeout=120)
    prompts = [f"def f{i}(x):\n" for i in range(20)]

    def one(p: str) -> str:
        return c.completions.create(model="x", prompt=p, max_tokens=32, temperature=0,
                                    extra_body={"block_size": 4, "ignore_eos": True}).choices[0].text
    serial = [one(p) for p in prompts[:2]]  # warm both contexts' buffers
    serial += [one(p) for p in prompts[2:]]
    rss0 = server.rss_kb()
    out: list[str | None] = [None] * len(prompts)

    def worker(i: int) -> None:
        out[i] = one(prompts[i])
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == serial
    assert server.rss_kb() <= 1.10 * rss0


def test_prefix_reuse_picks_the_context_holding_the_prompt(gguf, local) -> None:
    """--parallel 2: a request takes the context whose memory its prompt continues (read from the
    model: its committed tokens; for a chat, the conversation of its last exchange), also when
    the other free context comes first; the reused tokens are the runtime's (stats.n_reused of
    the same calls on one local context), in the reply (usage.prompt_tokens_details.cached_tokens,
    clover.reused_prompt_tokens) and in clover_prompt_tokens_reused_total."""
    kw = dict(max_tokens=8, temperature=0)
    local_kw = dict(kw, block_size=4)
    s = Server(gguf, "--parallel", "2", "-t", "1")
    try:
        c = s.client()
        before = s.metrics()

        def complete(ids: list[int]):
            return c.completions.create(model="x", prompt=ids, extra_body={"block_size": 4, "ignore_eos": True}, **kw)

        def cached(r) -> int:
            assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["clover"]["reused_prompt_tokens"]
            return r.usage.prompt_tokens_details.cached_tokens

        def expected(first: list[int], then: list[int]) -> int:
            local.generate(first, stop_at_eos=False, reuse_prefix=False, **local_kw)
            return local.generate(then, stop_at_eos=False, **local_kw).stats.n_reused

        a, b = (local.tokenize(t, add_bos=True, special=True) for t in ("def alpha(x):\n", "class Beta:\n"))
        assert cached(complete(a)) == 0 and cached(complete(b)) == 0  # one context each
        more = local.tokenize("    return x\n", add_bos=False, special=True)
        got = {}
        for name, first in (("b", b), ("a", a)):  # b's context is not the first free one
            local.generate(first, stop_at_eos=False, reuse_prefix=False, **local_kw)
            then = local.committed_tokens + more
            want = expected(first, then)
            assert want > len(first)  # the prompt and the reply's finished blocks
            got[name] = cached(complete(then))
            assert got[name] == want, name
        # a chat's next turn: its context holds the first turn's prompt and reply tokens
        m1 = [{"role": "user", "content": "def gamma(n):"}]
        r1 = c.chat.completions.create(model="x", messages=m1, extra_body={"block_size": 4}, **kw)
        assert cached(r1) == 0
        want1 = local.chat(m1, reuse_prefix=False, **local_kw)
        assert want1.text == r1.choices[0].message.content
        m2 = m1 + [{"role": "assistant", "content": want1.text}, {"role": "user", "content": "and delta?"}]
        want2 = local.chat(m2, **local_kw).stats.n_reused
        assert want2 > 0
        r2 = c.chat.completions.create(model="x", messages=m2, extra_body={"block_size": 4}, **kw)
        assert cached(r2) == want2
        after = s.metrics()
        assert after["clover_prompt_tokens_reused_total"] - before["clover_prompt_tokens_reused_total"] == \
            got["a"] + got["b"] + want2
    finally:
        s.stop()


@contextlib.contextmanager
def _holding_the_context(s: Server, headers: dict[str, str] | None = None) -> Iterator[None]:
    """While inside: a long streaming request holds the server's one context (threshold 1.0 with
    B = 500: a 500-token pass per token, seconds of work; the two blocks start right after the
    prompt, so prompt + 1000 positions fit -c 1024)."""
    body = {"prompt": "hello", "max_tokens": 1000, "stream": True, "block_size": 500, "threshold": 1.0,
            "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30, headers=headers) as first:
        # read the stream as a client does (one that stops reading is a slow client), and wait
        # until the request holds the context: its first chunk can leave before it does
        def read_all() -> None:
            try:
                for _ in first.iter_lines():
                    pass
            except httpx.HTTPError:  # the stream is closed when the test leaves the block
                pass

        threading.Thread(target=read_all, daemon=True).start()
        deadline = time.monotonic() + 20
        while "clover_contexts_busy 1" not in httpx.get(s.url + "/metrics", headers=headers).text:
            assert time.monotonic() < deadline, "the streaming request never took the context"
            time.sleep(0.02)
        yield


def test_api_key_and_queue_full(gguf) -> None:
    s = Server(gguf, "--api-key", "sekret", "--parallel", "1", "--queue-size", "0", "-t", "1")
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
        r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}, {"authorization": "Bearer wrong"})
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="x", prompt="x", max_tokens=2)
        ok = s.client(api_key="sekret").completions.create(model="x", prompt="x", max_tokens=2)
        assert ok.usage.completion_tokens >= 0
        # one context, no queue: a second request while the first streams gets 503
        with _holding_the_context(s, {"authorization": "Bearer sekret"}):
            r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}, {"authorization": "Bearer sekret"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        s.stop()


def test_llama_cpp_python_runs_a_clover_gguf_as_the_causal_model(gguf, local, tmp_path: Path) -> None:
    """llama_cpp.Llama on our libllama decodes a clover GGUF as the causal model (spec v2: a
    plain llama_decode is the model with the next-token shift): its logits are Clover.commit's,
    and greedy decoding with them gives the tokens of Clover's B = 1 (autoregressive decoding)."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:  # (importing it here would install its log callback)
        pytest.skip("dev.sh installs llama-cpp-python's Python layer")
    import numpy as np

    from clover_cpp import _native

    prompt = local.tokenize("hello", add_bos=True, special=True)
    n_new = 8
    # greedy over llama_cpp's own logits (the mask token excluded, as Clover's candidates exclude
    # it; ties to the lowest id, as clover_pick_candidate), one llama_decode per new token
    code = ("import json, sys\nimport numpy as np\nfrom llama_cpp import Llama\n"
            "llm = Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, n_threads=1, verbose=False)\n"
            "seq, mask, n_new = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])\n"
            "llm.eval(seq)\n"
            "for _ in range(n_new):\n"
            "    row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)\n"
            "    row[mask] = -np.inf\n"
            "    seq.append(int(row.argmax()))\n"
            "    llm.eval(seq[-1:])\n"
            "np.save(sys.argv[5], np.asarray(llm.scores[:llm.n_tokens], dtype=np.float32))\n"
            "print('TOKENS', json.dumps(seq))\n")
    libdir = _native.find_library().parent
    out = tmp_path / "llama-cpp-python-logits.npy"
    p = subprocess.run([sys.executable, "-c", code, str(gguf), json.dumps(prompt), str(local.mask_token), str(n_new),
                        str(out)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LLAMA_CPP_LIB_PATH": str(libdir)})
    assert p.returncode == 0 and "TOKENS" in p.stdout, p.stdout + p.stderr[-2000:]
    seq = json.loads(p.stdout.split("TOKENS", 1)[1])
    want = local.generate(prompt, max_tokens=n_new, block_size=1, temperature=0, stop_at_eos=False,
                          reuse_prefix=False).tokens
    assert len(want) == n_new and seq == prompt + want
    theirs = np.load(out)
    local.reset()
    ours = local.commit(seq, logits=True)
    local.reset()
    assert theirs.shape == ours.shape == (len(seq), local.n_vocab())
    # the prompt in one decode and the new tokens one by one against one commit of all of them: the
    # same numbers up to float rounding (measured 9e-5 of the largest logit)
    assert np.abs(theirs - ours).max() <= 1e-3 * np.abs(ours).max()


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3.0}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"five": 3.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 3.0}}, "logit_bias"),
    ({"prompt": "x", "samplers": "top_k;bogus"}, "samplers"),
    ({"prompt": "x", "mirostat": 3}, "mirostat"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "frobnicate": True}, "frobnicate"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "seed": -2}, "seed"),
    ({"prompt": "x", "top_k": 2**40}, "top_k"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "x", "max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"prompt": "x", "block_size": 1000}, "block_size"),
    ({"prompt": "x", "block_size": 1024}, "block_size"),  # n_ctx, above --max-block-size 512
    ({"prompt": "x", "block_size": -1}, "block_size"),
    ({"prompt": "x", "max_steps": 2**31}, "max_steps"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ({"prompt": [2**32 + 5]}, "prompt"),
    ({"prompt": "x", "draft_self": "bogus"}, "draft_self"),
    ({"prompt": "x", "draft_self": 1}, "draft_self"),
    ({"prompt": "x", "draft_self": None}, "draft_self"),
])
def test_every_field_honoured_or_named(server, body, param) -> None:
    """A field the server cannot honour, or a value out of its range, is a 400 naming it
    (never a 200 that ignores it)."""
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") and err["message"]


@pytest.mark.parametrize("field,value", [("threshold", 2), ("threshold", 1e400), ("temperature", -1), ("top_p", 1.5),
                                         ("top_k", -1), ("top_k", 2**40), ("max_steps", -1), ("seed", -2),
                                         ("max_tokens", -1), ("logprobs", 21), ("min_p", 1.5),
                                         ("presence_penalty", 3), ("repeat_penalty", 0), ("dry_base", 0.5)])
def test_ranges_are_the_runtimes(server, local, field, value) -> None:
    """generate's ranges have one owner (libclover's clover_generate_params_check, through the
    runtime): the server's 400 carries the runtime's message word for word, naming the field;
    the server keeps only the JSON types (a copy of a range with its own wording fails this)."""
    from clover_cpp import CloverValueError

    with pytest.raises(CloverValueError) as e:
        local.generate("x", **{field: value})
    r = _post(server, "/v1/completions", json.dumps({"prompt": "x", field: value}).replace("Infinity", "1e400"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == e.value.message and r.json()["error"]["param"] == field
    r = _post(server, "/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_sampler_chain_fields_are_generates(server, local) -> None:
    """OpenAI's penalties and logit_bias and llama-server's sampler fields run llama.cpp's samplers:
    the reply is Clover.generate's with them (chat too, through the openai client's extra_body)."""
    chain = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repeat_penalty": 1.3, "min_p": 0.1}
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "block_size": 4, "ignore_eos": True}
    plain = local.generate("def add(a, b):", max_tokens=12, temperature=0, block_size=4, stop_at_eos=False)
    ban = plain.tokens[0]
    r = _post(server, "/v1/completions", {**body, **chain, "logit_bias": {str(ban): -100}})
    assert r.status_code == 200, r.text
    want = local.generate("def add(a, b):", max_tokens=12, temperature=0, block_size=4, stop_at_eos=False,
                          logit_bias={ban: -100.0}, **chain)
    assert r.json()["choices"][0]["text"] == want.text and want.tokens[0] != ban
    c = server.client()
    reply = c.chat.completions.create(model="x", messages=MSGS, max_tokens=4, presence_penalty=1.0,
                                      extra_body={"dry_multiplier": 0.8, "samplers": "edkt", "mirostat": 0})
    assert reply.choices[0].message.content is not None


def test_top_p_zero_is_argmax(server) -> None:
    """top_p 0 keeps only the most probable token (libclover's rule; the server refused it before):
    accepted, and the seed no longer matters."""
    c = server.client()
    kw = dict(model="x", prompt="def add(a, b):", max_tokens=8, temperature=1.0, top_p=0,
              extra_body={"block_size": 4, "ignore_eos": True})
    texts = {c.completions.create(seed=seed, **kw).choices[0].text for seed in (1, 2, 3)}
    assert len(texts) == 1 and len(next(iter(texts))) > 0


def test_chat_fields_honoured_or_named(server) -> None:
    c = server.client()
    for kw, param in [(dict(presence_penalty=3.0), "presence_penalty"), (dict(logit_bias={"x": 5}), "logit_bias"),
                      (dict(extra_body={"tools_please": 1}), "tools_please"),
                      (dict(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
                      (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                       "messages.0.content")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": "x", "messages": MSGS, "max_tokens": 2, **kw})
        assert param in (e.value.body.get("param") or "") or param in e.value.body["message"], (kw, e.value.body)


def test_max_completion_tokens_is_max_tokens(server) -> None:
    c = server.client()
    r = c.chat.completions.create(model="x", messages=MSGS, max_completion_tokens=5, temperature=0,
                                  extra_body={"block_size": 4, "ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # seeds: None and -1 draw a fresh one (reported), a given one is used and reported
    r = c.completions.create(model="x", prompt="x", max_tokens=2, seed=1234, extra_body={"block_size": 4})
    assert r.model_extra["clover"]["seed"] == 1234
    seeds = {c.completions.create(model="x", prompt="x", max_tokens=1, seed=-1).model_extra["clover"]["seed"]
             for _ in range(3)}
    assert len(seeds) == 3
    # the reported seed is the one the runtime drew: given again, it reproduces a sampled reply
    sampled = dict(model="x", prompt="def", max_tokens=12, temperature=1.0,
                   extra_body={"block_size": 4, "ignore_eos": True})
    r = c.completions.create(**sampled)
    again = c.completions.create(**sampled, seed=r.model_extra["clover"]["seed"])
    assert again.choices[0].text == r.choices[0].text
    assert again.model_extra["clover"]["seed"] == r.model_extra["clover"]["seed"]


def test_draft_self_auto_and_the_mode_reported(server, local) -> None:
    """draft_self: true | false | "auto"; the reply's clover.mode names the last block's mode and
    clover.blocks counts the blocks per mode: false at B = 4 is diffusion, B = 1 autoregressive,
    true draft-self (the text of block_size 1); "auto" (with block_size auto) one of the three,
    its blocks counted; "bogus" is a 400 naming draft_self (test_every_field_honoured_or_named)."""
    c = server.client()
    prompt = "def fibonacci(n):\n"
    base = dict(model="x", prompt=prompt, max_tokens=12, temperature=0)
    one = c.completions.create(**base, extra_body={"block_size": 1, "ignore_eos": True}).model_extra["clover"]
    assert one["mode"] == "autoregressive" and one["blocks"]["autoregressive"] == 12
    diff = c.completions.create(**base, extra_body={"block_size": 4, "ignore_eos": True}).model_extra["clover"]
    assert diff["mode"] == "diffusion" and diff["blocks"] == {"autoregressive": 0, "diffusion": 3, "draft-self": 0}
    want = local.generate(prompt, max_tokens=12, block_size=1, stop_at_eos=False, reuse_prefix=False).text
    r = c.completions.create(**base, extra_body={"block_size": 4, "ignore_eos": True, "draft_self": True})
    assert r.choices[0].text == want and r.model_extra["clover"]["mode"] == "draft-self"
    for body in ({"block_size": "auto", "draft_self": "auto"}, {"draft_self": "auto"}):
        r = c.completions.create(**base, extra_body={**body, "ignore_eos": True})
        ext = r.model_extra["clover"]
        assert r.usage.completion_tokens == 12 and ext["mode"] in ("autoregressive", "diffusion", "draft-self"), ext
        assert ext["blocks"][ext["mode"]] >= 1 and sum(ext["blocks"].values()) >= 1, ext
    props = httpx.get(server.url + "/props").json()
    assert "auto" in props["modes"]
    r = _post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "draft_self": "bogus"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_self", r.text
    assert 'true, false or "auto"' in r.json()["error"]["message"]


def test_coreset_reported(server, local) -> None:
    """The reply's clover.coreset is the block expert coreset its block passes used: the request's
    coreset, else the served contexts' (/props' coreset: the tiny GGUF has no clover.expert_coreset,
    off); in the streamed last chunk too."""
    c = server.client()
    served = httpx.get(server.url + "/props").json()["coreset"]
    assert served == local.coreset == 0
    base = dict(model="x", prompt="def add(a, b):", max_tokens=8, temperature=0)
    r = c.completions.create(**base, extra_body={"block_size": 4, "coreset": 4})
    assert r.model_extra["clover"]["coreset"] == 4
    r = c.completions.create(**base, extra_body={"block_size": 4})
    assert r.model_extra["clover"]["coreset"] == served
    chunks = list(c.chat.completions.create(model="x", messages=MSGS, max_tokens=8, stream=True,
                                            extra_body={"block_size": 4, "coreset": 2}))
    assert [ch.model_extra["clover"]["coreset"] for ch in chunks if "clover" in (ch.model_extra or {})] == [2]


def test_info_endpoints(server, local) -> None:
    props = httpx.get(server.url + "/props").json()
    assert props["n_ctx"] == 1024 and props["model"] == local.metadata.get("general.name")
    assert props["train_block_size"] == local.train_block_size and props["block_size"] == "auto"
    assert props["mode"] == "block-diffusion" and props["parallel"] == 2
    assert props["limits"]["max_block_size"] == 512
    text = "def add(a, b):\n    return a + b"
    toks = httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]
    assert toks == local.tokenize(text, add_bos=False, special=True)
    pieces = httpx.post(server.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == text and [p["id"] for p in pieces] == toks
    assert httpx.post(server.url + "/detokenize", json={"tokens": toks}).json()["content"] == text
    r = httpx.post(server.url + "/detokenize", json={"tokens": [2**70]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    (card,) = server.client().models.list().data
    assert card.model_extra["meta"]["n_vocab"] == local.n_vocab() and card.model_extra["meta"]["n_ctx"] == 1024
    assert server.client().models.retrieve(card.id).id == card.id
    # Prometheus text format: every sample has its HELP and TYPE
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    samples = [ln.split()[0] for ln in lines if not ln.startswith("#")]
    assert samples and all(f"# HELP {s} " in "\n".join(lines) and f"# TYPE {s} " in "\n".join(lines)
                           for s in samples)
    # unknown routes and methods: the one error shape
    for r in (httpx.get(server.url + "/v1/nothing"), httpx.get(server.url + "/v1/completions")):
        assert r.status_code in (404, 405) and r.json()["error"]["message"]


def _long_body(**kw) -> dict:
    # threshold 1.0 at B = 64: one token per 64-token pass, 900 of them: seconds of work
    return {"prompt": "hello", "max_tokens": 900, "block_size": 64, "threshold": 1.0, "ignore_eos": True,
            "temperature": 0, **kw}


def _next_request_time(server) -> float:
    t0 = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "block_size": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_disconnect_cancels_non_streaming(gguf) -> None:
    """A non-streaming request whose client leaves (the openai client's timeout, or a raw socket
    closed) is cancelled: the one context is free for the next request at once."""
    s = Server(gguf, "--parallel", "1", "-t", "1")
    try:
        baseline = min(_next_request_time(s) for _ in range(3))
        before = s.metrics()
        with pytest.raises(openai.APITimeoutError):
            s.client(timeout=0.5).completions.create(model="x", prompt="hello", max_tokens=900, temperature=0,
                                                     extra_body={k: v for k, v in _long_body().items()
                                                                 if k not in ("prompt", "max_tokens", "temperature")})
        assert _next_request_time(s) < 0.2 + baseline
        body = json.dumps(_long_body()).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while "clover_contexts_busy 1" not in httpx.get(s.url + "/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert _next_request_time(s) < 0.2 + baseline
        after = s.metrics()
        assert after["clover_cancelled_total"] == before["clover_cancelled_total"] + 2
        assert after["clover_completion_tokens_total"] - before["clover_completion_tokens_total"] < 2 * 900
    finally:
        s.stop()


def test_the_server_uses_public_names_only() -> None:
    """clover_cpp/server/ reaches the runtime through its public names (as the CLI does): no
    `obj._name` on another object, no private keyword argument (`_chat_text=`), no private name
    imported from outside the package (none at all: CloverError.status's codes are
    clover_cpp.CLOVER_ERR_*, not _native's), no file over 600 lines, and no copy of a context's
    memory (the pool asks the model)."""
    import ast

    folder = Path(__file__).resolve().parents[2] / "clover_cpp" / "server"
    files = sorted(folder.glob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "app.py", "generation.py", "pool.py", "types.py", "tools.py"}
    found = []
    for p in files:
        text = p.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 600, p.name
        for node in ast.walk(ast.parse(text)):
            where = f"{p.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os")):
                found.append(f"{where} .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
                found.append(f"{where} {node.arg}=")
            if isinstance(node, ast.ImportFrom) and node.level != 1:  # outside the package
                found += [f"{where} import {a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__future__"]
                if any(part.startswith("_") and part != "__future__" for part in (node.module or "").split(".")):
                    found.append(f"{where} from {node.module}")
            if isinstance(node, ast.Import):
                found += [f"{where} import {a.name}" for a in node.names
                          if any(part.startswith("_") for part in a.name.split("."))]
            if isinstance(node, ast.Attribute) and node.attr in ("memory", "chat_text"):
                found.append(f"{where} .{node.attr} (a copy of what the model holds)")
    assert not found, found


def test_a_client_that_leaves_the_queue_gives_its_place_back(gguf) -> None:
    """A request waiting for a context whose client goes away leaves the queue: the next one is
    queued, not refused with queue_full (the place used to stay taken until a context freed)."""
    s = Server(gguf, "--parallel", "1", "--queue-size", "1", "-t", "1")
    try:
        with _holding_the_context(s):
            short = {"prompt": "x", "max_tokens": 2}
            # each waits in the one queue place, then its client gives up: were the place kept,
            # the second would be answered at once with 503 queue_full
            for _ in range(3):
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(s.url + "/v1/completions", json=short, timeout=1.5)
                time.sleep(0.3)
    finally:
        s.stop()
