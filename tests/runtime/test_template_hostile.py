"""Chat templates in model files that run away or fail: each is one clear
error naming the template, within a time limit, in render_chat, the Python API
(Clover.format_chat, create_chat_completion), `clover chat` and `clover serve`, whose /health
and other requests answer while and after a bad template renders.

Every case runs in a child process (or against a server) with a deadline, so that a template
that runs away fails its test instead of hanging the run. Temporary folders only."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clover_testkit import fuzz  # the one GGUF rewriter

RUNAWAY_LOOP = "{% set s = 'a' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"

#: name -> (template, what the error says)
HOSTILE = {
    "nested_range": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "range"),
    "bigint_power": ("{{ 9**(9**8) }}", "power"),
    "lipsum_1e6": ("{{ lipsum(1000000) }}", "lipsum"),
    "string_times_1e10": ("{{ 'a' * 10000000000 }}", "string or list"),
    "list_doubling": ("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}"
                      "{% endfor %}{{ ns.x|length }}", "string or list"),
    "string_doubling": ("{% set ns = namespace(x='a') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}"
                        "{% endfor %}{{ ns.x|length }}", ("memory", "ran past")),  # under load the clock can win
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses"),
    "division_by_zero": ("{{ 1 / 0 }}", "division by zero"),
    "include": ("{% include 'other.jinja' %}", "includes, imports or extends"),
    "extends": ("{% extends 'base.jinja' %}", "includes, imports or extends"),
    "import": ("{% import 'macros.jinja' as m %}{{ m.x() }}", "includes, imports or extends"),
    "huge_center": ("{{ 'a'|center(10000000000) }}", "memory"),
    "output_flood": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output passes"),
    "loop_over_long_string": (RUNAWAY_LOOP, "ran past 2 s"),
}

#: the child: renders argv[1] (a JSON template) under 2 s limits and prints what happened
RENDER = """
import json, sys
import clover_cpp.chat as chat
from clover_cpp import CloverError, render_chat
chat.TEMPLATE_LIMITS = chat.TemplateLimits(seconds=2)
try:
    print(json.dumps({"text": render_chat([{"role": "user", "content": "hi"}], json.loads(sys.argv[1]))}))
except CloverError as e:
    print(json.dumps({"error": str(e), "type": type(e).__name__}))
"""


def _child(code: str, *args: str, deadline: float = 30) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=deadline)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_render_chat_refuses_a_template_that_runs_away_or_fails(name: str) -> None:
    template, says = HOSTILE[name]
    start = time.monotonic()
    out = _child(RENDER, json.dumps(template))
    assert time.monotonic() - start < 20
    assert out.get("type") == "ChatTemplateError", out
    says = says if isinstance(says, tuple) else (says,)
    assert out["error"].startswith("chat template failed: ") and any(x in out["error"] for x in says), out
    assert "\n" not in out["error"]


def test_a_template_refusing_the_messages_is_a_plain_error_and_good_templates_still_render() -> None:
    from clover_cpp import CloverError, render_chat
    from clover_cpp.chat import ChatTemplateError

    with pytest.raises(CloverError, match="^chat template: System role not supported$") as e:
        render_chat([{"role": "system", "content": "x"}], "{{ raise_exception('System role not supported') }}")
    assert not isinstance(e.value, ChatTemplateError)
    with pytest.raises(CloverError, match="unsafe"):  # the sandbox still keeps attributes out
        render_chat([{"role": "user", "content": "x"}], "{{ ''.__class__.__mro__ }}")
    fine = "{% for i in range(3) %}{{ i ~ (2 ** 10) ~ ('ab' * 2) ~ ([1] + [2])|length }}{% endfor %}"
    assert render_chat([{"role": "user", "content": "x"}], fine) == "01024abab2" "11024abab2" "21024abab2"


# ---------------------------------------------------------------------------- model files


@pytest.fixture(scope="module")
def hostile_gguf(tiny_artifacts, tmp_path_factory) -> callable:
    d = tmp_path_factory.mktemp("hostile_templates")

    def make(name: str, template: str) -> Path:
        return fuzz.rewrite_gguf(tiny_artifacts["f32"], d / f"{name}.gguf", kv={"tokenizer.chat_template": template})
    return make


API = """
import json, sys
from clover_cpp import Clover, CloverError
with Clover(sys.argv[1], n_ctx=256, n_threads=1) as m:
    out = {}
    for call in ("format_chat", "create_chat_completion"):
        try:
            getattr(m, call)([{"role": "user", "content": "hi"}])
            out[call] = "rendered"
        except CloverError as e:
            out[call] = str(e)
