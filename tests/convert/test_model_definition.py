"""The model is defined once: clover_convert.mapping holds the tensor table and the config
validator, and the converter, the numpy reference, the checkpoint generator and train/ read
them from there. Changing the table changes all of them together; a second table or a second
validator that drifted from it would make these tests fail."""
from __future__ import annotations

import json

import pytest

import clover_convert.mapping as M
from clover_testkit import checkpoints, presets, reference


def test_every_reader_of_the_table_sees_a_new_rule(monkeypatch, tmp_path) -> None:
    """A made-up per-layer tensor added to the one table reaches the generator, the reference
    and the converter (which then misses it in a checkpoint written before)."""
    from clover_convert import ConversionError, plan_conversion

    ck = tmp_path / "ck"
    cfg = checkpoints.write_checkpoint(ck, preset="tiny", dtype="f32")
    probe = M.Rule(M.L_ + "probe.weight", "blk.{i}.probe.weight", "layer", lambda c: (3, c.H))
    monkeypatch.setattr(M, "TENSOR_TABLE", [*M.TENSOR_TABLE, probe])
    names = [n for n, _ in presets.tensor_plan(cfg)]
    ref = reference.hf_tensor_shapes(reference.CloverConfig.from_dict(cfg), tied=False)
    for i in range(cfg["num_hidden_layers"]):
        want = f"model.layers.{i}.probe.weight"
        assert want in names and ref[want] == (3, cfg["hidden_size"])
    with pytest.raises(ConversionError, match=r"missing tensor\(s\): model\.layers\.0\.probe\.weight"):
        plan_conversion(ck, tmp_path / "x.gguf", "f16", dry_run=True)


def test_generator_reference_and_converter_agree(tmp_path) -> None:
    """The generator writes exactly the tensors the reference expects and the converter consumes."""
    from clover_convert import plan_conversion
    from clover_convert.safetensors_io import CheckpointReader

    ck = tmp_path / "ck"
    cfg = checkpoints.write_checkpoint(ck, preset="tiny", dtype="f32")
    written = set(CheckpointReader(ck).names())
    ref = reference.hf_tensor_shapes(reference.CloverConfig.from_dict(cfg), tied=cfg.get("tie_word_embeddings", False))
    assert written == set(ref) == {n for n, _ in presets.tensor_plan(cfg)}
    plan_conversion(ck, tmp_path / "x.gguf", "f16", dry_run=True)  # no tensor missing, none unexpected


def test_unknown_tensor_fails_conversion_with_its_name(tmp_path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from clover_convert import ConversionError, plan_conversion

    ck = tmp_path / "ck"
    checkpoints.write_checkpoint(ck, preset="tiny", dtype="f32")
    save_file({"model.layers.0.mystery.weight": np.zeros((2, 2), np.float32)}, str(ck / "extra.safetensors"))
    index = {"metadata": {}, "weight_map": {}}
    from clover_convert.safetensors_io import CheckpointReader

    for name in CheckpointReader(ck).names():
        index["weight_map"][name] = "model.safetensors"
    index["weight_map"]["model.layers.0.mystery.weight"] = "extra.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"unexpected tensor\(s\): model\.layers\.0\.mystery\.weight"):
        plan_conversion(ck, tmp_path / "x.gguf", "f16", dry_run=True)


def test_one_config_validator() -> None:
    """The reference and the generator refuse a bad config with the converter's message."""
    bad = {**presets.preset_config("tiny"), "linear_num_value_heads": 3}
    with pytest.raises(M.ConversionError) as e:
        M.parse_config(bad)
    msg = str(e.value)
    with pytest.raises(ValueError) as e:
        reference.CloverConfig.from_dict(bad)
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:
        presets.preset_config("tiny", {"linear_num_value_heads": 3})
    assert str(e.value) == msg


def test_one_config_class() -> None:
    """The reference, train/ and the converter share one CloverConfig, and a config goes
    through the validator and back unchanged (train/ stores it in its checkpoints)."""
    import dataclasses

    assert reference.CloverConfig is M.CloverConfig
    cfg = M.CloverConfig.from_dict({**presets.preset_config("tiny"), "eos_token_id": [3, 5]})
    assert cfg.eos_token_id == 3 and cfg.eos_token_ids == (3, 5)
    again = M.CloverConfig.from_dict(cfg.to_dict())
    assert dataclasses.replace(again, raw={}) == dataclasses.replace(cfg, raw={})
