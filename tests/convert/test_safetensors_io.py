import json
import os
import stat
import struct
import warnings

import gguf
import ml_dtypes
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


def _usual_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


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
    assert sorted(f.names()) == ["a", "b", "c"]  # in the order the library wrote them
    assert f.dtype("a") == "F32" and f.dtype("b") == "F16" and f.dtype("c") == "BF16"
    assert f.shape("c") == (2, 3, 4) and f.nbytes("c") == 2 * 24
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
    assert stat.S_IMODE(p.stat().st_mode) == _usual_mode()  # not the temporary file's 0600


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


def test_bf16_bits_as_gguf_py():
    """Every bit pattern, NaN payloads included, rounds as gguf-py (and ggml) round; every bf16
    widens exactly."""
    bits = np.random.default_rng(2).integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    bits[:4] = [0x7FC00001, 0xFF812345, 0x7F800001, 0x00000001]  # NaNs with payloads, a denormal
    x = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NaN / inf inputs are expected, not warned about
        got = f32_to_bf16(x)
    np.testing.assert_array_equal(got, want)
    u = np.arange(2**16, dtype=np.uint32)
    np.testing.assert_array_equal(bf16_to_f32(u.astype(np.uint16)).view(np.uint32), u << 16)


def test_interop_with_safetensors_package(tmp_path):
    rng = np.random.default_rng(2)
    a, b, c = _tensors(rng)
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, {"a": (a, "F32"), "b": (b, "F16"), "i": np.arange(5, dtype=np.int64)})
    loaded = load_file(str(ours))
    np.testing.assert_array_equal(loaded["a"], a)
    np.testing.assert_array_equal(loaded["b"], b)
    np.testing.assert_array_equal(loaded["i"], np.arange(5))

    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": a, "h": b, "z": np.zeros((0, 4), np.float32), "c": c.view(ml_dtypes.bfloat16)}, str(theirs),
              metadata={"k": "v"})
    f = SafetensorsFile(theirs)
    assert sorted(f.names()) == ["c", "h", "w", "z"]
    np.testing.assert_array_equal(f.raw("w"), a)
    np.testing.assert_array_equal(f.read_f32("h"), b.astype(np.float32))
    np.testing.assert_array_equal(f.raw("c"), c)  # bf16 bit for bit
    assert f.shape("z") == (0, 4)
    assert f.metadata == {"k": "v"}


def test_partial_reads_and_reopening(tmp_path):
    rng = np.random.default_rng(4)
    fused = f32_to_bf16(rng.standard_normal((4, 6, 8)).astype(np.float32))
    conv = rng.standard_normal((5, 1, 3)).astype(np.float32)
    p = tmp_path / "p.safetensors"
    write_safetensors(p, {"fused": (fused, "BF16"), "conv": conv})
    f = SafetensorsFile(p)
    np.testing.assert_array_equal(f.raw("fused", (2, slice(3, 6))), fused[2, 3:6])
    np.testing.assert_array_equal(f.raw("conv", (slice(1, 4),)), conv[1:4])
    f.close()  # unmapped; the next read maps the file again
    np.testing.assert_array_equal(f.raw("fused"), fused)
    f.close()


def test_views_read_the_file_in_place(tmp_path):
    """view() gives what raw() gives, without a copy: read-only views of one memory map, the
    header's offsets honoured for every tensor (a gap of metadata and alignment included)."""
    rng = np.random.default_rng(5)
    a, b, c = _tensors(rng)
    fused = f32_to_bf16(rng.standard_normal((4, 6, 8)).astype(np.float32))
    p = tmp_path / "v.safetensors"
    write_safetensors(p, {"a": (a, "F32"), "b": (b, "F16"), "c": (c, "BF16"), "fused": (fused, "BF16")},
                      metadata={"format": "pt", "note": "x" * 13})
    f = SafetensorsFile(p)
    for name in f.names():
        v = f.view(name)
        assert v.dtype == f.raw(name).dtype and not v.flags.writeable
        np.testing.assert_array_equal(v, f.raw(name))
    np.testing.assert_array_equal(f.view("fused", (2, slice(3, 6))), fused[2, 3:6])
    assert np.shares_memory(f.view("a"), f.view("a"))  # the same mapping, nothing copied
    held = f.view("c")
    f.close()  # drops the map; a view still held keeps its pages valid, the next read maps anew
    np.testing.assert_array_equal(held, c)
    np.testing.assert_array_equal(f.view("b"), b)
    assert not np.shares_memory(held, f.view("c"))
    with SafetensorsFile(p) as g:
        with pytest.raises(CheckpointError, match="no tensor named 'zz'"):
            g.view("zz")
        os.truncate(p, p.stat().st_size - 8)  # cut after the header was checked: refused, not a SIGBUS
        with pytest.raises(CheckpointError, match=r"v.safetensors: tensor '\w+': the file is shorter"):
            for name in g.names():  # the last tensor's bytes are cut
                g.view(name)


