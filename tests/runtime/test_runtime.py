"""The Python runtime's parts: the output follower (stop strings and output
following as one class), "does it fit in n_ctx" (one rule: Clover.room / fits agree with
libclover's own check), the chat session (last_exchange, generate_chat), the committed tokens
read from libclover, stop tokens handled by libclover, and new_context."""

from __future__ import annotations

import pytest

from clover_cpp import _native as N
from clover_cpp.output import OutputFollower

pytestmark = pytest.mark.needs_libclover


# ----------------------------------------------------------------------------- output follower (no model)

def _detok(table: dict[int, bytes]):
    return lambda toks: b"".join(table[t] for t in toks)


def test_follower_emits_each_token_once_across_steps_and_blocks() -> None:
    MASK = 99
    pushed: list[tuple[str, list[int]]] = []
    f = OutputFollower(detokenize=_detok({1: b"a", 2: b"b", 3: b"c", 4: b"d"}),
                       push=lambda piece, toks: pushed.append((piece, toks)) is not None)
    # block of 4 right after a 2-token prompt: canvas positions [0, 4)
    assert not f.step([1, MASK, 3, MASK], 0, 4, MASK, 100)   # prefix [1]
    assert not f.step([1, 2, 3, MASK], 0, 4, MASK, 100)      # prefix [1, 2, 3]
    stop, text = f.block([1, 2, 3, 4])
    assert not stop and text == "abcd"
    assert pushed == [("a", [1]), ("bc", [2, 3]), ("d", [4])]
    assert f.tokens == [1, 2, 3, 4] and f.finish() == "" and f.text == "abcd"


def test_follower_cuts_at_stop_tokens_budget_and_holds_split_utf8() -> None:
    MASK, END = 99, 7
    check = "\u2713".encode()  # 3 bytes, split over two tokens
    f = OutputFollower(stop_tokens={END}, detokenize=_detok({1: check[:2], 2: check[2:], 3: b"x", END: b"!"}))
    assert not f.step([1, END, 3], 0, 3, MASK, 100)  # the prefix ends before the stop token
    assert f.tokens == [1] and f.text == ""          # half a character: held back
    stop, text = f.block([1, 2])
    assert (stop, text) == (False, "\u2713")
    g = OutputFollower(detokenize=_detok({1: b"a", 2: b"b", 3: b"c"}))
    g.step([1, 2, 3], 0, 3, MASK, 2)                 # the budget: two tokens
    assert g.tokens == [1, 2]


def test_follower_stop_string_across_pieces() -> None:
    f = OutputFollower(["</s>"], detokenize=_detok({1: b"ab<", 2: b"/", 3: b"s>cd"}))
    assert f.block([1]) == (False, "ab")      # "<" held: it may begin the stop string
    assert f.block([2]) == (False, "")
    assert f.block([3]) == (True, "")          # the stop string: nothing from it on
    assert f.hit and f.text == "ab" and f.tokens == [1, 2, 3] and f.finish() == ""
    # as a plain matcher (the old StopMatcher, still importable from clover_cpp.model)
    from clover_cpp.model import StopMatcher

    m = StopMatcher(["END"])
    assert "".join(m.feed(p) for p in ["xx E", "N", "Dyy"]) + m.flush() == "xx "


# ----------------------------------------------------------------------------- with the tiny model

@pytest.fixture(scope="module")
def model(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=64, n_threads=1, block_size=8) as m:
        yield m


