"""The output of one generation as it becomes final: :class:`OutputFollower` turns the decode
loop's tokens (each step's final canvas prefix, each finished block) into text pieces, exactly
once each, decoding UTF-8 across token boundaries and cutting at the first stop string (which
may span pieces: text that could begin one is held back until it is known not to; the matching
is libclover's clover_stop_matcher, which clover-cli's reverse prompts use too).

Stop tokens and EOS are libclover's (clover_generate_params.stop_tokens): the blocks it reports
are already cut at them; a step's canvas prefix is cut here at the same tokens."""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import _native as N
from .errors import CloverError, lib

#: push(piece, tokens) -> True to cancel (streams: the reader has gone); ``tokens``: the output
#: tokens not handed over yet, the piece's (a token whose text is held back comes with a later piece)
Push = Callable[[str, list[int]], bool]


class _StopStrings:
    """libclover's stop-string matcher (clover_stop_matcher_*): text in, final text out."""

    def __init__(self, stops: list[str]) -> None:
        lib()  # (loaded here at the latest: a missing library is a CloverError)
        # (C strings: a stop string holding a NUL character is left out, it never matches)
        enc = [x.encode("utf-8", "surrogatepass") for x in stops if "\0" not in x]
        self._h = N.clover_stop_matcher_new((ctypes.c_char_p * max(len(enc), 1))(*enc), len(enc))
        if not self._h:
            raise CloverError("stop strings: clover_stop_matcher_new failed")
        self.hit = False

    def _out(self, ptr: Any, n: ctypes.c_int32) -> str:
        if not ptr:
            raise CloverError("stop strings: the matcher refused its input")
        return ctypes.string_at(ptr, n.value).decode("utf-8", "surrogatepass")

    def feed(self, text: str) -> str:
        data, n = text.encode("utf-8", "surrogatepass"), ctypes.c_int32(0)
        out = self._out(N.clover_stop_matcher_feed(self._h, data, len(data), ctypes.byref(n)), n)
        self.hit = bool(N.clover_stop_matcher_hit(self._h))
        return out

    def flush(self) -> str:
        n = ctypes.c_int32(0)
        return self._out(N.clover_stop_matcher_flush(self._h, ctypes.byref(n)), n)

    def close(self) -> None:
        h, self._h = getattr(self, "_h", None), None
        if h:
            N.clover_stop_matcher_free(h)

    def __del__(self) -> None:
        self.close()


class OutputFollower:
    """Follows one generation's output. ``feed`` / ``flush`` are the stop-string matcher alone
    (text in, final text out); ``step`` / ``block`` / ``finish`` follow the decode loop's
    tokens (``detokenize`` gives a token list's bytes) and hand each new piece to ``push``.

    After it: ``tokens`` (the output tokens the pieces spell, up to the one that completed a
    stop string), ``pieces``, ``hit`` (a stop string was seen)."""

    def __init__(self, stops: Sequence[str] = (), *, stop_tokens: Iterable[int] = (),
                 detokenize: Callable[[list[int]], bytes] | None = None, push: Push | None = None) -> None:
        self.stops = [x for x in stops if x]
        self._matcher = _StopStrings(self.stops) if self.stops else None
        self.stop_tokens = frozenset(stop_tokens)  # where a step's canvas prefix ends (EOS included)
        self._detokenize = detokenize
        self._push = push
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.tokens: list[int] = []   # final output tokens so far (what the pieces spell)
        self.pieces: list[str] = []
        self._base = 0                # len(tokens) when the current block started
        self._block: list[str] = []   # the current block's pieces
        self._handed = 0              # tokens handed to push with a piece
        self._fed = ""                # the decoded text fed to the stop-string matcher
        self._n_out = 0               # how much of it came out

    # -- stop strings
    def feed(self, piece: str) -> str:
        """The part of ``piece`` (after what was held back) that is final; sets ``hit`` when a
        stop string has been seen (nothing from it on is returned, then or later)."""
        return self._matcher.feed(piece) if self._matcher is not None else piece

    def flush(self) -> str:
        """What was held back (the start of a stop string that never came); "" after a hit."""
        return self._matcher.flush() if self._matcher is not None else ""

    @property
    def hit(self) -> bool:
        """A stop string was seen."""
        return self._matcher is not None and self._matcher.hit

    def close(self) -> None:
        """Free the native matcher (also done when the follower is collected)."""
        if self._matcher is not None:
            self._matcher.close()

    # -- the decode loop's tokens
    def _advance(self, bt: list[int]) -> bool:
        """bt: the current block's output known so far (a prefix of what it will be). Emits
        what is new; True when the output must stop (a stop string, or push asked to)."""
        new = bt[len(self.tokens) - self._base:]
        piece = ""
        if new:
            self.tokens.extend(new)
            assert self._detokenize is not None
            piece = self._dec.decode(self._detokenize(new))
        if self.stops:
            self._fed += piece
            piece = self.feed(piece)
            self._n_out += len(piece)
        if piece:
            self.pieces.append(piece)
            self._block.append(piece)
            if self._push is not None and self._push(piece, self._unhanded(self._held_bytes())):
                return True
        return self.hit

    def step(self, canvas: Sequence[int], first: int, size: int, mask: int, budget: int) -> bool:
        """A denoising step's canvas: its positions [first, size) after the prompt; the
        contiguous unmasked prefix (cut at a stop token and at the budget) is final."""
        prefix: list[int] = []
        for t in canvas[first:min(size, first + budget - self._base)]:
            if t == mask or t in self.stop_tokens:
                break
            prefix.append(int(t))
        return self._advance(prefix)

    def block(self, tokens: list[int]) -> tuple[bool, str]:
        """A finished block's output tokens (libclover cut them at EOS, stop tokens, the
        budget): (stop, the block's text)."""
        stop = self._advance(tokens)
        text = "".join(self._block)
        self._block, self._base = [], len(self.tokens)
        return stop, text

    def finish(self) -> str:
        """The text held back at the end (an incomplete UTF-8 sequence, the start of a stop
        string that never came), pushed and returned; pushed with the tokens no piece carried
        (those of a stop string) even when it is empty."""
        tail = self._dec.decode(b"", final=True)
        if self.stops:
            tail = self.feed(tail) + self.flush()
        if tail:
            self.pieces.append(tail)
        if self._push is not None and (tail or self._handed < len(self.tokens)):
            self._push(tail, self._unhanded())
        return tail

    def _held_bytes(self) -> int:
        """The output's trailing bytes whose text has not come out (a split UTF-8 sequence, the
        start of a possible stop string)."""
        held = self._fed[self._n_out:] if not self.hit else ""
        return len(self._dec.getstate()[0]) + len(held.encode("utf-8", "surrogatepass"))

    def _unhanded(self, held_bytes: int = 0) -> list[int]:
        """The tokens not handed yet, less those that end in the last ``held_bytes`` bytes (their
        text has not come out: they go with a later piece)."""
        end = len(self.tokens)
        while held_bytes > 0 and end > self._handed:
            end -= 1
            assert self._detokenize is not None
            held_bytes -= len(self._detokenize([self.tokens[end]]))
        new, self._handed = self.tokens[self._handed:end], end
        return new

    @property
    def text(self) -> str:
        return "".join(self.pieces)