def _write_raw(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _hdr(**tensors) -> bytes:
    return json.dumps(tensors).encode()


def _bad_files(tmp_path):
    """(file, a regex its error must match) for malformed files, all made here."""
    t = tmp_path
    (t / "short.safetensors").write_bytes(b"\x01\x02")
    (t / "hdr.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    (t / "huge.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    _write_raw(t / "json.safetensors", b"{not json")
    _write_raw(t / "offs.safetensors", _hdr(t={"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}), b"\0" * 8)
    _write_raw(t / "dtype.safetensors", _hdr(t={"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}), b"\0" * 2)
    _write_raw(t / "size.safetensors", _hdr(t={"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}), b"\0" * 8)
    _write_raw(t / "overlap.safetensors", _hdr(a={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                b={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}), b"\0" * 8)
    _write_raw(t / "meta.safetensors", json.dumps({"__metadata__": {"format": 5}}).encode())
    good = t / "good.safetensors"
    write_safetensors(good, {"w": (np.ones((64, 64), np.float32), "F32")})
    (t / "trunc.safetensors").write_bytes(good.read_bytes()[:-100])  # a valid file cut in its data
    return [
        ("short", "truncated or corrupt"),
        ("hdr", "header length.*truncated or corrupt"),
        ("huge", "header too large"),
        ("json", "invalid JSON"),
        ("offs", "not fully covered.*truncated"),
        ("dtype", "Q4"),
        ("size", "invalid shape, data type, or offset"),
        ("overlap", "invalid offset for tensor `[ab]`"),  # either, as the library meets them
        ("meta", "expected a string"),
        ("trunc", "truncated"),
        ("missing", "file not found"),
    ]


def test_malformed_files_give_one_line_errors_naming_the_file(tmp_path):
    for stem, pattern in _bad_files(tmp_path):
        p = tmp_path / f"{stem}.safetensors"
        with pytest.raises(CheckpointError, match=pattern) as ei:
            SafetensorsFile(p)
        msg = str(ei.value)
        assert msg.startswith(f"{p}: ") and "\n" not in msg, msg
        # the same through a checkpoint folder
        folder = tmp_path / f"ck-{stem}"
        folder.mkdir()
        if p.exists():
            (folder / "model.safetensors").write_bytes(p.read_bytes())
            with pytest.raises(CheckpointError, match=pattern) as ei:
                CheckpointReader(folder)
            assert f"{folder / 'model.safetensors'}: " in str(ei.value) and "\n" not in str(ei.value)


def test_tensor_errors_name_file_and_tensor(tmp_path):
    good = tmp_path / "good.safetensors"
    write_safetensors(good, {"w": (np.ones((4, 4), np.float32), "F32")})
    with pytest.raises(CheckpointError, match=f"^{good}: no tensor named 'nope'$"):
        SafetensorsFile(good).raw("nope")
    # a dtype the library knows but we do not read: listed, with its size; reading it fails
    p = tmp_path / "fp8.safetensors"
    _write_raw(p, _hdr(t={"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [0, 6]}), b"\0" * 6)
    f = SafetensorsFile(p)
    assert f.dtype("t") == "F8_E4M3" and f.shape("t") == (2, 3) and f.nbytes("t") == 6
    with pytest.raises(CheckpointError, match=f"^{p}: tensor 't': dtype F8_E4M3 cannot be read"):
        f.raw("t")


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
    weight_map = {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    index_path = sh / "model.safetensors.index.json"

    def write_index(wm):
        index_path.write_text(json.dumps({"metadata": {"total_size": a.nbytes + b.nbytes + c.nbytes},
                                          "weight_map": wm}))

    write_index(weight_map)
    r = CheckpointReader(sh)
    assert sorted(r.names()) == ["a", "b", "c"]
    assert r.file_of("b").name == "model-00002-of-00002.safetensors"
    assert r.dtype("b") == "F16" and r.shape("a") == (3, 5)
    np.testing.assert_array_equal(r.raw("a"), a)
    r.close()
    with pytest.raises(CheckpointError, match=f"^{sh}: checkpoint has no tensor named 'd'$"):
        r.raw("d")

    # what the library cannot know: the index's own consistency
    for wm, pattern in [
        ({**weight_map, "d": "model-00002-of-00002.safetensors"},
         "tensor 'd' is mapped to model-00002-of-00002.safetensors, which lacks it"),
        ({**weight_map, "a": "../model.safetensors"}, "bad shard file name '../model.safetensors'"),
        ({**weight_map, "a": 5}, "every 'weight_map' value must be a shard file name"),
    ]:
        write_index(wm)
        with pytest.raises(CheckpointError, match=pattern) as ei:
            CheckpointReader(sh)
        assert str(ei.value).startswith(f"{index_path}: ") and "\n" not in str(ei.value)
    index_path.write_text("{nope")
    with pytest.raises(CheckpointError, match=f"^{index_path}: not valid JSON"):
        CheckpointReader(sh)
    write_index(weight_map)

    (sh / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors is missing"):
        CheckpointReader(sh)

    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint folder not found"):
        CheckpointReader(tmp_path / "nope")


def test_lazy_writer(tmp_path):
    calls = []

    def make(i):
        def f():
            calls.append(i)
            return np.full((2, 3), i, dtype=np.float32)
        return f

    p = tmp_path / "lazy.safetensors"
    write_safetensors_lazy(p, [(f"t{i}", (2, 3), "BF16" if i % 2 else "F32", make(i)) for i in range(4)],
                           {"format": "pt"})
    assert calls == [0, 1, 2, 3]
    f = SafetensorsFile(p)
    assert f.names() == ["t0", "t1", "t2", "t3"]  # in the given order
    assert [f.dtype(n) for n in f.names()] == ["F32", "BF16", "F32", "BF16"]
    np.testing.assert_array_equal(f.read_f32("t3"), np.full((2, 3), 3, np.float32))
    # the library reads what the streaming writer wrote, bf16 bit for bit
    loaded = load_file(str(p))
    assert loaded["t1"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(loaded["t1"].view(np.uint16), f32_to_bf16(np.full((2, 3), 1, np.float32)))
    with pytest.raises(ValueError, match="declared"):
        write_safetensors_lazy(tmp_path / "bad.safetensors", [("t", (4,), "F32", lambda: np.zeros(3, np.float32))])
    assert not (tmp_path / "bad.safetensors").exists()
    assert not list(tmp_path.glob(".*tmp"))
    assert stat.S_IMODE(p.stat().st_mode) == _usual_mode()


def test_writer_refuses_mismatched_dtypes(tmp_path):
    with pytest.raises(ValueError, match="does not match F32"):
        write_safetensors(tmp_path / "x.safetensors", {"t": (np.arange(3), "F32")})
    with pytest.raises(ValueError, match="BF16 needs uint16 bit patterns or floats"):
        write_safetensors(tmp_path / "x.safetensors", {"t": (np.arange(3, dtype=np.int8), "BF16")})
    with pytest.raises(ValueError, match="unknown safetensors dtype 'F8_E4M3'"):
        write_safetensors(tmp_path / "x.safetensors", {"t": (np.zeros(3, np.uint8), "F8_E4M3")})
    assert not list(tmp_path.iterdir())
