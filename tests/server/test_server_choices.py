"""`clover serve` and `Clover.create_completion`: a prompt's own log-probabilities (echo +
logprobs, max_tokens 0: lm-eval's loglikelihood), several choices (n, best_of, a list of
prompts), with the official openai client. The numbers are the library's: the causal commit's
logits (Clover.commit) for the prompt, Clover.generate with the choice's seed for the reply."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.needs_libclover

openai = pytest.importorskip("openai", reason="the test extra installs openai")
httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")

PROMPT = "class A:\n    def f(self):"
KNOBS = {"block_size": 4, "ignore_eos": True}
SEED = 7


def causal_logprobs(model, toks: list[int]) -> np.ndarray:
    """Row i: the log-softmax (float64, the mask token excluded) of the logits predicting token i + 1."""
    model.reset()
    z = model.commit(toks, logits=True).astype(np.float64)
    z[:, model.mask_token] = -np.inf
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def piece(model, t: int) -> str:
    return model.token_to_piece(t).decode("utf-8", "replace")


def test_echo_logprobs_score_the_prompt(tiny_server) -> None:
    s, local = tiny_server
    toks = local.tokenize(PROMPT, add_bos=True, special=True)
    want = causal_logprobs(local, toks)
    r = s.client().completions.create(model="x", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2,
                                      extra_body=KNOBS)
    c = r.choices[0]
    reply = local.generate(PROMPT, max_tokens=4, logprobs=2, reuse_prefix=False, stop_at_eos=False, block_size=4)
    assert c.text == PROMPT + reply.text
    lp = c.logprobs
    n = len(toks)
    assert lp.tokens == [piece(local, t) for t in toks + reply.tokens]
    # the prompt's: the first null (OpenAI's), each other from the row that predicts it
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([want[i - 1, t] for i, t in enumerate(toks) if i], abs=1e-9)
    for i in range(1, n):
        top = lp.top_logprobs[i]
        best = np.argsort(-want[i - 1], kind="stable")[:2]
        assert {piece(local, int(t)): pytest.approx(want[i - 1, t], abs=1e-9) for t in best} | \
            {lp.tokens[i]: pytest.approx(lp.token_logprobs[i], abs=1e-9)} == top
    # then the reply's, as generate() reports them
    assert lp.token_logprobs[n:] == pytest.approx(reply.logprobs, abs=1e-6)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_max_tokens_0_scores_a_prompt(tiny_server) -> None:
    """lm-eval's loglikelihood: the prompt's log-probabilities, nothing generated."""
    s, local = tiny_server
    toks = local.tokenize(PROMPT, add_bos=True, special=True)
    want = causal_logprobs(local, toks)
    r = s.client().completions.create(model="x", prompt=toks, max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[1:] == pytest.approx([want[i - 1, t] for i, t in enumerate(toks) if i], abs=1e-9)
    assert sum(c.logprobs.token_logprobs[1:]) == pytest.approx(sum(want[i - 1, t] for i, t in enumerate(toks) if i))


def test_streamed_echo_carries_the_prompts_logprobs(tiny_server) -> None:
    s, local = tiny_server
    toks = local.tokenize(PROMPT, add_bos=True, special=True)
    chunks = [ch for ch in s.client().completions.create(model="x", prompt=PROMPT, max_tokens=4, temperature=0,
                                                          echo=True, logprobs=1, stream=True, extra_body=KNOBS)]
    first = chunks[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(toks) and first.logprobs.token_logprobs[0] is None
    reply = [lp for ch in chunks[1:] if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.tokens]
    assert "".join(reply) == "".join(ch.choices[0].text for ch in chunks[1:] if ch.choices)


def test_n_choices_each_with_its_own_seed(tiny_server) -> None:
    s, local = tiny_server
    r = s.client().completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=SEED, n=3,
                                      extra_body=KNOBS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    want = [local.generate(PROMPT, max_tokens=6, temperature=1.0, seed=SEED + i, block_size=4, stop_at_eos=False)
            for i in range(3)]
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert [c.model_extra["clover"]["seed"] for c in r.choices] == [SEED, SEED + 1, SEED + 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(len(w.tokens) for w in want)
    assert r.usage.prompt_tokens == len(local.tokenize(PROMPT, add_bos=True, special=True))  # the prompt once


def test_a_list_of_prompts_in_openais_order(tiny_server) -> None:
    """Prompt i's n choices are indices i*n .. i*n + n - 1; seeds run over all of them."""
    s, local = tiny_server
    prompts = [PROMPT, "import os\n", "x = 1"]
    r = s.client().completions.create(model="x", prompt=prompts, max_tokens=4, temperature=1.0, seed=SEED, n=2,
                                      echo=True, extra_body=KNOBS)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        p = prompts[c.index // 2]
        want = local.generate(p, max_tokens=4, temperature=1.0, seed=SEED + c.index, block_size=4, stop_at_eos=False)
        assert c.text == p + want.text
    ids = [local.tokenize(p, add_bos=True, special=True) for p in prompts[:2]]  # token-id prompts too
    r2 = s.client().completions.create(model="x", prompt=ids, max_tokens=3, temperature=0, extra_body=KNOBS)
    assert [c.text for c in r2.choices] == [local.generate(t, max_tokens=3, block_size=4, stop_at_eos=False).text
                                            for t in ids]


def test_best_of_keeps_the_most_probable_per_token(tiny_server) -> None:
    s, local = tiny_server
    r = s.client().completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=SEED, n=2,
                                      best_of=4, extra_body=KNOBS)
    cands = [local.generate(PROMPT, max_tokens=6, temperature=1.0, seed=SEED + i, logprobs=0, block_size=4,
                            stop_at_eos=False) for i in range(4)]
    order = sorted(range(4), key=lambda i: -np.mean(cands[i].logprobs))
    assert [c.text for c in r.choices] == [cands[i].text for i in order[:2]]
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.logprobs is None for c in r.choices)  # not asked: not reported
    assert r.usage.completion_tokens == sum(len(c.tokens) for c in cands)  # every candidate counts


