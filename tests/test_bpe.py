import json
from collections import Counter

import pytest

from clover_testkit.bpe import (
    CHATML_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    QWEN2_PATTERN,
    SPECIAL_TOKENS,
    Tokenizer,
    bytes_to_unicode,
    pretokenize,
    train_bpe,
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


def _naive_train(texts, n_merges):
    """Reference: recount every pair after every merge."""
    enc = bytes_to_unicode()
    counts = Counter()
    for t in texts:
        counts.update(pretokenize(t))
    words = {tuple(enc[b] for b in w.encode()): c for w, c in counts.items()}
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        new_words = {}
        for w, c in words.items():
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(w[j] + w[j + 1])
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return merges


@pytest.fixture(scope="module")
def trained():
    vocab, merges = train_bpe(CORPUS, 256 + 150 + len(SPECIAL_TOKENS))
    return vocab, merges


def test_pretokenize_matches_qwen2_rules():
    assert pretokenize("Hello world!") == ["Hello", " world", "!"]
    assert pretokenize("I'm here's") == ["I", "'m", " here", "'s"]
    assert pretokenize("IT'S") == ["IT", "'S"]
    assert pretokenize("x=123") == ["x", "=", "1", "2", "3"]  # digits one by one
    assert pretokenize("a\n\n  b") == ["a", "\n\n", " ", " b"]
    assert pretokenize("  def f():\n") == [" ", " def", " f", "():\n"]
    assert pretokenize("日本語 ½") == ["日本語", " ", "½"]
    assert "".join(pretokenize("".join(CORPUS))) == "".join(CORPUS)


def test_training_matches_naive_reference(trained):
    vocab, merges = trained
    assert merges == _naive_train(CORPUS, len(merges))
    assert len(vocab) == 256 + len(merges) + len(SPECIAL_TOKENS)


def test_training_is_deterministic(trained):
    vocab, merges = trained
    v2, m2 = train_bpe(list(CORPUS), 256 + 150 + len(SPECIAL_TOKENS))
    assert v2 == vocab and m2 == merges
    assert sorted(vocab.values()) == list(range(len(vocab)))


def test_special_ids_follow_bpe_vocab(trained):
    vocab, merges = trained
    n = 256 + len(merges)
    assert [vocab[s] for s in SPECIAL_TOKENS] == list(range(n, n + len(SPECIAL_TOKENS)))


def test_round_trip(trained):
    tok = Tokenizer(*trained)
    for s in CORPUS + [
        "unseen wörds ✓ ∑ 😀 \u0301 \x00\x01 tabs\t\tand\r\nCRLF",
        "    deeply\n        indented = {'k': [1, 2, 3]}\n",
        "",
    ]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
    # trained text compresses
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0].encode()) / 2


def test_merges_applied_in_rank_order():
    # hand-built tokenizer: 'b c' ranks before 'a b', so "abc" -> a + bc, not ab + c
    enc = bytes_to_unicode()
    vocab = {enc[b]: b for b in range(256)}
    vocab["bc"] = 256
    vocab["ab"] = 257
    vocab["abc"] = 258
    vocab[EOS_TOKEN] = 259
    tok = Tokenizer(vocab, [("b", "c"), ("a", "b"), ("a", "bc")], [EOS_TOKEN])
    assert tok.encode("abc") == [258]
    tok2 = Tokenizer(vocab, [("b", "c"), ("a", "b")], [EOS_TOKEN])
    assert tok2.encode("abc") == [ord("a"), 256]
    tok3 = Tokenizer(vocab, [("a", "b"), ("b", "c")], [EOS_TOKEN])
    assert tok3.encode("abc") == [257, ord("c")]


def test_specials_are_single_ids(trained):
    vocab, merges = trained
    tok = Tokenizer(vocab, merges)
    s = f"{IM_START}user\nhi{IM_END}\n{MASK_TOKEN}{MASK_TOKEN}{EOS_TOKEN}"
    ids = tok.encode(s)
    assert ids[0] == vocab[IM_START]
    assert ids.count(vocab[MASK_TOKEN]) == 2 and ids[-1] == vocab[EOS_TOKEN]
    assert vocab[IM_END] in ids
    assert tok.decode(ids) == s
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    # not allowed: spelled out as bytes
    assert vocab[IM_START] not in tok.encode(IM_START, allow_special=False)


def test_tokenizer_files(tmp_path, trained):
    vocab, merges = trained
    write_tokenizer_files(tmp_path, vocab, merges, SPECIAL_TOKENS, CHATML_TEMPLATE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tj = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["model"]["type"] == "BPE"
    assert tj["model"]["byte_fallback"] is False
    assert len(tj["model"]["merges"]) == len(merges)
    assert tj["model"]["merges"][0] == " ".join(merges[0])
    assert len(tj["model"]["vocab"]) == 256 + len(merges)
    pre = tj["pre_tokenizer"]
    assert pre["type"] == "Sequence"
    assert pre["pretokenizers"][0]["type"] == "Split"
    assert pre["pretokenizers"][0]["pattern"]["Regex"] == QWEN2_PATTERN
    assert pre["pretokenizers"][1]["type"] == "ByteLevel"
    assert tj["decoder"]["type"] == "ByteLevel"
    added = {t["content"]: t for t in tj["added_tokens"]}
    assert set(added) == set(SPECIAL_TOKENS)
    assert all(t["special"] and t["id"] == vocab[t["content"]] for t in added.values())

    tc = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tc["bos_token"] is None
    assert tc["eos_token"] == EOS_TOKEN and tc["pad_token"] == EOS_TOKEN and tc["mask_token"] == MASK_TOKEN
    assert tc["added_tokens_decoder"][str(vocab[IM_START])]["content"] == IM_START
    assert "<|im_start|>" in tc["chat_template"] and "add_generation_prompt" in tc["chat_template"]

    # our loader reproduces the tokenizer
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    ref = Tokenizer(vocab, merges)
    s = CORPUS[3] + IM_END
    assert tok.encode(s) == ref.encode(s)


def test_against_hf_tokenizers(tmp_path, trained):
    tokenizers = pytest.importorskip("tokenizers")
    vocab, merges = trained
    write_tokenizer_files(tmp_path, vocab, merges)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(vocab, merges)
    for s in CORPUS[:5] + [f"{IM_START}user\nhi{IM_END}\n{MASK_TOKEN}"]:
        assert hf.encode(s).ids == ours.encode(s)


def test_chat_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    out = jinja2.Template(CHATML_TEMPLATE).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
