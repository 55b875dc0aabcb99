"""GGUF files rewritten for the tests with gguf-py: the metadata fields of a reader as the writer
takes them back, and a release file as upstream llama.cpp's converter would write it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def metadata_fields(reader: Any) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array sub-type) of every metadata field but the GGUF.* ones."""
    import gguf

    out = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    return out


def as_qwen35moe(src: Path, dst: Path) -> Path:
    """The release GGUF as the release's own llama.cpp converter makes it: upstream's Qwen3.5-MoE
    architecture (qwen35moe), the block-diffusion tensors (right conv, block softmax) dropped."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "qwen35moe")
    ours = {"clover.semantics", "clover.block_operator", "clover.ssm.conv_lookahead", "clover.diffusion.block_size"}
    for key, val, vt, sub in metadata_fields(r):
        if key == "general.architecture" or key in ours:
            continue
        w.add_key_value(key.replace("clover.", "qwen35moe.", 1) if key.startswith("clover.") else key, val, vt,
                        sub_type=sub)
    rot = r.fields["clover.rope.dimension_count"].contents()
    w.add_rope_dimension_sections([rot // 4, rot // 4, rot // 2 - 2 * (rot // 4), 0])  # text: one position
    for t in r.tensors:
        if ".ssm_bd_" not in t.name and "ssm_conv1d_look" not in t.name:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