@pytest.mark.parametrize("body,param", [
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
])
def test_refused_choices(tiny_server, body, param) -> None:
    s, _ = tiny_server
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_streamed_choices_and_chat_n(tiny_server) -> None:
    s, local = tiny_server
    c = s.client()
    chunks = list(c.completions.create(model="x", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=SEED, n=2,
                                       stream=True, stream_options={"include_usage": True}, extra_body=KNOBS))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for x in ch.choices:
            texts[x.index] += x.text
    want = [local.generate(PROMPT, max_tokens=5, temperature=1.0, seed=SEED + i, block_size=4, stop_at_eos=False)
            for i in range(2)]
    assert [texts[0], texts[1]] == [w.text for w in want]
    assert chunks[-1].usage.completion_tokens == sum(len(w.tokens) for w in want)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=1.0, seed=SEED, n=2,
                                  extra_body=KNOBS)
    assert [x.index for x in r.choices] == [0, 1]
    assert [x.message.content for x in r.choices] == [
        local.chat(msgs, max_tokens=5, temperature=1.0, seed=SEED + i, block_size=4, stop_at_eos=False).text
        for i in range(2)]


# llama-cpp-python's Llama in a process of its own (llama_cpp binds its library at import)
LLAMA_ECHO = r"""
import json, sys
import clover_cpp
from clover_cpp._lib import import_llama_cpp
import_llama_cpp()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=1, type_k=0, type_v=0, logits_all=True, verbose=False)
r = llm.create_completion(sys.argv[2], max_tokens=1, temperature=0, top_k=1, min_p=0.0, echo=True, logprobs=2)
print(json.dumps(r, default=float))
"""


