"""``clover serve``: request bodies, their checks, the limits, and the one error shape.

Every field a request may carry is declared here: a field is either honoured or refused with
a 400 that names it (``extra="forbid"``: an unknown field is an error, never silently
ignored). Types are checked here, strictly (``"5"`` is not an int, ``NaN`` is not a number);
the ranges and defaults of generate's parameters are the runtime's (libclover's
clover_generate_params_check: its message, in a 400 naming the field, Knobs.field_of).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (``clover serve`` flags; docs/server.md)."""

    max_body_bytes: int = 8 * 2**20    # --max-body: a larger body gets 413 before it is read
    max_messages: int = 4096           # --max-messages: chat messages per request
    body_timeout: float = 30.0         # --body-timeout: seconds to receive the whole body (408)
    max_block_size: int = 512          # --max-block-size: block_size above it gets 400
    stuck_after: float = 120.0         # --stuck-timeout: a generation with no progress this long is cancelled
    max_json_depth: int = 64           # nesting of the body's JSON
    # values in the body's JSON (array items and members), counted before it is parsed: a body
    # under --max-body of 4M token ids grew to 1.2 GB once parsed and validated
    max_json_values: int = 1 << 18
    # connections (uvicorn's h11 protocol; run.py): a request head must arrive within
    # header_timeout seconds of the connection (or of the last reply on it), and at most
    # max_connections are open, max_connections_per_client from one address; past a cap a new
    # connection gets 503 and is closed (a header trickled at 1 byte/s stayed open
    # forever, and ~1,100 half-open connections used up the fds and /health with them)
    header_timeout: float = 10.0
    max_connections: int = 512
    max_connections_per_client: int = 64
    max_stop: int = 16                 # stop strings per request
    max_generations: int = 128         # generations per request: prompts x best_of (chat: x n); OpenAI's n cap


# ----------------------------------------------------------------------------- errors

class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, kind: str | None = None, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()


def unsupported(field: str, why: str) -> APIError:
    return APIError(400, f"'{field}' is not supported by this server: {why}", code="unsupported_field", param=field)


# ----------------------------------------------------------------------------- the body

