"""A chat template given instead of the model's, as llama-server / llama-cli have it:
--chat-template NAME|JINJA, --chat-template-file FILE and --jinja (a no-op) on `clover run`, `chat`
and `serve`; Clover(chat_template=...) in
Python; the template in use in /props. A model whose own template fails is usable again with
it, and its error names the way out. Bad flags are one line and exit 1. Temporary folders only."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover_cpp.chat import CHATML_TEMPLATE, OVERRIDE_HINT
from clover_testkit import fuzz  # the one GGUF rewriter

FAILING = "{{ 1 / 0 }}"  # the model's template: fails on every render
MINE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def broken_model(tiny_artifacts, tmp_path_factory) -> Path:
    """The tiny model with a chat template that divides by zero."""
    d = tmp_path_factory.mktemp("override")
    return fuzz.rewrite_gguf(tiny_artifacts["f32"], d / "broken.gguf", kv={"tokenizer.chat_template": FAILING})


def clover(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_cpp.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_the_flags_are_in_the_help(command: str) -> None:
    out = clover(command, "--help").stdout
    assert "--chat-template NAME|JINJA" in out and "--chat-template-file FILE" in out
    assert "--jinja" in out and "no effect" in out


# ---------------------------------------------------------------------------- Python


@pytest.mark.needs_libclover
def test_python_chat_template_replaces_the_models(broken_model) -> None:
    from clover_cpp import Clover, CloverError

    with Clover(broken_model, n_ctx=256, n_threads=1) as m:
        assert m.chat_template == FAILING and m.chat_template_source == "model"
        with pytest.raises(CloverError) as e:
            m.format_chat(HI)
        assert str(e.value) == (f"the chat template of {broken_model.name} (tokenizer.chat_template) failed: "
                                f"ZeroDivisionError: division by zero; {OVERRIDE_HINT}")
    with Clover(broken_model, n_ctx=256, n_threads=1, chat_template=MINE) as m:
        assert m.chat_template == MINE and m.chat_template_source == "given"
        assert m.format_chat(HI) == "[user] hi\n[assistant] "
        with m.new_context() as other:  # (the server's other slots)
            assert other.format_chat(HI) == "[user] hi\n[assistant] "
        m.create_chat_completion(HI, max_tokens=2)
    with Clover(broken_model, n_ctx=256, n_threads=1, chat_template="chatml") as m:
        assert m.chat_template == CHATML_TEMPLATE
        assert m.format_chat(HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.needs_libclover
def test_python_a_given_template_that_fails_is_its_own_error(broken_model) -> None:
    from clover_cpp import Clover, CloverError, CloverTypeError, CloverValueError

    with Clover(broken_model, n_ctx=256, n_threads=1, chat_template="{% for %}") as m:
        with pytest.raises(CloverError, match=r"^the chat template given \(chat_template, --chat-template\) failed: "
                                              r"it does not compile") as e:
            m.format_chat(HI)
        assert OVERRIDE_HINT not in str(e.value)
    with pytest.raises(CloverTypeError, match="chat_template must be a string"):
        Clover(broken_model, chat_template=b"chatml")
    with pytest.raises(CloverValueError, match="chat_template must not be empty"):
        Clover(broken_model, chat_template=" ")


# ---------------------------------------------------------------------------- CLI


@pytest.mark.needs_libclover
def test_clover_chat_names_the_way_out_and_the_override_makes_the_model_usable(broken_model, tmp_path) -> None:
    base = ("chat", "-m", str(broken_model), "-n", "2", "-t", "1", "--no-visual")
    line = one_line_error(clover(*base, stdin="hi\n"))
    assert "division by zero" in line and line.endswith(OVERRIDE_HINT), line
    f = tmp_path / "mine.jinja"
    f.write_text(MINE)
    for flags in (("--chat-template-file", str(f)), ("--chat-template", "chatml", "--jinja"),
                  ("--chat-template", MINE)):
        r = clover(*base, *flags, stdin="hi\n")
        assert r.returncode == 0 and "Traceback" not in r.stderr, (flags, r.stderr[-2000:])


@pytest.mark.needs_libclover
def test_clover_run_renders_the_prompt_as_one_user_turn(broken_model) -> None:
    r = clover("run", "-m", str(broken_model), "-p", "hi", "-n", "2", "-t", "1", "--no-visual", "--no-stats",
               "--chat-template", MINE)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith("hi")  # (the prompt as given is echoed)


@pytest.mark.needs_libclover
def test_clover_chat_with_a_failing_override_is_one_line(broken_model) -> None:
    line = one_line_error(clover("chat", "-m", str(broken_model), "-n", "2", "-t", "1", "--no-visual",
                                 "--chat-template", "{{ raise_exception('nope') }}{{ 1 / 0 }}", stdin="hi\n"))
    assert line.startswith("error: the chat template given") and "nope" in line, line


def bad_template_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, what the error says)"""
    folder = tmp_path / "a_folder"
    folder.mkdir()
    fifo = tmp_path / "a_fifo"
    os.mkfifo(fifo)
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    return {"missing": (tmp_path / "missing.jinja", "not a readable file"), "folder": (folder, "not a readable file"),
            "fifo": (fifo, "not a readable file"), "empty": (empty, "the template is empty"),
            "not_utf8": (binary, "cannot read it")}


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_a_bad_template_file_is_one_line(broken_model, tmp_path, command: str) -> None:
    base = [command, "-m", str(broken_model)] + (["-p", "hi"] if command == "run" else [])
    for name, (path, says) in bad_template_files(tmp_path).items():
        line = one_line_error(clover(*base, "--chat-template-file", str(path), stdin="hi\n", timeout=30))
        assert f"--chat-template-file {path}" in line and says in line, (name, line)
    mine = tmp_path / "mine.jinja"
    mine.write_text(MINE)
    line = one_line_error(clover(*base, "--chat-template", "chatml", "--chat-template-file", str(mine)))
    assert "not both" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_template_file_is_one_line(broken_model, tmp_path) -> None:
    f = tmp_path / "secret.jinja"
    f.write_text(MINE)
    f.chmod(0)
    line = one_line_error(clover("chat", "-m", str(broken_model), "--chat-template-file", str(f), stdin="hi\n"))
    assert "cannot read it" in line and "ermission denied" in line, line


