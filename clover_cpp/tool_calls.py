"""Tool calling, the model's side (plain dicts, OpenAI's shapes): what a request's tools and
tool_choice do to the prompt and the reply, the grammar of a forced call, and the reply's calls
parsed out of its text. :meth:`Clover.create_chat_completion` and ``clover serve`` (which
validates the request with its pydantic types first) both use it.

The request's ``tools`` are rendered by the model's own chat template (its ``tools``
variable, as Hugging Face's ``apply_chat_template(tools=...)``); the reply's tool-call markup
is parsed into OpenAI ``tool_calls``. The markup is the Qwen family's, which the release
checkpoints' template uses::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(and Qwen3.5's XML form, ``<tool_call><function=NAME><parameter=P>value</parameter>
</function></tool_call>``, is read too). ``tool_choice``: ``"none"`` renders no tools;
``"auto"`` lets the model choose; ``"required"`` starts the reply with ``<tool_call>`` and a
grammar makes the rest a call of one of the tools (one or more with ``parallel_tool_calls``);
a named function starts it with that function's call up to its arguments, which its schema
constrains. Text outside the markup is the message's content.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import CloverTypeError, CloverValueError

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


def plan(tools: Sequence[Mapping[str, Any]] | None, choice: str | Mapping[str, Any] | None, parallel: bool,
         template: str | None) -> ToolPlan:
    """The plan of OpenAI's ``tools`` (``{"type": "function", "function": {"name", "parameters",
    ...}}``), ``tool_choice`` ("none", "auto", "required" or ``{"type": "function", "function":
    {"name": N}}``) and ``parallel_tool_calls`` under the chat ``template`` in use (None: ChatML,
    which renders no tools). Bad input: CloverValueError naming the argument."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise CloverValueError("tool_choice names a tool but the request has no tools", param="tool_choice")
        return ToolPlan(None, set(), "", parallel)
    funcs = [_function(t) for t in tools]
    names = {f["name"] for f in funcs}
    if len(names) != len(funcs):
        raise CloverValueError("tools: two tools share a name", param="tools")
    if choice == "none":
        return ToolPlan(None, set(), "", parallel)
    forced = _forced(choice, funcs)
    if template is None or "tools" not in template:
        raise CloverValueError("tools: the model's chat template does not render tools", param="tools")
    rendered = [dict(t) for t in tools]
    if forced is not None:  # the call up to its arguments, which then follow the tool's schema
        prefill = f'{OPEN}\n{{"name": {json.dumps(forced["name"])}, "arguments": '
        return ToolPlan(rendered, names, prefill, parallel, _arguments_grammar(forced.get("parameters")))
    if choice == "required":  # a call of any of the tools (one or more when parallel)
        return ToolPlan(rendered, names, f"{OPEN}\n", parallel, _calls_grammar(funcs, parallel))
    return ToolPlan(rendered, names, "", parallel)


def _function(tool: Any) -> dict[str, Any]:
    """A tool's ``function`` (its name a non-empty string, its parameters an object or None)."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise CloverValueError('tools: each tool must be {"type": "function", "function": {"name": ...}}',
                               param="tools")
    f = dict(tool["function"])
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise CloverValueError("tools: a function's name must be a non-empty string", param="tools")
    if not isinstance(f.get("parameters"), (Mapping, type(None))):
        raise CloverTypeError(f"tools: {f['name']}'s parameters must be a JSON schema object", param="tools")
    return f


def _forced(choice: Any, funcs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The function tool_choice names (None: "auto" or "required")."""
    if choice in (None, "auto", "required"):
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    if not isinstance(name, str):
        raise CloverValueError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                               f'"function": {{"name": ...}}}}, got {choice!r}'[:300], param="tool_choice")
    found = next((f for f in funcs if f["name"] == name), None)
    if found is None:
        raise CloverValueError(f"tool_choice: no tool named '{name}'"[:300], param="tool_choice")
    return found


# GBNF's tokens: a string literal, a character class, a comment, a name, anything else
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[A-Za-z0-9_-]+|.', re.S)


def _arguments_grammar(schema: dict[str, Any] | None) -> str | None:
    """GBNF for a forced call's rest: the arguments as the tool's JSON schema says, then the
    call's end. None (the prefill alone) when the runtime has no grammar converter."""
    args = _converted(schema or {"type": "object"}, "tool-call-args")
    return None if args is None else args + f'\nroot ::= tool-call-args "}}" "\\n{CLOSE}"\n'


def _converted(schema: dict[str, Any], rule: str) -> str | None:
    """The schema's GBNF by llama.cpp's converter, its root renamed ``rule``. None (the prefill
    alone) when the runtime has no converter."""
    try:
        from .grammar import GrammarError, json_schema_grammar  # noqa: PLC0415
    except ImportError:
        return None
    try:
        g = json_schema_grammar(schema)
    except GrammarError as e:
        if "install" in str(e):  # no converter here: the prefill alone
            return None
        raise CloverValueError(f"tools: {e}"[:400], param="tools") from None
    if re.search(rf"^{rule} ::=", g, re.M):  # the name is taken (a schema's $defs): no room for ours
        return None
    return _GBNF_TOKEN.sub(lambda m: rule if m.group() == "root" else m.group(), g)  # the name, never a literal


def _calls_grammar(funcs: list[dict[str, Any]], parallel: bool) -> str | None:
    """GBNF for a required call's rest (after ``<tool_call>\\n``): an object naming one of the
    tools with arguments as its schema says, then the call's end; when parallel, more calls may
    follow. As llama.cpp's common/chat.cpp builds it for this markup (Hermes 2 Pro / Qwen): one
    schema per tool, ``{"name": {"const": N}, "arguments": parameters}``, in an alternation."""
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": _hoist_defs(f.get("parameters") or {"type": "object"}, f"tool{i}-", defs)}}
             for i, f in enumerate(funcs)]
    schema: dict[str, Any] = {"anyOf": calls, **({"$defs": defs} if defs else {})}
    call = _converted(schema, "tool-call")
    if call is None:
        return None
    one = f'tool-call "\\n{CLOSE}"'
    more = f' ("\\n{OPEN}\\n" {one})*' if parallel else ""
    return call + f"\nroot ::= {one}{more}\n"


def _hoist_defs(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters with its ``$defs`` (or ``definitions``) moved into ``defs`` under
    prefixed names and its ``$ref``s pointed there: the tools' schemas share one document."""
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            defs[prefix + name] = _refs_to(sub, prefix)
    return _refs_to(schema, prefix)


def _refs_to(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_refs_to(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _refs_to(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        for local in ("#/$defs/", "#/definitions/"):
            if ref.startswith(local):
                out["$ref"] = "#/$defs/" + prefix + ref[len(local):]
    return out


def parse_call(body: str, names: set[str]) -> dict[str, Any] | None:
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
        if self.in_call and parse_call(self.buf, self.plan.names) is None:
            self._content(OPEN + self.buf, out)  # cut off inside a call (the budget): text, no closing tag made up
        elif self.in_call:  # a whole call, and the end-of-turn token came before its closing tag
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
        call = parse_call(body, self.plan.names)
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


def reply_message(text: str, tp: ToolPlan | None) -> dict[str, Any]:
    """A whole reply's assistant message, its calls parsed out of the text (OpenAI's
    ``tool_calls``; the finish reason: openai_reply.finish_reason(r, tool_calls=...))."""
    if tp is None or not tp.active:
        return {"role": "assistant", "content": text}
    ts = ToolStream(tp)
    ts.feed(text)
    ts.finish()
    content, calls = ts.message()
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content, "tool_calls": calls}
