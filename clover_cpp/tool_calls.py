"""Tool calling, the model's side (plain dicts, OpenAI's shapes): what a request's tools and
tool_choice do to the prompt and the reply, the grammar of a forced call, and the reply's calls
parsed out of its text. :meth:`Clover.create_chat_completion` and ``clover serve`` (which
validates the request with its pydantic types first) both use it.

The request's ``tools`` are rendered by the model's own chat template (its ``tools``
variable, as Hugging Face's ``apply_chat_template(tools=...)``); the reply's tool-call markup is
parsed into OpenAI ``tool_calls`` by llama.cpp's parser (common/chat.cpp, llama-server's, through
:mod:`clover_cpp.chat_format`) for whichever markup the template asks for: the Qwen family's,
which the release checkpoints' template uses::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen3-Coder / Qwen3.5's XML (``<tool_call><function=NAME><parameter=P>value</parameter>
</function></tool_call>``), Llama 3.x's JSON, Mistral's ``[TOOL_CALLS]``, ... A whole reply
llama.cpp's parser refuses is read once more by :func:`parse_call`, the lenient reader of the
``<tool_call>`` markup this module had before (it takes what chat.cpp does not and our tests
pin: arguments as a JSON string, Qwen3.5's XML inside a Hermes-template reply, text after a
call). ``tool_choice``: ``"none"`` renders no tools;
``"auto"`` lets the model choose; ``"required"`` starts the reply with ``<tool_call>`` and a
grammar makes the rest a call of one of the tools (one or more with ``parallel_tool_calls``);
a named function starts it with that function's call up to its arguments, which its schema
constrains. Text outside the markup is the message's content.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat_format import REASONING_FORMATS, ChatFormatError, ChatParser, chat_params, parse_reply
from .errors import CloverTypeError, CloverValueError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolPlan:
    """What the request's tools do to the prompt and the reply."""

    tools: list[dict[str, Any]] | None  # as the template reads them (None: not rendered)
    names: set[str]
    prefill: str                        # text the reply starts with (part of the prompt)
    parallel: bool
    grammar: str | None = None          # GBNF the rest of the reply must follow (a forced call's arguments)
    chat: dict[str, Any] = field(default_factory=dict)  # chat.cpp's format of the template's calls (parse_reply's)

    @property
    def active(self) -> bool:
        return self.tools is not None

    @property
    def parses(self) -> bool:
        """The reply is read by chat.cpp's parser (tool calls, or only the thinking when reasoning
        is asked for, the request has no tools and the template has thinking); otherwise its
        pieces stream through as they come."""
        return self.active or bool(self.chat)


def plan(tools: Sequence[Mapping[str, Any]] | None, choice: str | Mapping[str, Any] | None, parallel: bool,
         template: str | None, reasoning_format: str = "none") -> ToolPlan:
    """The plan of OpenAI's ``tools`` (``{"type": "function", "function": {"name", "parameters",
    ...}}``), ``tool_choice`` ("none", "auto", "required" or ``{"type": "function", "function":
    {"name": N}}``) and ``parallel_tool_calls`` under the chat ``template`` in use (None: ChatML,
    which renders no tools). ``reasoning_format`` (llama-server's: "none", "auto", "deepseek",
    "deepseek-legacy"): other than "none", the reply's thinking goes to ``reasoning_content``
    (with or without tools). Bad input: CloverValueError naming the argument."""
    if reasoning_format not in REASONING_FORMATS:
        raise CloverValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, "
                               f"got {reasoning_format!r}"[:300], param="reasoning_format")
    if not tools and choice not in (None, "none", "auto"):
        raise CloverValueError("tool_choice names a tool but the request has no tools", param="tool_choice")
    funcs = [_function(t) for t in tools or []]
    names = {f["name"] for f in funcs}
    if len(names) != len(funcs):
        raise CloverValueError("tools: two tools share a name", param="tools")
    if not tools or choice == "none":  # (the reply read for its thinking alone, when there is any)
        return ToolPlan(None, set(), "", parallel, chat=_thinking_format(template, parallel, reasoning_format))
    forced = _forced(choice, funcs)
    if template is None or "tools" not in template:
        raise CloverValueError("tools: the model's chat template does not render tools", param="tools")
    rendered = [dict(t) for t in tools]
    chat = _chat_format(template, rendered, choice, parallel, reasoning_format)
    if (forced is not None or choice == "required") and (grammar := _foreign_grammar(chat, forced or funcs[0])):
        return ToolPlan(rendered, names, "", parallel, grammar, chat)  # llama.cpp's grammar of the template's markup
    if forced is not None:  # the call up to its arguments, which then follow the tool's schema
        prefill = f'{OPEN}\n{{"name": {json.dumps(forced["name"])}, "arguments": '
        return ToolPlan(rendered, names, prefill, parallel, _arguments_grammar(forced.get("parameters")), chat)
    if choice == "required":  # a call of any of the tools (one or more when parallel)
        return ToolPlan(rendered, names, f"{OPEN}\n", parallel, _calls_grammar(funcs, parallel), chat)
    return ToolPlan(rendered, names, "", parallel, chat=chat)


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


