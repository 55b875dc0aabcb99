"""``clover serve``: tool calling.

The request's ``tools`` are rendered by the model's own chat template (its ``tools``
variable, as Hugging Face's ``apply_chat_template(tools=...)``); the reply's tool-call markup
is parsed into OpenAI ``tool_calls``. The markup is the Qwen family's, which the release
checkpoints' template uses::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(and Qwen3.5's XML form, ``<tool_call><function=NAME><parameter=P>value</parameter>
</function></tool_call>``, is read too). ``tool_choice``: ``"none"`` renders no tools;
``"auto"`` lets the model choose; ``"required"`` starts the reply with ``<tool_call>``; a
named function starts it with that function's call up to its arguments. Text outside the
markup is the message's content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from .types import APIError, NamedChoice, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_XML_FN = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass
class ToolPlan:
    """What the request's tools do to the prompt and the reply."""

    tools: list[dict[str, Any]] | None  # as the template reads them (None: not rendered)
    names: set[str]
    prefill: str                        # text the reply starts with (part of the prompt)
    parallel: bool
    grammar: str | None = None          # GBNF the rest of the reply must follow (a forced call's arguments)

    @property
    def active(self) -> bool:
        return self.tools is not None


def plan(tools: list[Tool] | None, choice: str | NamedChoice | None, parallel: bool,
         template: str | None) -> ToolPlan:
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice names a tool but the request has no tools", param="tool_choice")
        return ToolPlan(None, set(), "", parallel)
    names = {t.function.name for t in tools}
    if len(names) != len(tools):
        raise APIError(400, "tools: two tools share a name", param="tools")
    if choice == "none":
        return ToolPlan(None, set(), "", parallel)
    if template is None or "tools" not in template:
        raise APIError(400, "tools: the model's chat template does not render tools", param="tools")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    forced = None
    if isinstance(choice, NamedChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice: no tool named '{choice.function.name}'", param="tool_choice")
        forced = next(t for t in tools if t.function.name == choice.function.name)
    elif choice == "required" and len(tools) == 1:
        forced = tools[0]
    if forced is not None:  # the call up to its arguments, which then follow the tool's schema
        prefill = f'{OPEN}\n{{"name": {json.dumps(forced.function.name)}, "arguments": '
        return ToolPlan(rendered, names, prefill, parallel, _arguments_grammar(forced.function.parameters))
    return ToolPlan(rendered, names, f"{OPEN}\n" if choice == "required" else "", parallel)


_ROOT = re.compile(r"(?<![^\s(|])root(?=[\s)?*+]|$)", re.M)  # the rule name root, not inside a literal


def _arguments_grammar(schema: dict[str, Any] | None) -> str | None:
    """GBNF for a forced call's rest: the arguments as the tool's JSON schema says, then the
    call's end. None (the prefill alone) when the runtime has no grammar converter."""
    try:
        from ..grammar import GrammarError, json_schema_grammar  # noqa: PLC0415
    except ImportError:
        return None
    try:
        g = json_schema_grammar(schema or {"type": "object"})
    except GrammarError as e:
        if "install" in str(e):  # no converter here: the prefill alone
            return None
        raise APIError(400, f"tools: {e}", param="tools") from None
    if "tool-call-args" in g:
        return None
    return _ROOT.sub("tool-call-args", g) + f'\nroot ::= tool-call-args "}}" "\\n{CLOSE}"\n'


def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    """One tool call's OpenAI form from the text between the tags (None: not a call)."""
    body = body.strip()
    name: Any
    if body.startswith("{"):
        try:  # lenient on what the model wrote (a raw tab in a string), strict in what we send
            obj = json.loads(body, strict=False)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args, strict=False)
            except ValueError:
                return None
    elif (m := _XML_FN.search(body)) is not None:
        name = m.group(1).strip()
        args = {}
        for p in _XML_PARAM.finditer(m.group(2)):
            v = p.group(2)
            try:
                args[p.group(1).strip()] = json.loads(v)
            except ValueError:
                args[p.group(1).strip()] = v
    else:
        return None
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _holdback(text: str, tag: str) -> int:
    """How many characters at the end of text could start ``tag`` (kept until more comes)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ToolStream:
    """Splits the reply, piece by piece, into content and tool calls."""

    plan: ToolPlan
    buf: str = ""
    in_call: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buf = self.plan.prefill

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        """Events: ("content", text) and ("call", (index, call))."""
        self.buf += piece
        out: list[tuple[str, Any]] = []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _holdback(self.buf, OPEN)
                    text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    self._content(text, out)
                    return out
                self._content(self.buf[:i], out)
                self.buf, self.in_call = self.buf[i + len(OPEN):], True
            else:
                j = self.buf.find(CLOSE)
                if j < 0:
                    return out
                self._close(self.buf[:j], out)
                self.buf, self.in_call = self.buf[j + len(CLOSE):], False

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.in_call:  # the reply ended inside a call (the end-of-turn token came first)
            self._close(self.buf, out)
        else:
            self._content(self.buf, out)
        self.buf, self.in_call = "", False
        return out

    def _content(self, text: str, out: list[tuple[str, Any]]) -> None:
        if text:
            self.content.append(text)
            out.append(("content", text))

    def _close(self, body: str, out: list[tuple[str, Any]]) -> None:
        call = _call(body, self.plan.names)
        if call is None:  # not a call after all: the text stays content
            self._content(f"{OPEN}{body}{CLOSE}", out)
        elif self.plan.parallel or not self.calls:
            self.calls.append(call)
            out.append(("call", (len(self.calls) - 1, call)))

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole reply's content (None when it is only calls) and calls."""
        text = "".join(self.content)
        if self.calls:
            return (text.strip() or None), self.calls
        return text, []
