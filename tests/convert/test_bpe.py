import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from clover_testkit.bpe import (
    CHATML_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    QWEN2_PATTERN,
    SPECIAL_TOKENS,
    encode,
    train,
    write_tokenizer_files,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away!\n",
    "It's what they'd say: we're here, you've seen it, I'll go, I'm done. 12345 + 678 = 13023\n",
    "Les élèves étudient à l'école. Добрый день! 日本語のテキスト。 naïve café 🎉🎉\n",
    "for i in range(10):\n\tprint(i, i ** 2)  # squares\nif x == 0:\n    pass\n",
] * 3
VOCAB = 256 + 150 + len(SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tok():
    return train(CORPUS, VOCAB)


def test_training_is_deterministic(tok, tmp_path):
    assert train(list(CORPUS), VOCAB).to_str() == tok.to_str()
    # and from one process to the next (hash seeds differ), through the written files
    write_tokenizer_files(tmp_path / "a", tok)
    code = ("import sys; from clover_testkit.bpe import train, write_tokenizer_files; "
            f"write_tokenizer_files(sys.argv[1], train({CORPUS!r}, {VOCAB}))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, timeout=60)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_vocab_layout_and_special_ids(tok):
    assert tok.get_vocab_size() == VOCAB
    n_bpe = tok.get_vocab_size(with_added_tokens=False)
    vocab = tok.get_vocab(with_added_tokens=False)
    assert sorted(vocab.values()) == list(range(n_bpe))
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)  # every byte, seen or not
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(n_bpe, n_bpe + len(SPECIAL_TOKENS)))
    added = tok.get_added_tokens_decoder()
    assert [added[tok.token_to_id(s)].special for s in SPECIAL_TOKENS] == [True] * len(SPECIAL_TOKENS)


def test_training_stops_when_pairs_run_out():
    small = train(["abab abab"], 1000, min_frequency=2)
    assert small.get_vocab_size() < 1000
    assert encode(small, "abab") == [small.token_to_id("abab")]


def test_round_trip(tok):
    for s in CORPUS + [
        "    deeply\n        indented = {'k': [1, 2, 3]}\n",
        "tabs\t\tand\r\nCRLF, trailing spaces   \n\n",
        "",
    ]:
        assert tok.decode(encode(tok, s), skip_special_tokens=False) == s
    # trained text compresses
    assert len(encode(tok, CORPUS[0])) < len(CORPUS[0].encode()) / 2


def test_unseen_bytes_are_byte_tokens(tok):
    s = "\x00\x01\x7f✓∑\u0301"  # no byte of these is in the corpus: one byte token each
    ids = encode(tok, s)
    assert len(ids) == len(s.encode()) and all(len(tok.id_to_token(i)) == 1 for i in ids)
    assert tok.decode(ids) == s
    assert tok.decode(encode(tok, "😀 wörds")) == "😀 wörds"
    assert tok.decode(encode(tok, "ünïcödé")) == "ünïcödé"


def test_qwen2_pre_tokenizer_is_applied(tok):
    # "12345" occurs 3 times in the corpus, but digits are pre-tokenized one by one
    assert len(encode(tok, "12345")) == 5
    # contractions split off, words keep their leading space
    assert [tok.id_to_token(i) for i in encode(tok, "I'm")][-1].startswith("'")


def test_specials_are_single_ids(tok):
    s = f"{IM_START}user\nhi{IM_END}\n{MASK_TOKEN}{MASK_TOKEN}{EOS_TOKEN}"
    ids = encode(tok, s)
    assert ids[0] == tok.token_to_id(IM_START) and ids[-1] == tok.token_to_id(EOS_TOKEN)
    assert ids.count(tok.token_to_id(MASK_TOKEN)) == 2 and tok.token_to_id(IM_END) in ids
    assert tok.decode(ids, skip_special_tokens=False) == s
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_special_text_is_not_trained_on():
    t = train([f"alpha{EOS_TOKEN}beta{MASK_TOKEN}"] * 20, 256 + 40 + len(SPECIAL_TOKENS))
    merged = [tok for tok in t.get_vocab(with_added_tokens=False) if len(tok) > 1]
    assert "beta" in merged and not any("|" in tok or "endo" in tok or "mask" in tok for tok in merged)
    assert encode(t, f"alpha{EOS_TOKEN}") == [t.token_to_id("alpha"), t.token_to_id(EOS_TOKEN)]


def test_tokenizer_files(tmp_path, tok):
    write_tokenizer_files(tmp_path, tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tj = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    # what clover_convert.tokenizer reads, and llama.cpp's gpt2 + qwen2 pre-tokenizer mirrors
    assert tj["model"]["type"] == "BPE" and tj["normalizer"] is None
    assert len(tj["model"]["vocab"]) == tok.get_vocab_size(with_added_tokens=False)
    assert len(tj["model"]["merges"]) >= len(tj["model"]["vocab"]) - 256
    pre = tj["pre_tokenizer"]["pretokenizers"]
    assert [p["type"] for p in pre] == ["Split", "ByteLevel"]
    assert pre[0]["pattern"]["Regex"] == QWEN2_PATTERN and pre[1]["use_regex"] is False
    assert tj["decoder"]["type"] == "ByteLevel"
    assert {t["content"]: t["id"] for t in tj["added_tokens"] if t["special"]} == {
        s: tok.token_to_id(s) for s in SPECIAL_TOKENS}

    tc = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tc["bos_token"] is None and tc["add_bos_token"] is False
    assert tc["eos_token"] == EOS_TOKEN and tc["pad_token"] == EOS_TOKEN and tc["mask_token"] == MASK_TOKEN
    assert tc["added_tokens_decoder"][str(tok.token_to_id(IM_START))]["content"] == IM_START
    assert tc["chat_template"] == CHATML_TEMPLATE

    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    s = CORPUS[3] + IM_END + "unseen ✓"
    assert encode(loaded, s) == encode(tok, s)


def test_chat_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    out = jinja2.Template(CHATML_TEMPLATE).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
