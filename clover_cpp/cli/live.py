"""The live view (the block being denoised, redrawn in place on a terminal) and the one call that
writes a generation to stdout, live or as plain streamed text."""

from __future__ import annotations

import functools
import shutil
import sys
import unicodedata
from typing import Any


def _printable(s: str) -> str:
    out = []
    for ch in s:
        if ch == "\n":
            out.append("\u21b5")
        elif ch == "\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn") or unicodedata.east_asian_width(ch) in "WF":
            out.append("\u00b7" if unicodedata.category(ch)[0] == "C" else "?")
        else:
            out.append(ch)
    return "".join(out)


class LiveView:
    """Draws the committed text followed by the block being denoised; masked positions are
    shown as a shaded cell, tokens unmasked in the last step highlighted. The block is redrawn
    in place (ANSI cursor movement), committed text is written once."""

    MASK = "\u2591"

    def __init__(self, model: Any, out: Any = None, color: bool = True, n_prompt: int = 0) -> None:
        self.m = model
        self.n_prompt = n_prompt
        self.out = out or sys.stdout
        self.color = color
        self.col = 0          # cursor column after the committed text
        self.drawn = 0        # printable width of the block drawn after it
        self.prev: list[int] = []
        self.mask = model.mask_token
        self.width = max(20, shutil.get_terminal_size((80, 24)).columns)
        self._piece_cache: dict[int, str] = {}

    def _piece(self, t: int) -> str:
        s = self._piece_cache.get(t)
        if s is None:
            try:
                s = _printable(self.m.token_to_piece(t, special=True).decode("utf-8", "replace"))
            except Exception:  # noqa: BLE001
                s = "?"
            self._piece_cache[t] = s
        return s

    def _erase(self) -> None:
        if self.drawn:
            up = (self.col + self.drawn - 1) // self.width - self.col // self.width
            seq = (f"\x1b[{up}A" if up > 0 else "") + f"\x1b[{self.col % self.width + 1}G\x1b[J"
            self.out.write(seq)
            self.drawn = 0

    def step(self, canvas: list[int], n_masked: int, block_start: int) -> None:
        self._erase()
        dim, hi, rst = ("\x1b[2m", "\x1b[1;32m", "\x1b[0m") if self.color else ("", "", "")
        parts, width = [], 0
        budget = max(10, self.width * 3)
        for i, t in enumerate(canvas):
            if block_start + i < self.n_prompt:
                continue
            if t == self.mask:
                s, style = self.MASK, dim
            else:
                s = self._piece(t)
                style = hi if (i < len(self.prev) and self.prev[i] == self.mask) else ""
            if width + len(s) > budget:
                break
            parts.append(f"{style}{s}{rst}" if style else s)
            width += len(s)
        self.prev = list(canvas) if n_masked else []
        self.out.write("".join(parts))
        self.out.flush()
        self.drawn = width

    def block(self, text: str, tokens: list[int]) -> None:
        self._erase()
        self.write(text)
        self.prev = []

    def write(self, text: str, width_of: str | None = None) -> None:
        self.out.write(text)
        self.out.flush()
        for ch in text if width_of is None else width_of:
            if ch == "\n":
                self.col = 0
            else:
                self.col += 1

    def finish(self) -> None:
        self._erase()
        self.out.flush()


def generate_to_terminal(m: Any, prompt: Any, visual: bool, chat_messages: Any = None, prefix: str = "",
                         **kw: Any) -> Any:
    """Run one generation, writing prefix then its text to stdout (live view or plain streaming).
    The prefix (the echoed prompt) is written once the generation runs: a refused call (the
    context too small, a bad argument) prints only its one-line error."""
    from ..errors import show_notices

    show_notices()  # "measuring the cost curve" before a first block size auto (seconds of silence else)
    if visual:
        # tokenize here so that the view knows which canvas positions hold the prompt
        if chat_messages is not None:
            text = m.format_chat(chat_messages)
            n_prompt = len(m.chat_tokens(text))  # (the earlier turns' tokens: the memory is reused)
            run = functools.partial(m.generate_chat, text)
        else:
            toks = m.tokenize(prompt, add_bos=True, special=True)
            n_prompt = len(toks)
            run = functools.partial(m.generate, toks)
        view = LiveView(m, color=True, n_prompt=n_prompt)
        pending = [prefix]

        def echo() -> None:
            if pending and pending.pop():
                view.write(f"\x1b[1m{prefix}\x1b[0m", width_of=prefix)

        def step(*a: Any) -> Any:
            echo()
            return view.step(*a)

        def block(*a: Any) -> Any:
            echo()
            return view.block(*a)
        try:
            r = run(on_step=step, on_block=block, **kw)
            echo()
        finally:
            view.finish()
        return r
    stream = m.chat(chat_messages, stream=True, **kw) if chat_messages is not None else \
        m.generate(prompt, stream=True, **kw)
    try:
        for piece in stream:
            if prefix:
                sys.stdout.write(prefix)
                prefix = ""
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        stream.close()
    if prefix:  # nothing generated (EOS first, -n 0): the echo still comes
        sys.stdout.write(prefix)
    return stream.result
