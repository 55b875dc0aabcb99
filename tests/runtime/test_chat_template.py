"""Chat templates are rendered as Hugging Face's apply_chat_template renders them."""
import pytest

from clover_cpp import CloverError
from clover_cpp.model import CHATML_TEMPLATE, render_chat

QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

NO_SYSTEM_ROLE = (  # Gemma-style: no system role, alternating turns, bos_token in the text
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<bos>": 1, "<eos>": 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


def _hf(tok, template: str, msgs, add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, QWEN_STYLE, NO_SYSTEM_ROLE], ids=["chatml", "qwen", "gemma"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_render_equals_hugging_face(hf_tokenizer, template: str, conv: int, gen: bool) -> None:
    msgs = CONVERSATIONS[conv]
    try:
        want = _hf(hf_tokenizer, template, msgs, gen)
    except Exception as e:  # noqa: BLE001 - the template itself refuses (a system role in gemma)
        with pytest.raises(CloverError, match="System role not supported"):
            render_chat(msgs, template, gen, bos_token="<bos>", eos_token="<eos>")
        assert "System role" in str(e)
        return
    assert render_chat(msgs, template, gen, bos_token="<bos>", eos_token="<eos>") == want


def test_template_defaults_apply() -> None:
    text = render_chat([{"role": "user", "content": "hi"}], QWEN_STYLE)
    assert text.startswith("<|im_start|>system\nYou are Qwen")  # the template's own default system message
    assert text.endswith("<|im_start|>assistant\n")


def test_no_template_is_chatml_and_bad_messages_fail() -> None:
    assert render_chat([{"role": "user", "content": "a"}], None, add_generation_prompt=False) == \
        "<|im_start|>user\na<|im_end|>\n"
    with pytest.raises(CloverError, match="role"):
        render_chat([{"content": "no role"}])
    with pytest.raises(CloverError, match="chat template"):
        render_chat([{"role": "user", "content": "a"}], "{% for %}")


def test_template_is_sandboxed() -> None:
    with pytest.raises(CloverError, match="chat template"):
        render_chat([{"role": "user", "content": "a"}], "{{ ''.__class__.__mro__[1].__subclasses__() }}")