def _depth_ok(x: Any, limit: int) -> bool:
    stack = [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_STRING = re.compile(rb'"[^"]*"')
_TOO_DEEP = object()
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_values(raw: bytes) -> int:
    """An upper bound on the number of values in the JSON text ``raw`` (the separators and
    brackets outside its strings, plus one), counted in linear time without parsing it."""
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # no escaped quote is left: strings are "[^"]*"
    bare = _STRING.sub(b"", bare)
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


def _surrogate_path(x: Any, path: str = "") -> str | None:
    """Where in the parsed body a string holds a lone surrogate (not Unicode text: it cannot be
    tokenized, matched, nor written back as UTF-8), as a field path; None when nowhere."""
    stack = [(x, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at or "body"
        elif isinstance(v, dict):
            stack.extend((c, f"{at}.{k}" if at else str(k)) for k, c in v.items())
            stack.extend((k, at or "body") for k in v if isinstance(k, str))
        elif isinstance(v, list):
            stack.extend((c, f"{at}[{i}]") for i, c in enumerate(v))
    return None


def parse_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    """The request body as a JSON object, or an APIError saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    if len(raw) > limits.max_json_values and (n := json_values(raw)) > limits.max_json_values:
        raise APIError(400, f"the request body holds about {n} JSON values (token ids, messages, ...); at most "
                            f"{limits.max_json_values} are read")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {limits.max_json_depth} levels") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if not _depth_ok(body, limits.max_json_depth):
        raise APIError(400, f"the request body nests deeper than {limits.max_json_depth} levels")
    if _SURROGATE_ESCAPE.search(raw) and (where := _surrogate_path(body)) is not None:
        raise APIError(400, f"{where}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not Unicode text", param=where)
    return body


_TYPE_NAMES = {"int", "str", "float", "bool", "list", "dict", "none"}


def validate(cls: type[BaseModel], body: dict[str, Any]) -> Any:
    """``cls`` from the body; the first problem as a 400 naming its field."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        # the field's path, without the union members pydantic names in it ("block_size.int")
        where = ".".join(str(x) for x in first.get("loc", ()) if isinstance(x, int) or not (
            x[:1].isupper() or "[" in x or x in _TYPE_NAMES))
        if first.get("type") == "extra_forbidden":
            raise APIError(400, f"unknown field '{where}' (fields this server honours: docs/server.md)",
                           code="unknown_field", param=where) from None
        if first.get("type") == "missing":
            raise APIError(400, f"'{where}' is required", param=where) from None
        raise APIError(400, f"{where}: {first.get('msg', 'invalid value').removeprefix('Value error, ')}", param=where or None) from None


_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    include_canvas: bool = False  # Clover's: the block's positions after every step (docs/server.md)


class JsonSchema(BaseModel):
    model_config = _STRICT
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-server's json_object + schema

    def for_runtime(self) -> dict[str, Any] | None:
        """The response_format Clover.generate takes (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise APIError(400, "response_format: json_schema needs json_schema.schema", param="response_format")
            return {"type": "json_schema", "json_schema": {"schema": self.json_schema.schema_}}
        if self.schema_ is not None:
            return {"type": "json_schema", "json_schema": {"schema": self.schema_}}
        return {"type": "json_object"}


class SamplerChainFields(BaseModel):
    """OpenAI's penalties and biases and llama-server's samplers: llama.cpp's sampler chain
    (spec/decoding.md, "Sampler chain"; None: Clover.generate's default, off; the ranges are
    libclover's). Shared by /v1/completions, /v1/chat/completions and /completion."""

    model_config = _STRICT

    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # {token id: bias} (OpenAI's), or llama-server's [[token id, bias], ...]; a bias of false bans the token
    logit_bias: Union[dict[str, Union[float, bool]], list[list[Union[int, float, bool]]], None] = None
    min_p: float | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = Field(default=None, max_length=64)
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    min_keep: int | None = None
    samplers: Union[list[str], str, None] = None  # the chain's order: llama-server's names or letters

    CHAIN_FIELDS: ClassVar[tuple[str, ...]] = ("presence_penalty", "frequency_penalty", "min_p", "typical_p", "top_n_sigma", "repeat_penalty",
                    "repeat_last_n", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base",
                    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat_tau",
                    "mirostat_eta", "dynatemp_range", "dynatemp_exponent", "min_keep", "samplers")

    def chain(self) -> dict[str, Any]:
        """The sampler chain's fields given, as Clover.generate's keywords."""
        kw = {f: v for f in self.CHAIN_FIELDS if (v := getattr(self, f)) is not None}
        if self.mirostat is not None:
            kw["mirostat_mode"] = self.mirostat
        if self.logit_bias:
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            bias: dict[int, float] = {}
            for pair in pairs:
                if not isinstance(self.logit_bias, dict) and (len(pair) != 2 or type(pair[0]) is not int):
                    raise APIError(400, f"logit_bias: {json.dumps(pair)[:40]} is not [token id, bias]",
                                   param="logit_bias")
                tok, b = pair
                if isinstance(tok, str) and not tok.strip().isdigit():
                    raise APIError(400, f"logit_bias: {tok!r} is not a token id", param="logit_bias")
                if b is True:
                    raise APIError(400, "logit_bias: a bias is a number, or false to ban the token", param="logit_bias")
                bias[int(tok)] = float("-inf") if b is False else float(b)
            kw["logit_bias"] = bias
        return kw


class Knobs(SamplerChainFields):
    """Fields both endpoints share: OpenAI's names, then Clover's own knobs."""

    model_config = _STRICT

    model: str | None = None  # any name is accepted: one model is served
    # (None: Clover.generate's default, libclover's; the ranges are libclover's too)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name
    temperature: float = 0.8  # OpenAI's default (Clover.generate's is greedy)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # None or -1: a fresh random seed
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1)  # choices per prompt, each its own seed (seed + i when given)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)  # an end-user id (OpenAI's): not used for output
    # structured output: a JSON object / schema (OpenAI's) or a GBNF grammar (llama-server's)
    response_format: ResponseFormat | None = None
    grammar: str | None = Field(default=None, max_length=1 << 20)
    json_schema: Union[dict[str, Any], bool, None] = None  # llama-server's: the reply follows this JSON schema
    # Clover's own knobs
    block_size: Union[int, Literal["auto"], None] = None
    threshold: float | None = None
    max_steps: int | None = None
    ignore_eos: bool = False
    # true: lossless self-speculative decoding (the output of block_size 1); "auto": with block_size
    # auto the mode too is chosen per block (B = 1, block diffusion or draft-self; clover.mode says which)
    draft_self: Union[bool, Literal["auto"]] = False
    # the block expert coreset of this request's block passes (None: the served context's; 0 = off;
    # "auto": 3 k when below the expert count)
    coreset: Union[int, Literal["model", "auto"], None] = None

    @field_validator("draft_self", mode="before")
    @classmethod
    def _draft_self(cls, v: Any) -> Any:
        if v is True or v is False or v == "auto":
            return v
        raise ValueError(f'must be true, false or "auto", got {json.dumps(v)[:40]}')

    def stops(self, limits: Limits) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(s) > limits.max_stop:
            raise APIError(400, f"stop: at most {limits.max_stop} strings, got {len(s)}", param="stop")
        if any(not x for x in s):
            raise APIError(400, "stop: an empty string never matches", param="stop")
        return s

    def n_logprobs(self) -> int | None:
        """generate()'s logprobs: None = off, N = each token's and the N most probable."""
        return None

    def structured_output(self) -> dict[str, Any] | None:
        """The response_format Clover.generate takes: OpenAI's response_format, or llama-server's
        top-level json_schema (None: plain text)."""
        if self.json_schema is None:
            return self.response_format.for_runtime() if self.response_format is not None else None
        if self.response_format is not None:
            raise APIError(400, "json_schema and response_format: give one", param="json_schema")
        return {"type": "json_schema", "json_schema": {"schema": self.json_schema}}

    def field_of(self, param: str) -> str:
        """The request's field for a keyword of Clover.generate (CloverError.param)."""
        if param == "max_tokens":
            return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"stop_at_eos": "ignore_eos", "mirostat_mode": "mirostat"}.get(param, param)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: Union[str, dict[str, Any]]


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (Hugging Face's shape): content a string,
        tool calls' arguments as objects when they are JSON."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                    except RecursionError:  # a 100,000-deep string was a 500
                        args = _TOO_DEEP
                    if args is _TOO_DEEP or not _depth_ok(args, Limits.max_json_depth):
                        raise APIError(400, f"a tool call's arguments nest deeper than {Limits.max_json_depth} "
                                            "levels", param="messages")
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                          "arguments": args}})
            m["tool_calls"] = calls
        return m


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedChoice(BaseModel):
    model_config = _STRICT

    class _Name(BaseModel):
        model_config = _STRICT
        name: str

    type: Literal["function"]
    function: _Name


