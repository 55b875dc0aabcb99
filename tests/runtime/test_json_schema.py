"""JSON schemas through llama.cpp's own converter (clover.h: clover_json_schema_to_grammar; the
converter of llama-server's json_schema / response_format, common/json-schema-to-grammar.cpp).

* a suite of schemas (integer ranges at every nesting, $ref/$defs, anyOf / oneOf / allOf, arrays
  with minItems / maxItems and item ranges, tuples, pattern, formats, lengths, enums, type lists):
  every sampled output of the tiny model (temperature > 0, several seeds, block size 1 and
  draft-self) ends and validates with the jsonschema package (formats checked);
* a keyword the converter would not enforce (a number's bounds, multipleOf, not, format email,
  an overlapping oneOf, an unanchored pattern, pattern beside minLength, ...) is refused with
  its name and place, at the top level and inside $ref, anyOf, items and properties; never dropped;
* the C call: buffer negotiation, NULL and invalid JSON, one-line errors;
* the server: response_format json_schema and llama-server's top-level json_schema field (400
  naming a refused keyword); the CLIs: `clover run` / `chat` --json-schema, --json-schema-file,
  --grammar, --grammar-file, and clover-cli -j / -jf (a refused schema: one line, exit 1, before the
  model loads).
"""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.needs_libclover

jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")

SUITE = {
    "integer range": {"type": "integer", "minimum": 18, "maximum": 30},
    "nested ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 30},
            "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
            "inner": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 3},
                                                       "neg": {"type": "integer", "maximum": -10, "minimum": -12}},
                      "required": ["level", "neg"], "additionalProperties": False},
        },
        "required": ["age", "delta", "inner"],
        "additionalProperties": False,
    },
    "refs and defs": {
        "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9},
                  "point": {"type": "object", "properties": {"x": {"$ref": "#/$defs/digit"},
                                                             "y": {"$ref": "#/$defs/digit"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3,
    },
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 100, "maximum": 199},
                        {"type": "string", "maxLength": 4}, {"type": "null"}]},
    "oneOf by discriminator": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer", "minimum": 1, "maximum": 5}},
         "required": ["kind", "n"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "b"}, "ok": {"type": "boolean"}},
         "required": ["kind", "ok"], "additionalProperties": False},
    ]},
    "oneOf by type": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    "allOf": {
        "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}}},
        "allOf": [{"$ref": "#/$defs/base"},
                  {"properties": {"rank": {"type": "integer", "minimum": 1, "maximum": 3}}},
                  {"required": ["id"]}],
    },
    "array item ranges": {"type": "array", "items": {"type": "integer", "minimum": -3, "maximum": 3},
                          "minItems": 2, "maxItems": 4},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 1, "maximum": 2}, {"enum": ["x", "y"]}]},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "formats": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                                 "day": {"type": "string", "format": "date"},
                                                 "at": {"type": "string", "format": "time"}},
                "required": ["id", "day", "at"], "additionalProperties": False},
    "string lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "enum and const": {"type": "object", "properties": {"e": {"enum": [1, "two", None, [3]]}, "c": {"const": "k"}},
                       "required": ["e", "c"], "additionalProperties": False},
    "type list": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    "number": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
               "additionalProperties": False},
}

