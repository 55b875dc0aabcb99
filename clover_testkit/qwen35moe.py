"""Qwen3.5-MoE twins of a Clover model, the GGUFs users already have of that architecture:

* :func:`qwen35moe_checkpoint`: a Clover Hugging Face checkpoint as a Qwen3.5-MoE one
  (``model_type: qwen3_5_moe_text``; the same tensors less Clover's memory gate, look-ahead taps and
  block calibration and canvas FFN), for upstream llama.cpp's ``convert_hf_to_gguf.py`` (:func:`upstream_convert`,
  torch needed);
* :func:`qwen35moe_from_clover`: the qwen35moe twin of a Clover GGUF, written with gguf-py: llama.cpp's own Qwen3.5-MoE architecture with the same
dimensions and weights. Every tensor and key of the clover GGUF except the clover-only ones
(``ssm_mix``, ``ssm_conv1d_look``, ``ssm_block_calib``, ``ffn_*_canvas``; ``ssm.conv_lookahead``,
``diffusion.block_size``, ``canvas_feed_forward_length``), keys renamed ``clover.*`` -> ``qwen35moe.*`` plus
``rope.dimension_sections``; the tensors copied byte for byte (the same types). The chat template
is left out. What the GGUFs users already have of Qwen3.5-MoE look like to the loader (the
benchmarks' same-size baseline, and the fixture of tests/runtime/test_qwen35moe.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UPSTREAM = REPO / "third_party" / "llama.cpp" / "convert_hf_to_gguf.py"
CLOVER_ONLY_HF = ("in_proj_m.weight", "conv1d_lookahead.weight", "block_calib", "canvas_ffn.gate_proj.weight",
                  "canvas_ffn.up_proj.weight", "canvas_ffn.down_proj.weight")
# upstream's converter with its pre-tokenizer check answered (the fixture tokenizer is a
# Qwen2-style byte-level BPE whose hash upstream does not list), then run as a script
UPSTREAM_RUNNER = r"""
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [sys.argv[2]] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

CLOVER_ONLY_TENSORS = ("ssm_mix", "ssm_conv1d_look", "ssm_block_calib", "ffn_gate_canvas", "ffn_up_canvas",
                       "ffn_down_canvas")
CLOVER_ONLY_KEYS = ("clover.ssm.conv_lookahead", "clover.diffusion.block_size", "clover.canvas_feed_forward_length")


def copy_field(writer, field, key: str) -> None:
    """Copy one metadata field of a GGUFReader into a GGUFWriter under `key`."""
    import gguf

    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else gguf.GGUFValueType.INT32
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    else:
        writer.add_key_value(key, field.contents(), vtype)


def qwen35moe_from_clover(src: Path, out: Path) -> int:
    """Write `out` (through a temporary file), the qwen35moe twin of the clover GGUF `src`;
    returns the number of tensors kept."""
    import gguf

    reader = gguf.GGUFReader(src)
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "qwen35moe")
    rope_dims = None
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in CLOVER_ONLY_KEYS:
            continue
        if key == "tokenizer.chat_template":
            continue
        new_key = "qwen35moe." + key[len("clover."):] if key.startswith("clover.") else key
        if key == "clover.rope.dimension_count":
            rope_dims = int(field.contents())
        copy_field(writer, field, new_key)
    if rope_dims is None:
        raise RuntimeError(f"{src} has no clover.rope.dimension_count")
    # Qwen3.5 uses interleaved M-RoPE; text-only positions make all sections identical.
    half = rope_dims // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3, 0]
    writer.add_key_value("qwen35moe.rope.dimension_sections", sections, gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.INT32)
    kept = [t for t in reader.tensors if not any(t.name.endswith(f".{c}.weight") or t.name.endswith(f".{c}")
                                                 for c in CLOVER_ONLY_TENSORS)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    del reader
    tmp.rename(out)
    return len(kept)


def qwen35moe_checkpoint(src: Path, dst: Path) -> None:
    """The Clover checkpoint `src` as a Qwen3.5-MoE checkpoint in `dst` (see the module doc)."""
    from safetensors.numpy import save_file

    from clover_convert.safetensors_io import CheckpointReader

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    for k in ("linear_conv_lookahead", "block_size", "mask_token_id", "canvas_ffn_intermediate_size"):
        cfg.pop(k, None)
    cfg.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
               rope_parameters={"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1e7),
                                "partial_rotary_factor": cfg.get("partial_rotary_factor", 0.25),
                                "mrope_section": [11, 11, 10]})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    import ml_dtypes
    import numpy as np

    r = CheckpointReader(src)
    tensors = {}
    for name in r.names():
        if name.endswith(CLOVER_ONLY_HF):
            continue
        a = r.raw(name)
        tensors[name] = np.ascontiguousarray(a.view(ml_dtypes.bfloat16) if r.dtype(name) == "BF16" else a)
    save_file(tensors, str(dst / "model.safetensors"))
    r.close()


def upstream_convert(checkpoint: Path, out: Path, outtype: str = "f16") -> None:
    """upstream llama.cpp's convert_hf_to_gguf.py (the pinned tree's) on `checkpoint`, in a child."""
    p = subprocess.run([sys.executable, "-c", UPSTREAM_RUNNER, str(UPSTREAM.parent), str(UPSTREAM), str(checkpoint),
                        "--outtype", outtype, "--no-mtp", "--outfile", str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {p.stderr[-2000:]}")
