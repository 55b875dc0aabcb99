"""The HF -> GGUF converter (clover_convert) on bad inputs: every user error is one line
`error: ...`, exit 1, nothing left behind; the Hugging Face cache, offline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from clover_convert import ConversionError, convert
from clover_convert.cli import main as cli_main
from clover_convert.safetensors_io import CheckpointReader, write_safetensors
from clover_testkit.converted_gguf import conversion_error, copy_checkpoint, leftovers, read_gguf
from clover_testkit.presets import preset_config


# ---------------------------------------------------------------------------
# bad inputs: one line `error: ...`, exit 1, nothing left behind


def _rewrite(folder: Path, edit) -> None:
    """Rewrite model.safetensors with edit(dict name -> (array, dtype))."""
    rd = CheckpointReader(folder)
    tensors = {n: (np.array(rd.raw(n)), rd.dtype(n)) for n in rd.names()}
    rd.close()
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors)


def _edit_config(folder: Path, **changes) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is _DEL:
            del cfg[k]
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


_DEL = object()


def _trunc(folder: Path) -> None:
    p = folder / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 1000])


def _corrupt_header(folder: Path) -> None:
    p = folder / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[8:20] = b"\x00garbage!{[("
    p.write_bytes(bytes(data))


BAD_CONFIGS = [
    (dict(hidden_size=_DEL), "error: config.json: hidden_size is missing"),
    (dict(hidden_size=0), "error: config.json: hidden_size must be a positive integer, got 0"),
    (dict(num_hidden_layers="4"), "error: config.json: num_hidden_layers must be a positive integer, got '4'"),
    (dict(linear_num_value_heads=5), "error: config.json: linear_num_value_heads must be a multiple of "
                                     "linear_num_key_heads (2), got 5"),
    (dict(num_experts_per_tok=9), "error: config.json: num_experts_per_tok must be <= num_experts (8), got 9"),
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]),
     "error: config.json: layer_types[1] is 'mamba', expected 'linear_attention' or 'full_attention'"),
    (dict(linear_value_head_dim=32), "error: config.json: linear_value_head_dim must equal linear_key_head_dim (16), "
                                     "got 32"),
    (dict(mask_token_id=_DEL), "error: config.json: mask_token_id is missing"),
    (dict(rms_norm_eps=-1.0), "error: config.json: rms_norm_eps must be a positive number, got -1.0"),
    (dict(model_type="llama"), "error: config.json: model_type must be 'clover' (or the release's 'clover_moe'), got 'llama'"),
]

_RETRAIN = "retrain or re-export them with train/ of this version (python -m train.export --run RUN --out FOLDER)"


@pytest.mark.parametrize("value,message", [
    (_DEL, 'error: config.json has no "clover_semantics": "causal-shift": these weights were trained for the '
           f"retired in-place semantics (spec v1); {_RETRAIN}"),
    ("in-place", 'error: config.json: clover_semantics must be "causal-shift" (spec v2), got \'in-place\': these '
                 f"weights were not trained for the semantics this version runs; {_RETRAIN}"),
], ids=["missing", "wrong"])
def test_config_without_current_semantics_refused(fx, tmp_path, value, message):
    """Weights trained for the retired in-place semantics (spec v1) have no "clover_semantics":
    the converter refuses them with one line, exit 1, no traceback, no output file."""
    src = copy_checkpoint(fx, tmp_path)
    _edit_config(src, clover_semantics=value)
    assert conversion_error(src, tmp_path) == message
    assert not (tmp_path / "out" / "m.gguf").exists()
    with pytest.raises(ConversionError, match="clover_semantics"):
        convert(src, tmp_path / "out" / "m2.gguf")


def test_config_semantics_round_trip():
    from clover_convert.mapping import CloverConfig
    cfg = CloverConfig.from_dict(preset_config("tiny"))
    assert cfg.clover_semantics == "causal-shift"
    assert cfg.to_dict()["clover_semantics"] == "causal-shift"
    assert CloverConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("changes,message", BAD_CONFIGS, ids=[m.split(": ")[2].split()[0] for _, m in BAD_CONFIGS])
def test_bad_config(fx, tmp_path, changes, message):
    src = copy_checkpoint(fx, tmp_path)
    _edit_config(src, **changes)
    assert conversion_error(src, tmp_path) == message


def test_missing_config(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)
    (src / "config.json").unlink()
    assert conversion_error(src, tmp_path) == f"error: {src}: config.json not found"


def test_shape_mismatch(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)

    def edit(t):
        t["model.layers.1.linear_attn.in_proj_z.weight"] = (np.zeros((60, 64), np.uint16), "BF16")

    _rewrite(src, edit)
    assert conversion_error(src, tmp_path) == (
        "error: tensor model.layers.1.linear_attn.in_proj_z.weight: expected shape [64, 64], got [60, 64]"
    )


def test_missing_tensor(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)
    _rewrite(src, lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight"))
    assert conversion_error(src, tmp_path) == "error: missing tensor(s): model.layers.2.mlp.experts.5.down_proj.weight"


def test_missing_tensor_sharded(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path, "f32_sharded")
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    shard = idx["weight_map"]["model.norm.weight"]
    rd = CheckpointReader(src)
    keep = {n: (np.array(rd.raw(n)), rd.dtype(n)) for n, f in idx["weight_map"].items()
            if f == shard and n != "model.norm.weight"}
    rd.close()
    write_safetensors(src / shard, keep)
    del idx["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert conversion_error(src, tmp_path) == "error: missing tensor(s): model.norm.weight"


def test_unexpected_tensor(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)

    def edit(t):
        t["model.layers.0.mlp.extra_bias"] = (np.zeros(4, np.float32), "F32")

    _rewrite(src, edit)
    assert conversion_error(src, tmp_path) == "error: unexpected tensor(s): model.layers.0.mlp.extra_bias"


def test_tied_checkpoint_with_untied_config(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path, "tied_f32")
    _edit_config(src, tie_word_embeddings=False)
    assert conversion_error(src, tmp_path) == "error: missing tensor(s): lm_head.weight"


@pytest.mark.parametrize("dtype,np_dtype", [("I64", np.int64), ("F64", np.float64)])
def test_unsupported_dtype(fx, tmp_path, dtype, np_dtype):
    src = copy_checkpoint(fx, tmp_path)

    def edit(t):
        t["model.norm.weight"] = (np.ones(64, np_dtype), dtype)

    _rewrite(src, edit)
    assert conversion_error(src, tmp_path) == (
        f"error: tensor model.norm.weight has unsupported dtype {dtype} (supported: F32, F16, BF16)"
    )


def test_truncated_safetensors(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)
    _trunc(src)
    msg = conversion_error(src, tmp_path)
    assert "model.safetensors" in msg and "truncated" in msg


def test_corrupt_header(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)
    _corrupt_header(src)
    msg = conversion_error(src, tmp_path)
    assert "model.safetensors" in msg and "header" in msg


def test_missing_tokenizer(fx, tmp_path):
    src = copy_checkpoint(fx, tmp_path)
    (src / "tokenizer.json").unlink()
    assert conversion_error(src, tmp_path) == f"error: {src}: tokenizer.json not found"


def test_bad_outtype_and_missing_source(tmp_path):
    r = CliRunner().invoke(cli_main, [str(tmp_path / "nope"), str(tmp_path / "m.gguf")])
    assert r.exit_code == 1
    assert r.stderr.strip() == f"error: {tmp_path / 'nope'}: no such folder (and not a Hugging Face repo id org/name)"
    r = CliRunner().invoke(cli_main, [str(tmp_path), str(tmp_path / "m.gguf"), "--outtype", "q9_9"])
    assert r.exit_code == 2  # click usage error


def test_hub_offline_not_cached(tmp_path):
    home = tmp_path / "hf_home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(home))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "clover_convert", "DiffuSpace/Clover-35B-A3B-Preview", str(out_dir / "m.gguf"),
         "--no-progress"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == [
        "error: DiffuSpace/Clover-35B-A3B-Preview: not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
        "download it first or unset HF_HUB_OFFLINE"
    ]
    assert leftovers(out_dir) == []


def test_hub_id_from_offline_cache(fx, tmp_path):
    """A repo id resolves through the local Hugging Face cache (HF_HUB_OFFLINE=1)."""
    home = tmp_path / "hf_home"
    repo = home / "hub" / "models--test-org--clover-tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(fx.ckpt("bf16"), snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(home))
    out = tmp_path / "m.gguf"
    p = subprocess.run([sys.executable, "-m", "clover_convert", "test-org/clover-tiny", str(out), "--no-progress",
                        "--outtype", "bf16"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    whole, _ = fx.gguf("bf16", "bf16")
    _, a, _ = read_gguf(out)
    _, b, _ = read_gguf(whole)
    assert list(a) == list(b)
    for n in a:
        np.testing.assert_array_equal(np.asarray(a[n].data), np.asarray(b[n].data))