REFUSED = [
    ({"type": "number", "minimum": 0}, "'minimum' at #"),
    ({"type": "number", "exclusiveMaximum": 1}, "'exclusiveMaximum' at #"),
    ({"type": "integer", "multipleOf": 5}, "'multipleOf' at #"),
    ({"not": {"type": "string"}}, "'not' at #"),
    ({"type": "string", "format": "email"}, "'format' at #"),
    ({"format": "email"}, "'format' at #"),
    ({"type": "object", "properties": {"age": {"type": "number", "maximum": 30}}}, "'maximum' at #/properties/age"),
    ({"$defs": {"a": {"type": "integer", "multipleOf": 2}}, "$ref": "#/$defs/a"}, "'multipleOf' at #/$defs/a"),
    ({"anyOf": [{"type": "string", "format": "email"}, {"type": "null"}]}, "'format' at #/anyOf/0"),
    ({"type": "array", "items": {"type": "number", "minimum": 1}}, "'minimum' at #/items"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' at #"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "'minProperties' at #"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "'patternProperties' at #"),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "'if' at #"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' at #/oneOf"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, "'oneOf' at #/oneOf"),
    ({"type": "string", "pattern": "[0-9]+"}, "'pattern' at #"),
    ({"type": "string", "pattern": "^(?=a)[a-z]$"}, "'pattern' at #"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "'maxLength' at #"),
    ({"type": "string", "format": "date", "minLength": 3}, "'minLength' at #"),
    ({"type": "integer", "minimum": 0, "exclusiveMinimum": 5}, "'exclusiveMinimum' at #"),
    ({"type": "integer", "minimum": 10, "maximum": 1}, "'minimum' at #"),
    ({"type": "integer", "maximum": 1e17}, "'maximum' at #"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "'required' at #"),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "maximum": 3}, "'maximum' at #"),
    ({"oneOf": [{"type": "integer"}], "anyOf": [{"type": "string"}]}, "'anyOf' at #"),
    ({"allOf": [{"anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                           {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}]}, "'allOf' at #/allOf/0"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "'allOf' at #/allOf/0"),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}},
                {"properties": {"a": {"type": "integer", "minimum": 3}}}]}, "'properties' at #/allOf/1"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, "'prefixItems' at #"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "'minItems' at #"),
    ({"type": "boolean", "nullable": True}, "'nullable' at #"),
    ({"const": 3, "type": "string"}, "'type' at #"),
    # llama.cpp's grammar reads an upper bound past 2000 as none, and a count past 2^32 wrapped
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 5000}, "'maxItems' at #"),
    ({"type": "string", "minLength": 4294967297}, "'minLength' at #"),
    ({"type": "string", "pattern": "^a{1,5000}$"}, "'pattern' at #"),
]


def _grammar(schema):
    from clover_cpp.grammar import json_schema_grammar

    return json_schema_grammar(schema)


@pytest.mark.parametrize("name", list(SUITE))
def test_suite_schemas_convert(name) -> None:
    jsonschema.Draft202012Validator.check_schema(SUITE[name])
    assert "root ::=" in _grammar(SUITE[name])


@pytest.mark.parametrize("schema,where", REFUSED, ids=[w + " " + json.dumps(s)[:40] for s, w in REFUSED])
def test_a_keyword_the_converter_cannot_enforce_is_refused_by_name(schema, where, capfd) -> None:
    from clover_cpp.grammar import GrammarError

    with pytest.raises(GrammarError) as e:
        _grammar(schema)
    msg = str(e.value)
    assert msg.startswith("JSON schema: ") and where in msg and "\n" not in msg, msg
    assert capfd.readouterr().err == ""  # (the converter prints a warning for a pattern it cannot write)


@pytest.mark.parametrize("schema", [
    {"type": ["integer", "null"], "maxLength": 3},            # a string keyword on non-strings holds
    {"type": "integer", "format": "int32", "minimum": 0},       # (OpenAPI's integer formats)
    {"enum": ["a", "b"], "minimum": 3},                         # the values are strings: minimum holds
    {"properties": {"a": {"type": "integer"}}, "maxItems": 2},  # an object is written: maxItems holds
    {"type": "string", "title": "t", "description": "d", "default": "x", "examples": ["y"], "$comment": "c"},
    {"type": "string", "pattern": "^\\{[0-9]{1,2000}\\}$"},     # (escaped braces repeat nothing)
])
def test_keywords_that_hold_on_every_written_value_are_accepted(schema) -> None:
    assert "root ::=" in _grammar(schema)


def test_the_c_call() -> None:
    from clover_cpp import _native as N

    L = N.load_library()
    err, n = N.err_buffer()
    n_out = ctypes.c_int32(-1)
    schema = json.dumps(SUITE["nested ranges"]).encode()
    assert L.clover_json_schema_to_grammar(schema, None, 0, ctypes.byref(n_out), err, n) == N.CLOVER_ERR_BUFFER_TOO_SMALL
    need = n_out.value
    buf = ctypes.create_string_buffer(need)  # one byte short of the terminator
    assert L.clover_json_schema_to_grammar(schema, buf, need, ctypes.byref(n_out), err, n) == N.CLOVER_ERR_BUFFER_TOO_SMALL
    buf = ctypes.create_string_buffer(need + 1)
    assert L.clover_json_schema_to_grammar(schema, buf, need + 1, ctypes.byref(n_out), err, n) == N.CLOVER_OK
    assert n_out.value == need and buf.value.decode() == _grammar(SUITE["nested ranges"]) and err.value == b""
    for bad, why in [(None, b"NULL"), (b"{", b"not valid JSON"), (b'{"type": 5}', b"type must be"),
                     (b'{"$ref": "#/nope"}', b"cannot resolve"), (b"[1]", b"schema must be an object")]:
        assert L.clover_json_schema_to_grammar(bad, None, 0, None, err, n) == N.CLOVER_ERR_INVALID_ARG, bad
        assert why in err.value and b"\n" not in err.value, err.value
    assert L.clover_json_schema_to_grammar(b"{}", None, -1, None, err, n) == N.CLOVER_ERR_INVALID_ARG


