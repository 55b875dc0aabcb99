"""Chat: templates (:func:`render_chat`: the GGUF's ``tokenizer.chat_template`` rendered with
jinja2 in a sandbox, as Hugging Face's ``apply_chat_template`` does; ChatML when the model has
none), the continuation of a conversation (:class:`ChatExchange`: the last prompt and reply as
their tokens, so the next turn reads the reply's own tokens again and the memory is reused),
and :class:`Clover`'s chat calls (:class:`ChatCalls`: chat, generate_chat, chat_tokens,
format_chat, end_of_turn_tokens, last_exchange) that the CLI and the server use."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._args import str_arg
from .errors import CloverError, CloverTypeError

__all__ = ["CHATML_TEMPLATE", "END_OF_TURN_TEXTS", "ChatCalls", "ChatExchange", "render_chat"]

#: used when the GGUF has no template (the format the default model is trained on)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

#: the end-of-turn markers a chat stops at (besides EOS), when one is a single token of the model's
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> Any:
    """A sandboxed jinja2 template with Hugging Face's chat-template environment
    (trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, tojson)."""
    import datetime  # noqa: PLC0415
    import json  # noqa: PLC0415

    import jinja2  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(messages: Sequence[Mapping[str, Any]], template: str | None = None,
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                **template_kwargs: Any) -> str:
    """Render chat messages ({"role", "content", ...} dicts) with a jinja2 chat template (the
    model's; ChatML when None), with Hugging Face's semantics: ``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra keyword arguments
    are the template's variables, so its own defaults (a default system message, say) apply."""
    import jinja2  # noqa: PLC0415

    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (Sequence, Iterator)):
        raise CloverTypeError(f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}")
    if template is not None and not isinstance(template, str):
        raise CloverTypeError(f"template must be a string or None, got {type(template).__name__}")
    msgs = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise CloverError("each chat message must be a mapping with 'role' and 'content'")
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, type(None))):
            raise CloverError("a chat message's role and content must be strings")
        msgs.append(dict(m))
    try:
        return _compile_template(template or CHATML_TEMPLATE).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **template_kwargs)
    except jinja2.TemplateError as e:
        raise CloverError(f"chat template: {' '.join(str(e).split())}") from e


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


class ChatCalls:
    """The chat calls of :class:`Clover` (a mixin over its tokenizer, metadata and generate)."""

    _eot_cache: list[int] | None
    _last: ChatExchange | None
    tokenize: Any
    detokenize: Any
    token_to_piece: Any
    metadata: Any
    mask_token: Any
    chat_template: Any
    generate: Any
    _generate: Any
    _tokens: Any
    _m: Any

    @property
    def end_of_turn_tokens(self) -> list[int]:
        """The chat end-of-turn token ids (besides EOS) that :meth:`chat` and
        :meth:`generate_chat` stop on: those of ``<|im_end|>``, ``<|eot_id|>`` and ``<|end|>``
        that are single tokens of this model's vocabulary."""
        if self._eot_cache is None:
            ids: list[int] = []
            for txt in END_OF_TURN_TEXTS:
                try:
                    t = self.tokenize(txt, add_special=False, parse_special=True)
                except CloverError:
                    continue
                if len(t) == 1 and t[0] != self.mask_token:
                    ids.append(t[0])
            self._eot_cache = ids
        return list(self._eot_cache)

    # -- chat
    def chat(self, messages: Sequence[Mapping[str, str]], **gen_kwargs: Any) -> Any:
        """Format messages with the model's chat template (see the module doc) and generate the
        assistant's reply; stops at EOS or the end-of-turn token. Keyword arguments are those
        of :meth:`generate` (stream=True works). The conversation's earlier turns are not
        re-read when the context still holds them (prefix reuse)."""
        return self.generate_chat(self.format_chat(messages), **gen_kwargs)

    def generate_chat(self, text: str, **gen_kwargs: Any) -> Any:
        """Generate the reply to an already rendered chat prompt (:meth:`format_chat`'s text):
        its tokens are :meth:`chat_tokens`'s (the last exchange's own tokens when ``text``
        continues it, so the memory is reused), and the output stops at EOS or an
        :attr:`end_of_turn_tokens` token (besides any ``stop_tokens`` given). Keyword arguments
        are those of :meth:`generate` (stream=True works); the reply is remembered as this
        object's :attr:`last_exchange`."""
        text = str_arg("text", text)
        stops = self._tokens(gen_kwargs.pop("stop_tokens", None) or ()) + self.end_of_turn_tokens
        bound = inspect.signature(self.generate).bind(self.chat_tokens(text), stop_tokens=stops, **gen_kwargs)
        bound.apply_defaults()
        return self._generate(bound.arguments, text)

    @property
    def last_exchange(self) -> ChatExchange | None:
        """This object's last generation (its chat prompt, if any, the prompt's tokens, the reply):
        the conversation a chat prompt that starts with ``last_exchange.text`` continues."""
        self._m()
        return self._last

    def chat_tokens(self, prompt: str) -> list[int]:
        """The tokens of a rendered chat prompt. When it continues the last chat exchange (that
        prompt, then the reply as generated), they are that exchange's tokens followed by the
        new text's: the model reads its own reply's tokens again (as llama.cpp's conversation
        mode does) rather than a re-tokenization that may differ, so the memory is reused."""
        prompt = str_arg("prompt", prompt)
        last = getattr(self, "_last", None)
        toks = None if last is None else \
            last.tokens_for(prompt, lambda s: self.tokenize(s, add_special=False), self.detokenize)
        return toks if toks is not None else self.tokenize(prompt, add_special=True, parse_special=True)

    def _special_text(self, key: str) -> str:
        tid = self.metadata(key)
        try:
            return self.token_to_piece(int(tid), special=True).decode("utf-8", "replace") if tid else ""
        except (CloverError, ValueError):
            return ""

    def format_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text of messages under the model's chat template (see :func:`render_chat`)."""
        return render_chat(messages, self.chat_template, add_generation_prompt,
                           bos_token=self._special_text("tokenizer.ggml.bos_token_id"),
                           eos_token=self._special_text("tokenizer.ggml.eos_token_id"), **template_kwargs)
