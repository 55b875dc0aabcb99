"""Structure-aware mutators for the fuzz suite (tests/hostile/test_fuzz.py): GGUF metadata and tensor
infos (rewritten through gguf-py, so the file stays well-formed where the mutation does not
aim at the format itself), safetensors headers and config.json files.

    python -m clover_testkit.fuzz gguf MODEL.gguf OUTDIR N [SEED]    # write N mutated GGUFs (a corpus)
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

import numpy as np

from clover_testkit.gguf_files import metadata_fields

EXTREME_INTS = [0, 1, 2, 3, 7, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
EXTREME_FLOATS = [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e-45, 1e30, 3.0]


def rewrite_gguf(src: Path, dst: Path, kv: dict | None = None, drop: tuple[str, ...] = (),
                 f16: str | None = None) -> Path:
    """src with metadata values replaced (kv: key -> value, same type), keys dropped, or one F32
    tensor (its name ending in f16) stored as F16."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "clover")
    for key, val, vt, sub in metadata_fields(r):
        if key == "general.architecture" or key in drop:
            continue
        w.add_key_value(key, (kv or {}).get(key, val), vt, sub_type=sub)
    for t in r.tensors:
        data = np.array(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, data.astype(np.float16) if f16 and t.name.endswith(f16) else data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def write_gguf(src: Path, dst: Path, rng: random.Random) -> str:
    """dst = src with one structure-aware mutation; returns its description."""
    import gguf

    r = gguf.GGUFReader(str(src))
    fields = metadata_fields(r)
    tensors = [(t.name, np.array(t.data), t.tensor_type, [int(x) for x in t.shape]) for t in r.tensors]
    kind = rng.choice(["int", "float", "type", "drop", "tensor_type", "tensor_shape", "drop_tensor", "array"])
    desc = kind
    V = gguf.GGUFValueType
    if kind == "int":
        idx = [i for i, f in enumerate(fields) if f[2] in (V.UINT32, V.INT32, V.UINT64)]
        i = rng.choice(idx)
        v = rng.choice(EXTREME_INTS + [rng.randrange(0, 5000)])
        key, _, vt, sub = fields[i]
        if vt == V.INT32:
            v = min(v, 2**31 - 1)
        fields[i] = (key, v, vt, sub)
        desc = f"{key}={v}"
    elif kind == "float":
        idx = [i for i, f in enumerate(fields) if f[2] == V.FLOAT32]
        i = rng.choice(idx)
        v = rng.choice(EXTREME_FLOATS)
        fields[i] = (fields[i][0], v, V.FLOAT32, None)
        desc = f"{fields[i][0]}={v}"
    elif kind == "type":  # the right key with a value of another type
        i = rng.randrange(len(fields))
        key = fields[i][0]
        nv = rng.choice([("s", "12", V.STRING, None), ("f", 1.5, V.FLOAT32, None), ("b", True, V.BOOL, None),
                         ("a", [1, 2], V.ARRAY, V.INT32), ("u64", 2**40, V.UINT64, None)])
        fields[i] = (key, nv[1], nv[2], nv[3])
        desc = f"{key} as {nv[0]}"
    elif kind == "drop":
        i = rng.randrange(len(fields))
        desc = f"drop {fields[i][0]}"
        if fields[i][0] != "general.architecture":
            del fields[i]
    elif kind == "array":  # arrays of the wrong length / type
        idx = [i for i, f in enumerate(fields) if f[2] == V.ARRAY]
        i = rng.choice(idx)
        key, val, _, sub = fields[i]
        val = list(val)
        new = rng.choice([val[: max(1, len(val) // 2)], val + val[:3], val[:1]])
        fields[i] = (key, new, V.ARRAY, sub)
        desc = f"{key} len {len(new)}"
    elif kind == "tensor_type":  # f32 <-> f16 (data converted, so only the type is "wrong")
        idx = [i for i, t in enumerate(tensors) if t[2] in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)]
        i = rng.choice(idx)
        name, data, tt, shape = tensors[i]
        data = data.astype(np.float16 if tt == gguf.GGMLQuantizationType.F32 else np.float32)
        tensors[i] = (name, data, None, shape)
        desc = f"{name} as {data.dtype}"
    elif kind == "tensor_shape":
        i = rng.randrange(len(tensors))
        name, data, tt, shape = tensors[i]
        if tt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            flat = data.reshape(-1)
            new = rng.choice([flat[: max(1, flat.size // 2)], np.concatenate([flat, flat[:8]]), flat[::-1].copy()])
            tensors[i] = (name, new.reshape(1, -1) if rng.random() < 0.5 else new, None, None)
            desc = f"{name} shape {new.shape}"
        else:
            desc = "noop"
    elif kind == "drop_tensor":
        i = rng.randrange(len(tensors))
        desc = f"drop tensor {tensors[i][0]}"
        del tensors[i]
    arch = next((f[1] for f in fields if f[0] == "general.architecture"), "clover")
    w = gguf.GGUFWriter(str(dst), arch if isinstance(arch, str) else "clover")
    for key, val, vt, sub in fields:
        if key == "general.architecture":
            continue
        w.add_key_value(key, val, vt, sub_type=sub)
    for name, data, tt, shape in tensors:
        if tt is None or tt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data)
        else:  # quantized: raw bytes with the numpy shape gguf-py reads back
            w.add_tensor(name, data, raw_dtype=tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return desc


def flip_bytes(src: Path, dst: Path, rng: random.Random) -> str:
    """Raw damage inside the header (before the tensor data): flipped bytes or a truncation."""
    data = bytearray(src.read_bytes())
    head = min(len(data), 4096)
    if rng.random() < 0.3:
        n = rng.randrange(0, head)
        dst.write_bytes(bytes(data[:n]))
        return f"truncated at {n}"
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(4, head)] = rng.randrange(256)
    dst.write_bytes(bytes(data))
    return "bytes flipped"


# ----------------------------------------------------------------------------- checkpoints

def mutate_safetensors_header(path: Path, rng: random.Random) -> str:
    """Rewrite the JSON header of a .safetensors file in place with one mutation."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    t = header[name]
    kind = rng.choice(["dtype", "shape", "offsets_overlap", "offsets_out", "offsets_type", "not_dict", "length",
                       "metadata", "huge_shape", "neg_shape"])
    if kind == "dtype":
        t["dtype"] = rng.choice(["F64", "I8", "Q4", ["F32"], 7, "BF16", "F8_E4M3"])
    elif kind == "shape":
        t["shape"] = rng.choice([[], [0], list(reversed(t["shape"])), [1] + t["shape"], "12", [1.5]])
    elif kind == "huge_shape":
        t["shape"] = [2**40, 2**40]
    elif kind == "neg_shape":
        t["shape"] = [-1] + t["shape"][1:]
    elif kind == "offsets_overlap":
        other = header[rng.choice(names)]
        t["data_offsets"] = list(other["data_offsets"])
    elif kind == "offsets_out":
        t["data_offsets"] = [t["data_offsets"][0], len(body) + rng.choice([1, 10**6, 2**62])]
    elif kind == "offsets_type":
        t["data_offsets"] = rng.choice([[-8, 0], ["0", "4"], [1e300, 2e300], [2**64, 2**64 + 4], None])
    elif kind == "not_dict":
        header[name] = rng.choice([[1, 2], "x", None, 5])
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([{"format": 5}, [1], "pt", {"a": {"b": 1}}])
    text = json.dumps(header).encode()
    if kind == "length":
        path.write_bytes(struct.pack("<Q", rng.choice([0, 1, n + 10**6, 2**63])) + text + body)
    else:
        path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return f"{name}: {kind}"


def mutate_config(path: Path, rng: random.Random) -> str:
    cfg = json.loads(path.read_text())
    key = rng.choice(sorted(cfg))
    v = rng.choice([None, "false", "12", -1, 0, 2**32, 2**64, 1e300, float("nan"), [1], {"a": 1}, True, 0.5])
    if rng.random() < 0.15:
        del cfg[key]
        desc = f"drop {key}"
    else:
        cfg[key] = v
        desc = f"{key}={v!r}"
    path.write_text(json.dumps(cfg))
    return desc


def mutate_tokenizer(folder: Path, rng: random.Random) -> str:
    """tokenizer.json / tokenizer_config.json / generation_config.json fields of wrong types."""
    name = rng.choice(["tokenizer.json", "tokenizer_config.json"])
    p = folder / name
    if not p.exists():
        return "noop"
    d = json.loads(p.read_text())
    if name == "tokenizer.json":
        target = rng.choice(["added_tokens", "model.merges", "model.vocab"])
        v = rng.choice([5, "x", [1, 2], {"a": "b"}, None, [{"id": "x", "content": 3}]])
        if target == "added_tokens":
            d["added_tokens"] = v
        else:
            d.setdefault("model", {})[target.split(".")[1]] = v
    else:
        target = rng.choice(["add_bos_token", "bos_token", "eos_token", "chat_template"])
        d[target] = rng.choice(["false", 5, None, [1], {"content": 7}])
    p.write_text(json.dumps(d))
    return f"{name}:{target}"


def main(argv: list[str]) -> None:
    kind, src, out, n = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    rng = random.Random(int(argv[4]) if len(argv) > 4 else 0)
    out.mkdir(parents=True, exist_ok=True)
    assert kind == "gguf"
    for i in range(n):
        dst = out / f"case-{i:05d}.gguf"
        desc = write_gguf(src, dst, rng) if rng.random() < 0.8 else flip_bytes(src, dst, rng)
        print(dst.name, desc)


if __name__ == "__main__":
    main(sys.argv[1:])
