"""Grammars and schemas that explode: libclover checks a grammar before llama.cpp's
engine gets it (clover-grammar.cpp, grammar_check) and refuses with one line naming the rule:

* ``root ::= "a"{5,3}``, a minimum above the maximum: llama.cpp's parser allocated without bound
  (std::bad_alloc at 2 GiB, an abort at 4 GiB);
* ``root ::= b{0,30}``, ``b ::= c{0,30}``, ``c ::= "a"?``: 900 readings of each "a", minutes of CPU
  per token that no signal stopped; ``(("a"?){32}){32}``, b{0,30} of 30 ``"a"?`` written out and the
  schema pattern ``^((a?){32}){32}$`` likewise (llama.cpp's engine keeps one stack per reading of the
  text and expands each again after every character: at most 64 readings of one character here,
  while an enum's 1,000 alternatives that all begin with '"' pass);
* ``("a"*)*``, ``("a"?)*`` and left recursion through a rule that can match nothing (``root ::= x "b"``,
  ``x ::= e root | "c"``, ``e ::= "a"?``: llama.cpp's own check misses it, and the process grew to
  GBs): a rule that comes back to itself before reading a character;
* a long literal repeated 2000 times (gigabytes once llama.cpp's parser writes the copies out);
* 60,000 alternatives (18 s to set up, quadratic; a slot held until the watchdog) or a pattern of
  20,000: at most 8,192 ways for a rule to begin;
* schema patterns: ``(`` (not a regex), ``^a{3,1}$``, ``^a**$``, the exponential one and the
  alternatives above.

And at run time (patch 0013): ``root ::= "a" root "b" | "a" root "c" | ""`` passes those checks, but
its parse stacks double with every "a": llama.cpp's engine stops at 4,096 and the generation ends
with one line (a 400 from the server).

Each case runs in a child under a time and an address-space limit, through the Python API, clover-cli,
`clover run` and `clover serve` (a 400 naming the field); temporary folders only."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_testkit.llama_tools import default_gguf  # noqa: F401 - a fixture

pytestmark = pytest.mark.needs_libclover

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("CLOVER_CLI_PATH", ROOT / "build" / "bin" / "clover-cli"))
BOUND = 30        # seconds
MEMORY = 3 << 30  # bytes of address space (Python, numpy and the tiny model fit in far less)

#: name -> (GBNF, what the one line says)
GRAMMARS = {
    "min_above_max": ('root ::= "a"{5,3}', "rule 'root': repetition {5,3}: its minimum is above its maximum"),
    "nested_nullable": ('root ::= b{0,30}\nb ::= c{0,30}\nc ::= "a"?', "rule 'root' is too ambiguous"),
    "nested_exact": ('root ::= (("a"?){32}){32}', "rule 'root' is too ambiguous"),
    "nested_overlapping": ("root ::= b{0,30}\nb ::= " + " ".join(f"[a-{c}]?" for c in "bcdefghijklmnopqrstuvwxyz"),
                           "rule 'root' is too ambiguous"),
    "nested_inline": ('root ::= b{0,30}\nb ::= ' + ' '.join(['"a"?'] * 30), "rule 'root' is too ambiguous"),
    "star_of_star": ('root ::= ("a"*)*', "rule 'root' can come back to itself before reading a character"),
    "star_of_optional": ('root ::= "x" y\ny ::= ("a"?)*', "rule 'y' can come back to itself"),
    "left_recursion_nullable_prefix": ('root ::= x "b"\nx ::= e root | "c"\ne ::= "a"?',
                                       "(root -> x -> root): left recursion"),
    "left_recursion": ('root ::= root "a" | "b"', "rule 'root' can come back to itself"),
    "written_out": ('root ::= "' + "a" * 100_000 + '"{2000}', "more than 4194304 symbols"),
    "alternatives": ("root ::= " + " | ".join(f'"x{i}"' for i in range(60_000)), "rule 'root' begins in 60000 ways"),
}

#: name -> (a string pattern, what the one line says)
PATTERNS = {
    "exponential": ("^((a?){32}){32}$", "too ambiguous"),
    "not_a_regex": ("(", "is not one llama.cpp's converter can write"),
    "min_above_max": ("^a{3,1}$", "repetition {3,1}: its minimum is above its maximum"),
    "star_of_star": ("^a**$", "can come back to itself"),
    "alternatives": ("^(" + "|".join(f"x{i}" for i in range(20_000)) + ")$", "begins in 20000 ways"),
}


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _run(args: list, **kw) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=BOUND,
                           stdin=subprocess.DEVNULL, preexec_fn=_limit, **kw)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no answer within {BOUND} s") from None
    assert 0 <= p.returncode < 128, f"killed by a signal (exit {p.returncode}): {p.stderr[-800:]}"
    return p


def _one_line(p: subprocess.CompletedProcess, match: str) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0] \
        and "Traceback" not in p.stderr, f"exit {p.returncode}, want {match!r}: {p.stderr[-1500:]}"
    return lines[0]


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f32"]


PY_GENERATE = """
import sys
from clover_cpp import Clover, CloverError
with Clover(sys.argv[1], n_ctx=256, n_threads=1) as m:
    try:
        m.generate("hi", max_tokens=4, grammar=open(sys.argv[2]).read())
    except CloverError as e:
        print(e)
        sys.exit(1)
    print(m.generate("hi", max_tokens=2, grammar='root ::= [a-z]+').text)