def _chat_format(template: str, tools: list[dict[str, Any]], choice: Any, parallel: bool,
                 reasoning_format: str = "none") -> dict[str, Any]:
    """chat.cpp's format of the template's tool calls: what :func:`chat_format.parse_reply` needs;
    {} when chat.cpp cannot read the template (its Jinja engine is not jinja2, which renders the
    prompt): the reply is then read by :func:`parse_call` alone."""
    try:
        return dict(_chat_format_cached(template, json.dumps(tools, sort_keys=True), json.dumps(choice), parallel,
                                        reasoning_format))
    except ChatFormatError:
        return {}


@functools.lru_cache(maxsize=64)  # (chat.cpp renders the template a few times to tell its format)
def _chat_format_cached(template: str, tools: str, choice: str, parallel: bool,
                        reasoning_format: str) -> tuple[tuple[str, Any], ...]:
    p = chat_params(template, tools=json.loads(tools), tool_choice=json.loads(choice), parallel_tool_calls=parallel,
                    reasoning_format=reasoning_format)
    return tuple((k, p[k]) for k in ("format", "format_name", "parser", "generation_prompt", "grammar", "grammar_lazy"))


def _thinking_format(template: str | None, parallel: bool, reasoning_format: str) -> dict[str, Any]:
    """chat.cpp's format for reading a tool-less reply's thinking; {} when there is nothing to
    read, so the reply streams through as it comes (no parse per piece): no template,
    reasoning_format "none", or a template whose format reasoning_format leaves as under "none"
    (chat.cpp finds no thinking in it: the default model's, Qwen2.5's, Qwen3-Coder's, Llama's)."""
    if template is None or reasoning_format == "none":
        return {}
    chat = _chat_format(template, [], None, parallel, reasoning_format)
    return chat if chat != _chat_format(template, [], None, parallel, "none") else {}


def _foreign_grammar(chat: dict[str, Any], func: dict[str, Any]) -> str | None:
    """For a forced call under a template whose parser does not read our ``<tool_call>`` JSON
    markup (Qwen3-Coder's XML, Llama 3.x, Mistral, ...): llama.cpp's grammar of the template's
    own markup, without the generation prompt it starts with (the prompt already holds it;
    llama-server feeds it to the grammar first). None: our markup's prefill and grammar do."""
    if not chat or chat.get("grammar_lazy") or not chat.get("grammar"):
        return None
    ours = f'{OPEN}\n{{"name": {json.dumps(func["name"])}, "arguments": {{}}}}\n{CLOSE}'
    try:  # (partial: a reply off the format is no error, and no warning on stderr)
        if parse_reply(chat, ours, partial=True)["tool_calls"]:
            return None
    except ChatFormatError:
        pass
    lead = f"root ::= {json.dumps(chat['generation_prompt'], ensure_ascii=False)} " if chat["generation_prompt"] else ""
    grammar = chat["grammar"]
    if lead and f"\n{lead}" not in f"\n{grammar}":
        return None  # (a grammar of another shape: not one to cut the prompt out of)
    return grammar.replace(lead, "root ::= ", 1) if lead else grammar


