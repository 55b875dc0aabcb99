"""The HF -> GGUF converter (clover_convert): every tensor of the tiny checkpoints round trips
(bf16, f32, sharded, fused experts, tied; to bf16 / f16 / q8_0 / f32 / auto) against
clover_testkit.converted_gguf's independent expectation; the writer: chunked partial reads,
write-back, the on-disk layout gguf's writer gives, pwrite or not; the runtime imports no
converter.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from clover_convert import convert
from clover_convert import filler as filler_mod
from clover_convert import gguf_writer as writer_mod
from clover_convert import plan as plan_mod
from clover_convert.safetensors_io import CheckpointReader
from clover_testkit.checkpoints import write_checkpoint
from clover_testkit.converted_gguf import (deq, expected_tensors, is_bf16_source, is_f32_only, read_gguf,
                                           reorder_v_heads)


# (variant, outtype) round trips
ROUND_TRIPS = [
    ("bf16", "bf16"),
    ("bf16", "f16"),
    ("bf16", "q8_0"),
    ("bf16", "f32"),
    ("bf16", "auto"),
    ("f32_sharded", "f16"),
    ("f32_sharded", "bf16"),
    ("f32_sharded", "auto"),
    ("fused_bf16", "q8_0"),
    ("fused_bf16", "bf16"),
    ("tied_f32", "f32"),
    ("tied_f32", "q8_0"),
]


# ---------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("variant,outtype", ROUND_TRIPS)
def test_round_trip(fx, variant, outtype):
    src = fx.ckpt(variant)
    path, plan = fx.gguf(variant, outtype)
    want_type = outtype
    if outtype == "auto":
        want_type = "bf16" if is_bf16_source(src) else "f16"
    assert plan.outtype == want_type
    qwant = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}[want_type]
    exp = expected_tensors(src)
    _, tensors, _ = read_gguf(path)
    assert set(tensors) == set(exp)
    for name, ref in exp.items():
        t = tensors[name]
        got = deq(t)
        assert got.shape == ref.shape, name
        if is_f32_only(name, ref.shape):
            assert t.tensor_type == QT.F32, f"{name} is {t.tensor_type.name}, must stay F32"
        else:
            assert t.tensor_type == qwant, name
        if t.tensor_type == QT.F32:
            np.testing.assert_array_equal(got, ref, err_msg=name)
        elif t.tensor_type == QT.F16:
            np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float32), err_msg=name)
        elif t.tensor_type == QT.BF16:
            rounded = gguf.quants.dequantize(gguf.quants.quantize(ref, QT.BF16), QT.BF16).reshape(ref.shape)
            np.testing.assert_array_equal(got, rounded, err_msg=name)
        else:
            assert t.tensor_type == QT.Q8_0
            blocks = ref.reshape(-1, 32)
            amax = np.abs(blocks).max(axis=1, keepdims=True)
            bound = amax / 127 * 0.5 + amax * 2.0**-11 + 1e-12
            err = np.abs(got.reshape(-1, 32) - blocks)
            assert np.all(err <= bound), f"{name}: max err {err.max()} over the Q8_0 bound"


def test_bf16_passthrough_keeps_bits(fx):
    src = fx.ckpt("bf16")
    path, _ = fx.gguf("bf16", "bf16")
    _, tensors, _ = read_gguf(path)
    rd = CheckpointReader(src)
    raw = rd.raw("model.embed_tokens.weight")
    got = np.asarray(tensors["token_embd.weight"].data).view(np.uint16).reshape(raw.shape)
    np.testing.assert_array_equal(got, raw)
    # expert 3 of layer 1, up projection, stacked
    raw = rd.raw("model.layers.1.mlp.experts.3.up_proj.weight")
    t = tensors["blk.1.ffn_up_exps.weight"]
    got = np.asarray(t.data).view(np.uint16).reshape(8, *raw.shape)[3]
    np.testing.assert_array_equal(got, raw)
    rd.close()


def test_fused_and_per_expert_layouts_agree(fx, tmp_path):
    # the same seed gives the same values in both layouts
    a, _ = fx.gguf("bf16", "bf16")
    b, _ = fx.gguf("fused_bf16", "bf16")
    _, ta, _ = read_gguf(a)
    _, tb, _ = read_gguf(b)
    for n in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.3.ffn_down_exps.weight"):
        np.testing.assert_array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data))


@pytest.mark.parametrize("variant,outtype", [("bf16", "q8_0"), ("fused_bf16", "bf16"), ("f32_sharded", "f16")])
def test_chunked_partial_reads_give_the_same_file(fx, tmp_path, monkeypatch, variant, outtype):
    """With chunks of 40 rows every tensor of 2+ dims is read in row ranges (value-head
    permuted rows in runs, fused expert slabs by offset) and the maps are dropped after
    every few KB: the output is the same bytes as reading whole slabs in one go."""
    want, _ = fx.gguf(variant, outtype)
    partial: list[tuple] = []
    real_view = CheckpointReader.view

    def spy(self, name, index=None):
        if index is not None:
            partial.append(index)
        return real_view(self, name, index)

    monkeypatch.setattr(filler_mod, "CHUNK_ELEMS", 40 * 64)
    monkeypatch.setattr(filler_mod, "RELEASE_BYTES", 4096)
    monkeypatch.setattr(CheckpointReader, "view", spy)
    out = tmp_path / "chunked.gguf"
    convert(fx.ckpt(variant), out, outtype=outtype, progress=False)
    assert out.read_bytes() == want.read_bytes()
    assert any(isinstance(ix[-1], slice) and ix[-1].stop - ix[-1].start < 40 for ix in partial)  # a run
    if variant.startswith("fused"):
        assert any(len(ix) == 2 and isinstance(ix[0], int) and ix[1].start >= 32 for ix in partial)  # up half


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_write_back_started_as_the_output_grows(fx, tmp_path, monkeypatch):
    """Every few KB the written range goes to POSIX_FADV_DONTNEED (write-back starts, pages
    already on disk are dropped), each call from where the last-but-one range began: the
    ranges cover the tensor data without a hole, and the file is the same bytes."""
    want, _ = fx.gguf("bf16", "f16")
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((offset, offset + length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(writer_mod, "WRITEBACK_BYTES", 8192)
    monkeypatch.setattr(os, "posix_fadvise", spy)
    out = tmp_path / "m.gguf"
    convert(fx.ckpt("bf16"), out, outtype="f16", progress=False)
    assert out.read_bytes() == want.read_bytes()
    assert len(calls) >= 10 and calls[0][0] == 0
    for (s0, e0), (s1, e1) in zip(calls, calls[1:]):
        assert s0 <= s1 < e0 < e1 and e1 - e0 >= 8192  # each repeats the range begun before it
    assert calls[-1][1] > out.stat().st_size // 2  # the tail is the final fsync's


@pytest.mark.parametrize("split", [0, 5000])
def test_tensor_data_laid_out_as_gguf_writer_writes_it(tmp_path, split):
    """The converter writes each tensor at the offset lay_out_tensor_data gives, in any order
    (os.pwrite into a file sized up front); the file is the bytes of gguf-py's own
    write_tensor_data, alignment padding and shards included."""
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal(n).astype(np.float16) for i, n in enumerate((3, 1000, 17, 2048, 1))}

    def writer(cls, path):
        w = cls(None, "clover", split_max_size=split)
        for name, a in tensors.items():
            w.add_tensor_info(name, a.shape, a.dtype, a.nbytes)
        w.add_string("general.name", "layout")
        w.open_output_file(path)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        return w

    theirs = writer(gguf.GGUFWriter, tmp_path / "theirs.gguf")
    for a in tensors.values():
        theirs.write_tensor_data(a)
    theirs.close()
    ours = writer(writer_mod.ShardWriter, tmp_path / "ours.gguf")
    where = ours.lay_out_tensor_data()
    for name in reversed(tensors):  # any order
        fd, offset = where[name]
        filler_mod._pwrite_all(fd, tensors[name], offset)
    ours.close()
    shards = sorted(tmp_path.glob("theirs*"))
    assert len(shards) == 1 if split == 0 else len(shards) > 1
    for shard in shards:
        assert (tmp_path / shard.name.replace("theirs", "ours")).read_bytes() == shard.read_bytes(), shard.name


def test_same_file_without_pwrite(fx, tmp_path, monkeypatch):
    """Where os.pwrite is missing (Windows), chunks are written by a seek and a write under one
    lock: the same shards, byte for byte."""
    shards = {}
    for pwrite in (True, False):
        d = tmp_path / f"pwrite-{pwrite}"
        d.mkdir()
        with monkeypatch.context() as m:
            if not pwrite:
                m.delattr(os, "pwrite")
            convert(fx.ckpt("bf16"), d / "m.gguf", outtype="f16", split_max_size="100K", progress=False)
        shards[pwrite] = [p.read_bytes() for p in sorted(d.glob("m-*.gguf"))]
    assert len(shards[True]) > 1 and shards[False] == shards[True]


def test_chunks_shrink_with_the_cores(fx, monkeypatch):
    """Every worker holds its chunk's output (and temporaries of several times a chunk when it
    is not a plain cast), so chunks are 1/workers of CHUNK_ELEMS: 16 cores hold what 1 does."""
    for cores in (1, 2, 16):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        filler = filler_mod.Filler(CheckpointReader(fx.ckpt("bf16")))
        try:
            assert filler._chunk_elems() == filler_mod.CHUNK_ELEMS // cores
        finally:
            filler.close()


def test_writer_built_once_per_conversion(fx, tmp_path, monkeypatch):
    """The plan builds the GGUF writer (keys, tokenizer, tensor infos) once; convert opens that
    writer rather than building another: one build per conversion, split or not, same bytes."""
    want, _ = fx.gguf("bf16", "f16")
    built = []
    real = plan_mod.build_writer

    def spy(*args, **kwargs):
        built.append(args[3])  # the outtype
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "build_writer", spy)
    plan = convert(fx.ckpt("bf16"), tmp_path / "m.gguf", outtype="f16", progress=False)
    assert built == ["f16"] and plan.out.read_bytes() == want.read_bytes()
    plan = convert(fx.ckpt("bf16"), tmp_path / "s.gguf", outtype="f16", split_max_size="100K", progress=False)
    assert built == ["f16", "f16"] and len(plan.shard_paths) > 1


def test_runtime_imports_no_converter():
    """Layering: no module of clover_cpp (the runtime) imports clover_convert or clover_testkit at
    module level (both import the shared helpers from clover_gguf, test_layering.py checks
    every import), and importing the runtime's file tools
    (inspect, quantize, imatrix, kld) loads no converter module."""
    root = Path(__file__).resolve().parents[2] / "clover_cpp"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("clover_convert", "clover_testkit")]
    assert found == []
    code = ("import sys, clover_cpp.gguf_info, clover_cpp.quant, clover_cpp.imatrix, clover_cpp.kld; "
            "print(sorted(m for m in sys.modules if m.startswith(('clover_convert', 'clover_testkit'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_q8_0_falls_back_to_f16_for_odd_rows(tmp_path):
    src = tmp_path / "odd"
    write_checkpoint(src, "tiny", dtype="bf16", config_overrides={"moe_intermediate_size": 48})
    out = tmp_path / "odd.gguf"
    convert(src, out, outtype="q8_0", progress=False)
    _, tensors, _ = read_gguf(out)
    assert tensors["blk.0.ffn_down_exps.weight"].tensor_type == QT.F16  # rows of 48
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type == QT.Q8_0  # rows of 64
    exp = expected_tensors(src)
    np.testing.assert_array_equal(deq(tensors["blk.0.ffn_down_exps.weight"]),
                                  exp["blk.0.ffn_down_exps.weight"].astype(np.float16).astype(np.float32))


def test_v_head_order_small_example():
    from clover_convert.mapping import v_head_order

    # Hk=2 key heads, r=3: tiled position p holds grouped head (p % 2) * 3 + p // 2
    assert v_head_order(2, 3).tolist() == [0, 3, 1, 4, 2, 5]
    x = np.arange(6)
    assert reorder_v_heads(x, 0, 2, 3, 1).tolist() == [0, 3, 1, 4, 2, 5]