"""


@pytest.mark.parametrize("case", list(GRAMMARS))
def test_python_refuses_it(gguf, tmp_path, case: str) -> None:
    grammar, match = GRAMMARS[case]
    (tmp_path / "g.gbnf").write_text(grammar)
    p = _run([sys.executable, "-c", PY_GENERATE, gguf, tmp_path / "g.gbnf"], cwd=tmp_path)
    assert p.returncode == 1 and "invalid grammar: " in p.stdout and match in p.stdout, (p.stdout, p.stderr[-800:])
    assert len(p.stdout.strip().splitlines()) == 1 and len(p.stdout) < 500 and "Traceback" not in p.stderr


@pytest.mark.parametrize("case", list(GRAMMARS))
def test_clover_cli_refuses_it(gguf, tmp_path, case: str) -> None:
    grammar, match = GRAMMARS[case]
    (tmp_path / "g.gbnf").write_text(grammar)
    line = _one_line(_run([CLI, "-m", gguf, "-p", "hi", "-n", "4", "-t", "1", "--grammar-file", tmp_path / "g.gbnf"],
                          cwd=tmp_path), match)
    assert "invalid grammar: " in line and len(line) < 500


@pytest.mark.parametrize("case", ["min_above_max", "nested_nullable", "left_recursion_nullable_prefix"])
def test_clover_run_refuses_it(gguf, tmp_path, case: str) -> None:
    grammar, match = GRAMMARS[case]
    (tmp_path / "g.gbnf").write_text(grammar)
    _one_line(_run([sys.executable, "-m", "clover_cpp.cli", "run", "-m", gguf, "-p", "hi", "-n", "4", "-t", "1",
                    "--grammar-file", tmp_path / "g.gbnf"], cwd=tmp_path), match)


def test_what_the_engine_runs_is_still_taken(gguf, tmp_path) -> None:
    """Just inside the bounds: b{0,8} of c{0,8} (64 readings), a{1,3} (no longer read as a{3,1}),
    right recursion, a nullable rule repeated exactly once, "a"* after something that can be empty,
    an enum of 1,000 values and a chain of 4,000 rules that each begin with a choice."""
    for grammar in ('root ::= b{0,8}\nb ::= c{0,8}\nc ::= "a"?', 'root ::= "a"{1,3}', 'root ::= "a" root | "b"',
                    'root ::= ("a"?){1} "b"', 'root ::= "x"? "a"*', 'root ::= [a-z]{0,2000}',
                    "root ::= " + " | ".join(f'"\\"v{i}\\""' for i in range(1000)),
                    "root ::= r0\n" + "".join(f'r{i} ::= "a{i}" | r{i + 1}\n' for i in range(4000)) + 'r4000 ::= "z"'):
        (tmp_path / "g.gbnf").write_text(grammar)
        p = _run([CLI, "-m", gguf, "-p", "hi", "-n", "4", "-t", "1", "--grammar-file", tmp_path / "g.gbnf"],
                 cwd=tmp_path)
        assert p.returncode == 0, (grammar, p.stderr[-800:])


@pytest.mark.parametrize("case", list(PATTERNS))
def test_schema_patterns(gguf, tmp_path, case: str) -> None:
    pattern, match = PATTERNS[case]
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
    p = _run([sys.executable, "-c", "import sys, json\nfrom clover_cpp.grammar import json_schema_grammar, GrammarError\n"
              "try:\n    json_schema_grammar(json.loads(sys.argv[1]))\nexcept GrammarError as e:\n    print(e)\n"
              "    sys.exit(1)", json.dumps(schema)], cwd=tmp_path)
    want = f"JSON schema: 'pattern' at #/properties/code: {pattern[:80]}"
    assert p.returncode == 1 and p.stdout.startswith(want) and match in p.stdout, (p.stdout, p.stderr[-800:])
    line = _one_line(_run([CLI, "-m", gguf, "-p", "hi", "-n", "4", "-t", "1", "--json-schema", json.dumps(schema)],
                          cwd=tmp_path), match)
    assert want in line


def _serve(gguf: Path, tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "clover_cpp.cli", "serve", "-m", str(gguf), "--port", str(port),
                             "-c", "512", "-t", "1", "--parallel", "1"], cwd=tmp_path, preexec_fn=_limit,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def test_server_answers_400_and_serves_on(gguf, tmp_path) -> None:
    import httpx

    proc, url = _serve(gguf, tmp_path)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, "clover serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        bodies = [({"grammar": g}, "grammar", m) for g, m in GRAMMARS.values()]
        bodies += [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                                                            "pattern": p}}}},
                    "response_format", m) for p, m in PATTERNS.values()]
        for body, param, match in bodies:
            for path, extra in (("/v1/completions", {"prompt": "hi"}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                t = time.time()
                r = httpx.post(url + path, json={**extra, **body, "max_tokens": 4}, timeout=BOUND)
                assert r.status_code == 400, (path, match, r.status_code, r.text[:300])
                err = r.json()["error"]
                assert match in err["message"] and err["param"] == param and "\n" not in err["message"], err
                assert time.time() - t < 10
            if param == "grammar":  # llama-server's own endpoint
                r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 4, **body}, timeout=BOUND)
                assert r.status_code == 400 and match in r.json()["error"]["message"], r.text[:300]
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "grammar": "root ::= [a-z]+"},
                       timeout=BOUND)
        assert r.status_code == 200, r.text[:300]
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert "Traceback" not in out, out[-2000:]


PY_MULTIPLYING = """
import sys, time
from clover_cpp import Clover, CloverValueError
grammar = 'root ::= "a" root "b" | "a" root "c" | ""'
with Clover(sys.argv[1], n_ctx=512, n_threads=1) as m:
    for kw in ({}, {"block_size": 8, "draft_self": True}):
        t = time.time()
        try:
            m.generate("x", max_tokens=64, grammar=grammar, stop_at_eos=False, **kw)
            print("no error")
        except CloverValueError as e:
            print(f"{time.time() - t:.2f}", e)
    print(m.generate("def f():", max_tokens=4, stop_at_eos=False).stats.n_generated)
