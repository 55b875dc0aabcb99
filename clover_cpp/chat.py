"""Chat: templates (:func:`render_chat`: the GGUF's ``tokenizer.chat_template`` rendered with
jinja2 in a sandbox, as Hugging Face's ``apply_chat_template`` does; ChatML when the model has
none), the continuation of a conversation (:class:`ChatExchange`: the last prompt and reply as
their tokens, so the next turn reads the reply's own tokens again and the memory is reused),
and :class:`Clover`'s chat calls (generate_chat's arguments, chat_tokens, format_chat,
end_of_turn_tokens, over :class:`ChatState`) that the CLI and the server use."""

from __future__ import annotations

import atexit
import inspect
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._args import str_arg, token_ids
from .errors import CLOVER_ERR_INTERNAL, CloverError, CloverTypeError, CloverValueError

__all__ = ["BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "END_OF_TURN_TEXTS", "OVERRIDE_HINT", "TEMPLATE_LIMITS",
           "ChatExchange", "ChatState", "ChatTemplateError", "TemplateLimits", "render_chat", "template_override"]

#: used when the GGUF has no template (the format the default model is trained on)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

#: the templates ``--chat-template`` / ``chat_template=`` take by name (as llama-server's; any other
#: value is the template's Jinja text)
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}

#: what a failing model template's error adds: the way out
OVERRIDE_HINT = "use --chat-template-file/--chat-template to override"


def template_override(chat_template: Any, chat_format: str | None = None) -> str | None:
    """The template rendered instead of the GGUF's: ``chat_template`` (a name of
    :data:`BUILTIN_TEMPLATES` or Jinja text; it wins over ``chat_format``), else ChatML for
    ``chat_format="chatml"``; None: the GGUF's own."""
    if chat_template is None:
        return CHATML_TEMPLATE if chat_format == "chatml" else None
    if not isinstance(chat_template, str):
        raise CloverTypeError(f"chat_template must be a string (Jinja text or a name: "
                              f"{', '.join(BUILTIN_TEMPLATES)}), got {type(chat_template).__name__}",
                              param="chat_template")
    if not chat_template.strip():
        raise CloverValueError("chat_template must not be empty", param="chat_template")
    return BUILTIN_TEMPLATES.get(chat_template, chat_template)


#: the end-of-turn markers a chat stops at (besides EOS), when one is a single token of the model's
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


@dataclass(frozen=True)
class TemplateLimits:
    """What one chat-template render may cost (:data:`TEMPLATE_LIMITS`). Templates render in a
    worker process (clover_cpp/chat_worker.py) that is killed past ``seconds``, whose address
    space is ``memory_bytes``, and whose output, or any string or list it builds with ``*`` or
    ``+``, is at most ``max_chars`` long: a template that runs away costs that process, never
    the caller's time, memory or GIL."""

    seconds: float = 10.0
    max_chars: int = 16 << 20
    memory_bytes: int = 512 << 20


#: the limits every render uses (tests set smaller ones)
TEMPLATE_LIMITS = TemplateLimits()


class ChatTemplateError(CloverError):
    """A chat template that failed or passed a limit (:class:`TemplateLimits`): the template's
    fault, not the messages' (a template refusing the messages is a plain CloverError)."""

    def __init__(self, message: str = "", status: int = CLOVER_ERR_INTERNAL, param: str | None = None) -> None:
        super().__init__(message, status, param)


def _worker_env() -> dict[str, str]:
    """The worker's environment: ours without a preloaded sanitizer runtime (the worker is pure
    Python; AddressSanitizer reserves terabytes of address space, which its memory limit refuses)."""
    env = dict(os.environ)
    keep = [p for p in env.get("LD_PRELOAD", "").split() if "libasan" not in p and "libubsan" not in p]
    if keep:
        env["LD_PRELOAD"] = " ".join(keep)
    else:
        env.pop("LD_PRELOAD", None)
    return env


