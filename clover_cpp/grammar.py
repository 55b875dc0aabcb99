"""Constrained decoding: the GBNF grammar of a request (``grammar`` / ``response_format``).

libclover applies a GBNF grammar with llama.cpp's own grammar sampler (clover.h,
``clover_generate_params.grammar``; spec/decoding.md, "Grammar"). This module turns the
OpenAI-style ``response_format`` into that grammar with llama-cpp-python's converter
(``llama_cpp.llama_grammar``: ``JSON_GBNF`` for ``{"type": "json_object"}``,
``json_schema_to_gbnf`` for a JSON schema), so that a schema means here what it means for
llama-cpp-python's ``Llama``.
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["grammar_for", "json_schema_grammar", "JSON_OBJECT", "GrammarError"]

_module: ModuleType | None = None


class GrammarError(ValueError):
    """A grammar or response_format that cannot be used (the message is one line)."""


def _llama_grammar() -> ModuleType:
    """llama-cpp-python's llama_grammar module (pure Python), loaded from its file: importing the
    ``llama_cpp`` package would load a libllama into the process only to convert a schema."""
    global _module
    if _module is None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            raise GrammarError("response_format needs llama-cpp-python's grammar converter: install its "
                               "Python layer (CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install 'clover-cpp[quantize]')")
        path = Path(next(iter(spec.submodule_search_locations))) / "llama_grammar.py"
        mspec = importlib.util.spec_from_file_location("_clover_llama_grammar", path)
        if mspec is None or mspec.loader is None or not path.is_file():
            raise GrammarError(f"llama-cpp-python has no grammar converter at {path}")
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
        # its string character rule lets raw control characters (a newline) into a JSON string,
        # which no strict JSON parser reads: llama.cpp's own converter (common/
        # json-schema-to-grammar.cpp) excludes them, and so does this copy of the module
        rules = getattr(mod, "PRIMITIVE_RULES", {})
        if "char" in rules and "x1F" not in rules["char"].content:
            rules["char"] = mod.BuiltinRule(r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] '
                                            r'[0-9a-fA-F] [0-9a-fA-F])', [])
        _module = mod
    return _module


def json_schema_grammar(schema: Mapping[str, Any] | str) -> str:
    """GBNF of a JSON schema (llama-cpp-python's ``json_schema_to_gbnf``)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return _llama_grammar().json_schema_to_gbnf(text)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - the converter raises anything on a bad schema
        raise GrammarError(f"response_format: cannot convert the JSON schema: {type(e).__name__}: {e}") from None


def __getattr__(name: str) -> Any:
    if name == "JSON_OBJECT":  # llama-cpp-python's JSON grammar (an object at the top level)
        return _llama_grammar().JSON_GBNF
    raise AttributeError(name)


def grammar_for(grammar: str | None, response_format: Mapping[str, Any] | None) -> str | None:
    """The GBNF text for a request: ``grammar`` as given (text, or llama-cpp-python's
    ``LlamaGrammar``), or that of ``response_format``
    (``{"type": "text"}`` = none, ``{"type": "json_object"}`` = any JSON object, with an
    optional ``"schema"``; ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` as
    OpenAI's API sends it, or ``{"type": "json_schema", "schema": {...}}``). None = no grammar.
    Raises GrammarError for both at once or a malformed response_format."""
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
        return json_schema_grammar(schema) if schema is not None else _llama_grammar().JSON_GBNF
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else response_format.get("schema")
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return json_schema_grammar(schema if isinstance(schema, Mapping) else {})
    raise GrammarError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
