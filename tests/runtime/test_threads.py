"""Thread safety of the Python API: calls on one Clover object from several threads
run in turn without deadlock, close() cancels or waits for the calls in flight and later calls
raise "the model is closed", a generate() from another thread waits for a stream instead of
cancelling it, and a bounded stress run of every public method from several threads with
close() in the middle. Each case runs in a child process, so that a crash (use after free) or a
deadlock is a failed test, not a dead test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_libclover

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent("""
    import random, sys, threading, time
    from clover_cpp import Clover, CloverError
    GGUF = sys.argv[1]

    def start(fn, *args):
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        return t

    def joined(threads, timeout):
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in threads)
""")


def _child(code: str, gguf: Path, timeout: float = 120) -> str:
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), str(gguf)], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout


@pytest.fixture(scope="module")
def gguf(tiny_artifacts) -> Path:
    return tiny_artifacts["f16"]


def test_generate_and_block_logits_from_two_threads(gguf) -> None:
    # before: block_logits held the object's lock while waiting for the decode thread, which
    # waited for that lock in generate: both threads hung (10 runs out of 10)
    out = _child("""
        import numpy as np
        m = Clover(GGUF, n_ctx=512, n_threads=1, block_size=4)
        want_gen = m.generate("hello world", max_tokens=12).tokens
        want_logits = m.block_logits([1, 2, 3], commit_before=[5, 6, 7])
        bad = []

        def gen():
            for _ in range(15):
                if m.generate("hello world", max_tokens=12).tokens != want_gen:
                    bad.append("generate")

        def logits():
            for _ in range(15):
                if not np.array_equal(m.block_logits([1, 2, 3], commit_before=[5, 6, 7]), want_logits):
                    bad.append("block_logits")

        assert joined([start(gen), start(logits), start(gen), start(logits)], 60), "deadlock"
        assert not bad, bad
        print("ok")
    """, gguf)
    assert out.strip() == "ok"


def test_close_while_other_threads_tokenize(gguf) -> None:
    # before: SIGSEGV 10 runs out of 10 (the model freed under clover_tokenize), SIGABRT with
    # detokenize; now the calls in flight finish and later ones raise "the model is closed"
    out = _child("""
        for run in range(8):
            m = Clover(GGUF, n_ctx=256, n_threads=1, block_size=4)
            text = "<|im_start|>user\\nhello world, how are you?<|im_end|>\\n" * 20
            toks = m.tokenize(text, add_bos=False, special=True)
            errors, counts, go = [], [0, 0], threading.Event()

            def work(i):
                go.set()
                while True:
                    try:
                        if i == 0:
                            m.tokenize(text, add_bos=False, special=True)
                        elif i == 1:
                            m.detokenize(toks)
                        elif i == 2:
                            m.token_to_piece(toks[5])
                            m.metadata.get("general.architecture")
                        else:
                            m.n_vocab(), m.eos_token, m.n_ctx()
                        counts[0] += 1
                    except CloverError as e:
                        if "the model is closed" not in str(e):
                            errors.append(repr(e))
                        counts[1] += 1
                        return
                    except BaseException as e:
                        errors.append(repr(e))
                        return

            threads = [start(work, i) for i in range(4)]
            go.wait(5)
            time.sleep(0.02 * (run % 3))
            m.close()
            assert joined(threads, 30), "a thread did not end"
            assert not errors, errors
            assert counts[1] == 4, counts
            try:
                m.tokenize("x", add_bos=False, special=True)
                raise SystemExit("tokenize after close did not raise")
            except CloverError as e:
                assert "the model is closed" in str(e)
        print("ok")
    """, gguf)
    assert out.strip() == "ok"


def test_close_cancels_a_generation_in_flight(gguf) -> None:
    out = _child("""
        m = Clover(GGUF, n_ctx=2048, n_threads=1)
        budget = (m.n_ctx() - len(m.tokenize("hello", add_bos=True, special=True))) // 512 * 512
        stepped, box = threading.Event(), {}

        def gen():
            try:
                box["r"] = m.generate("hello", max_tokens=budget, block_size=512, threshold=1.0,
                                      on_step=lambda *a: stepped.set())
            except CloverError as e:
                box["e"] = e

        t = start(gen)
        assert stepped.wait(30)
        t0 = time.monotonic()
        m.close()
        took = time.monotonic() - t0
        assert joined([t], 30)
        assert took < 5, took  # cancelled at its next step, not run to the end (~1,500 steps)
        assert "r" in box and box["r"].finish_reason == "cancelled", box
        for call in (lambda: m.generate("hi", max_tokens=2), lambda: m.block_logits([1]), lambda: m.reset(),
                     lambda: m.tokenize("x", add_bos=False, special=True), lambda: m.n_committed, lambda: m.block_size):
            try:
                call()
                raise SystemExit("a call after close did not raise")
            except CloverError as e:
                assert "the model is closed" in str(e), e
        m.close()  # again: nothing
        print("ok", round(took, 2))
    """, gguf)
    assert out.startswith("ok")


def test_generate_from_another_thread_waits_for_a_stream(gguf) -> None:
    # before: the second generate() cancelled the stream another thread was still reading
    out = _child("""
        m = Clover(GGUF, n_ctx=512, n_threads=1, block_size=4)
        want = m.generate("hello world", max_tokens=48, threshold=1.0, stop_at_eos=False)
        # (each step of the stream takes 20 ms more, so that it is still decoding when the other
        # thread calls; a slower machine only makes it longer)
        s = m.generate("hello world", max_tokens=48, threshold=1.0, stop_at_eos=False, stream=True,
                       on_step=lambda *a: time.sleep(0.02))
        pieces = [next(s)]
        box, t_other = {}, []

        def other():
            box["r"] = m.generate("def f(x):", max_tokens=4)
            t_other.append(time.monotonic())

        t = start(other)
        time.sleep(0.3)
        assert t.is_alive()  # waiting for the stream, not cancelling it
        pieces += list(s)
        t_stream = time.monotonic()
        assert joined([t], 30)
        assert s.result.finish_reason == "max_tokens", s.result.finish_reason
        assert "".join(pieces) == want.text and s.result.tokens == want.tokens
        assert len(box["r"].tokens) == 4 and t_other[0] >= t_stream - 0.05
        # the thread reading a stream abandons it by starting another generation (as before)
        s2 = m.generate("hello world", max_tokens=48, threshold=1.0, stop_at_eos=False, stream=True)
        next(s2)
        assert len(m.generate("hi", max_tokens=2).tokens) == 2
        assert s2.result is None or s2.result.finish_reason == "cancelled"
        print("ok")
    """, gguf)
    assert out.strip() == "ok"


def test_threads_stress_every_public_method_with_close(gguf) -> None:
    # 6 threads x 40 random calls of every public method on one object; close() in the middle.
    # Every call either works or raises CloverError ("the model is closed" once closed); no
    # crash, no hang, no other exception. Three rounds with different seeds and close times.
    out = _child("""
        import numpy as np
        def calls(m, rng, toks):
            return [
                lambda: m.generate("hello", max_tokens=rng.randint(1, 8), block_size=rng.choice([1, 2, 4, "auto"])),
                lambda: m.generate(toks[:6], max_tokens=4, temperature=0.7, seed=None),
                lambda: "".join(m.generate("hi", max_tokens=6, stream=True)),
                lambda: next(iter(m.generate("hi", max_tokens=8, stream=True)), None),
                lambda: m.chat([{"role": "user", "content": "hi"}], max_tokens=4),
                lambda: m.create_completion("hi", max_tokens=3, temperature=0),
                lambda: m.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=3),
                lambda: m.tokenize("hello <|im_start|> world", add_bos=False, special=True),
                lambda: m.detokenize(toks),
                lambda: m.token_to_piece(toks[0]),
                lambda: m.metadata.get("general.architecture"),
                lambda: m.format_chat([{"role": "user", "content": "x"}]),
                lambda: m.block_logits([1], commit_before=[3, 4]),
                lambda: m.commit([5]),
                lambda: m.reset(),
                lambda: m.last_logits(),
                lambda: m.n_committed,
                lambda: m.block_size,
                lambda: setattr(m, "block_size", rng.choice([2, 4])),
                lambda: m.set_cost_curve({1: 1.0, 2: 1.5, 4: 2.0}),
                lambda: m.set_n_threads(1),
                lambda: (m.n_vocab(), m.n_ctx(), m.eos_token, m.mask_token, m.chat_template, repr(m)),
                lambda: m.perplexity(toks * 8, n_ctx=16),
            ]

        # what a call may answer when another thread has just changed the context
        LEGIT = ("nothing is committed", "n_ctx", "more than", "block size")
        for rnd in range(3):
            m = Clover(GGUF, n_ctx=256, n_threads=1, block_size=4)
            toks = m.tokenize("the quick brown fox jumps over the lazy dog", add_bos=False, special=True)
            bad, closed_errors, done = [], [0], [0]

            def work(seed):
                rng = random.Random(seed)
                fns = calls(m, rng, toks)
                for _ in range(40):
                    try:
                        rng.choice(fns)()
                        done[0] += 1
                    except CloverError as e:
                        if "the model is closed" in str(e):
                            closed_errors[0] += 1
                        elif not any(w in str(e) for w in LEGIT):
                            bad.append(repr(e))
                    except BaseException as e:
                        bad.append(repr(e))

            threads = [start(work, 100 * rnd + i) for i in range(6)]
            time.sleep(0.2 + 0.3 * rnd)
            m.close()
            assert joined(threads, 90), "a thread hung"
            assert not bad, bad[:5]
            print("round", rnd, "calls", done[0], "refused after close", closed_errors[0])
        print("ok")
    """, gguf, timeout=300)
    assert out.strip().endswith("ok"), out


def test_ctrl_c_while_waiting_for_another_threads_call(gguf) -> None:
    # before: the deadlocked threads could not be interrupted; a call waiting its turn now sees
    # Ctrl-C (within its 0.25 s wait), and the other thread's generation is not disturbed
    out = _child("""
        import os, signal
        m = Clover(GGUF, n_ctx=512, n_threads=1)
        stepped, box = threading.Event(), {}

        def step(*a):  # 64 steps of 30 ms: the generation outlasts the wait below
            stepped.set()
            time.sleep(0.03)

        def gen():
            box["r"] = m.generate("hello", max_tokens=64, block_size=8, threshold=1.0, stop_at_eos=False,
                                  on_step=step)

        t = start(gen)
        assert stepped.wait(30)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            m.block_logits([1])
            raise SystemExit("block_logits did not wait")
        except KeyboardInterrupt:
            waited = time.monotonic() - t0
        assert 0.4 < waited < 3, waited
        assert joined([t], 60) and box["r"].finish_reason == "max_tokens"
        assert m.block_logits([1]).shape == (1, m.n_vocab())
        print("ok", round(waited, 2))
    """, gguf)
    assert out.startswith("ok")
