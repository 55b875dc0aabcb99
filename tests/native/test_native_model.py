"""A libclover model (native/libclover/clover.h, through ctypes) and its files: metadata, default block
size, tokenizer round trip; not-a-GGUF file, a GGUF of another architecture or a broken clover
GGUF -> status code + message, no crash; clover-cli end to end.

The module is skipped only when libclover is not built (build/bin/libclover.so).
"""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (CLI, L, artifacts, model)  # noqa: E402, F401


# ----------------------------------------------------------------------------- metadata
def test_model_metadata(model, artifacts):
    cfg = artifacts["cfg"]
    assert model.n_vocab == cfg["vocab_size"]
    assert model.mask == cfg["mask_token_id"]
    assert model.eos == cfg["eos_token_id"]
    assert L.clover_train_block_size(model.p) == cfg["block_size"] == 8
    bos = cfg.get("bos_token_id")
    assert L.clover_bos_token(model.p) == (-1 if bos is None else bos)
    buf = ctypes.create_string_buffer(64)
    assert L.clover_model_meta(model.p, b"general.architecture", buf, 64) == 6
    assert buf.value == b"clover"
    assert L.clover_model_meta(model.p, b"no.such.key", buf, 64) == -1


def test_default_block_size_is_training_block_size(model):
    cp = L.clover_context_default_params()
    cp.n_ctx = 64
    eb, el = N.err_buffer()
    c = L.clover_context_new(model.p, ctypes.byref(cp), eb, el)
    assert c, eb.value
    try:
        assert L.clover_block_size(c) == 8
        assert L.clover_n_ctx(c) == 64
    finally:
        L.clover_context_free(c)


def test_tokenize_roundtrip(model):
    text = "def fibonacci(n):\n    return n"
    toks = (ctypes.c_int32 * 64)()
    n = ctypes.c_int32()
    assert L.clover_tokenize(model.p, text.encode(), -1, toks, 64, 0, 1, ctypes.byref(n)) == N.CLOVER_OK
    assert 0 < n.value < len(text)
    small = (ctypes.c_int32 * 1)()
    need = ctypes.c_int32()
    assert L.clover_tokenize(model.p, text.encode(), -1, small, 1, 0, 1, ctypes.byref(need)) == N.CLOVER_ERR_BUFFER_TOO_SMALL
    assert need.value == n.value
    buf = ctypes.create_string_buffer(256)
    nb = ctypes.c_int32()
    assert L.clover_detokenize(model.p, toks, n.value, buf, 256, 0, 0, ctypes.byref(nb)) == N.CLOVER_OK
    assert buf.value.decode() == text and nb.value == len(text.encode())
    pieces = b""
    for t in toks[:n.value]:
        pb = ctypes.create_string_buffer(64)
        k = ctypes.c_int32()
        assert L.clover_token_to_piece(model.p, t, pb, 64, 0, ctypes.byref(k)) == N.CLOVER_OK
        pieces += pb.raw[:k.value]
    assert pieces.decode() == text
    # clover.h's contract: CLOVER_OK and the count in n_out; too small: the size needed in n_out
    long_tok = max(toks[:n.value], key=lambda t: len(_piece(model, t)))
    want = _piece(model, long_tok)
    tiny, k = ctypes.create_string_buffer(1), ctypes.c_int32(-7)
    rc = L.clover_token_to_piece(model.p, long_tok, tiny, len(want) - 1, 0, ctypes.byref(k))
    assert len(want) > 1 and rc == N.CLOVER_ERR_BUFFER_TOO_SMALL and k.value == len(want)
    assert L.clover_token_to_piece(model.p, 10**6, buf, 256, 0, ctypes.byref(nb)) == N.CLOVER_ERR_INVALID_ARG


def _piece(model, t: int) -> bytes:
    pb, k = ctypes.create_string_buffer(64), ctypes.c_int32()
    assert L.clover_token_to_piece(model.p, t, pb, 64, 0, ctypes.byref(k)) == N.CLOVER_OK
    return pb.raw[:k.value]


