"""The qwen35moe twin of a Clover GGUF: llama.cpp's own Qwen3.5-MoE architecture with the same
dimensions and weights. Every tensor and key of the clover GGUF except the clover-only ones
(``ssm_mix``, ``ssm_conv1d_look``, ``ssm_block_calib``; ``ssm.conv_lookahead``,
``diffusion.block_size``), keys renamed ``clover.*`` -> ``qwen35moe.*`` plus
``rope.dimension_sections``; the tensors copied byte for byte (the same types). The chat template
is left out. What the GGUFs users already have of Qwen3.5-MoE look like to the loader (the
benchmarks' same-size baseline, and the fixture of tests/test_qwen35moe.py)."""

from __future__ import annotations

from pathlib import Path

CLOVER_ONLY_TENSORS = ("ssm_mix", "ssm_conv1d_look", "ssm_block_calib")
CLOVER_ONLY_KEYS = ("clover.ssm.conv_lookahead", "clover.diffusion.block_size")


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
