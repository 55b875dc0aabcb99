"""The output of one generation as it becomes final: :class:`OutputFollower` turns the decode
loop's tokens (each step's final canvas prefix, each finished block) into text pieces, exactly
once each, decoding UTF-8 across token boundaries and cutting at the first stop string (which
may span pieces: text that could begin one is held back until it is known not to).

Stop tokens and EOS are libclover's (clover_generate_params.stop_tokens): the blocks it reports
are already cut at them; a step's canvas prefix is cut here at the same tokens."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence

#: push(piece, tokens) -> True to cancel (streams: the reader has gone)
Push = Callable[[str, list[int]], bool]


class OutputFollower:
    """Follows one generation's output. ``feed`` / ``flush`` are the stop-string matcher alone
    (text in, final text out); ``step`` / ``block`` / ``finish`` follow the decode loop's
    tokens (``detokenize`` gives a token list's bytes) and hand each new piece to ``push``.

    After it: ``tokens`` (the output tokens the pieces spell, up to the one that completed a
    stop string), ``pieces``, ``hit`` (a stop string was seen)."""

    def __init__(self, stops: Sequence[str] = (), *, stop_tokens: Iterable[int] = (),
                 detokenize: Callable[[list[int]], bytes] | None = None, push: Push | None = None) -> None:
        self.stops = [x for x in stops if x]
        self.hit = False
        self._held = ""
        self.stop_tokens = frozenset(stop_tokens)  # where a step's canvas prefix ends (EOS included)
        self._detokenize = detokenize
        self._push = push
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.tokens: list[int] = []   # final output tokens so far (what the pieces spell)
        self.pieces: list[str] = []
        self._base = 0                # len(tokens) when the current block started
        self._block: list[str] = []   # the current block's pieces

    # -- stop strings
    def feed(self, piece: str) -> str:
        """The part of ``piece`` (after what was held back) that is final; sets ``hit`` when a
        stop string has been seen (nothing from it on is returned, then or later)."""
        if self.hit:
            return ""
        text = self._held + piece
        cut = min((i for i in (text.find(x) for x in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._held = True, ""
            return text[:cut]
        keep = 0
        for x in self.stops:  # the longest tail of text that begins some stop string
            for k in range(min(len(x) - 1, len(text)), keep, -1):
                if x.startswith(text[-k:]):
                    keep = k
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = ("" if self.hit else self._held), ""
        return held

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
            piece = self.feed(piece)
        if piece:
            self.pieces.append(piece)
            self._block.append(piece)
            if self._push is not None and self._push(piece, new):
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
        string that never came), pushed and returned."""
        tail = self._dec.decode(b"", final=True)
        if self.stops:
            tail = self.feed(tail) + self.flush()
        if tail:
            self.pieces.append(tail)
            if self._push is not None:
                self._push(tail, [])
        return tail

    @property
    def text(self) -> str:
        return "".join(self.pieces)
