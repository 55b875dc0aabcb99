"""What a hostile-input run found in the bindings and the command lines: re-entrant callbacks,
abandoned streams, Ctrl-C, values that wrapped at 32 bits, inputs that gave tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clover_cpp import Clover, CloverError
from clover_cpp.model import CloverValueError

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
            "budget = (m.n_ctx() - len(m.tokenize('hello', add_bos=True, special=True))) // 512 * 512\n"
            "assert budget >= 1024, budget\n")


@pytest.mark.parametrize("how", sorted(ABANDON))
def test_abandoned_stream_exits_cleanly(gguf, how: str) -> None:
    code = ("import sys\nfrom clover_cpp import Clover\n" + LONG_RUN +
            "s = m.generate('hello', max_tokens=budget, block_size=512, threshold=1.0, stream=True)\n"
            + ABANDON[how] + "print('done')\n")
    p = _python(code, str(gguf))
    assert p.returncode == 0 and p.stdout.strip() == "done", (p.returncode, p.stderr[-800:])


def test_abandoned_stream_stops_decoding(model) -> None:
    budget = (model.n_ctx() - len(model.tokenize("hello", add_bos=True, special=True))) // 256 * 256  # whole blocks
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
        model.tokenize(12, add_bos=False, special=True)
    # spec v2: the first block is predicted from the prompt's last token, so an empty prompt
    # (the fixture adds no BOS) is refused before the memory is touched
    model.generate("hello", max_tokens=8, block_size=4, stop_at_eos=False)
    kept = model.n_committed
    assert kept > 0 and model.tokenize("", add_bos=True, special=True) == []
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
    cli = Path(__file__).resolve().parents[2] / "build" / "bin" / "clover-cli"
    p = subprocess.run([str(cli), "-m", str(gguf), "-f", str(tmp_path), "-n", "2"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and "folder" in p.stderr or "directory" in p.stderr, p.stderr


def test_signal_names_are_the_usual_ones() -> None:
    assert signal.SIGINT == 2  # the exit status 130 the CLI uses is 128 + SIGINT


# ---------------------------------------------------------------- hostile input, round 2

def test_subnormal_temperature_finishes(model) -> None:
    # temperature 1e-310 made logits / T overflow: NaN probabilities, the mask token as every
    # candidate, a block that never finished (the server's slot spun at 100% CPU)
    greedy = model.generate("def add(a, b):", max_tokens=8, block_size=8)
    for t in (1e-310, 5e-324, 1e-300, 1e-7):
        r = model.generate("def add(a, b):", max_tokens=8, temperature=t, block_size=8)
        assert r.tokens == greedy.tokens and model.mask_token not in r.tokens, t
    # top_p 0 keeps the argmax alone; top_k >= vocab is off
    assert model.generate("hi", max_tokens=8, temperature=0.8, top_p=0.0).tokens == \
        model.generate("hi", max_tokens=8, temperature=0.8, top_k=1).tokens
    a = model.generate("hi", max_tokens=8, temperature=0.8, top_k=model.n_vocab() + 5, seed=7)
    assert a.tokens == model.generate("hi", max_tokens=8, temperature=0.8, top_k=0, seed=7).tokens


def test_seed_none_is_random_and_reported(model) -> None:
    runs = [model.generate("hello", max_tokens=16, temperature=1.0, block_size=4) for _ in range(4)]
    seeds = {r.seed for r in runs}
    assert len(seeds) == 4 and all(isinstance(s, int) and s >= 0 for s in seeds)
    assert len({tuple(r.tokens) for r in runs}) > 1  # not the same text every call
    for r in runs[:2]:  # the reported seed reproduces the output
        assert model.generate("hello", max_tokens=16, temperature=1.0, block_size=4, seed=r.seed).tokens == r.tokens
    assert model.generate("hello", max_tokens=4, temperature=1.0, seed=-1).seed not in (None, -1)
    assert model.generate("hello", max_tokens=4, seed=5).seed == 5 and runs[0].stats.seed == runs[0].seed


WRAPPED = {  # ids past 32 bits were wrapped by ctypes: 2**32 + 5 read as 5, 2**70 as 0
    "detokenize 2**32+5": lambda m: m.detokenize([2**32 + 5]),
    "detokenize 2**70": lambda m: m.detokenize([2**70]),
    "detokenize -1": lambda m: m.detokenize([-1]),
    "token_to_piece": lambda m: m.token_to_piece(2**32 + 5),
    "block_logits": lambda m: m.block_logits([2**32 + 5]),
    "commit": lambda m: m.commit([2**32 + 5]),
    "generate prompt": lambda m: m.generate([1, 2**32 + 5], max_tokens=2),
    "stop_tokens": lambda m: m.generate("hi", max_tokens=2, stop_tokens=[2**32 + 5]),
    "set_cost_curve key": lambda m: m.set_cost_curve({2**32 + 1: 1.0}),
    "numpy uint64": lambda m: m.detokenize(np.array([2**63 + 5], dtype=np.uint64)),
}


@pytest.mark.parametrize("what", sorted(WRAPPED))
def test_values_past_32_bits_are_refused(model, what: str) -> None:
    with pytest.raises(CloverValueError, match="range|must be in"):
        WRAPPED[what](model)


def test_block_size_past_32_bits_in_the_gguf_is_refused(gguf, tmp_path: Path) -> None:
    from clover_testkit.fuzz import rewrite_gguf

    import gguf as gg
    bad = tmp_path / "b.gguf"
    # the key is u32 in our files: 2**31 + 5 read as int32 was -2147483643
    rewrite_gguf(gguf, bad, kv={"clover.diffusion.block_size": 2**31 + 5})
    assert int(gg.GGUFReader(str(bad)).fields["clover.diffusion.block_size"].parts[-1][0]) == 2**31 + 5
    with pytest.raises(CloverError, match="block_size"):
        Clover(bad, n_ctx=256, n_threads=1)


def _gen(**kw):
    return lambda m: m.generate("hi", max_tokens=2, **kw)


# (call, the exception's other base besides CloverError): every bad argument is a CloverError
# with a message, also a ValueError or a TypeError; never AttributeError / KeyError / a wrap
LEAKS = {
    "stop=5": (_gen(stop=5), TypeError),
    "stop=[None]": (_gen(stop=[None]), TypeError),
    "stop_tokens=5": (_gen(stop_tokens=5), TypeError),
    "stop_tokens=['x']": (_gen(stop_tokens=["x"]), TypeError),
    "stop_tokens=[1.5]": (_gen(stop_tokens=[1.5]), TypeError),
    "fused keys": (lambda m: m.set_cost_curve({1: 1, 2: 1}, fused={1: 1}), ValueError),
    "curve None": (lambda m: m.set_cost_curve(None), TypeError),
    "curve {}": (lambda m: m.set_cost_curve({}), TypeError),
    "curve value str": (lambda m: m.set_cost_curve({1: "x"}), TypeError),
    "curve 1e300": (lambda m: m.set_cost_curve({1: 1e300, 2: 1e300}), ValueError),
    "curve inf": (lambda m: m.set_cost_curve({1: float("inf")}), ValueError),
    "curve nan": (lambda m: m.set_cost_curve({1: float("nan")}), ValueError),
    "curve 0": (lambda m: m.set_cost_curve({1: 0.0}), ValueError),
    "curve -1": (lambda m: m.set_cost_curve({1: -1.0}), ValueError),
    "token_to_piece('a')": (lambda m: m.token_to_piece("a"), TypeError),
    "token_to_piece(None)": (lambda m: m.token_to_piece(None), TypeError),
    "token_to_piece(1.5)": (lambda m: m.token_to_piece(1.5), TypeError),
    "tokenize add_bos='yes'": (lambda m: m.tokenize("x", add_bos="yes", special=True), TypeError),
    "detokenize(5)": (lambda m: m.detokenize(5), TypeError),
    "detokenize([1.7])": (lambda m: m.detokenize([1.7]), TypeError),
    "detokenize 2-D": (lambda m: m.detokenize(np.zeros((2, 2), dtype=np.int32)), ValueError),
    "generate(None)": (lambda m: m.generate(None), TypeError),
    "generate on_step='x'": (_gen(on_step="x"), TypeError),
    "generate temperature inf": (_gen(temperature=float("inf")), ValueError),
    "generate top_p 2": (_gen(top_p=2.0), ValueError),
    "generate seed -5": (_gen(seed=-5), ValueError),
    "generate seed 'x'": (_gen(seed="x"), TypeError),
    "generate stream='no'": (_gen(stream="no"), TypeError),
    "generate threshold 10**400": (_gen(threshold=10**400), ValueError),
    "chat(None)": (lambda m: m.chat(None, max_tokens=2), TypeError),
    "chat_tokens(None)": (lambda m: m.chat_tokens(None), TypeError),
    "chat_tokens(b'x')": (lambda m: m.chat_tokens(b"x"), TypeError),
    "chat stop_tokens=5": (lambda m: m.chat([{"role": "user", "content": "x"}], stop_tokens=5), TypeError),
    "chat content 5": (lambda m: m.chat([{"role": "user", "content": 5}]), ValueError),
    "calibrate fused='x'": (lambda m: m.calibrate(fused="x"), TypeError),
    "block_size = 'x'": (lambda m: setattr(m, "block_size", "x"), TypeError),
    "new_context(bad=1)": (lambda m: m.new_context(bad=1), ValueError),
    "new_context(n_ctx=-1)": (lambda m: m.new_context(n_ctx=-1), ValueError),
    "perplexity(None)": (lambda m: m.perplexity(None), TypeError),
    "create_completion min_p": (lambda m: m.create_completion("x", min_p=1.5), ValueError),
    "create_chat_completion tools": (lambda m: m.create_chat_completion([{"role": "user", "content": "x"}],
                                                                        tools=[{"type": "function"}]), ValueError),
}


@pytest.mark.parametrize("what", sorted(LEAKS))
def test_api_raises_only_its_own_errors(model, what: str) -> None:
    call, base = LEAKS[what]
    with pytest.raises(CloverError) as ei:
        call(model)
    assert isinstance(ei.value, base) and ei.value.message, (what, type(ei.value).__mro__)
    assert not model.closed


CTOR_LEAKS = {
    "model_path None": (dict(model_path=None), TypeError),
    "flash_attn 'maybe'": (dict(flash_attn="maybe"), ValueError),
    "kv_f32 'no'": (dict(kv_f32="no"), TypeError),
    "use_mmap 'x'": (dict(use_mmap="x"), TypeError),
    "tensor_split 5": (dict(tensor_split=5), TypeError),
    "tensor_split nan": (dict(tensor_split=[float("nan")]), ValueError),
    "tensor_split inf": (dict(tensor_split=[float("inf")]), ValueError),
    "rpc_servers [1]": (dict(rpc_servers=[1]), TypeError),
    "n_ctx 2**32+256": (dict(n_ctx=2**32 + 256), ValueError),
}


@pytest.mark.parametrize("what", sorted(CTOR_LEAKS))
def test_constructor_raises_only_its_own_errors(gguf, what: str) -> None:
    kw, base = CTOR_LEAKS[what]
    kw = {"model_path": gguf, "n_ctx": 256, "n_threads": 1, **kw}
    with pytest.raises(CloverError) as ei:
        Clover(**kw)
    assert isinstance(ei.value, base) and ei.value.message


def test_flash_attn_words_mean_what_they_say(gguf) -> None:
    # flash_attn='off' turned flash attention ON (bool('off') is True)
    from clover_cpp._args import tristate_arg as _tristate

    assert [_tristate("f", v) for v in (None, "auto", False, "off", "OFF", 0, True, "on", 1)] == \
        [-1, -1, 0, 0, 0, 0, 1, 1, 1]
    out = {}
    for v in (False, "off", True, "on"):
        with Clover(gguf, n_ctx=256, n_threads=1, block_size=4, flash_attn=v) as m:
            out[v] = m.block_logits([1, 2, 3], commit_before=list(range(5, 60)))
    assert np.array_equal(out[False], out["off"]) and np.array_equal(out[True], out["on"])


@pytest.mark.parametrize("cost", ["1e+300", "inf", "nan", "0", "-5", "1e12"])
def test_impossible_calibration_cache_is_measured_again(gguf, tmp_path: Path, monkeypatch, cost: str) -> None:
    # costs near 1e300 in the cache made every auto generation fail ("block size must be in
    # [1, n_ctx], got 0") until the file was deleted
    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path))
    with Clover(gguf, n_ctx=256, n_threads=1) as m:
        first = m.generate("hello", max_tokens=4, block_size="auto")
        assert first.stats.calibration == "measured"
    (entry,) = list(tmp_path.glob("calibration-*.txt"))
    lines = entry.read_text().splitlines()
    entry.write_text("\n".join(f"cost {ln.split()[1]} {cost} {cost}" if ln.startswith("cost ") else ln
                               for ln in lines) + "\n")
    p = subprocess.run([sys.executable, "-c",
                        "import sys; from clover_cpp import Clover\n"
                        "m = Clover(sys.argv[1], n_ctx=256, n_threads=1)\n"
                        "r = m.generate('hello', max_tokens=4, block_size='auto')\n"
                        "print(r.stats.calibration, len(r.tokens))", str(gguf)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "CLOVER_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0 and p.stdout.split() == ["measured", "4"], (p.stdout, p.stderr[-500:])
    assert "calibration cache entry" in p.stderr and "measuring again" in p.stderr
    assert f"cost 1 {cost} {cost}\n" not in entry.read_text()  # replaced by the new measurement


@pytest.mark.parametrize("train_block,n_ctx", [(256, 256), (1024, 512), (64, 64), (512, 8)])
def test_training_block_size_at_or_past_n_ctx_works_with_auto(gguf, tmp_path: Path, monkeypatch,
                                                              train_block: int, n_ctx: int) -> None:
    from clover_testkit.fuzz import rewrite_gguf

    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path))
    big = rewrite_gguf(gguf, tmp_path / "big.gguf", kv={"clover.diffusion.block_size": train_block})
    with Clover(big, n_ctx=n_ctx, n_threads=1) as m:
        assert m.train_block_size == train_block and m.block_size <= n_ctx
        r = m.generate("hello", max_tokens=4, block_size="auto", stop_at_eos=False)
        assert len(r.tokens) == 4 and r.stats.calibration == "measured" and 1 <= r.stats.block_size <= n_ctx // 2
        assert m.generate("hello", max_tokens=4, stop_at_eos=False).tokens == r.tokens


@pytest.mark.parametrize("n_ctx", [1, 2])
def test_tiny_context_is_refused_not_aborted(gguf, n_ctx: int) -> None:
    # n_ctx < 3 aborted the process (GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) in
    # llama.cpp: its batch is capped at n_ctx and it reserves one output per sequence, 3 here)
    code = ("import sys, ctypes\nfrom clover_cpp import Clover, CloverError, _native as N\n"
            "try:\n    Clover(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=1, block_size=1)\n"
            "except CloverError as e:\n    print('python:', e)\n"
            "L = N.lib()\nerr, n = N.err_buffer()\n"
            "m = L.clover_model_load(sys.argv[1].encode(), None, err, n)\n"
            "cp = L.clover_context_default_params()\ncp.n_ctx = int(sys.argv[2])\ncp.n_threads = 1\n"
            "c = L.clover_context_new(m, ctypes.byref(cp), err, n)\n"
            "print('native:', bool(c), err.value.decode())\nL.clover_model_free(m)\n")
    p = _python(code, str(gguf), str(n_ctx))
    assert p.returncode == 0, p.stderr[-800:]
    # (one rule, one message: Python raises libclover's, clover_context_params_check)
    assert f"python: n_ctx must be 0 (the model's training context) or >= 3, got {n_ctx}" in p.stdout and \
        "native: False n_ctx must be 0 (the model's training context) or >= 3" in p.stdout, \
        p.stdout
    with Clover(gguf, n_ctx=3, n_threads=1, block_size=1) as m:
        assert len(m.generate([1], max_tokens=1).tokens) == 1