# ---------------------------------------------------------------------------- server


@pytest.mark.needs_libclover
def test_server_renders_the_given_template_and_shows_it_in_props(broken_model) -> None:
    httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")
    from clover_cpp import Clover
    from clover_testkit.server_harness import InProcessServer

    server = InProcessServer(Clover(broken_model, n_ctx=256, n_threads=1))
    try:
        r = httpx.post(server.url + "/apply-template", json={"messages": HI}, timeout=20)
        assert r.status_code == 400 and r.json()["error"]["message"].endswith(OVERRIDE_HINT), r.text
        props = httpx.get(server.url + "/props", timeout=5).json()
        assert props["chat_template"] == FAILING and props["chat_template_source"] == "model"
    finally:
        server.stop()
    server = InProcessServer(Clover(broken_model, n_ctx=256, n_threads=1, chat_template=MINE))
    try:
        r = httpx.post(server.url + "/apply-template", json={"messages": HI}, timeout=20)
        assert r.status_code == 200 and r.json()["prompt"] == "[user] hi\n[assistant] ", r.text
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        props = httpx.get(server.url + "/props", timeout=5).json()
        assert props["chat_template"] == MINE and props["chat_template_source"] == "given"
    finally:
        server.stop()


@pytest.mark.needs_libclover
def test_clover_serve_with_a_failing_override_stops_with_one_line(broken_model) -> None:
    line = one_line_error(clover("serve", "-m", str(broken_model), "--port", "0", "-t", "1", "-c", "256",
                                 "--chat-template", "{% for %}", timeout=60))
    assert "the chat template given" in line and "does not compile" in line, line
