"""The chat-template worker: a process of its own that renders jinja2 chat templates for
:mod:`clover_cpp.chat`, so that a template that runs away (1e10 loop iterations, a bigint
computed with the GIL held, a 10 GB string) costs this process, which the caller kills past its
time limit, and never the caller's time, memory or GIL.

Run as a script (``python chat_worker.py``): it imports only the standard library and jinja2,
not the clover_cpp package (which loads libclover). Requests come on stdin, replies go to
stdout, each a 4-byte big-endian length and a body. A request is a pickle (the caller is this
process's parent) of ``(template, variables, limits)``; a reply is JSON (a template that
escaped the sandbox could write it: the parent never unpickles what comes from here):
``{"text": ...}``, or ``{"error": message, "kind": "refused" | "failed"}`` where "refused" is
the template refusing these messages (``raise_exception``, an undefined value, a jinja2 error)
and "failed" the template itself failing or passing a limit.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pickle
import struct
import sys
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

#: the largest power a template may compute (``**``), in bits: legitimate templates compute none
MAX_POWER_BITS = 1 << 16
#: the most items a template's range() calls may produce in one render, all calls together
#: (jinja2's own range caps each call at 100,000, not the product of nested loops)
RANGE_BUDGET = 1_000_000
#: lipsum()'s most paragraphs and words per paragraph
MAX_LIPSUM = 100


class Failed(Exception):
    """The template failed or passed a limit: the template's fault, not the messages'."""


class Refused(Exception):
    """The template's raise_exception(): it refuses these messages."""


class NoOtherTemplates(jinja2.BaseLoader):
    """A chat template is one text: include, import and extend find nothing to read."""

    def get_source(self, environment: Any, template: str) -> Any:
        raise Failed(f"it includes, imports or extends another template ({template!r}): a chat template is one text")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Hugging Face's chat-template environment (trim_blocks, lstrip_blocks, loop controls,
    raise_exception, strftime_now, tojson) with the sandbox's own hooks bounding what they see:
    ``**``, ``*`` and ``+`` go through call_binop (intercepted operators are also never folded
    into constants at compile time), range() draws on a budget per render, lipsum() is capped.
    A loop over a long string or a ``~`` join is still unbounded here: the worker's time and
    memory limits stop those."""

    intercepted_binops = frozenset({"**", "*", "+"})

    def __init__(self, max_items: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         loader=NoOtherTemplates())
        self.max_items = max_items
        self.range_left = RANGE_BUDGET
        self.filters["tojson"] = tojson
        self.globals.update(raise_exception=raise_exception, range=self.bounded_range, lipsum=bounded_lipsum,
                            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise Failed(f"it computes a power of more than {MAX_POWER_BITS} bits")
        if operator in ("*", "+") and self.items_of(operator, left, right) > self.max_items:
            raise Failed(f"it builds a string or list of more than {self.max_items} items ({operator!r})")
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def items_of(operator: str, left: Any, right: Any) -> int:
        """The length of the string or list that ``left operator right`` would build (0: not one)."""
        seqs = (str, bytes, list, tuple)
        if operator == "+":
            return len(left) + len(right) if isinstance(left, seqs) and isinstance(right, seqs) else 0
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, seqs) and isinstance(n, int):
                return len(seq) * n
        return 0

    def bounded_range(self, *args: int) -> range:
        r = range(*args)
        self.range_left -= len(r)
        if self.range_left < 0:
            raise Failed(f"its range() calls produce more than {RANGE_BUDGET} items in one render")
        return r


def raise_exception(message: str) -> None:
    raise Refused(message)


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja2's names
    if n > MAX_LIPSUM or max > MAX_LIPSUM:
        raise Failed(f"it asks lipsum() for more than {MAX_LIPSUM} paragraphs or words")
    return generate_lorem_ipsum(n, html, min, max)


def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compiled(template: str, max_items: int) -> Any:
    env = BoundedEnvironment(max_items)
    return env, env.from_string(template)


def render(template: str, variables: dict[str, Any], max_chars: int) -> str:
    env, tmpl = compiled(template, max_chars)
    env.range_left = RANGE_BUDGET
    out: list[str] = []
    n = 0
    for piece in tmpl.generate(**variables):
        n += len(piece)
        if n > max_chars:
            raise Failed(f"its output passes {max_chars} characters")
        out.append(piece)
    return "".join(out)


def reply_to(template: str, variables: dict[str, Any], max_chars: int) -> dict[str, Any]:
    try:
        return {"text": render(template, variables, max_chars)}
    except Refused as e:
        return {"error": str(e), "kind": "refused"}
    except Failed as e:
        return {"error": str(e), "kind": "failed"}
    except jinja2.TemplateSyntaxError as e:
        return {"error": f"it does not compile: {e} (line {e.lineno})", "kind": "failed"}
    except jinja2.TemplateError as e:
        return {"error": str(e), "kind": "refused"}
    except MemoryError:
        return {"error": "it ran out of memory", "kind": "failed"}
    except RecursionError:
        return {"error": "it recurses too deep", "kind": "failed"}
    except Exception as e:  # noqa: BLE001 - whatever the template's Python raised (division by zero...)
        return {"error": f"{type(e).__name__}: {e}", "kind": "failed"}


def read_exactly(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        b = os.read(fd, n)
        if not b:
            raise EOFError
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def serve(fd_in: int, fd_out: int) -> None:
    while True:
        try:
            (size,) = struct.unpack(">I", read_exactly(fd_in, 4))
            request = read_exactly(fd_in, size)
        except EOFError:
            return  # the parent has gone
        try:
            template, variables, limits = pickle.loads(request)
            reply = reply_to(template, variables, limits["max_chars"])
        except Exception as e:  # noqa: BLE001 - a variable of a class this process cannot import
            reply = {"error": f"its variables cannot be read here: {type(e).__name__}: {e}", "kind": "refused"}
        body = json.dumps(reply).encode()
        os.write(fd_out, struct.pack(">I", len(body)))
        view = memoryview(body)
        while view:
            view = view[os.write(fd_out, view):]


def main() -> None:
    try:
        import resource  # noqa: PLC0415 - POSIX only

        limit = int(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, IndexError, ValueError, OSError):
        pass  # no address-space limit here: the parent's time limit still holds
    # the protocol's own descriptors; fd 1 goes nowhere, so nothing else can write to the pipe
    fd_in, fd_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    serve(fd_in, fd_out)


if __name__ == "__main__":
    main()
