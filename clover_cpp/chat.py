"""Chat: templates (:func:`render_chat`: the GGUF's ``tokenizer.chat_template`` rendered with
jinja2 in a sandbox, as Hugging Face's ``apply_chat_template`` does; ChatML when the model has
none) and the continuation of a conversation (:class:`ChatExchange`: the last prompt and reply
as their tokens, so the next turn reads the reply's own tokens again and the memory is reused)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CloverError, CloverTypeError

__all__ = ["CHATML_TEMPLATE", "END_OF_TURN_TEXTS", "ChatExchange", "render_chat"]

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