def test_python_echo_logprobs_as_llama_cpp_python(tiny_artifacts) -> None:
    """Clover.create_completion(echo=True, logprobs=N) has Llama.create_completion's shape: the
    prompt's tokens then the reply's, offsets from 0, the first log-probability null, top dicts of
    N + the token's own. (llama-cpp-python 0.3.36 pairs each token with the row after it when the
    model adds no BOS, the tiny one's case: its top dict at i is ours at i + 1; and it lists no
    log-probability for the last token generated.)"""
    from clover_cpp import Clover

    res = subprocess.run([sys.executable, "-c", LLAMA_ECHO, str(tiny_artifacts["f32"]), PROMPT],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = json.loads(res.stdout.strip().splitlines()[-1])["choices"][0]
    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1, kv_f32=True) as m:
        ours = m.create_completion(PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2, block_size=1)
        toks = m.tokenize(PROMPT, add_bos=True, special=True)
        want = causal_logprobs(m, toks)
        assert m.bos_token < 0  # (the alignment note above)
    o, t = ours["choices"][0], theirs
    assert set(o) == set(t) and set(o["logprobs"]) == set(t["logprobs"])
    assert ours["usage"] == json.loads(res.stdout.strip().splitlines()[-1])["usage"]
    n = len(toks)
    # (the prompt's part: the reply's token may be a partial character, which they drop and we replace)
    assert o["text"][:len(PROMPT)] == t["text"][:len(PROMPT)] == PROMPT
    # (theirs zips the tokens with the rows evaluated, which leave out the last token generated)
    assert len(o["logprobs"]["tokens"]) == n + 1 and len(t["logprobs"]["tokens"]) == n
    for k in ("tokens", "text_offset"):
        assert o["logprobs"][k][:n] == t["logprobs"][k][:n], k
    assert o["logprobs"]["token_logprobs"][0] is None and o["logprobs"]["top_logprobs"][0] is None
    assert t["logprobs"]["token_logprobs"][0] is None and t["logprobs"]["top_logprobs"][0] is None
    assert o["logprobs"]["token_logprobs"][1:n] == pytest.approx([want[i - 1, x] for i, x in enumerate(toks) if i])
    for i in range(1, n):
        mine, theirs_i = o["logprobs"]["top_logprobs"][i], t["logprobs"]["top_logprobs"][i]
        assert 1 <= len(mine) <= 3 and mine[o["logprobs"]["tokens"][i]] == o["logprobs"]["token_logprobs"][i]
        if i + 1 < n:  # the two most probable of the same row in both (they include the mask token: ~1e-3)
            top2 = sorted(o["logprobs"]["top_logprobs"][i + 1].values(), reverse=True)[:2]
            assert sorted(theirs_i.values(), reverse=True)[:2] == pytest.approx(top2, abs=1e-2)


def own_logprobs(chunks, index: int) -> list:
    """The logprobs objects of choice ``index``'s chunks, in order (None: a chunk carrying none)."""
    return [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].index == index]


def test_streamed_completion_chunks_carry_their_own_logprobs(tiny_server) -> None:
    """Each streamed chunk carries its own tokens' logprobs; joined, they are the unstreamed
    reply's (same seed), and the last chunk carries none."""
    s, _ = tiny_server
    kw = dict(model="x", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=SEED, n=2, logprobs=2, extra_body=KNOBS)
    want = s.client().completions.create(**kw)
    chunks = list(s.client().completions.create(stream=True, **kw))
    for c in want.choices:
        lps = own_logprobs(chunks, c.index)
        texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert lps[-1] is None and all(lp is not None for lp in lps[1:-1]) and len(lps) >= 4
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for lp in lps[1:-1] for x in getattr(lp, field)] == getattr(c.logprobs, field), field
        assert all(lp.tokens for lp in lps[1:-1]) and "".join(texts) == c.text


def test_streamed_chat_chunks_carry_their_own_logprobs(tiny_server) -> None:
    s, _ = tiny_server
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(model="x", messages=msgs, max_tokens=12, temperature=0.8, seed=SEED, n=2, logprobs=True,
              top_logprobs=2, extra_body=KNOBS)
    want = s.client().chat.completions.create(**kw)
    chunks = list(s.client().chat.completions.create(stream=True, **kw))
    for c in want.choices:
        lps = own_logprobs(chunks, c.index)
        assert lps[-1] is None and sum(lp is not None for lp in lps) >= 2
        assert [x for lp in lps if lp is not None for x in lp.content] == c.logprobs.content