@pytest.mark.parametrize("block_size,draft_self", [(8, False), (3, False), (1, False), ("auto", False), (8, True)])
def test_room_is_libclovers_rule(model, block_size, draft_self) -> None:
    """Clover.room / fits say what libclover's own check says: room fits, room + 1 does not
    (the native call made without the Python check refuses it with CLOVER_ERR_CONTEXT_FULL)."""
    from clover_cpp import CloverError
    from clover_cpp.decoding import Generation, GenParams

    toks = model.tokenize("hello world", add_bos=True, special=True)
    room = model.room(len(toks), block_size, draft_self)
    assert room > 0 and model.fits(len(toks), room, block_size, draft_self)
    assert not model.fits(len(toks), room + 1, block_size, draft_self)
    if block_size == 8 and not draft_self:
        assert room == (model.n_ctx() - len(toks)) // 8 * 8 and model.room(len(toks)) == room  # the default B
    r = model.generate(toks, max_tokens=room, block_size=block_size, draft_self=draft_self, stop_at_eos=False)
    assert len(r.tokens) == room
    with pytest.raises(CloverError) as e:
        model.generate(toks, max_tokens=room + 1, block_size=block_size, draft_self=draft_self)
    assert e.value.status == N.CLOVER_ERR_CONTEXT_FULL
    p = GenParams.of(room + 1, block_size, 0.9, 0, 0.0, 0, 1.0, 1, draft_self=1 if draft_self else 0)
    info = model._info()
    with model._op() as c, pytest.raises(CloverError) as e:
        Generation(c, toks, p, mask=info.mask, eos=info.eos, detokenize=model.detokenize).run()
    assert e.value.status == N.CLOVER_ERR_CONTEXT_FULL and "n_ctx" in e.value.message


def test_block_size_none_means_auto(model) -> None:
    from clover_cpp.decoding import GenParams

    assert GenParams.of(4, None, 0.9, 0, 0.0, 0, 1.0, 1).block_size == "auto"
    assert model.room(10, None) == model.room(10, "auto") == model.n_ctx() - 10


def test_committed_tokens_are_the_memory(model) -> None:
    toks = model.tokenize("hello world", add_bos=True, special=True)
    r = model.generate(toks, max_tokens=24, block_size=8, stop_at_eos=False)
    mem = model.committed_tokens
    assert len(mem) == model.n_committed >= len(toks)
    assert mem == (toks + r.tokens)[:len(mem)]
    model.reset()
    assert model.committed_tokens == [] and model.n_committed == 0


def test_stop_tokens_end_the_output_in_libclover(model) -> None:
    toks = model.tokenize("def fibonacci(n):", add_bos=True, special=True)
    full = model.generate(toks, max_tokens=24, block_size=8, stop_at_eos=False)
    i = next(k for k in range(1, len(full.tokens)) if full.tokens[k] not in full.tokens[:k])
    r = model.generate(toks, max_tokens=24, block_size=8, stop_at_eos=False, stop_tokens=[full.tokens[i]])
    assert r.tokens == full.tokens[:i] and r.finish_reason == "stop"
    assert r.stats.n_generated == i and r.text == model.detokenize_text(full.tokens[:i])
    streamed = model.generate(toks, max_tokens=24, block_size=8, stop_at_eos=False, stop_tokens=[full.tokens[i]],
                              stream=True)
    assert "".join(streamed) == r.text and streamed.result.finish_reason == "stop"


def test_last_exchange_is_the_chat_session(model) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    text = model.format_chat(msgs)
    r = model.generate_chat(text, max_tokens=8)
    ex = model.last_exchange
    assert ex.prompt == text and ex.reply == r.text and list(ex.reply_tokens) == r.tokens
    assert list(ex.prompt_tokens) == model.tokenize(text, add_bos=True, special=True)
    nxt = model.format_chat(msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "more"}])
    assert ex.continued_by(nxt) and not ex.continued_by(text + "x" * 0 + "?" + r.text)
    model.generate("plain text", max_tokens=2)
    assert model.last_exchange.prompt is None and model.last_exchange.text == ""
    assert not model.last_exchange.continued_by(nxt)