@dataclass
class ToolStream:
    """Splits the reply, piece by piece, into content, thinking and tool calls, as llama-server
    does (task_result_state::update_chat_msg): the whole text so far parsed again by chat.cpp's
    parser (partial) at each piece, and the change since the last parse sent on (chat.cpp's PEG
    parser has no incremental parse: a piece costs a parse of the text so far, as in llama-server).
    The parser is loaded once per reply (chat_format.ChatParser). Events: ("content", text), ("reasoning", text)
    (only when the plan asks for reasoning_format) and ("call", (index, delta)), a call's first
    delta its id, type, name and the start of its arguments, the next ones more of its arguments."""

    plan: ToolPlan
    text: str = ""
    sent: dict[str, Any] = field(default_factory=lambda: {"content": "", "reasoning": "", "calls": []})
    ids: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # the whole reply's calls (after finish)
    content: str = ""
    reasoning: str = ""  # the whole reply's reasoning_content (after finish)
    lead: str = ""  # what the parser reads as content in the generation prompt (Qwen3.5's "<think>\n")
    parser: ChatParser | None = None

    def __post_init__(self) -> None:
        try:
            self.parser = ChatParser(self.plan.chat) if self.plan.chat else None
            self.lead = self._parse("", partial=True)["content"]
        except ChatFormatError:
            self.lead = ""

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        self.text += piece
        try:
            return self._diff(self._parse(self.text, partial=True))
        except ChatFormatError:  # (no reading yet: the next piece's, or the whole reply's)
            return []

    def finish(self) -> list[tuple[str, Any]]:
        """The last events; then :meth:`message` is the whole reply's."""
        msg = self._whole()
        out = self._diff(msg)
        self.content, self.calls, self.reasoning = msg["content"], msg["tool_calls"], msg["reasoning_content"]
        if self.parser is not None:
            self.parser.close()
        return out

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole reply's content (None when it is only calls) and calls."""
        if self.calls:
            return (self.content.strip() or None), self.calls
        return self.content, []

    def _parse(self, text: str, partial: bool) -> dict[str, Any]:
        """chat.cpp's reading of the reply so far: {"content", "tool_calls" (OpenAI's)}."""
        if self.parser is None:
            raise ChatFormatError("no chat.cpp format for this template")
        msg = self.parser.parse(self.plan.prefill + text, partial=partial)
        content = msg["content"]
        if self.lead and content.startswith(self.lead):
            content = content[len(self.lead):]
        calls = [c for c in msg["tool_calls"] if c["name"] in self.plan.names]
        if not self.plan.parallel:
            calls = calls[:1]
        for i, c in enumerate(calls):  # a call keeps the id it was first sent with
            if i == len(self.ids):
                self.ids.append(c["id"] or f"call_{secrets.token_hex(12)}")
        return {"content": content, "reasoning_content": msg["reasoning_content"], "tool_calls": [
            {"id": self.ids[i], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for i, c in enumerate(calls)]}

    def _whole(self) -> dict[str, Any]:
        """The whole reply's reading; one chat.cpp refuses, or whose call's arguments are no JSON
        object, read by :meth:`_hermes` (where a call cut off by the budget stays text)."""
        try:
            msg = self._parse(self.text, partial=False)
        except ChatFormatError:
            return self._hermes(self.plan.prefill + self.text)
        for c in msg["tool_calls"]:
            try:
                ok = isinstance(json.loads(c["function"]["arguments"]), dict)
            except ValueError:
                ok = False
            if not ok:
                return self._hermes(self.plan.prefill + self.text)
        return msg

    def _hermes(self, text: str) -> dict[str, Any]:
        """A reply chat.cpp's parser refuses, read as the Qwen family's ``<tool_call>`` markup the
        way our templates' models write it and chat.cpp does not take (arguments as a JSON string,
        ``"parameters"`` for ``"arguments"``, Qwen3.5's XML form inside it, text after a call); a
        body that is no call stays text."""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while (i := text.find(OPEN)) >= 0:
            content.append(text[:i])
            j = text.find(CLOSE, i)
            body, end = (text[i + len(OPEN):j], j + len(CLOSE)) if j >= 0 else (text[i + len(OPEN):], len(text))
            call = parse_call(body, self.plan.names)
            if call is None:
                content.append(text[i:end])
            elif self.plan.parallel or not calls:
                if len(calls) == len(self.ids):
                    self.ids.append(call["id"])
                calls.append({**call, "id": self.ids[len(calls)]})
            text = text[end:]
        content.append(text)
        return {"content": "".join(content), "reasoning_content": "", "tool_calls": calls}

    def _diff(self, msg: dict[str, Any]) -> list[tuple[str, Any]]:
        """The events from what was sent to msg (only what extends it: a reading that takes back
        text already sent sends nothing until it extends it again)."""
        out: list[tuple[str, Any]] = []
        for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
            old, new = self.sent[kind], msg[key]
            if new.startswith(old) and len(new) > len(old):
                out.append((kind, new[len(old):]))
                self.sent[kind] = new
        sent_calls = self.sent["calls"]
        for i, call in enumerate(msg["tool_calls"]):
            args = call["function"]["arguments"]
            if i == len(sent_calls):
                if not args:  # (its name alone could still change: llama-server waits for its arguments too)
                    break
                out.append(("call", (i, call)))
                sent_calls.append(args)
            elif args.startswith(sent_calls[i]) and len(args) > len(sent_calls[i]):
                out.append(("call", (i, {"function": {"arguments": args[len(sent_calls[i]):]}})))
                sent_calls[i] = args
        return out


_XML_FN = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_call(body: str, names: set[str]) -> dict[str, Any] | None:
    """One tool call's OpenAI form from the text between the ``<tool_call>`` tags, as
    :meth:`ToolStream._hermes` reads it (None: not a call)."""
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


def reply_message(text: str, tp: ToolPlan | None) -> dict[str, Any]:
    """A whole reply's assistant message, its calls parsed out of the text (OpenAI's
    ``tool_calls``; the finish reason: openai_reply.finish_reason(r, tool_calls=...)) and its
    thinking in ``reasoning_content`` when the plan asks for it (as llama-server's message)."""
    if tp is None or not tp.parses:
        return {"role": "assistant", "content": text}
    ts = ToolStream(tp)
    ts.text = text
    ts.finish()
    content, calls = ts.message()
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if ts.reasoning:
        msg["reasoning_content"] = ts.reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg
