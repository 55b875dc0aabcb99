import json
import math
import time

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from clover_convert.safetensors_io import CheckpointReader, f32_to_bf16
from clover_testkit import bpe
from clover_testkit.checkpoints import cli, write_checkpoint
from clover_testkit.presets import count_params, preset_config, tensor_plan


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_tiny_is_fast_and_complete(tmp_path):
    t = time.perf_counter()
    cfg = write_checkpoint(tmp_path, "tiny")
    elapsed = time.perf_counter() - t
    assert elapsed < 1.0, elapsed
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk == cfg
    assert cfg["model_type"] == "clover" and cfg["architectures"] == ["CloverForBlockDiffusion"]
    assert cfg["clover_semantics"] == "causal-shift"  # what the converter asks of every config.json
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["vocab_size"] % 64 == 0
    r = CheckpointReader(tmp_path)
    plan = tensor_plan(cfg)
    assert sorted(r.names()) == sorted(n for n, _ in plan)
    for n, s in plan:
        assert r.shape(n) == s and r.dtype(n) == "F32"
    C = 2 * 2 * 16 + 4 * 16
    assert r.shape("model.layers.0.linear_attn.conv1d.weight") == (C, 1, 4)
    assert r.shape("model.layers.0.linear_attn.conv1d_lookahead.weight") == (C, 1, 3)
    assert r.shape("model.layers.3.self_attn.q_proj.weight") == (4 * 16 * 2, 64)
    assert r.shape("model.layers.3.mlp.experts.7.down_proj.weight") == (64, 32)
    # activations-friendly scales
    w = r.read_f32("model.layers.0.linear_attn.in_proj_qkv.weight")
    assert abs(w.std() * math.sqrt(64) - 1) < 0.1
    assert np.all(np.isfinite(r.read_f32("model.layers.0.linear_attn.dt_bias")))

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() <= cfg["vocab_size"]
    assert tok.token_to_id(bpe.MASK_TOKEN) == cfg["mask_token_id"]
    assert tok.token_to_id(bpe.EOS_TOKEN) == cfg["eos_token_id"] == cfg["pad_token_id"]
    assert len(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]) == 300
    s = "def f(x):\n    return x + 1  # café"
    assert tok.decode(bpe.encode(tok, s)) == s


def test_deterministic(tmp_path):
    write_checkpoint(tmp_path / "a", "tiny", seed=7)
    write_checkpoint(tmp_path / "b", "tiny", seed=7)
    write_checkpoint(tmp_path / "c", "tiny", seed=8)
    a, b, c = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_shards_and_index(tmp_path):
    cfg = write_checkpoint(tmp_path / "one", "tiny", dtype="bf16")
    write_checkpoint(tmp_path / "three", "tiny", dtype="bf16", shards=3)
    folder = tmp_path / "three"
    assert not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all((folder / f).exists() for f in files)
    one, three = CheckpointReader(tmp_path / "one"), CheckpointReader(folder)
    assert sorted(three.names()) == sorted(index["weight_map"]) == sorted(one.names())
    assert index["metadata"]["total_size"] == sum(three.nbytes(n) for n in three.names())
    assert index["metadata"]["total_size"] == 2 * count_params(cfg)
    for n in one.names():
        assert three.file_of(n).name == index["weight_map"][n]
        assert three.dtype(n) == "BF16"
        np.testing.assert_array_equal(one.raw(n), three.raw(n))
    # shards hold roughly equal shares
    sizes = [(folder / f).stat().st_size for f in files]
    assert max(sizes) < 2.5 * min(sizes)
    # rewriting a sharded folder unsharded removes the stale shards
    write_checkpoint(folder, "tiny")
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]


def test_bf16_is_rounded_f32(tmp_path):
    write_checkpoint(tmp_path / "f32", "tiny")
    write_checkpoint(tmp_path / "bf16", "tiny", dtype="bf16")
    a, b = CheckpointReader(tmp_path / "f32"), CheckpointReader(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for n in ["model.embed_tokens.weight", "model.layers.1.linear_attn.A_log", "lm_head.weight"]:
        np.testing.assert_array_equal(b.raw(n), f32_to_bf16(a.raw(n)))


def test_fused_experts_hold_the_same_numbers(tmp_path):
    cfg = write_checkpoint(tmp_path / "per", "tiny")
    write_checkpoint(tmp_path / "fused", "tiny", fused_experts=True)
    per, fused = CheckpointReader(tmp_path / "per"), CheckpointReader(tmp_path / "fused")
    E, I, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in fused
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gu = fused.raw(p + "gate_up_proj")
        dn = fused.raw(p + "down_proj")
        assert gu.shape == (E, 2 * I, H) and dn.shape == (E, H, I)
        for j in range(E):
            np.testing.assert_array_equal(gu[j, :I], per.raw(f"{p}{j}.gate_proj.weight"))
            np.testing.assert_array_equal(gu[j, I:], per.raw(f"{p}{j}.up_proj.weight"))
            np.testing.assert_array_equal(dn[j], per.raw(f"{p}{j}.down_proj.weight"))
    shared = [n for n in per.names() if ".experts." not in n]
    assert sorted(shared) == sorted(n for n in fused.names() if ".experts." not in n)
    for n in shared:
        np.testing.assert_array_equal(per.raw(n), fused.raw(n))


def test_tied(tmp_path):
    cfg = write_checkpoint(tmp_path, "tiny", tied=True)
    assert cfg["tie_word_embeddings"] is True
    r = CheckpointReader(tmp_path)
    assert "lm_head.weight" not in r and "model.embed_tokens.weight" in r
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True


def test_config_overrides(tmp_path):
    cfg = write_checkpoint(tmp_path, "tiny", config_overrides={"num_hidden_layers": 2, "full_attention_interval": 2,
                                                              "linear_conv_lookahead": 0})
    assert cfg["layer_types"] == ["linear_attention", "full_attention"]
    r = CheckpointReader(tmp_path)
    assert "model.layers.0.linear_attn.conv1d_lookahead.weight" not in r
    assert "model.layers.2.input_layernorm.weight" not in r
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        preset_config("tiny", {"linear_num_value_heads": 3})


def test_small_preset_shape():
    cfg = preset_config("small")
    n = count_params(cfg)
    print(f"small: {n:,} parameters")
    assert 0.3e9 <= n <= 1e9
    assert cfg["vocab_size"] % 256 == 0
    for name, shape in tensor_plan(cfg):
        if len(shape) >= 2 and "conv1d" not in name and "block_calib" not in name:  # f32 always
            assert shape[-1] % 256 == 0, (name, shape)


def test_35b_a3b_plan():
    cfg = preset_config("35b-a3b")
    assert cfg["vocab_size"] == 248320 and cfg["num_hidden_layers"] == 40
    assert cfg["layer_types"].count("full_attention") == 10
    plan = tensor_plan(cfg)
    n = sum(math.prod(s) for _, s in plan)
    print(f"35b-a3b: {n:,} parameters in {len(plan)} tensors")
    assert 34e9 <= n <= 36.5e9
    fused = tensor_plan(cfg, fused_experts=True)
    assert sum(math.prod(s) for _, s in fused) == n
    with pytest.raises(ValueError, match="too big"):
        write_checkpoint("/nonexistent/never-written", "35b-a3b")


def test_cli(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["tiny", str(tmp_path / "out"), "--dtype", "bf16", "--shards", "2", "--tied", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "parameters" in res.output
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    res = runner.invoke(cli, ["35b-a3b", str(tmp_path / "big"), "--dry-run"])
    assert res.exit_code == 0 and "parameters" in res.output, res.output
    assert not (tmp_path / "big").exists()

