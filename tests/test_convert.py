"""The HF -> GGUF converter (clover_convert): round trips, metadata, tokenizer, splits,
dry runs and every user error.

Expected GGUF tensors are computed here independently of clover_convert.mapping: the
value-head reorder is done the way upstream's ``_reorder_v_heads`` does it (reshape to
[Hk, r, unit], swap the first two axes), not with the converter's index arrays.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from clover_convert import ConversionError, convert
from clover_convert import converter as conv_mod
from clover_convert import filler as filler_mod
from clover_convert import gguf_writer as writer_mod
from clover_convert import plan as plan_mod
from clover_convert.cli import main as cli_main
from clover_convert.safetensors_io import CheckpointReader, write_safetensors
from clover_testkit.checkpoints import write_checkpoint
from clover_testkit.presets import preset_config, tensor_plan

VARIANTS = {
    "bf16": dict(dtype="bf16"),
    "f32_sharded": dict(dtype="f32", shards=3),
    "fused_bf16": dict(dtype="bf16", fused_experts=True, shards=2),
    "tied_f32": dict(dtype="f32", tied=True),
}

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

F32_SUFFIXES = (
    "norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight",
    "ssm_conv1d_look.weight", "ssm_a", "ssm_dt.bias", "ssm_block_calib",
)


class Fixtures:
    def __init__(self, root: Path):
        self.root = root
        self._ckpt: dict[str, Path] = {}
        self._gguf: dict[tuple[str, str], tuple[Path, object]] = {}

    def ckpt(self, variant: str) -> Path:
        if variant not in self._ckpt:
            d = self.root / "ckpt" / variant
            write_checkpoint(d, "tiny", **VARIANTS[variant])
            self._ckpt[variant] = d
        return self._ckpt[variant]

    def gguf(self, variant: str, outtype: str):
        key = (variant, outtype)
        if key not in self._gguf:
            out = self.root / "out" / f"{variant}-{outtype}.gguf"
            out.parent.mkdir(parents=True, exist_ok=True)
            plan = convert(self.ckpt(variant), out, outtype=outtype, progress=False)
            self._gguf[key] = (out, plan)
        return self._gguf[key]


@pytest.fixture(scope="session")
def fx(tmp_path_factory) -> Fixtures:
    return Fixtures(tmp_path_factory.mktemp("convert"))


# ---------------------------------------------------------------------------
# independent reference


def _layer_types(cfg: dict) -> list[str]:
    if cfg.get("layer_types"):
        return cfg["layer_types"]
    n = cfg["full_attention_interval"]
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])]


def _vre(x: np.ndarray, dim: int, Hk: int, r: int, unit: int) -> np.ndarray:
    """upstream-style value-head reorder along dim (grouped -> tiled)."""
    x = np.moveaxis(x, dim, 0)
    s = x.shape
    x = x.reshape(Hk, r, unit, *s[1:]).swapaxes(0, 1).reshape(s)
    return np.moveaxis(x, 0, dim)


def expected_tensors(folder: Path) -> dict[str, np.ndarray]:
    cfg = json.loads((folder / "config.json").read_text())
    rd = CheckpointReader(folder)
    g = rd.read_f32
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = Hv // Hk
    qk = 2 * Hk * dk
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    fused = "model.layers.0.mlp.experts.gate_up_proj" in rd
    out: dict[str, np.ndarray] = {
        "token_embd.weight": g("model.embed_tokens.weight"),
        "output_norm.weight": g("model.norm.weight") + np.float32(1),
    }
    if not cfg.get("tie_word_embeddings"):
        out["output.weight"] = g("lm_head.weight")

    def v_rows_qkv(x):
        return np.concatenate([x[:qk], _vre(x[qk:], 0, Hk, r, dv)], axis=0)

    for i, lt in enumerate(_layer_types(cfg)):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = g(p + "input_layernorm.weight") + np.float32(1)
        out[b + "post_attention_norm.weight"] = g(p + "post_attention_layernorm.weight") + np.float32(1)
        if lt == "linear_attention":
            a = p + "linear_attn."
            out[b + "attn_qkv.weight"] = v_rows_qkv(g(a + "in_proj_qkv.weight"))
            out[b + "attn_gate.weight"] = _vre(g(a + "in_proj_z.weight"), 0, Hk, r, dv)
            out[b + "ssm_beta.weight"] = _vre(g(a + "in_proj_b.weight"), 0, Hk, r, 1)
            out[b + "ssm_alpha.weight"] = _vre(g(a + "in_proj_a.weight"), 0, Hk, r, 1)
            out[b + "ssm_mix.weight"] = _vre(g(a + "in_proj_m.weight"), 0, Hk, r, 1)
            out[b + "ssm_conv1d.weight"] = v_rows_qkv(g(a + "conv1d.weight")[:, 0, :])
            if cfg.get("linear_conv_lookahead", 0) > 0:
                out[b + "ssm_conv1d_look.weight"] = v_rows_qkv(g(a + "conv1d_lookahead.weight")[:, 0, :])
            out[b + "ssm_dt.bias"] = _vre(g(a + "dt_bias"), 0, Hk, r, 1)
            out[b + "ssm_a"] = _vre(-np.exp(g(a + "A_log")), 0, Hk, r, 1)
            out[b + "ssm_block_calib"] = _vre(g(a + "block_calib"), 1, Hk, r, 1)
            out[b + "ssm_norm.weight"] = g(a + "norm.weight")
            out[b + "ssm_out.weight"] = _vre(g(a + "out_proj.weight"), 1, Hk, r, dv)
        else:
            a = p + "self_attn."
            out[b + "attn_q.weight"] = g(a + "q_proj.weight")
            out[b + "attn_k.weight"] = g(a + "k_proj.weight")
            out[b + "attn_v.weight"] = g(a + "v_proj.weight")
            out[b + "attn_output.weight"] = g(a + "o_proj.weight")
            out[b + "attn_q_norm.weight"] = g(a + "q_norm.weight") + np.float32(1)
            out[b + "attn_k_norm.weight"] = g(a + "k_norm.weight") + np.float32(1)
        m = p + "mlp."
        out[b + "ffn_gate_inp.weight"] = g(m + "gate.weight")
        if fused:
            gu = g(m + "experts.gate_up_proj")
            out[b + "ffn_gate_exps.weight"] = gu[:, :I]
            out[b + "ffn_up_exps.weight"] = gu[:, I:]
            out[b + "ffn_down_exps.weight"] = g(m + "experts.down_proj")
        else:
            for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                out[b + gg + ".weight"] = np.stack([g(f"{m}experts.{j}.{hf}.weight") for j in range(E)])
        out[b + "ffn_gate_shexp.weight"] = g(m + "shared_expert.gate_proj.weight")
        out[b + "ffn_up_shexp.weight"] = g(m + "shared_expert.up_proj.weight")
        out[b + "ffn_down_shexp.weight"] = g(m + "shared_expert.down_proj.weight")
        out[b + "ffn_gate_inp_shexp.weight"] = g(m + "shared_expert_gate.weight")[0]
    rd.close()
    return out


def read_gguf(paths: Path | list[Path]) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor], list[GGUFReader]]:
    if isinstance(paths, Path):
        paths = [paths]
    readers = [GGUFReader(p) for p in paths]
    fields = {k: f for k, f in readers[0].fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for rd in readers:
        for t in rd.tensors:
            assert t.name not in tensors
            tensors[t.name] = t
    return fields, tensors, readers


def deq(t) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def is_f32_only(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith(F32_SUFFIXES)


def _is_bf16_source(folder: Path) -> bool:
    rd = CheckpointReader(folder)
    try:
        return any(rd.dtype(n) == "BF16" for n in rd.names())
    finally:
        rd.close()


# ---------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("variant,outtype", ROUND_TRIPS)
def test_round_trip(fx, variant, outtype):
    src = fx.ckpt(variant)
    path, plan = fx.gguf(variant, outtype)
    want_type = outtype
    if outtype == "auto":
        want_type = "bf16" if _is_bf16_source(src) else "f16"
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
    root = Path(__file__).resolve().parents[1] / "clover_cpp"
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
    assert _vre(x, 0, 2, 3, 1).tolist() == [0, 3, 1, 4, 2, 5]


# ---------------------------------------------------------------------------
# metadata and tokenizer


def _field(fields, key):
    assert key in fields, f"missing metadata key {key}"
    return fields[key].contents()


def test_metadata_every_key(fx):
    src = fx.ckpt("bf16")
    path, _ = fx.gguf("bf16", "q8_0")
    cfg = json.loads((src / "config.json").read_text())
    fields, _, _ = read_gguf(path)
    lt = _layer_types(cfg)
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
        got = _field(fields, key)
        assert fields[key].types[0] == vtype, key
        if vtype == ARR:
            assert fields[key].types[-1] == BOOL
        assert got == value, f"{key}: {got!r} != {value!r}"
    assert all(isinstance(v, bool) for v in _field(fields, "clover.attention.recurrent_layers"))
    # the ids in the config's token fields
    if cfg.get("pad_token_id") is not None:
        assert _field(fields, "tokenizer.ggml.padding_token_id") == cfg["pad_token_id"]
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
    assert _field(fields, "general.name") == "Clover-Tiny-v2"
    label = _field(fields, "general.size_label")
    assert label.startswith(f"{cfg['num_experts']}x"), label
    assert "general.license" not in fields
    (src / "README.md").write_text("---\nlicense: apache-2.0\nbasename: clover\nfinetune: instruct\n"
                                   "version: v2\ntags:\n- block-diffusion\n---\n\n# a card\n")
    carded = tmp_path / "carded.gguf"
    convert(src, carded, outtype="f16", progress=False)
    fields, _, _ = read_gguf(carded)
    for key, want in {"general.license": "apache-2.0", "general.basename": "clover", "general.finetune": "instruct",
                      "general.version": "v2", "general.size_label": label}.items():
        assert _field(fields, key) == want, key
    assert "block-diffusion" in _field(fields, "general.tags")


def test_tokenizer_reproduces_tokenizer_json(fx):
    src = fx.ckpt("bf16")
    path, _ = fx.gguf("bf16", "bf16")
    cfg = json.loads((src / "config.json").read_text())
    tj = json.loads((src / "tokenizer.json").read_text())
    tc = json.loads((src / "tokenizer_config.json").read_text())
    fields, _, _ = read_gguf(path)
    tokens = _field(fields, "tokenizer.ggml.tokens")
    types = _field(fields, "tokenizer.ggml.token_type")
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
    assert merges and _field(fields, "tokenizer.ggml.merges") == merges
    tok_id = {t: i for i, t in id_to_tok.items()}
    assert _field(fields, "tokenizer.ggml.eos_token_id") == tok_id[tc["eos_token"]] == cfg["eos_token_id"]
    assert _field(fields, "tokenizer.ggml.padding_token_id") == tok_id[tc["pad_token"]]
    assert _field(fields, "tokenizer.ggml.mask_token_id") == tok_id["<|mask|>"] == cfg["mask_token_id"]
    assert _field(fields, "tokenizer.chat_template") == tc["chat_template"]
    assert _field(fields, "tokenizer.ggml.add_bos_token") is False


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
    src = _copy_ckpt(fx, tmp_path, "f32_sharded")
    for f in src.glob("*.safetensors"):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        f.write_bytes(data[: 8 + n])
    _, real_plan = fx.gguf("f32_sharded", "f16")
    plan = convert(src, tmp_path / "x.gguf", outtype="auto", dry_run=True)
    assert plan.virtual and plan.outtype == "f16"
    assert [(t.name, t.shape, t.qtype) for t in plan.tensors] == [(t.name, t.shape, t.qtype) for t in real_plan.tensors]
    msg = _run_fail(src, tmp_path)
    assert "truncated" in msg


# ---------------------------------------------------------------------------
# atomic output, interruption, disk space


def _leftovers(d: Path) -> list[str]:
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
    assert _leftovers(out_dir) == []


def test_not_enough_disk_space(fx, tmp_path, monkeypatch):
    src = fx.ckpt("bf16")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ConversionError, match="not enough free disk space"):
        convert(src, tmp_path / "m.gguf", progress=False)
    assert _leftovers(tmp_path) == []


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
    assert _leftovers(tmp_path) == ["m.gguf"]


def test_output_folder_gets_default_name(fx, tmp_path):
    src = fx.ckpt("bf16")
    plan = convert(src, tmp_path, outtype="q8_0", progress=False)
    assert plan.shard_paths == [tmp_path / "bf16-q8_0.gguf"]
    assert (tmp_path / "bf16-q8_0.gguf").exists()


# ---------------------------------------------------------------------------
# bad inputs: one line `error: ...`, exit 1, nothing left behind


def _copy_ckpt(fx, tmp_path: Path, variant: str = "bf16") -> Path:
    d = tmp_path / "src"
    shutil.copytree(fx.ckpt(variant), d)
    return d


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


def _run_fail(src: Path, tmp_path: Path, *extra: str) -> str:
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    r = CliRunner().invoke(cli_main, [str(src), str(out_dir / "m.gguf"), "--no-progress", *extra])
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    assert _leftovers(out_dir) == []
    return lines[0]


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
    src = _copy_ckpt(fx, tmp_path)
    _edit_config(src, clover_semantics=value)
    assert _run_fail(src, tmp_path) == message
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
    src = _copy_ckpt(fx, tmp_path)
    _edit_config(src, **changes)
    assert _run_fail(src, tmp_path) == message


def test_missing_config(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)
    (src / "config.json").unlink()
    assert _run_fail(src, tmp_path) == f"error: {src}: config.json not found"


def test_shape_mismatch(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)

    def edit(t):
        t["model.layers.1.linear_attn.in_proj_z.weight"] = (np.zeros((60, 64), np.uint16), "BF16")

    _rewrite(src, edit)
    assert _run_fail(src, tmp_path) == (
        "error: tensor model.layers.1.linear_attn.in_proj_z.weight: expected shape [64, 64], got [60, 64]"
    )


def test_missing_tensor(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)
    _rewrite(src, lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight"))
    assert _run_fail(src, tmp_path) == "error: missing tensor(s): model.layers.2.mlp.experts.5.down_proj.weight"


def test_missing_tensor_sharded(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path, "f32_sharded")
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    shard = idx["weight_map"]["model.norm.weight"]
    rd = CheckpointReader(src)
    keep = {n: (np.array(rd.raw(n)), rd.dtype(n)) for n, f in idx["weight_map"].items()
            if f == shard and n != "model.norm.weight"}
    rd.close()
    write_safetensors(src / shard, keep)
    del idx["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert _run_fail(src, tmp_path) == "error: missing tensor(s): model.norm.weight"


def test_unexpected_tensor(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)

    def edit(t):
        t["model.layers.0.mlp.extra_bias"] = (np.zeros(4, np.float32), "F32")

    _rewrite(src, edit)
    assert _run_fail(src, tmp_path) == "error: unexpected tensor(s): model.layers.0.mlp.extra_bias"


def test_tied_checkpoint_with_untied_config(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path, "tied_f32")
    _edit_config(src, tie_word_embeddings=False)
    assert _run_fail(src, tmp_path) == "error: missing tensor(s): lm_head.weight"


@pytest.mark.parametrize("dtype,np_dtype", [("I64", np.int64), ("F64", np.float64)])
def test_unsupported_dtype(fx, tmp_path, dtype, np_dtype):
    src = _copy_ckpt(fx, tmp_path)

    def edit(t):
        t["model.norm.weight"] = (np.ones(64, np_dtype), dtype)

    _rewrite(src, edit)
    assert _run_fail(src, tmp_path) == (
        f"error: tensor model.norm.weight has unsupported dtype {dtype} (supported: F32, F16, BF16)"
    )


def test_truncated_safetensors(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)
    _trunc(src)
    msg = _run_fail(src, tmp_path)
    assert "model.safetensors" in msg and "truncated" in msg


def test_corrupt_header(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)
    _corrupt_header(src)
    msg = _run_fail(src, tmp_path)
    assert "model.safetensors" in msg and "header" in msg


def test_missing_tokenizer(fx, tmp_path):
    src = _copy_ckpt(fx, tmp_path)
    (src / "tokenizer.json").unlink()
    assert _run_fail(src, tmp_path) == f"error: {src}: tokenizer.json not found"


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
    assert _leftovers(out_dir) == []


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
