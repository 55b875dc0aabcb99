"""llama.cpp's chat formats (common/chat.cpp, what llama-server runs), through libclover
(native/clover-chat.h): which tool-call markup a chat template makes the model write, and a
reply, whole or partial, parsed into an OpenAI message.

:func:`chat_params` asks once per request (template, messages, tools, tool_choice); its answer's
``format``, ``parser`` and ``generation_prompt`` are what :func:`parse_reply` needs. The formats are
those llama.cpp knows: Hermes/Qwen ``<tool_call>{json}</tool_call>``, Qwen3-Coder / Qwen3.5's XML
(``<tool_call><function=NAME><parameter=P>...``), Llama 3.x's JSON, Mistral's ``[TOOL_CALLS]``,
and the others of llama.cpp's autoparser.
"""
from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping
from ctypes import POINTER, c_char_p, c_int, c_size_t
from typing import Any

from . import _native as N

__all__ = ["ChatFormatError", "chat_params", "parse_reply"]


class ChatFormatError(ValueError):
    """A template, request or reply chat.cpp refuses (the message is one line)."""


def _fn(name: str) -> Any:
    f = getattr(N.lib(), name)
    if f.argtypes is None:  # (clover-chat.h: int f(const char *, const char **, char *, size_t))
        f.argtypes, f.restype = [c_char_p, POINTER(c_char_p), c_char_p, c_size_t], c_int
    return f


def _call(name: str, request: Mapping[str, Any]) -> dict[str, Any]:
    data = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
    try:
        f = _fn(name)
    except (N.CloverLibraryNotFound, AttributeError) as e:
        raise ChatFormatError(f"chat formats need a libclover with {name}: {e}"[:300]) from None
    err, err_len = N.err_buffer()
    out = c_char_p()
    status = f(data, ctypes.byref(out), err, err_len)
    if status != N.CLOVER_OK or out.value is None:
        raise ChatFormatError(err.value.decode("utf-8", "replace") or f"{name}: status {status}")
    return json.loads(out.value.decode("utf-8"))


def chat_params(template: str, *, messages: list[Any] | None = None, tools: list[Any] | None = None,
                tool_choice: Any = None, parallel_tool_calls: bool = False,
                bos_token: str = "", eos_token: str = "") -> dict[str, Any]:
    """chat.cpp's params for a request under ``template`` (clover-chat.h, clover_chat_params):
    format, format_name, parser, generation_prompt, prompt, grammar, grammar_lazy,
    grammar_triggers, preserved_tokens, additional_stops."""
    req: dict[str, Any] = {"template": template, "bos_token": bos_token, "eos_token": eos_token,
                           "tools": tools or None, "tool_choice": tool_choice,
                           "parallel_tool_calls": bool(parallel_tool_calls)}
    if messages is not None:
        req["messages"] = messages
    return _call("clover_chat_params", req)


def parse_reply(params: Mapping[str, Any], text: str, *, partial: bool = False) -> dict[str, Any]:
    """The reply ``text`` (after the prompt) as chat.cpp's parser of ``params`` reads it:
    {"role", "content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]}. A
    whole text off the format: ChatFormatError."""
    return _call("clover_chat_parse", {"format": params["format"], "parser": params["parser"],
                                       "generation_prompt": params["generation_prompt"], "text": text,
                                       "is_partial": partial})