"""


def test_a_parse_that_multiplies_is_stopped(default_gguf, tmp_path) -> None:  # noqa: F811
    """``root ::= "a" root "b" | "a" root "c" | ""`` passes every static check (each rule is entered
    one way), but after n "a"s llama.cpp's engine holds 2^n stacks and compares each new one with
    the others: the default model, greedy after "x", writes "a"s, and one token took minutes and GBs.
    Patch 0013 bounds the stacks (4,096): the generation ends with one line, at B = 1 and under
    draft-self (whose drafts clone the grammar), and the model generates on."""
    p = _run([sys.executable, "-c", PY_MULTIPLYING, default_gguf], cwd=tmp_path)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and len(lines) == 3, (p.stdout, p.stderr[-800:])
    for line in lines[:2]:
        secs, msg = line.split(" ", 1)
        assert msg.startswith("grammar: the grammar's parse grew past 4096 alternative stacks"), line
        assert float(secs) < 5, line
    assert lines[2] == "4"


def test_the_server_answers_a_multiplying_parse_with_400(default_gguf) -> None:  # noqa: F811
    import httpx

    from clover_testkit.server_harness import Server

    s = Server(default_gguf, "-t", "1")
    try:
        grammar = 'root ::= "a" root "b" | "a" root "c" | ""'
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 64}),
                           ("/completion", {"prompt": "x", "n_predict": 64})):
            t = time.time()
            r = httpx.post(s.url + path, json={**body, "grammar": grammar, "temperature": 0}, timeout=BOUND)
            assert r.status_code == 400 and time.time() - t < 10, (path, r.status_code, r.text[:300])
            assert "alternative stacks" in r.json()["error"]["message"], r.text[:300]
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=BOUND)
        assert r.status_code == 200, r.text[:300]
    finally:
        s.stop()