class _Worker:
    """One chat_worker.py process and its pipes."""

    SCRIPT = str(Path(__file__).with_name("chat_worker.py"))

    def __init__(self, limits: TemplateLimits) -> None:
        self.died = False  # it ended on its own (out of memory in C, a crash), not timed out
        try:
            self.proc = subprocess.Popen([sys.executable, self.SCRIPT, str(limits.memory_bytes)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                                         env=_worker_env())
        except OSError as e:
            raise ChatTemplateError(f"cannot start the chat template worker ({sys.executable}): {e}") from None

    def ask(self, request: bytes, seconds: float) -> dict[str, Any] | None:
        """The reply to a request; None when there is none within ``seconds`` (or the worker died)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(struct.pack(">I", len(request)) + request)
        except OSError:
            self.died = True
            return None
        deadline = time.monotonic() + seconds
        size = self._read(4, deadline)
        body = self._read(struct.unpack(">I", size)[0], deadline) if size is not None else None
        return json.loads(body) if body is not None else None

    def _read(self, n: int, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        chunks = []
        while n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            b = os.read(fd, n)
            if not b:
                self.died = True
                return None
            chunks.append(b)
            n -= len(b)
        return b"".join(chunks)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class _Workers:
    """At most ``AT_ONCE`` renders at a time (the server renders on several threads: this bounds
    the memory runaway templates can take to AT_ONCE x memory_bytes), each in a worker of its
    own; idle workers are kept for the next render, one that timed out or died is stopped."""

    AT_ONCE = 4

    def __init__(self) -> None:
        self._idle: list[tuple[TemplateLimits, _Worker]] = []
        self._lock = threading.Lock()
        self._turns = threading.BoundedSemaphore(self.AT_ONCE)
        atexit.register(self.close)

    def render(self, template: str, variables: dict[str, Any], limits: TemplateLimits) -> dict[str, Any]:
        """The worker's reply (chat_worker.py), or a failure of its own when it timed out or died."""
        try:
            request = pickle.dumps((template, variables, {"max_chars": limits.max_chars}))
        except Exception as e:  # noqa: BLE001 - a template variable that cannot be sent
            raise CloverTypeError(f"chat template variables: {e}") from None
        with self._turns:
            w = self._take(limits)
            reply = w.ask(request, limits.seconds)
            if reply is None:
                w.stop()
                return {"kind": "failed", "error": f"it ran out of memory ({limits.memory_bytes >> 20} MiB) and stopped"
                        if w.died else f"it ran past {limits.seconds:g} s and was stopped"}
            self._give_back(limits, w)
            return reply

    def _take(self, limits: TemplateLimits) -> _Worker:
        with self._lock:
            for i, (lim, w) in enumerate(self._idle):
                if lim.memory_bytes == limits.memory_bytes and w.proc.poll() is None:
                    del self._idle[i]
                    return w
        return _Worker(limits)

    def _give_back(self, limits: TemplateLimits, w: _Worker) -> None:
        with self._lock:
            if len(self._idle) < self.AT_ONCE:
                self._idle.append((limits, w))
                return
        w.stop()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, w in idle:
            w.stop()


_workers = _Workers()


def _render(template: str, variables: dict[str, Any], source: str, way_out: str = "") -> str:
    """``template`` rendered by a worker; ``source`` names it in errors ("chat template", or the
    model's with its key); ``way_out`` ends the error of a template that failed."""
    reply = _workers.render(template, variables, TEMPLATE_LIMITS)
    if "text" in reply:
        return str(reply["text"])
    message = " ".join(str(reply["error"]).split())
    if reply["kind"] == "refused":
        raise CloverError(f"{source}: {message}")
    raise ChatTemplateError(f"{source} failed: {message}" + (f"; {way_out}" if way_out else ""))


def _checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (Sequence, Iterator)):
        raise CloverTypeError(f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}")
    msgs = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise CloverError("each chat message must be a mapping with 'role' and 'content'")
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, type(None))):
            raise CloverError("a chat message's role and content must be strings")
        msgs.append(dict(m))
    return msgs


def render_chat(messages: Sequence[Mapping[str, Any]], template: str | None = None,
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                **template_kwargs: Any) -> str:
    """Render chat messages ({"role", "content", ...} dicts) with a jinja2 chat template (the
    model's; ChatML when None), with Hugging Face's semantics: ``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra keyword arguments
    are the template's variables, so its own defaults (a default system message, say) apply.
    The template renders in a sandbox, in a worker process, within :data:`TEMPLATE_LIMITS`; a
    template that fails or passes them raises :class:`ChatTemplateError`."""
    if template is not None and not isinstance(template, str):
        raise CloverTypeError(f"template must be a string or None, got {type(template).__name__}")
    variables = dict(template_kwargs, messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token)
    return _render(template or CHATML_TEMPLATE, variables, "chat template")


