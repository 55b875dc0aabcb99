"""Constrained decoding: the GBNF grammar of a request (``grammar`` / ``response_format`` / a JSON schema).

libclover applies a GBNF grammar with llama.cpp's own grammar sampler (clover.h,
``clover_generate_params.grammar``; spec/decoding.md, "Grammar"). A JSON schema becomes a grammar
by llama.cpp's own converter, the one llama-server runs for ``json_schema`` and ``response_format``
(clover.h, ``clover_json_schema_to_grammar``): a keyword the grammar would not enforce (a number's
``minimum``, ``multipleOf``, ``not``, ``format: email``, ...) is refused with its name and place,
never dropped.
"""
from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping
from typing import Any

from . import _native as N

__all__ = ["grammar_for", "json_schema_grammar", "JSON_OBJECT", "GrammarError"]


class GrammarError(ValueError):
    """A grammar, schema or response_format that cannot be used (the message is one line)."""


def json_schema_grammar(schema: Mapping[str, Any] | bool | str) -> str:
    """GBNF of a JSON schema (a dict, or its JSON text), by llama.cpp's converter in libclover.
    ``True`` / ``{}`` admit any JSON value. Raises GrammarError naming a keyword it cannot enforce."""
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError("JSON schema: false admits no value")
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"JSON schema: not JSON ({e})") from None
    data = text.encode("utf-8", "surrogatepass")
    try:
        N.lib()  # (loaded here: a missing library is this call's error)
    except N.CloverLibraryNotFound as e:
        raise GrammarError(f"a JSON schema needs libclover: {e}") from None
    err, err_len = N.err_buffer()
    cap = 4 * len(data) + 4096
    for _ in range(2):
        buf, n_out = ctypes.create_string_buffer(cap), ctypes.c_int32(0)
        status = N.clover_json_schema_to_grammar(data, buf, cap, ctypes.byref(n_out), err, err_len)
        if status == N.CLOVER_ERR_BUFFER_TOO_SMALL:
            cap = n_out.value + 1
            continue
        if status != N.CLOVER_OK:
            raise GrammarError(err.value.decode("utf-8", "replace") or f"JSON schema: status {status}")
        return buf.raw[:n_out.value].decode("utf-8")
    raise GrammarError("JSON schema: the grammar's size changed between two conversions")


def __getattr__(name: str) -> Any:
    if name == "JSON_OBJECT":  # any JSON object, as llama.cpp's converter writes {"type": "object"}
        return json_schema_grammar({"type": "object"})
    raise AttributeError(name)


def grammar_for(grammar: str | None, response_format: Mapping[str, Any] | None) -> str | None:
    """The GBNF text for a request: ``grammar`` as given (text, or llama-cpp-python's
    ``LlamaGrammar``), or that of ``response_format``
    (``{"type": "text"}`` = none, ``{"type": "json_object"}`` = any JSON object, with an
    optional ``"schema"``; ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` as
    OpenAI's API sends it, or ``{"type": "json_schema", "schema": {...}}``). None = no grammar.
    Raises GrammarError for both at once, a malformed response_format or a schema the converter
    cannot enforce."""
    if grammar is not None and not isinstance(grammar, str):
        text = getattr(grammar, "_grammar", None)  # llama-cpp-python's LlamaGrammar (code written for Llama)
        if not isinstance(text, str):
            raise GrammarError(f"grammar must be GBNF text (a string), got {type(grammar).__name__}")
        grammar = text
    if response_format is None:
        return grammar or None
    if grammar:
        raise GrammarError("give either grammar or response_format, not both")
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return json_schema_grammar(schema if schema is not None else {"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else response_format.get("schema")
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return json_schema_grammar(schema)
    raise GrammarError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