class ChatRequest(Knobs):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedChoice, None] = None
    parallel_tool_calls: bool = True
    # llama-server's: the reply's thinking in reasoning_content (None: the server's --reasoning-format)
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # (its range: libclover's CLOVER_MAX_TOP_LOGPROBS)

    def n_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def field_of(self, param: str) -> str:
        return "top_logprobs" if param == "logprobs" else super().field_of(param)


class CompletionRequest(Knobs):
    # a text, token ids, or a list of either (one choice per prompt x n)
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False  # the prompt before the reply (with logprobs: the prompt's tokens scored too)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)  # candidates per prompt (None: n); the n best are kept
    logprobs: int | None = None  # the legacy API's: the N most probable (range: libclover's)

    def n_logprobs(self) -> int | None:
        return self.logprobs

    def candidates(self) -> int:
        """Generations per prompt: best_of (at least n, as OpenAI; it cannot stream when above n)."""
        best_of = self.n if self.best_of is None else self.best_of
        if best_of < self.n:
            raise APIError(400, f"best_of ({best_of}) must be at least n ({self.n})", param="best_of")
        if best_of > self.n and self.stream:
            raise APIError(400, "best_of above n cannot stream (the best are known at the end)", param="best_of")
        return best_of

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts: each a text or token ids ([] stays one empty prompt)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    tokens: list[int]


class ApplyTemplateRequest(BaseModel):
    model_config = _STRICT
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedChoice, None] = None
    parallel_tool_calls: bool = True
