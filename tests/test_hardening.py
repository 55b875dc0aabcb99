"""What a hostile-input run found in the bindings and the command lines: re-entrant callbacks,
abandoned streams, Ctrl-C, values that wrapped at 32 bits, inputs that gave tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_cpp import Clover, CloverError

pytestmark = pytest.mark.needs_libclover


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f16"]


@pytest.fixture(scope="module")
def model(gguf):
    with Clover(gguf, n_ctx=1024, n_threads=1, block_size=4) as m:
        yield m


REENTRANT = {
    "close": lambda m: m.close(),
    "block_size": lambda m: setattr(m, "block_size", 8),
    "generate": lambda m: m.generate("x", max_tokens=2),
    "reset": lambda m: m.reset(),
    "block_logits": lambda m: m.block_logits([1]),
}


@pytest.mark.parametrize("what", sorted(REENTRANT))
@pytest.mark.parametrize("hook", ["on_step", "on_block"])
def test_reentrant_calls_from_callbacks_are_refused(model, what: str, hook: str) -> None:
    want = model.generate("hello", max_tokens=12).tokens

    def cb(*_a):
        REENTRANT[what](model)
    with pytest.raises(CloverError, match="inside one of its own callbacks"):
        model.generate("hello", max_tokens=12, **{hook: cb})
    assert not model.closed and model.generate("hello", max_tokens=12).tokens == want


def _python(code: str, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, **kw)


ABANDON = {
    "break": "for p in s:\n    break\n",
    "exception": "try:\n    for p in s:\n        raise ValueError('x')\nexcept ValueError:\n    pass\n",
    "ctrl-c": "import os, signal\ntry:\n    for p in s:\n        os.kill(os.getpid(), signal.SIGINT)\n"
              "        import time; time.sleep(1)\nexcept KeyboardInterrupt:\n    pass\n",
}


# A long generation in the child processes below: blocks of 512 (one token per pass at threshold
# 1.0) and a budget of the whole blocks that fit after the prompt (spec v2: blocks start right
# after the prompt, and a block's canvas must fit n_ctx even where it runs past the budget)
LONG_RUN = ("m = Clover(sys.argv[1], n_ctx=2048, n_threads=1)\n"
            "budget = (m.n_ctx - len(m.tokenize('hello', add_special=True))) // 512 * 512\n"
            "assert budget >= 1024, budget\n")


@pytest.mark.parametrize("how", sorted(ABANDON))
def test_abandoned_stream_exits_cleanly(gguf, how: str) -> None:
    code = ("import sys\nfrom clover_cpp import Clover\n" + LONG_RUN +
            "s = m.generate('hello', max_tokens=budget, block_size=512, threshold=1.0, stream=True)\n"
            + ABANDON[how] + "print('done')\n")
    p = _python(code, str(gguf))
    assert p.returncode == 0 and p.stdout.strip() == "done", (p.returncode, p.stderr[-800:])


def test_abandoned_stream_stops_decoding(model) -> None:
    budget = (model.n_ctx - len(model.tokenize("hello", add_special=True))) // 256 * 256  # whole blocks
    assert budget >= 512
    s = model.generate("hello", max_tokens=budget, block_size=256, threshold=1.0, stream=True)
    next(iter(s))
    t0 = time.perf_counter()
    r = model.generate("hello", max_tokens=4)  # cancels the stream instead of waiting for it
    assert time.perf_counter() - t0 < 2.0 and len(r.tokens) == 4
    assert s.result is None or s.result.finish_reason == "cancelled"


def test_ctrl_c_during_generate_raises(gguf) -> None:
    # Ctrl-C arrives while the decode is running (sent from the first step's callback)
    code = ("import sys, os, signal, time\nfrom clover_cpp import Clover\n" + LONG_RUN + "t = []\n"
            "def step(*a):\n    if not t:\n        t.append(time.time()); os.kill(os.getpid(), signal.SIGINT)\n"
            "try:\n    m.generate('hello', max_tokens=budget, block_size=512, threshold=1.0, on_step=step)\n"
            "    print('RETURNED')\n"
            "except KeyboardInterrupt:\n    print('INTERRUPTED', round(time.time() - t[0], 1))\n")
    p = _python(code, str(gguf))
    assert p.returncode == 0 and p.stdout.startswith("INTERRUPTED"), (p.stdout, p.stderr[-500:])
    assert float(p.stdout.split()[1]) < 5


@pytest.mark.parametrize("call,msg", [
    (lambda g: Clover(g, n_ctx=2**32 + 256), "n_ctx"),
    (lambda g: Clover(g, n_ctx=256, block_size=2**32 + 4), "block_size"),
    (lambda g: Clover(g, n_ctx=256, n_threads=2000), "n_threads"),
])
def test_values_that_wrapped_at_32_bits(gguf, call, msg: str) -> None:
    with pytest.raises(CloverError, match=msg):
        call(gguf)


def test_generate_values_are_checked_before_use(model) -> None:
    with pytest.raises(CloverError, match="max_tokens"):
        model.generate("hi", max_tokens=2**32 + 8)
    with pytest.raises(CloverError, match="block_size"):
        model.generate("hi", max_tokens=4, block_size=2**32 + 4)
    with pytest.raises(CloverError, match="n_threads"):
        model.set_n_threads(0)
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CloverError, match="n_ctx"):  # no 4 GB output buffer first
        model.generate("hi", max_tokens=1_000_000_000)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000
    with pytest.raises(CloverError, match="Unicode"):
        model.generate("bad \udc80 surrogate", max_tokens=2)
    with pytest.raises(CloverError):
        model.generate("hi", max_tokens=2, stop_tokens=["x"])
    with pytest.raises(CloverError):
        model.generate("hi", max_tokens=2, stop_tokens=5)
    with pytest.raises(CloverError, match="text"):
        model.tokenize(12)
    # spec v2: the first block is predicted from the prompt's last token, so an empty prompt
    # (the fixture adds no BOS) is refused before the memory is touched
    model.generate("hello", max_tokens=8, block_size=4, stop_at_eos=False)
    kept = model.n_committed
    assert kept > 0 and model.tokenize("", add_special=True) == []
    for empty in ([], ""):
        with pytest.raises(CloverError, match="empty prompt"):
            model.generate(empty, max_tokens=2)
        assert model.n_committed == kept
    assert model.generate([], max_tokens=0).tokens == []


def _clover(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-c", "from clover_cpp.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout, input=stdin,
                          env={**os.environ, **(env or {})})


def test_chat_with_stdin_closed(gguf) -> None:
    p = subprocess.run([sys.executable, "-c", "from clover_cpp.cli import main; main()", "chat", "-m", str(gguf),
                        "-c", "256", "-t", "1"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "Error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = _clover("chat", "-m", str(gguf), "-c", "128", "-t", "1", "-n", "16",
                stdin="x " * 400 + "\nhello\n")  # an over-long message ends neither the session nor its history
    assert p.returncode == 0, p.stderr
    assert "do not fit" in p.stderr and p.stdout.strip(), (p.stdout, p.stderr)


def test_cli_threads_and_demo_model(gguf, tmp_path: Path) -> None:
    p = _clover("run", "-m", str(gguf), "-p", "hi", "-n", "2", "-t", "2000")
    assert p.returncode != 0 and "threads" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = _clover("demo", "-n", "2", "--no-compare", env={"CLOVER_DEMO_MODEL": str(tmp_path / "nope")})
    assert p.returncode == 1 and "CLOVER_DEMO_MODEL" in p.stderr, p.stderr


def test_clover_cli_prompt_file_is_a_folder(gguf, tmp_path: Path) -> None:
    cli = Path(__file__).resolve().parents[1] / "build" / "bin" / "clover-cli"
    p = subprocess.run([str(cli), "-m", str(gguf), "-f", str(tmp_path), "-n", "2"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and "folder" in p.stderr or "directory" in p.stderr, p.stderr


def test_signal_names_are_the_usual_ones() -> None:
    assert signal.SIGINT == 2  # the exit status 130 the CLI uses is 128 + SIGINT
