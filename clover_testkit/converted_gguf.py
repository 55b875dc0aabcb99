"""The converter tests' shared pieces: the tiny checkpoints and their conversions, made once a
session (Fixtures, behind tests/conftest.py's fx), the GGUF tensors a checkpoint should give,
computed independently of clover_convert.mapping (the value-head reorder done the way upstream's
``_reorder_v_heads`` does it: reshape to [Hk, r, unit], swap the first two axes, not with the
converter's index arrays), and a GGUF read back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
from click.testing import CliRunner
from gguf import GGUFReader

from clover_convert import convert
from clover_convert.cli import main as cli_main
from clover_convert.safetensors_io import CheckpointReader
from clover_testkit.checkpoints import write_checkpoint

VARIANTS = {
    "bf16": dict(dtype="bf16"),
    "f32_sharded": dict(dtype="f32", shards=3),
    "fused_bf16": dict(dtype="bf16", fused_experts=True, shards=2),
    "tied_f32": dict(dtype="f32", tied=True),
}


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


def layer_types(cfg: dict) -> list[str]:
    if cfg.get("layer_types"):
        return cfg["layer_types"]
    n = cfg["full_attention_interval"]
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])]


def reorder_v_heads(x: np.ndarray, dim: int, Hk: int, r: int, unit: int) -> np.ndarray:
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
        return np.concatenate([x[:qk], reorder_v_heads(x[qk:], 0, Hk, r, dv)], axis=0)

    for i, lt in enumerate(layer_types(cfg)):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = g(p + "input_layernorm.weight") + np.float32(1)
        out[b + "post_attention_norm.weight"] = g(p + "post_attention_layernorm.weight") + np.float32(1)
        if lt == "linear_attention":
            a = p + "linear_attn."
            out[b + "attn_qkv.weight"] = v_rows_qkv(g(a + "in_proj_qkv.weight"))
            out[b + "attn_gate.weight"] = reorder_v_heads(g(a + "in_proj_z.weight"), 0, Hk, r, dv)
            out[b + "ssm_beta.weight"] = reorder_v_heads(g(a + "in_proj_b.weight"), 0, Hk, r, 1)
            out[b + "ssm_alpha.weight"] = reorder_v_heads(g(a + "in_proj_a.weight"), 0, Hk, r, 1)
            out[b + "ssm_mix.weight"] = reorder_v_heads(g(a + "in_proj_m.weight"), 0, Hk, r, 1)
            out[b + "ssm_conv1d.weight"] = v_rows_qkv(g(a + "conv1d.weight")[:, 0, :])
            if cfg.get("linear_conv_lookahead", 0) > 0:
                out[b + "ssm_conv1d_look.weight"] = v_rows_qkv(g(a + "conv1d_lookahead.weight")[:, 0, :])
            out[b + "ssm_dt.bias"] = reorder_v_heads(g(a + "dt_bias"), 0, Hk, r, 1)
            out[b + "ssm_a"] = reorder_v_heads(-np.exp(g(a + "A_log")), 0, Hk, r, 1)
            out[b + "ssm_block_calib"] = reorder_v_heads(g(a + "block_calib"), 1, Hk, r, 1)
            out[b + "ssm_norm.weight"] = g(a + "norm.weight")
            out[b + "ssm_out.weight"] = reorder_v_heads(g(a + "out_proj.weight"), 1, Hk, r, dv)
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


def is_bf16_source(folder: Path) -> bool:
    rd = CheckpointReader(folder)
    try:
        return any(rd.dtype(n) == "BF16" for n in rd.names())
    finally:
        rd.close()


def gguf_field(fields, key):
    assert key in fields, f"missing metadata key {key}"
    return fields[key].contents()


def leftovers(d: Path) -> list[str]:
    """What a conversion may leave behind in d: GGUFs and temporary files."""
    return sorted(p.name for p in d.iterdir() if p.suffix in (".gguf", ".tmp") or ".tmp" in p.name)


def copy_checkpoint(fx, tmp_path: Path, variant: str = "bf16") -> Path:
    """A copy of the session's tiny checkpoint to edit."""
    d = tmp_path / "src"
    shutil.copytree(fx.ckpt(variant), d)
    return d


def conversion_error(src: Path, tmp_path: Path, *extra: str) -> str:
    """The error of converting src, which must fail: one line `error: ...`, exit 1, no traceback,
    nothing left behind."""
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    r = CliRunner().invoke(cli_main, [str(src), str(out_dir / "m.gguf"), "--no-progress", *extra])
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    assert leftovers(out_dir) == []
    return lines[0]

