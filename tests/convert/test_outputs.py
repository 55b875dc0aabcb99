"""Output files never lose data: convert and quantize refuse to overwrite their inputs or
non-regular files, leave the old output or the new one after any signal or a full disk, and
clean up the temporary files of killed runs. Everything happens inside tmp_path."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clover_convert import convert
from clover_convert.mapping import ConversionError

ROOT = Path(__file__).resolve().parents[2]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_convert_refuses_to_overwrite_its_input(tiny_artifacts, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    import shutil
    shutil.copytree(tiny_artifacts["ckpt"], ck)
    before = _sha(ck / "model.safetensors")
    with pytest.raises(ConversionError, match="one of the inputs"):
        convert(ck, ck / "model.safetensors", outtype="f16", force=True, progress=False)
    assert _sha(ck / "model.safetensors") == before


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo"])
def test_force_never_replaces_a_non_regular_file(tiny_artifacts, tmp_path: Path, kind: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = fifo
    if kind == "link-to-fifo":
        out = tmp_path / "out.gguf"
        out.symlink_to(fifo)
    with pytest.raises(ConversionError, match="not a regular file"):
        convert(tiny_artifacts["ckpt"], out, outtype="f16", force=True, progress=False)
    from clover_cpp.quant import QuantizeError, quantize
    with pytest.raises(QuantizeError, match="not a regular file"):
        quantize(tiny_artifacts["f32"], out, "Q8_0", force=True)
    assert fifo.is_fifo()


def test_missing_output_folder(tiny_artifacts, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="does not exist"):
        convert(tiny_artifacts["ckpt"], str(tmp_path / "nope") + "/", outtype="f16", progress=False)
    assert not (tmp_path / "nope").exists()


def test_stale_temp_files_are_cleaned(tiny_artifacts, tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.gguf"
    stale = tmp_path / f".m.gguf.{_dead_pid()}.deadbeef.tmp"
    stale.write_bytes(b"x" * 1000)
    live = tmp_path / f".m.gguf.{os.getpid()}.cafef00d.tmp"  # a writer that is still running: kept
    live.write_bytes(b"y")
    convert(tiny_artifacts["ckpt"], out, outtype="f16", progress=False)
    assert not stale.exists() and live.exists() and out.is_file()
    assert "interrupted run" in capsys.readouterr().err


@pytest.mark.needs_libclover
def test_quantize_messages_and_read_back(tiny_artifacts, tmp_path: Path) -> None:
    from clover_cpp.quant import QuantizeError, quantize

    with pytest.raises(QuantizeError, match="--allow-requantize"):
        quantize(tiny_artifacts["q8_0"], tmp_path / "q4.gguf", "Q4_K_M")
    with pytest.raises(QuantizeError, match="cannot be read back"):  # llama.cpp writes it, nothing reads it
        quantize(tiny_artifacts["f32"], tmp_path / "q2.gguf", "Q2_0")
    assert not (tmp_path / "q2.gguf").exists() and not list(tmp_path.glob(".*.tmp"))
    seen: list[tuple[int, int]] = []
    out = quantize(tiny_artifacts["f32"], tmp_path, "Q8_0", progress=lambda i, n, t: seen.append((i, n)))
    assert out.parent == tmp_path and out.name.endswith("q8_0.gguf")  # a folder as OUT, as gguf tools do
    assert seen and seen[-1][0] == seen[-1][1] and len(seen) == seen[-1][1]


# ----------------------------------------------------------------------------- faults

def _convert_cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "clover_convert", str(src), str(out), "--outtype", "f32", "--force",
            "--no-progress"]


def _quantize_cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", "from clover_cpp.cli import main; main()", "quantize", str(src), str(out),
            "Q8_0", "--force"]


@pytest.mark.needs_libclover
@pytest.mark.parametrize("tool", ["convert", "quantize"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signals_leave_old_or_new_output(tiny_artifacts, tmp_path: Path, tool: str, sig: int) -> None:
    out = tmp_path / "out.gguf"
    old = b"OLD OUTPUT" * 100
    rng = random.Random(sig * 7 + len(tool))
    cmd = _convert_cmd(tiny_artifacts["ckpt"], out) if tool == "convert" else _quantize_cmd(tiny_artifacts["f32"], out)
    t0 = time.monotonic()  # an uninterrupted run: the new file, and how long a run lives
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lifetime = time.monotonic() - t0
    new_sha = hashlib.sha256(out.read_bytes()).hexdigest()
    for trial in range(4):
        out.write_bytes(old)
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.0, lifetime))  # somewhere inside the run, start-up to rename
        p.send_signal(sig)
        p.wait(60)
        data = out.read_bytes()
        if data != old:  # then it is the whole new file, the same every time
            assert hashlib.sha256(data).hexdigest() == new_sha, f"trial {trial}: a partial output"
        if sig != signal.SIGKILL:  # a killed run cannot clean up; the next one does
            assert not list(tmp_path.glob(".*.tmp")), f"trial {trial}: temporary files left"
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    assert not list(tmp_path.glob(".*.tmp")) and out.read_bytes()[:4] == b"GGUF"


@pytest.mark.needs_libclover
@pytest.mark.parametrize("tool", ["convert", "quantize"])
def test_full_disk_leaves_nothing_partial(tiny_artifacts, tmp_path: Path, tool: str) -> None:
    """A write failure mid-file (RLIMIT_FSIZE: the write fails as on a full disk)."""
    out = tmp_path / "out.gguf"
    out.write_bytes(b"OLD")
    cmd = _convert_cmd(tiny_artifacts["ckpt"], out) if tool == "convert" else _quantize_cmd(tiny_artifacts["f32"], out)

    def limit() -> None:
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    assert out.read_bytes() == b"OLD" and not list(tmp_path.glob(".*.tmp"))


def _plant(st: Path, suffix: str, fmt: str, values: list) -> None:
    """Overwrite the first values of the tensor whose name ends with suffix, 64 bytes in (not at
    a chunk's start), with values stored as fmt."""
    from clover_convert.safetensors_io import read_header

    raw = bytearray(st.read_bytes())
    data_start, header = read_header(st)
    name = next(k for k in header if k.endswith(suffix))
    at = data_start + header[name]["data_offsets"][0] + 64
    bad = np.array(values, dtype=fmt).tobytes()
    raw[at:at + len(bad)] = bad
    st.write_bytes(bytes(raw))


# NaN, +Inf, -Inf, then a large finite value (not counted), as each source dtype stores them
NONFINITE_BITS = {"f32": ("<f4", [float("nan"), float("inf"), -float("inf"), 65504.0]),
                  "f16": ("<u2", [0x7E00, 0x7C00, 0xFC00, 0x7BFF]), "bf16": ("<u2", [0x7FC1, 0x7F80, 0xFF80, 0x477F])}


@pytest.mark.parametrize("dtype", sorted(NONFINITE_BITS))
def test_nan_weights_are_reported(tmp_path: Path, capsys, dtype: str) -> None:
    from clover_testkit.checkpoints import write_checkpoint

    ck = tmp_path / "ck"
    write_checkpoint(ck, preset="tiny", dtype="f32" if dtype == "f16" else dtype)
    st = ck / "model.safetensors"
    if dtype == "f16":  # the generator writes f32 or bf16: an f16 checkpoint is its f32 one cast
        from safetensors.numpy import load_file, save_file

        save_file({k: v.astype(np.float16) for k, v in load_file(st).items()}, str(st))
    _plant(st, "down_proj.weight", *NONFINITE_BITS[dtype])
    convert(ck, tmp_path / "m.gguf", outtype="f16", progress=False)
    err = capsys.readouterr().err
    assert err.strip() == "warning: blk.0.ffn_down_exps.weight: 3 NaN/Inf value(s) in the checkpoint", err


# values f16 cannot hold (they round to +-inf: from 65520 up) among ones it can, per source dtype
PAST_F16_BITS = {"f32": ("<f4", [65519.0, 65520.0, -1e5, 3e38, 65504.0]),
                 "bf16": ("<u2", [0x477F, 0x4780, 0xC780, 0x7F7F, 0x4700])}  # 65280, 65536, -65536, 3.4e38


@pytest.mark.parametrize("dtype", sorted(PAST_F16_BITS))
def test_values_past_the_f16_range_are_reported(tmp_path: Path, capsys, dtype: str) -> None:
    """f16 turns them into +-inf: one warning line of ours that counts them (numpy's own
    "overflow encountered in cast" warning is not shown); to bf16 nothing is lost or said."""
    import warnings

    from gguf import GGUFReader

    from clover_testkit.checkpoints import write_checkpoint

    ck = tmp_path / "ck"
    write_checkpoint(ck, preset="tiny", dtype=dtype)
    _plant(ck / "model.safetensors", "layers.0.linear_attn.out_proj.weight", *PAST_F16_BITS[dtype])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        convert(ck, tmp_path / "m.gguf", outtype="f16", progress=False)
        convert(ck, tmp_path / "m-bf16.gguf", outtype="bf16", progress=False)
    assert [str(w.message) for w in seen] == []
    err = capsys.readouterr().err
    assert err.strip() == ("warning: blk.0.ssm_out.weight: 3 value(s) past the f16 range (+-65504) written as "
                           "+-inf (--outtype bf16 or f32 keeps them)"), err
    t = next(t for t in GGUFReader(tmp_path / "m.gguf").tensors if t.name == "blk.0.ssm_out.weight")
    assert np.count_nonzero(np.isinf(t.data)) == 3


def _clover(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_cpp.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _write_imatrix(path: Path, model: Path, seed: int = 0) -> int:
    """A GGUF importance matrix (llama-imatrix's format) for every 2D/3D weight of model."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["clover-test"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", 64)
    n = 0
    for t in gguf.GGUFReader(model).tensors:
        if t.name.endswith(".weight") and len(t.shape) >= 2 and "norm" not in t.name:
            n_per_row, n_mat = int(t.shape[0]), int(np.prod(t.shape[2:])) if len(t.shape) > 2 else 1
            w.add_tensor(f"{t.name}.in_sum2", rng.uniform(0.01, 10, (n_mat, n_per_row)).astype(np.float32))
            w.add_tensor(f"{t.name}.counts", np.full((n_mat, 1), 256.0, np.float32))
            n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n


@pytest.mark.needs_libclover
def test_quantize_with_an_importance_matrix(tiny_artifacts, tmp_path: Path) -> None:
    """--imatrix reaches llama.cpp's quantizer: other bytes than without it, the provenance keys
    llama-quantize writes, a model that loads and generates; a bad file is one line."""
    import gguf

    from clover_cpp import Clover

    src = tiny_artifacts["f32"]
    im = tmp_path / "clover.imatrix.gguf"
    n = _write_imatrix(im, src)
    plain = tmp_path / "plain.gguf"
    weighted = tmp_path / "weighted.gguf"
    assert _clover("quantize", src, plain, "Q4_0").returncode == 0
    r = _clover("quantize", src, weighted, "Q4_0", "--imatrix", im)
    assert r.returncode == 0, r.stderr
    assert plain.read_bytes() != weighted.read_bytes()
    fields = gguf.GGUFReader(weighted).fields
    assert fields["quantize.imatrix.file"].contents() == im.name
    assert fields["quantize.imatrix.entries_count"].contents() == n
    assert fields["quantize.imatrix.chunks_count"].contents() == 4
    with Clover(weighted, n_threads=1) as m:
        assert len(m.generate("hello", max_tokens=4, stop_at_eos=False).tokens) == 4
    bad = tmp_path / "bad.imatrix"
    bad.write_bytes(b"not an imatrix")
    for args in (["Q4_0", "--imatrix", bad], ["Q4_0", "--imatrix", tmp_path / "missing.gguf"], ["IQ2_XXS"]):
        r = _clover("quantize", src, tmp_path / "x.gguf", *args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "--imatrix" in r.stderr and not (tmp_path / "x.gguf").exists()