def test_stream_closed_mid_block_is_cancelled(model) -> None:
    """A stream closed while a block is being denoised reports "cancelled" (it said "stop" when
    the close was seen by the piece push of a step)."""
    import threading

    read, streams = threading.Event(), []

    def on_step(canvas, n_masked, block_start):
        if read.is_set():
            streams[0]._cancel.wait(10)  # the decode waits mid-block until the reader closes the stream
        return False

    s = model.generate("hello world", max_tokens=40, block_size=8, threshold=1.0, stop_at_eos=False, stream=True,
                       on_step=on_step)
    streams.append(s)
    next(iter(s))
    read.set()
    s.close()
    assert s.result is not None and s.result.finish_reason == "cancelled" and len(s.result.tokens) < 40


def test_new_context_shares_the_model(model) -> None:
    from clover_cpp import CloverValueError

    with pytest.raises(CloverValueError, match="unknown argument"):
        model.new_context(n_gpu_layers=1)
    other = model.new_context(n_ctx=32, block_size=4)
    try:
        assert other._shared is model._shared and other.n_ctx() == 32 and other.block_size == 4
        assert other.generate("hello", max_tokens=4).tokens == model.generate("hello", max_tokens=4, block_size=4).tokens
    finally:
        other.close()
    assert model._shared.handle is not None and model.generate("hello", max_tokens=2).tokens


@pytest.mark.parametrize("kw,field", [(dict(threshold=2), "threshold"), (dict(temperature=-1), "temperature"),
                                      (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                                      (dict(max_steps=-1), "max_steps"), (dict(max_tokens=-1), "max_tokens"),
                                      (dict(draft_steps=-1), "draft_steps"), (dict(logprobs=21), "n_top_logprobs")])
def test_ranges_are_libclovers(model, kw, field) -> None:
    """The parameter ranges have one owner, clover_generate_params_check: generate() raises its
    message (before waiting or allocating; a stream at the call, not at the first piece), and
    CloverError.param names the keyword refused (what the server's 400 and the CLI name)."""
    import pickle

    from clover_cpp import CloverValueError

    for stream in (False, True):
        with pytest.raises(CloverValueError) as e:
            model.generate("hello", stream=stream, **kw)
        assert e.value.message.startswith(field)
        assert e.value.param == next(iter(kw))
        assert pickle.loads(pickle.dumps(e.value)).param == e.value.param
    with pytest.raises(CloverValueError) as early:  # the same check with no model (front ends, before loading)
        type(model).check_generate_args(**kw)
    assert (early.value.message, early.value.param) == (e.value.message, e.value.param)
    ((_, value),) = kw.items()
    gp = N.lib().clover_generate_default_params()  # the same value straight into the C check
    setattr(gp, field, value)
    buffers = (N.ctypes.c_int32 * 1)(), (N.ctypes.c_float * 1)()
    gp.top_tokens, gp.top_logprobs = buffers
    assert N.generate_params_problem(gp) == e.value.message


def test_two_broken_ranges_name_libclovers_first(model) -> None:
    """Two values out of range: the message of libclover's first rule, and CloverError.param its keyword."""
    from clover_cpp import CloverValueError

    for two, first in ((dict(top_p=2.0, threshold=2.0), "threshold"), (dict(max_tokens=-1, top_p=2.0), "top_p")):
        with pytest.raises(CloverValueError) as e:
            model.generate("hello", **two)
        assert e.value.message.startswith(first) and e.value.param == first


def test_check_generate_args_needs_no_model() -> None:
    """Clover.check_generate_args: generate's keywords checked before any model is loaded (what
    the CLI asks before opening one): valid values pass (top_p 0 included), an unknown keyword
    is a CloverTypeError naming it."""
    from clover_cpp import Clover, CloverTypeError

    Clover.check_generate_args(threshold=0.5, top_p=0.0, max_steps=3, temperature=0.7, seed=-1, block_size="auto",
                               draft_self="auto", stop=["x"])
    with pytest.raises(CloverTypeError) as e:
        Clover.check_generate_args(thresold=0.5)
    assert e.value.param == "thresold"