def test_errors_model_files(artifacts, tmp_path, llama_gguf):
    eb, el = N.err_buffer()

    def load(p):
        m = L.clover_model_load(str(p).encode(), None, eb, el)
        if m:
            L.clover_model_free(m)
        return m, eb.value.decode()

    m, msg = load(tmp_path / "missing.gguf")
    assert not m and "cannot open" in msg
    (tmp_path / "text.gguf").write_text("hello, I am not a GGUF file\n")
    m, msg = load(tmp_path / "text.gguf")
    assert not m and "not a GGUF" in msg
    (tmp_path / "trunc.gguf").write_bytes(artifacts["f32"].read_bytes()[:1000])
    m, msg = load(tmp_path / "trunc.gguf")
    assert not m and msg
    # a GGUF of another architecture
    m, msg = load(llama_gguf)
    assert not m and "'llama'" in msg and "clover" in msg
    assert not L.clover_model_load(None, None, eb, el)


def _rewrite_gguf(src, dst, *, drop_tensor=None, kv=None, shrink_tensor=None):
    """Copy a GGUF, optionally dropping a tensor, overriding keys or cutting a tensor's last column."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "clover")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = (kv or {}).get(f.name, f.contents())
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(f.name, value, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, value, f.types[0])
    for t in reader.tensors:
        if t.name == drop_tensor:
            continue
        data = np.array(t.data)
        if t.name == shrink_tensor:
            data = np.ascontiguousarray(data[..., :-1])
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case, edit, message", [
    ("missing", dict(drop_tensor="blk.0.ssm_mix.weight"), "tensor 'blk.0.ssm_mix.weight' not found"),
    ("block0", dict(kv={"clover.diffusion.block_size": 0}), "diffusion.block_size must be a u32 in [1, "),
    ("block2^31", dict(kv={"clover.diffusion.block_size": 2**31 + 5}), "diffusion.block_size must be a u32 in [1, "),
    ("experts", dict(kv={"clover.expert_used_count": 99}), "expert_used_count must be a u32 in [1, clover.expert_count]"),
    ("shape", dict(shrink_tensor="blk.1.ssm_out.weight"), "tensor 'blk.1.ssm_out.weight' has wrong shape"),
])
def test_bad_clover_gguf_fails_to_load_with_a_message(artifacts, tmp_path, case, edit, message):
    bad = tmp_path / f"{case}.gguf"
    _rewrite_gguf(artifacts["f32"], bad, **edit)
    eb, el = N.err_buffer()
    m = L.clover_model_load(str(bad).encode(), None, eb, el)
    assert not m
    assert message in eb.value.decode()


# ----------------------------------------------------------------------------- CLI
@pytest.mark.skipif(not CLI.is_file(), reason="clover-cli is not built")
def test_cli(artifacts):
    cmd = [str(CLI), "-m", str(artifacts["f32"]), "-p", "def fibonacci(n):", "-n", "12", "--block-size", "4",
           "-t", "2", "-c", "256", "--threshold", "0.5"]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "clover: prompt" in r.stderr and "generated 12 tok" in r.stderr and "tokens/forward" in r.stderr
    assert r.stdout.strip()
    rv = subprocess.run(cmd + ["--visual", "--temp", "0.7", "--top-k", "20", "--top-p", "0.9", "--seed", "3",
                               "--max-steps", "2", "--no-stop-at-eos"], capture_output=True, text=True, errors="replace", timeout=120)
    assert rv.returncode == 0, rv.stderr
    assert "[MASK]" in rv.stderr and "[block @" in rv.stderr
    ra = subprocess.run(cmd[:-4] + ["--block-size", "auto", "--no-stop-at-eos"], capture_output=True, text=True,
                        errors="replace", timeout=120)
    assert ra.returncode == 0, ra.stderr
    assert "generated 12 tok" in ra.stderr and "(auto)" in ra.stderr
    for bad, word in [(["--threshold", "2"], "threshold"), (["--block-size", "0"], "block-size"),
                      (["--block-size", "sometimes"], "block-size"),
                      (["--temp", "abc"], "--temp"), (["--bogus"], "unknown option"),
                      (["-c", "8", "--block-size", "16"], "n_ctx=8"), (["-n", "1000", "-c", "64"], "n_ctx")]:
        rb = subprocess.run(cmd + bad, capture_output=True, text=True, errors="replace", timeout=120)
        assert rb.returncode == 1, (bad, rb.stderr)
        lines = rb.stderr.strip().splitlines()
        assert lines and lines[-1].startswith("error: ") and word in lines[-1], (bad, rb.stderr)
    rm = subprocess.run([str(CLI), "-m", "/nonexistent.gguf", "-p", "x"], capture_output=True, text=True, errors="replace")
    assert rm.returncode == 1 and rm.stderr.startswith("error: ")