print(json.dumps(out))
"""


@pytest.mark.needs_libclover
@pytest.mark.parametrize("name", ["bigint_power", "lipsum_1e6", "division_by_zero", "include"])
def test_python_api_names_the_models_template(hostile_gguf, name: str) -> None:
    template, says = HOSTILE[name]
    path = hostile_gguf(name, template)
    out = _child(API, str(path))
    for call, err in out.items():
        assert err.startswith(f"the chat template of {path.name} (tokenizer.chat_template) failed: "), (call, err)
        assert says in err, (call, err)


@pytest.mark.needs_libclover
@pytest.mark.parametrize("name", ["bigint_power", "lipsum_1e6", "recursive_macro"])
def test_clover_chat_is_one_line_error(hostile_gguf, name: str) -> None:
    template, says = HOSTILE[name]
    path = hostile_gguf(name, template)
    r = subprocess.run([sys.executable, "-m", "clover_cpp.cli", "chat", "-m", str(path), "-n", "4", "-t", "1",
                        "--no-visual"], input=b"hi\n", capture_output=True, timeout=60)
    err = r.stderr.decode()
    assert r.returncode != 0 and "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"chat template of {path.name}" in lines[0] and says in lines[0], err


@pytest.mark.needs_libclover
def test_server_answers_while_and_after_a_template_runs_away(hostile_gguf, monkeypatch) -> None:
    """A model whose template loops 1e10 times: the chat request gets one error (400: see
    docs/internals.md) when the render is stopped; /health and completions answer meanwhile and
    after."""
    httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")
    import clover_cpp.chat as chat
    from clover_cpp import Clover
    from clover_testkit.server_harness import InProcessServer

    monkeypatch.setattr(chat, "TEMPLATE_LIMITS", chat.TemplateLimits(seconds=4))
    path = hostile_gguf("server_loop", RUNAWAY_LOOP)
    server = InProcessServer(Clover(path, n_ctx=256, n_threads=1))
    try:
        chat_reply: list[httpx.Response] = []
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        t = threading.Thread(target=lambda: chat_reply.append(
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)))
        start = time.monotonic()
        t.start()
        time.sleep(0.5)  # the render is under way
        while t.is_alive() and time.monotonic() - start < 3:
            assert httpx.get(server.url + "/health", timeout=2).status_code == 200
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=5)
            assert r.status_code == 200, r.text
        t.join(25)
        assert not t.is_alive() and time.monotonic() - start < 25
        r = chat_reply[0]
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert msg == (f"the chat template of {path.name} (tokenizer.chat_template) failed: it ran past 4 s and was "
                       "stopped; use --chat-template-file/--chat-template to override")
        assert httpx.get(server.url + "/health", timeout=2).status_code == 200
        r = httpx.post(server.url + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=20)
        assert r.status_code == 400 and "ran past" in r.json()["error"]["message"]
    finally:
        server.stop()


CONCURRENT = """
import json, threading, time
import clover_cpp.chat as chat
from clover_cpp import CloverError, render_chat
chat.TEMPLATE_LIMITS = chat.TemplateLimits(seconds=3)
msgs = [{"role": "user", "content": "hi"}]
errors = []
def runaway():
    try:
        render_chat(msgs, json.loads(__import__("sys").argv[1]))
    except CloverError as e:
        errors.append(str(e))
t = threading.Thread(target=runaway)
t.start()
time.sleep(0.5)
start = time.monotonic()
text = render_chat(msgs)
took = time.monotonic() - start
t.join()
class Mine: pass
try:
    render_chat(msgs, "{{ x }}", x=Mine())
    odd = "rendered"
except CloverError as e:
    odd = str(e)
print(json.dumps({"text": text, "took": took, "errors": errors, "odd": odd}))
"""


def test_other_renders_go_on_while_one_runs_away_and_odd_variables_are_one_error() -> None:
    out = _child(CONCURRENT, json.dumps(RUNAWAY_LOOP))
    assert out["text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out["took"] < 2.0  # not after the runaway's 3 s
    assert out["errors"] == ["chat template failed: it ran past 3 s and was stopped"]
    assert out["odd"].startswith("chat template: its variables cannot be read here: ") and "\n" not in out["odd"]