def test_deep_nesting_is_refused_not_a_crash() -> None:
    from clover_cpp.grammar import GrammarError

    depth = 5000
    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    with pytest.raises(GrammarError, match="nested deeper than 64"):
        _grammar(schema)


@pytest.fixture(scope="module")
def tiny(tiny_artifacts):
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=1024, n_threads=1) as m:
        yield m


def _validate(schema, text: str) -> None:
    jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize("name", list(SUITE))
def test_sampled_outputs_validate(tiny, name) -> None:
    """Temperature > 0, three seeds at block size 1 and one with draft-self: each output ends and
    validates (the tiny model's weights are random: the grammar alone makes it valid)."""
    schema = SUITE[name]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    runs = [dict(seed=s, temperature=1.0) for s in range(3)] + [dict(seed=7, temperature=0.8, draft_self=True,
                                                                     block_size=4)]
    broken = []
    for kw in runs:
        r = tiny.generate("value:", max_tokens=700, response_format=rf, **kw)
        assert r.stats.finish_reason == "eos", (kw, r.text)
        raw = b"".join(tiny.token_to_piece(t) for t in r.tokens)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            broken.append((kw, raw))
            continue
        _validate(schema, r.text)
    if broken:
        # llama.cpp's grammar sampler decodes a token's bytes leniently (llama-grammar.cpp,
        # decode_utf8): a lead byte F5-FF, an overlong or a surrogate passes as a code point, so the
        # random-weight model's free strings can hold bytes that are not UTF-8 (not the converter's)
        pytest.xfail(f"not UTF-8 under llama.cpp's grammar sampler: {broken[0][1][:60]!r}")


def test_time_and_date_time_formats_are_iso(tiny) -> None:
    """jsonschema checks "time" / "date-time" only with extra packages: Python's ISO parser here."""
    import datetime

    schema = {"type": "object", "properties": {"t": {"type": "string", "format": "time"},
                                               "dt": {"type": "string", "format": "date-time"}},
              "required": ["t", "dt"], "additionalProperties": False}
    for seed in range(3):
        r = tiny.generate("when:", max_tokens=400, temperature=1.0, seed=seed,
                          response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        v = json.loads(r.text)
        datetime.time.fromisoformat(v["t"].replace("Z", "+00:00"))
        datetime.datetime.fromisoformat(v["dt"].replace("Z", "+00:00"))


def test_python_refuses_before_generating(tiny) -> None:
    from clover_cpp import CloverValueError

    with pytest.raises(CloverValueError, match="'multipleOf' at #/properties/n"):
        tiny.generate("x", max_tokens=4, response_format={
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}})


