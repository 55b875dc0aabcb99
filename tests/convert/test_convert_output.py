"""The HF -> GGUF converter (clover_convert): split output, --split-max-size parsing, dry runs
(on the index or the headers alone), and the output written atomically: an interrupted run or a
full disk leaves nothing, --force, the default file name.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from clover_convert import ConversionError, convert
from clover_convert import converter as conv_mod
from clover_convert import filler as filler_mod
from clover_convert.cli import main as cli_main
from clover_testkit.converted_gguf import conversion_error, copy_checkpoint, leftovers, read_gguf
from clover_testkit.presets import preset_config, tensor_plan


# ---------------------------------------------------------------------------
# split, dry run


def test_split_output_readable_and_complete(fx, tmp_path):
    src = fx.ckpt("bf16")
    whole, plan = fx.gguf("bf16", "bf16")
    out = tmp_path / "split" / "m.gguf"
    out.parent.mkdir()
    limit = plan.total_bytes // 3 + 1
    r = CliRunner().invoke(cli_main, [str(src), str(out), "--outtype", "bf16", "--split-max-size", str(limit),
                                      "--no-progress"])
    assert r.exit_code == 0, r.output
    files = sorted(out.parent.iterdir())
    n = len(files)
    assert n >= 3
    assert [f.name for f in files] == [f"m-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]
    fields_whole, t_whole, _ = read_gguf(whole)
    _, t_split, readers = read_gguf(files)
    assert list(t_split) == list(t_whole)
    for name in t_whole:
        np.testing.assert_array_equal(np.asarray(t_split[name].data), np.asarray(t_whole[name].data))
    for k, rd in enumerate(readers):
        assert rd.fields["split.no"].contents() == k
        assert rd.fields["split.count"].contents() == n
        assert rd.fields["split.tensors.count"].contents() == len(t_whole)
        tensor_bytes = sum(t.n_bytes for t in rd.tensors)
        assert tensor_bytes <= limit or len(rd.tensors) == 1
    # all the model metadata lives in the first file
    first = {k for k in readers[0].fields if not k.startswith(("GGUF.", "split."))}
    assert first == {k for k in fields_whole}


def test_split_size_parsing():
    assert conv_mod.parse_size("50M") == 50_000_000
    assert conv_mod.parse_size("2G") == 2_000_000_000
    assert conv_mod.parse_size("123") == 123
    with pytest.raises(ConversionError):
        conv_mod.parse_size("lots")


def test_dry_run_matches_real_conversion(fx, tmp_path):
    src = fx.ckpt("f32_sharded")
    path, _ = fx.gguf("f32_sharded", "f16")
    out = tmp_path / "dry.gguf"
    plan = convert(src, out, outtype="f16", dry_run=True)
    assert not out.exists()
    _, tensors, _ = read_gguf(path)
    real = [(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type, t.n_bytes)
            for t in tensors.values()]
    planned = [(t.name, t.shape, t.qtype, t.nbytes) for t in plan.tensors]
    assert planned == real
    assert plan.total_params == sum(math.prod(s) for _, s, _, _ in real)
    # and the CLI prints every tensor with shape, type and bytes, plus the totals
    r = CliRunner().invoke(cli_main, [str(src), str(out), "--outtype", "f16", "--dry-run"])
    assert r.exit_code == 0, r.output
    for name, shape, qt, nb in real:
        line = next(line for line in r.stdout.splitlines() if line.split() and line.split()[0] == name)
        assert qt.name in line and str(nb) in line and ", ".join(map(str, shape)) in line
    assert f"{plan.total_params} parameters" in r.stdout
    assert not out.exists()


def test_dry_run_35b_a3b_from_index_without_shards(fx, tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    tiny = fx.ckpt("bf16")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, d / f)
    cfg = preset_config("35b-a3b", {"mask_token_id": 248319, "eos_token_id": 248318, "pad_token_id": 248318},
                        dtype="bf16")
    (d / "config.json").write_text(json.dumps(cfg))
    plan_ = tensor_plan(cfg)
    total = sum(math.prod(s) for _, s in plan_) * 2
    wm = {n: f"model-{(k % 14) + 1:05d}-of-00014.safetensors" for k, (n, _) in enumerate(plan_)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}))
    plan = convert(d, tmp_path / "big.gguf", dry_run=True)
    assert 34e9 <= plan.total_params <= 36.5e9
    assert plan.outtype == "bf16"
    assert plan.virtual
    names = {t.name for t in plan.tensors}
    assert "blk.39.ffn_down_exps.weight" in names and "blk.3.attn_q.weight" in names
    t = next(t for t in plan.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert t.shape == (256, 512, 2048)
    # CLI dry run of the same folder
    r = CliRunner().invoke(cli_main, [str(d), str(tmp_path / "big.gguf"), "--dry-run", "--outtype", "q8_0"])
    assert r.exit_code == 0, r.output
    assert "blk.39.ffn_down_exps.weight" in r.stdout
    assert not (tmp_path / "big.gguf").exists()


def test_dry_run_on_headers_only(fx, tmp_path):
    """safetensors files holding only their header: the dry run plans, a real run refuses."""
    src = copy_checkpoint(fx, tmp_path, "f32_sharded")
    for f in src.glob("*.safetensors"):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        f.write_bytes(data[: 8 + n])
    _, real_plan = fx.gguf("f32_sharded", "f16")
    plan = convert(src, tmp_path / "x.gguf", outtype="auto", dry_run=True)
    assert plan.virtual and plan.outtype == "f16"
    assert [(t.name, t.shape, t.qtype) for t in plan.tensors] == [(t.name, t.shape, t.qtype) for t in real_plan.tensors]
    msg = conversion_error(src, tmp_path)
    assert "truncated" in msg


# ---------------------------------------------------------------------------
# atomic output, interruption, disk space


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix in (".gguf", ".tmp") or ".tmp" in p.name)


def test_interrupted_run_leaves_nothing(fx, tmp_path, monkeypatch):
    src = fx.ckpt("bf16")
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    real = filler_mod.Filler.submit
    calls = {"n": 0}

    def boom(self, t, fd, offset):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(self, t, fd, offset)

    monkeypatch.setattr(filler_mod.Filler, "submit", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out_dir / "m.gguf", outtype="f16", split_max_size="100K", progress=False)
    assert leftovers(out_dir) == []


def test_not_enough_disk_space(fx, tmp_path, monkeypatch):
    src = fx.ckpt("bf16")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ConversionError, match="not enough free disk space"):
        convert(src, tmp_path / "m.gguf", progress=False)
    assert leftovers(tmp_path) == []


def test_force_overwrites(fx, tmp_path):
    src = fx.ckpt("bf16")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    r = CliRunner().invoke(cli_main, [str(src), str(out), "--no-progress"])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines() == [f"error: {out} already exists (use --force to overwrite)"]
    assert out.read_bytes() == b"old"
    r = CliRunner().invoke(cli_main, [str(src), str(out), "--no-progress", "--force"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"GGUF"
    assert leftovers(tmp_path) == ["m.gguf"]


def test_output_folder_gets_default_name(fx, tmp_path):
    src = fx.ckpt("bf16")
    plan = convert(src, tmp_path, outtype="q8_0", progress=False)
    assert plan.shard_paths == [tmp_path / "bf16-q8_0.gguf"]
    assert (tmp_path / "bf16-q8_0.gguf").exists()
