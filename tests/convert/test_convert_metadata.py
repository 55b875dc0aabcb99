"""The HF -> GGUF converter (clover_convert): every metadata key, the identity keys from the model
card and the tensors, the tokenizer as tokenizer.json has it.
"""

from __future__ import annotations

import json

import gguf
import numpy as np

from clover_testkit.converted_gguf import gguf_field, layer_types, read_gguf


def test_metadata_every_key(fx):
    src = fx.ckpt("bf16")
    path, _ = fx.gguf("bf16", "q8_0")
    cfg = json.loads((src / "config.json").read_text())
    fields, _, _ = read_gguf(path)
    lt = layer_types(cfg)
    U32, F32, BOOL, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL,
                           gguf.GGUFValueType.ARRAY)
    want = {
        "general.architecture": ("clover", gguf.GGUFValueType.STRING),
        "clover.context_length": (cfg.get("max_position_embeddings", 262144), U32),
        "clover.embedding_length": (cfg["hidden_size"], U32),
        "clover.block_count": (cfg["num_hidden_layers"], U32),
        "clover.feed_forward_length": (cfg["moe_intermediate_size"], U32),
        "clover.attention.head_count": (cfg["num_attention_heads"], U32),
        "clover.attention.head_count_kv": (cfg["num_key_value_heads"], U32),
        "clover.attention.key_length": (cfg["head_dim"], U32),
        "clover.attention.value_length": (cfg["head_dim"], U32),
        "clover.attention.layer_norm_rms_epsilon": (np.float32(cfg["rms_norm_eps"]), F32),
        "clover.attention.recurrent_layers": ([t == "linear_attention" for t in lt], ARR),
        "clover.full_attention_interval": (cfg["full_attention_interval"], U32),
        "clover.rope.dimension_count": (int(cfg["head_dim"] * cfg["partial_rotary_factor"]), U32),
        "clover.rope.freq_base": (np.float32(cfg["rope_theta"]), F32),
        "clover.expert_count": (cfg["num_experts"], U32),
        "clover.expert_used_count": (cfg["num_experts_per_tok"], U32),
        "clover.expert_feed_forward_length": (cfg["moe_intermediate_size"], U32),
        "clover.expert_shared_feed_forward_length": (cfg["shared_expert_intermediate_size"], U32),
        "clover.expert_weights_norm": (cfg["norm_topk_prob"], BOOL),
        "clover.ssm.conv_kernel": (cfg["linear_conv_kernel_dim"], U32),
        "clover.ssm.conv_lookahead": (cfg["linear_conv_lookahead"], U32),
        "clover.ssm.state_size": (cfg["linear_key_head_dim"], U32),
        "clover.ssm.group_count": (cfg["linear_num_key_heads"], U32),
        "clover.ssm.time_step_rank": (cfg["linear_num_value_heads"], U32),
        "clover.ssm.inner_size": (cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"], U32),
        "clover.diffusion.block_size": (cfg["block_size"], U32),
        "clover.semantics": ("causal-shift", gguf.GGUFValueType.STRING),
        "tokenizer.ggml.mask_token_id": (cfg["mask_token_id"], U32),
        "tokenizer.ggml.eos_token_id": (cfg["eos_token_id"], U32),
        "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
        "tokenizer.ggml.pre": ("qwen2", gguf.GGUFValueType.STRING),
        "general.file_type": (int(gguf.LlamaFileType.MOSTLY_Q8_0), U32),
    }
    for key, (value, vtype) in want.items():
        got = gguf_field(fields, key)
        assert fields[key].types[0] == vtype, key
        if vtype == ARR:
            assert fields[key].types[-1] == BOOL
        assert got == value, f"{key}: {got!r} != {value!r}"
    assert all(isinstance(v, bool) for v in gguf_field(fields, "clover.attention.recurrent_layers"))
    # the ids in the config's token fields
    if cfg.get("pad_token_id") is not None:
        assert gguf_field(fields, "tokenizer.ggml.padding_token_id") == cfg["pad_token_id"]
    if cfg.get("bos_token_id") is None:
        assert "tokenizer.ggml.bos_token_id" not in fields


def test_identity_keys_from_model_card_and_tensors(fx, tmp_path):
    """general.* identity as the hub and llama.cpp's converter fill them: the model card's front
    matter (license, basename, finetune, version, tags) and an MoE size label counted from the
    tensors (experts x parameters per expert path)."""
    import shutil

    from clover_convert import convert

    src = tmp_path / "Clover-Tiny-v2"
    shutil.copytree(fx.ckpt("bf16"), src)
    cfg = json.loads((src / "config.json").read_text())
    plain = tmp_path / "plain.gguf"
    convert(src, plain, outtype="f16", progress=False)
    fields, _, _ = read_gguf(plain)
    assert gguf_field(fields, "general.name") == "Clover-Tiny-v2"
    label = gguf_field(fields, "general.size_label")
    assert label.startswith(f"{cfg['num_experts']}x"), label
    assert "general.license" not in fields
    (src / "README.md").write_text("---\nlicense: apache-2.0\nbasename: clover\nfinetune: instruct\n"
                                   "version: v2\ntags:\n- block-diffusion\n---\n\n# a card\n")
    carded = tmp_path / "carded.gguf"
    convert(src, carded, outtype="f16", progress=False)
    fields, _, _ = read_gguf(carded)
    for key, want in {"general.license": "apache-2.0", "general.basename": "clover", "general.finetune": "instruct",
                      "general.version": "v2", "general.size_label": label}.items():
        assert gguf_field(fields, key) == want, key
    assert "block-diffusion" in gguf_field(fields, "general.tags")


def test_tokenizer_reproduces_tokenizer_json(fx):
    src = fx.ckpt("bf16")
    path, _ = fx.gguf("bf16", "bf16")
    cfg = json.loads((src / "config.json").read_text())
    tj = json.loads((src / "tokenizer.json").read_text())
    tc = json.loads((src / "tokenizer_config.json").read_text())
    fields, _, _ = read_gguf(path)
    tokens = gguf_field(fields, "tokenizer.ggml.tokens")
    types = gguf_field(fields, "tokenizer.ggml.token_type")
    V = cfg["vocab_size"]
    assert len(tokens) == len(types) == V
    id_to_tok = {i: t for t, i in tj["model"]["vocab"].items()}
    specials = {}
    for at in tj["added_tokens"]:
        id_to_tok[at["id"]] = at["content"]
        specials[at["id"]] = at["special"]
    for i in range(V):
        if i in id_to_tok:
            assert tokens[i] == id_to_tok[i], i
            if i in specials:
                want = gguf.TokenType.CONTROL if specials[i] else gguf.TokenType.USER_DEFINED
            else:
                want = gguf.TokenType.NORMAL
            assert types[i] == want, i
        else:
            assert tokens[i] == f"[PAD{i}]"
            assert types[i] == gguf.TokenType.UNUSED
    assert len(id_to_tok) < V, "the tiny fixture should exercise padding"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert merges and gguf_field(fields, "tokenizer.ggml.merges") == merges
    tok_id = {t: i for i, t in id_to_tok.items()}
    assert gguf_field(fields, "tokenizer.ggml.eos_token_id") == tok_id[tc["eos_token"]] == cfg["eos_token_id"]
    assert gguf_field(fields, "tokenizer.ggml.padding_token_id") == tok_id[tc["pad_token"]]
    assert gguf_field(fields, "tokenizer.ggml.mask_token_id") == tok_id["<|mask|>"] == cfg["mask_token_id"]
    assert gguf_field(fields, "tokenizer.chat_template") == tc["chat_template"]
    assert gguf_field(fields, "tokenizer.ggml.add_bos_token") is False
