"""The 35B-A3B slice (clover_testkit.true_dims): its config and every tensor shape
against the real dimensions (written nowhere: the checkpoint is 8.8 GB), its 248,320-entry
tokenizer, the streamed writer at the real widths on a few tensors, and the one-layer parity
machinery (clover_testkit.layer_parity) on the tiny preset, where the whole reference runs too."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from clover_testkit import bpe, checkpoints, presets, true_dims
from clover_testkit.presets import PRESETS, count_params, preset_config, tensor_plan

# clover-architecture.md's table: the numbers the slice must keep, written out here once more
ARCH = {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "linear_conv_lookahead": 3,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "block_size": 32, "partial_rotary_factor": 0.25, "rope_theta": 1e7, "norm_topk_prob": True}


@pytest.fixture(scope="module")
def cfg() -> dict:
    return true_dims.slice_config()


def test_slice_config_has_the_real_dimensions(cfg):
    for k, v in ARCH.items():
        assert PRESETS["35b-a3b"][k] == v, k
        assert cfg[k] == (4 if k == "num_hidden_layers" else v), k
    assert {k: v for k, v in true_dims.REAL_DIMS.items()} == {k: ARCH[k] for k in true_dims.REAL_DIMS}
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # one period of the real pattern: the 40-layer model is ten slices
    assert presets.layer_types_of(40, 4) == cfg["layer_types"] * 10
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False


def test_slice_tensor_shapes(cfg):
    plan = dict(tensor_plan(cfg))
    H, V, E, I = 2048, 248320, 256, 512
    C = 2 * 16 * 128 + 32 * 128  # q, k (16 key heads) and v (32 value heads) channels of 128
    want = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(3):
        g = f"model.layers.{i}.linear_attn."
        want |= {g + "in_proj_qkv.weight": (C, H), g + "in_proj_z.weight": (32 * 128, H),
                 g + "in_proj_b.weight": (32, H), g + "in_proj_a.weight": (32, H), g + "in_proj_m.weight": (32, H),
                 g + "conv1d.weight": (C, 1, 4), g + "conv1d_lookahead.weight": (C, 1, 3), g + "dt_bias": (32,),
                 g + "A_log": (32,), g + "block_calib": (2, 32), g + "norm.weight": (128,),
                 g + "out_proj.weight": (H, 32 * 128)}
    a = "model.layers.3.self_attn."
    want |= {a + "q_proj.weight": (16 * 256 * 2, H), a + "k_proj.weight": (2 * 256, H),
             a + "v_proj.weight": (2 * 256, H), a + "o_proj.weight": (H, 16 * 256), a + "q_norm.weight": (256,),
             a + "k_norm.weight": (256,)}
    for i in range(4):
        m = f"model.layers.{i}.mlp."
        want |= {f"model.layers.{i}.input_layernorm.weight": (H,),
                 f"model.layers.{i}.post_attention_layernorm.weight": (H,), m + "gate.weight": (E, H),
                 m + "shared_expert.gate_proj.weight": (I, H), m + "shared_expert.up_proj.weight": (I, H),
                 m + "shared_expert.down_proj.weight": (H, I), m + "shared_expert_gate.weight": (1, H)}
        for j in range(E):
            want |= {m + f"experts.{j}.gate_proj.weight": (I, H), m + f"experts.{j}.up_proj.weight": (I, H),
                     m + f"experts.{j}.down_proj.weight": (H, I)}
    assert plan == want
    # the projection's arithmetic: 40 layers = the vocabulary matrices + 10 x the slice's layers
    vocab = 2 * V * H + H
    full = count_params(preset_config("35b-a3b"))
    assert full == vocab + 10 * (count_params(cfg) - vocab)
    assert 34e9 < full < 36e9  # "35B"
    assert true_dims.tensor_bytes(cfg) == 2 * count_params(cfg)


def test_slice_tokenizer_has_every_entry(cfg, tmp_path):
    tok = true_dims.slice_tokenizer()
    assert tok.get_vocab_size() == 248320 == cfg["vocab_size"]
    n_bpe = 248320 - len(bpe.SPECIAL_TOKENS)
    assert [tok.token_to_id(s) for s in bpe.SPECIAL_TOKENS] == list(range(n_bpe, 248320))
    assert cfg["mask_token_id"] == tok.token_to_id(bpe.MASK_TOKEN) and cfg["eos_token_id"] == tok.token_to_id(bpe.EOS_TOKEN)
    vocab = tok.get_vocab(with_added_tokens=False)
    assert sorted(vocab.values()) == list(range(n_bpe))
    # the fixture tokenizer's entries keep their ids; the synthetic merges are used
    small = presets.train_fixture_tokenizer("small").get_vocab(with_added_tokens=False)
    assert all(vocab[t] == i for t, i in small.items())
    text = "def fibonacci(n): the quick brown fox <|mask|> zzqx café"
    ids = bpe.encode(tok, text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("Ġzz") in ids and tok.token_to_id(bpe.MASK_TOKEN) in ids
    # the files, as the converter reads them
    from clover_convert.mapping import parse_config
    from clover_convert.tokenizer import load_tokenizer

    bpe.write_tokenizer_files(tmp_path, tok)
    info = load_tokenizer(tmp_path, parse_config(cfg))
    assert len(info.tokens) == 248320 and info.n_real == 248320 and info.mask_id == cfg["mask_token_id"]
    assert len(info.merges) == n_bpe - 256


def test_vocabulary_matrices_are_the_generators_values_in_chunks(cfg, monkeypatch):
    monkeypatch.setattr(true_dims, "_CHUNK_ELEMS", 2048 * 7)  # 7 rows a chunk
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        chunks = list(true_dims._chunks(name, (50, 2048), cfg, 3))
        assert len(chunks) == 8
        assert np.array_equal(np.concatenate(chunks), presets.init_weight(name, (50, 2048), cfg, 3, False))


def test_streamed_writer_at_the_real_widths(cfg, tmp_path):
    """A few real-width tensors of the slice (52 MB of bf16), read back with the library."""
    from safetensors import safe_open

    from clover_convert.safetensors_io import bf16_to_f32, f32_to_bf16

    plan = [(n, s) for n, s in tensor_plan(cfg) if n.startswith("model.layers.0.linear_attn.")
            or n.startswith("model.layers.3.self_attn.") or ".experts.7." in n and "layers.1." in n]
    assert len(plan) == 12 + 6 + 3
    seen = []
    true_dims._write_file(tmp_path / "part.safetensors", plan, cfg, 0, "bf16", seen.append)
    assert seen and seen[-1].endswith(f"{len(plan)}/{len(plan)} tensors")
    with safe_open(tmp_path / "part.safetensors", framework="np") as f:
        assert list(f.keys()) == sorted(n for n, _ in plan) and f.metadata() == {"format": "pt"}
        for name, shape in plan:
            got = f.get_tensor(name)
            assert got.shape == shape and str(got.dtype) == "bfloat16"
            want = bf16_to_f32(f32_to_bf16(presets.init_weight(name, shape, cfg, 0, False)))
            assert np.array_equal(got.astype(np.float32), want), name
    assert not list(tmp_path.glob(".*tmp"))


def test_cli_dry_run_counts_the_slice(tmp_path):
    from click.testing import CliRunner

    r = CliRunner().invoke(checkpoints.cli, ["35b-a3b-slice", str(tmp_path / "x"), "--dry-run"])
    assert r.exit_code == 0, r.output
    n = count_params(preset_config("35b-a3b-slice"))
    assert f"{n:,} parameters" in r.output and 4.3e9 < n < 4.5e9
    assert not (tmp_path / "x").exists()
    for flag in ("--tied", "--fused-experts"):  # the slice keeps the real layout: one line, nothing written
        r = CliRunner().invoke(checkpoints.cli, ["35b-a3b-slice", str(tmp_path / "x"), "--dtype", "bf16", flag])
        assert r.exit_code == 1 and r.output.count("\n") == 1 and "not supported" in r.output, r.output
        assert not (tmp_path / "x").exists()


@pytest.mark.needs_libclover
def test_layer_parity_on_tiny(tiny_artifacts):
    """The one-layer comparison the slice's benchmark runs: exact on the f32 file (layer 0 = GDN,
    layer 3 = attention, whose keys go through llama.cpp's f16 cache), and on q8_0 the file's own
    weights explain more of the difference than the checkpoint's."""
    from clover_testkit.layer_parity import layer_parity

    prompt, canvas = [1, 5, 9, 33, 70, 2, 100, 7], [8, 9, 10, 11, 12, 13, 14, 15]
    for layer, tol in ((0, 1e-5), (3, 1e-3)):
        r = layer_parity(tiny_artifacts["f32"], tiny_artifacts["ckpt"], layer, prompt, canvas, n_threads=1)
        assert r["type"] == ("linear_attention" if layer == 0 else "full_attention")
        for kind in ("commit", "block_pass"):
            assert r["gguf"][kind]["max_rel"] < tol, (layer, kind, r)
    r = layer_parity(tiny_artifacts["q8_0"], tiny_artifacts["ckpt"], 0, prompt, canvas, n_threads=1,
                     sources=("gguf", "checkpoint"))
    for kind in ("commit", "block_pass"):
        assert 1e-5 < r["gguf"][kind]["rms_rel"] < 0.03, r
        assert r["gguf"][kind]["rms_rel"] < r["checkpoint"][kind]["rms_rel"], r
    json.dumps(r)  # what the benchmark stores
    assert math.isfinite(r["gguf"]["scale"])
