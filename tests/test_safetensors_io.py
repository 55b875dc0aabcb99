import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clover_convert.safetensors_io import (
    CheckpointError,
    CheckpointReader,
    SafetensorsFile,
    bf16_to_f32,
    f32_to_bf16,
    write_safetensors,
    write_safetensors_lazy,
)


def _tensors(rng):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((7,)).astype(np.float16)
    c = f32_to_bf16(rng.standard_normal((2, 3, 4)).astype(np.float32))
    return a, b, c


def test_round_trip_f32_f16_bf16(tmp_path):
    rng = np.random.default_rng(0)
    a, b, c = _tensors(rng)
    p = tmp_path / "x.safetensors"
    write_safetensors(p, {"a": (a, "F32"), "b": (b, "F16"), "c": (c, "BF16")}, metadata={"format": "pt"})
    f = SafetensorsFile(p)
    assert f.names() == ["a", "b", "c"]
    assert f.dtype("a") == "F32" and f.dtype("b") == "F16" and f.dtype("c") == "BF16"
    assert f.shape("c") == (2, 3, 4)
    assert f.metadata == {"format": "pt"}
    np.testing.assert_array_equal(f.raw("a"), a)
    np.testing.assert_array_equal(f.raw("b"), b)
    assert f.raw("c").dtype == np.uint16
    np.testing.assert_array_equal(f.raw("c"), c)
    np.testing.assert_array_equal(f.read_f32("b"), b.astype(np.float32))
    np.testing.assert_array_equal(f.read_f32("c"), bf16_to_f32(c))
    # header length is a multiple of 8
    (n,) = struct.unpack("<Q", p.read_bytes()[:8])
    assert n % 8 == 0
    assert not list(tmp_path.glob(".*tmp"))


def test_bf16_rounding():
    x = np.array([1.0, -2.5, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, np.inf, -np.inf, np.nan,
                  3.4e38], dtype=np.float32)
    u = f32_to_bf16(x)
    y = bf16_to_f32(u)
    assert y[0] == 1.0 and y[1] == -2.5
    assert y[2] == 1.0  # tie -> even (down)
    assert y[3] == 1.0 + 4 * 2**-8  # tie -> even (up)
    assert y[4] == 1.0
    assert y[5] == np.inf and y[6] == -np.inf and np.isnan(y[7])
    assert np.isinf(y[8])  # rounds past the bf16 max
    r = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert np.max(np.abs(bf16_to_f32(f32_to_bf16(r)) - r) / np.abs(r)) <= 2**-8


def test_interop_with_safetensors_package(tmp_path):
    rng = np.random.default_rng(2)
    a, b, _ = _tensors(rng)
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, {"a": (a, "F32"), "b": (b, "F16"), "i": np.arange(5, dtype=np.int64)})
    loaded = load_file(str(ours))
    np.testing.assert_array_equal(loaded["a"], a)
    np.testing.assert_array_equal(loaded["b"], b)
    np.testing.assert_array_equal(loaded["i"], np.arange(5))

    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": a, "h": b, "z": np.zeros((0, 4), np.float32)}, str(theirs), metadata={"k": "v"})
    f = SafetensorsFile(theirs)
    assert sorted(f.names()) == ["h", "w", "z"]
    np.testing.assert_array_equal(f.raw("w"), a)
    np.testing.assert_array_equal(f.read_f32("h"), b.astype(np.float32))
    assert f.shape("z") == (0, 4)
    assert f.metadata == {"k": "v"}


def _write_raw(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_errors(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="short.safetensors.*shorter than"):
        SafetensorsFile(p)

    p = tmp_path / "hdr.safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match="hdr.safetensors.*past the end"):
        SafetensorsFile(p)

    p = tmp_path / "json.safetensors"
    _write_raw(p, b"{not json")
    with pytest.raises(CheckpointError, match="json.safetensors.*not valid JSON"):
        SafetensorsFile(p)

    p = tmp_path / "offs.safetensors"
    _write_raw(p, json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"offs.safetensors.*'t'.*outside"):
        SafetensorsFile(p)

    p = tmp_path / "dtype.safetensors"
    _write_raw(p, json.dumps({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}).encode(), b"\0" * 2)
    with pytest.raises(CheckpointError, match=r"dtype.safetensors.*'t'.*unknown dtype 'Q4'"):
        SafetensorsFile(p)

    p = tmp_path / "size.safetensors"
    _write_raw(p, json.dumps({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode(), b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"size.safetensors.*'t'.*needs 12"):
        SafetensorsFile(p)

    # a valid file truncated in its data section
    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"w": (np.ones((64, 64), np.float32), "F32")})
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"trunc.safetensors.*'w'.*truncated") as ei:
        SafetensorsFile(trunc)
    assert "\n" not in str(ei.value)

    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        SafetensorsFile(good).raw("nope")


def test_checkpoint_reader_single_and_shards(tmp_path):
    rng = np.random.default_rng(3)
    a, b, c = _tensors(rng)
    single = tmp_path / "single"
    write_safetensors(single / "model.safetensors", {"a": (a, "F32"), "c": (c, "BF16")})
    r = CheckpointReader(single)
    assert sorted(r.names()) == ["a", "c"]
    assert r.nbytes("c") == c.size * 2
    assert r.file_of("a").name == "model.safetensors"
    np.testing.assert_array_equal(r.read_f32("c"), bf16_to_f32(c))

    sh = tmp_path / "sharded"
    write_safetensors(sh / "model-00001-of-00002.safetensors", {"a": (a, "F32")})
    write_safetensors(sh / "model-00002-of-00002.safetensors", {"b": (b, "F16"), "c": (c, "BF16")})
    index = {
        "metadata": {"total_size": a.nbytes + b.nbytes + c.nbytes},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (sh / "model.safetensors.index.json").write_text(json.dumps(index))
    r = CheckpointReader(sh)
    assert sorted(r.names()) == ["a", "b", "c"]
    assert r.file_of("b").name == "model-00002-of-00002.safetensors"
    assert r.dtype("b") == "F16" and r.shape("a") == (3, 5)
    np.testing.assert_array_equal(r.raw("a"), a)

    (sh / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors is missing"):
        CheckpointReader(sh)

    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        CheckpointReader(tmp_path)


def test_lazy_writer(tmp_path):
    calls = []

    def make(i):
        def f():
            calls.append(i)
            return np.full((2, 3), i, dtype=np.float32)
        return f

    p = tmp_path / "lazy.safetensors"
    write_safetensors_lazy(p, [(f"t{i}", (2, 3), "BF16" if i % 2 else "F32", make(i)) for i in range(4)])
    assert calls == [0, 1, 2, 3]
    f = SafetensorsFile(p)
    assert [f.dtype(n) for n in f.names()] == ["F32", "BF16", "F32", "BF16"]
    np.testing.assert_array_equal(f.read_f32("t3"), np.full((2, 3), 3, np.float32))
    with pytest.raises(ValueError, match="declared"):
        write_safetensors_lazy(tmp_path / "bad.safetensors", [("t", (4,), "F32", lambda: np.zeros(3, np.float32))])
    assert not (tmp_path / "bad.safetensors").exists()
    assert not list(tmp_path.glob(".*tmp"))