@dataclass(frozen=True)
class ChatExchange:
    """The last generation of a Clover object (:attr:`Clover.last_exchange`): its rendered chat
    prompt (None when it was not a chat: nothing continues it), the prompt's tokens, and the
    reply as generated (tokens and text)."""

    prompt: str | None
    prompt_tokens: tuple[int, ...]
    reply_tokens: tuple[int, ...]
    reply: str

    @property
    def text(self) -> str:
        """The conversation so far as text (prompt + reply); "" when it was not a chat."""
        return "" if self.prompt is None else self.prompt + self.reply

    def continued_by(self, prompt: str) -> bool:
        """Whether a rendered chat prompt continues this exchange (starts with its prompt and reply)."""
        return self.prompt is not None and prompt.startswith(self.text)

    def tokens_for(self, prompt: str, tokenize: Callable[[str], list[int]],
                   detokenize: Callable[[list[int]], str]) -> list[int] | None:
        """The tokens of ``prompt`` when it continues this exchange: the exchange's own tokens
        (the reply's as generated, not a re-tokenization that may differ) followed by the new
        text's (``tokenize``: without BOS); None when it does not continue it (or when the reply's
        tokens do not spell its text: the reply was cut inside a token)."""
        if not self.continued_by(prompt) or detokenize(list(self.reply_tokens)) != self.reply:
            return None
        return list(self.prompt_tokens) + list(self.reply_tokens) + tokenize(prompt[len(self.text):])


@dataclass
class ChatState:
    """What a Clover object's chat calls remember (the object owns it; a new context starts a
    fresh one): its last generation (:attr:`Clover.last_exchange`) and the model's end-of-turn
    tokens (found once)."""

    last: ChatExchange | None = None
    end_of_turn: list[int] | None = None


# Clover's chat calls (``llm``: the Clover object, its public calls only); its methods of the same
# names document them

def end_of_turn_tokens(llm: Any, state: ChatState) -> list[int]:
    """:attr:`Clover.end_of_turn_tokens`."""
    if state.end_of_turn is None:
        ids: list[int] = []
        for txt in END_OF_TURN_TEXTS:
            try:
                t = llm.tokenize(txt, add_bos=False, special=True)
            except CloverError:
                continue
            if len(t) == 1 and t[0] != llm.mask_token:
                ids.append(t[0])
        state.end_of_turn = ids
    return list(state.end_of_turn)


def generate_chat_args(llm: Any, state: ChatState, text: str, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
    """generate()'s arguments for :meth:`Clover.generate_chat` of a checked ``text``: its
    :func:`chat_tokens`, the end-of-turn tokens added to ``stop_tokens``, the defaults filled in."""
    stops = token_ids(gen_kwargs.pop("stop_tokens", None) or (), llm.n_vocab()) + end_of_turn_tokens(llm, state)
    bound = inspect.signature(llm.generate).bind(chat_tokens(llm, state, text), stop_tokens=stops, **gen_kwargs)
    bound.apply_defaults()
    return bound.arguments


def chat_tokens(llm: Any, state: ChatState, prompt: str) -> list[int]:
    """:meth:`Clover.chat_tokens`."""
    prompt = str_arg("prompt", prompt)
    last = state.last
    toks = None if last is None else \
        last.tokens_for(prompt, lambda s: llm.tokenize(s, add_bos=False, special=True), llm.detokenize_text)
    return toks if toks is not None else llm.tokenize(prompt, add_bos=True, special=True)


def _special_text(llm: Any, key: str) -> str:
    tid = llm.metadata.get(key)
    try:
        return llm.token_to_piece(int(tid), special=True).decode("utf-8", "replace") if tid else ""
    except (CloverError, ValueError):
        return ""


def format_chat(llm: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                **template_kwargs: Any) -> str:
    """:meth:`Clover.format_chat`."""
    template = llm.chat_template
    variables = dict(template_kwargs, messages=_checked_messages(messages),
                     add_generation_prompt=bool(add_generation_prompt),
                     bos_token=_special_text(llm, "tokenizer.ggml.bos_token_id"),
                     eos_token=_special_text(llm, "tokenizer.ggml.eos_token_id"))
    if llm.chat_template_source == "model":
        source = f"the chat template of {Path(llm.model_path).name} (tokenizer.chat_template)"
        return _render(template, variables, source, OVERRIDE_HINT)
    source = "the chat template given (chat_template, --chat-template)" if template else "chat template"
    return _render(template or CHATML_TEMPLATE, variables, source)