def test_server_json_schema_and_response_format(tiny) -> None:
    openai = pytest.importorskip("openai", reason="the test extra installs openai")
    from clover_testkit.server_harness import InProcessServer

    s = InProcessServer(tiny)
    try:
        c = s.client()
        schema = SUITE["nested ranges"]
        for seed in range(2):
            # llama-server's top-level json_schema, on both endpoints
            r = c.completions.create(model="x", prompt="v:", max_tokens=600, temperature=1.0, seed=seed,
                                     extra_body={"json_schema": schema})
            assert r.choices[0].finish_reason == "stop"
            _validate(schema, r.choices[0].text)
            r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "v"}], max_tokens=600,
                                          temperature=1.0, seed=seed, extra_body={"json_schema": schema})
            _validate(schema, r.choices[0].message.content)
            r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "v"}], max_tokens=600,
                                          temperature=1.0, seed=seed, response_format={
                                              "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            _validate(schema, r.choices[0].message.content)
        bad = {"type": "object", "properties": {"age": {"type": "number", "minimum": 18}}}
        for kw, param, why in [
            (dict(extra_body={"json_schema": bad}), "json_schema", "'minimum' at #/properties/age"),
            (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": bad}}}),
             "response_format", "'minimum' at #/properties/age"),
            (dict(extra_body={"json_schema": {"type": "integer"}, "grammar": 'root ::= "1"'}), "grammar",
             "grammar and json_schema"),
            (dict(extra_body={"json_schema": {"type": "integer"}, "response_format": {"type": "json_object"}}),
             "json_schema", "json_schema and response_format"),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model="x", prompt="x", max_tokens=4, **kw)
            assert e.value.body["param"] == param and why in e.value.body["message"], e.value.body
    finally:
        s.stop()


def _clover(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_cpp.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=180)


def test_cli_json_schema_and_grammar_flags(tiny_artifacts, tmp_path) -> None:
    schema = SUITE["nested ranges"]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    g = tmp_path / "digits.gbnf"
    g.write_text("root ::= [0-9]{1,4}\n")
    base = ["-m", str(tiny_artifacts["f32"]), "-n", "600", "-t", "1", "--temp", "1.0", "--seed", "3"]
    for flags in (["-j", json.dumps(schema)], ["--json-schema-file", str(f)], ["-jf", str(f)]):
        r = _clover("run", *base, "-p", "v:", "--no-echo", "--no-stats", *flags)
        assert r.returncode == 0, r.stderr
        _validate(schema, r.stdout.strip())
    r = _clover("run", *base, "-p", "v:", "--no-echo", "--no-stats", "--grammar", "root ::= [0-9]{1,4}")
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stderr
    r = _clover("chat", *base, "--json-schema-file", str(f), "--separator", "@@", stdin="hi\nagain\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.split("\n@@\n")  # (a reply may hold newlines: JSON whitespace)
    assert len(replies) == 2, r.stdout
    for reply in replies:
        _validate(schema, reply)
    r = _clover("chat", *base, "--grammar-file", str(g), "--separator", "", stdin="hi\n")
    assert r.returncode == 0 and r.stdout.strip().isdigit(), (r.stdout, r.stderr)
    # refused: one line under the flag, exit 1, before the model loads (a missing model is not reached)
    missing = ["-m", str(tmp_path / "none.gguf"), "-p", "x"]
    for cmd, flags, why in [
        ("run", ["-j", '{"type": "number", "maximum": 3}'], "--json-schema: JSON schema: 'maximum' at #"),
        ("chat", ["-j", '{"type": "string", "format": "email"}'], "'format' at #"),
        ("run", ["-j", "{nope"], "--json-schema: not JSON"),
        ("run", ["-jf", str(tmp_path)], "not a readable file"),
        ("run", ["-j", "{}", "--grammar", "root ::= \"a\""], "give one of --grammar, --json-schema"),
        ("run", ["--json", "--grammar-file", str(g)], "give one of --grammar-file, --json"),
    ]:
        args = missing if cmd == "run" else missing[:2]
        r = _clover(cmd, *args, *flags, stdin="")
        assert r.returncode == 1 and r.stdout == "" and why in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_clover_cli_json_schema(tiny_artifacts, tmp_path) -> None:
    from pathlib import Path

    cli = Path(__file__).resolve().parents[2] / "build" / "bin" / "clover-cli"
    if not cli.is_file():
        pytest.skip("clover-cli is not built")
    schema = SUITE["refs and defs"]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    base = [str(cli), "-m", str(tiny_artifacts["f32"]), "-p", "v:", "-n", "600", "-t", "1", "--temp", "1", "--no-echo"]
    for seed, flags in enumerate((["-j", json.dumps(schema)], ["--json-schema-file", str(f)], ["-jf", str(f)])):
        r = subprocess.run(base + ["-s", str(seed), *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "grammar: decoded at block size 1" in r.stderr, r.stderr
        _validate(schema, r.stdout)
    for flags, why in [(["-j", '{"type": "integer", "multipleOf": 3}'], "--json-schema: JSON schema: 'multipleOf' at #"),
                       (["-j", "{nope"], "--json-schema: JSON schema: not valid JSON"),
                       (["-jf", str(tmp_path)], "not a readable file"),
                       (["-j", "{}", "--grammar-file", str(f)], "give one of --grammar")]:
        r = subprocess.run(base + flags, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stdout == "" and why in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
