"""llama.cpp's chat formats (common/chat.cpp, what llama-server runs), through libclover
(native/libclover/clover-chat.h): which tool-call markup a chat template makes the model write, and a
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
from ctypes import c_char_p, c_void_p
from typing import Any

from . import _native as N

__all__ = ["REASONING_FORMATS", "ChatFormatError", "ChatParser", "chat_params", "parse_reply"]

# llama-server's --reasoning-format values: "none" leaves the thinking in the content; the others
# put it in reasoning_content (deepseek-legacy: llama-server streams it inside the content too)
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


class ChatFormatError(ValueError):
    """A template, request or reply chat.cpp refuses (the message is one line)."""


def _native(name: str) -> Any:
    """clover-chat.h's ``name``, a typed stub of :mod:`clover_cpp._native`."""
    try:
        N.lib()
    except N.CloverLibraryNotFound as e:
        raise ChatFormatError(f"chat formats need libclover: {e}"[:300]) from None
    return getattr(N, name)


def _call(name: str, request: Mapping[str, Any]) -> dict[str, Any]:
    data = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
    f = _native(name)
    err, err_len = N.err_buffer()
    out = c_char_p()
    status = f(data, ctypes.byref(out), err, err_len)
    if status != N.CLOVER_OK or out.value is None:
        raise ChatFormatError(err.value.decode("utf-8", "replace") or f"{name}: status {status}")
    return json.loads(out.value.decode("utf-8"))


def chat_params(template: str, *, messages: list[Any] | None = None, tools: list[Any] | None = None,
                tool_choice: Any = None, parallel_tool_calls: bool = False, reasoning_format: str = "none",
                bos_token: str = "", eos_token: str = "") -> dict[str, Any]:
    """chat.cpp's params for a request under ``template`` (clover-chat.h, clover_chat_params):
    format, format_name, parser, generation_prompt, prompt, grammar, grammar_lazy,
    grammar_triggers, preserved_tokens, additional_stops. ``reasoning_format`` (one of
    REASONING_FORMATS) other than "none": the parser reads the thinking into reasoning_content."""
    if reasoning_format not in REASONING_FORMATS:
        raise ChatFormatError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, "
                              f"got {reasoning_format!r}"[:300])
    req: dict[str, Any] = {"template": template, "bos_token": bos_token, "eos_token": eos_token,
                           "tools": tools or None, "tool_choice": tool_choice,
                           "parallel_tool_calls": bool(parallel_tool_calls), "reasoning_format": reasoning_format}
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


class ChatParser:
    """chat.cpp's parser of ``params`` loaded once (clover_chat_parser_new), for a reply parsed
    again whole at each streamed piece, as llama-server does (:func:`parse_reply` loads it at
    every call). :meth:`parse` answers as parse_reply."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._handle = c_void_p()
        new = _native("clover_chat_parser_new")
        self._parse, self._free = _native("clover_chat_parser_parse"), _native("clover_chat_parser_free")
        data = json.dumps({k: params[k] for k in ("format", "parser", "generation_prompt")}, ensure_ascii=False)
        err, err_len = N.err_buffer()
        if new(data.encode("utf-8", "surrogatepass"), ctypes.byref(self._handle), err, err_len) != N.CLOVER_OK:
            raise ChatFormatError(err.value.decode("utf-8", "replace") or "clover_chat_parser_new failed")

    def parse(self, text: str, *, partial: bool = False) -> dict[str, Any]:
        if not self._handle:
            raise ChatFormatError("the chat parser is closed")
        err, err_len = N.err_buffer()
        out = c_char_p()
        status = self._parse(self._handle, text.encode("utf-8", "surrogatepass"), int(partial), ctypes.byref(out),
                             err, err_len)
        if status != N.CLOVER_OK or out.value is None:
            raise ChatFormatError(err.value.decode("utf-8", "replace") or f"clover_chat_parser_parse: status {status}")
        return json.loads(out.value.decode("utf-8"))

    def close(self) -> None:
        if self._handle:
            self._free(self._handle)
            self._handle = c_void_p()

    def __del__(self) -> None:
        self.close()
