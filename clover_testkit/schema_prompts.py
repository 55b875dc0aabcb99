"""The JSON schema (a person record) and the prompts that constrained decoding is tested
(tests/runtime/test_grammar.py) and measured (benchmarks/grammar.py) with."""

from __future__ import annotations

__all__ = ["SCHEMA", "RF_SCHEMA", "PROMPTS"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
#: SCHEMA as an OpenAI response_format
RF_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
PROMPTS = ["def main():", "The user record is", "import os\n", '{"name":', "Once upon a time",
           "class Config:", "# settings\n", "return {", "Hello", "x = 1\n"]
