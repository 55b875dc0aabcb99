"""One-step quantizing conversion (clover_convert.quantize_stream, patch 0008): the file of
`clover convert --outtype bf16` + `clover quantize TYPE`, byte for byte, without the bf16 file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.needs_libclover

# a tiny-shaped model whose matrices are 256 wide, so that the K-quants and IQ types quantize
# them (at 64 columns llama.cpp falls back to other types for every matrix)
WIDE = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from clover_convert import convert
    from clover_testkit.checkpoints import write_checkpoint

    d = tmp_path_factory.mktemp("qstream")
    src = d / "ck"
    write_checkpoint(src, preset="tiny", dtype="bf16", fused_experts=True, config_overrides=WIDE)
    bf16 = d / "m-bf16.gguf"
    convert(src, bf16, outtype="bf16", progress=False)
    return {"dir": d, "src": src, "bf16": bf16}


def _write_imatrix(path: Path, bf16: Path, seed: int = 0) -> None:
    """An importance matrix in llama-imatrix's GGUF format for every matrix of the model."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch="imatrix")
    w.add_type(gguf.GGUFType.IMATRIX)
    w.add_array(gguf.Keys.IMatrix.DATASETS, ["fixture"])
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, 4)
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, 64)
    for t in gguf.GGUFReader(bf16).tensors:
        shape = [int(x) for x in t.shape]  # ggml order: ne0 (columns), ne1, ne2 (experts)
        if len(shape) < 2 or t.name == "token_embd.weight":
            continue
        n_exp = shape[2] if len(shape) == 3 else 1
        w.add_tensor(f"{t.name}.in_sum2", rng.uniform(0.1, 4.0, (n_exp, shape[0])).astype(np.float32))
        w.add_tensor(f"{t.name}.counts", np.full((n_exp, 1), 256.0, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_one_step_is_the_two_step_file(ck: dict, qtype: str, tmp_path: Path) -> None:
    import gguf

    from clover_convert.quantize_stream import convert_quantized
    from clover_cpp.quant import quantize

    two = quantize(ck["bf16"], tmp_path / "two.gguf", qtype, n_threads=1)
    plan = convert_quantized(ck["src"], tmp_path / "one.gguf", qtype, n_threads=1, progress=False)
    assert plan.out == tmp_path / "one.gguf"
    a, b = two.read_bytes(), (tmp_path / "one.gguf").read_bytes()
    assert a == b
    # and it is the quantized file, not a copy of the bf16 one
    types = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "one.gguf").tensors}
    assert types & {qtype.split("_K")[0] + "_K" if "_K" in qtype else qtype}, types
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.gguf", "two.gguf"]  # no temporaries left


def test_one_step_iq4_xs_with_imatrix(ck: dict, tmp_path: Path) -> None:
    import gguf

    from clover_convert.quantize_stream import convert_quantized
    from clover_cpp.quant import quantize

    im = tmp_path / "fixture.imatrix.gguf"
    _write_imatrix(im, ck["bf16"])
    two = quantize(ck["bf16"], tmp_path / "two.gguf", "IQ4_XS", n_threads=1, imatrix=im)
    convert_quantized(ck["src"], tmp_path / "one.gguf", "IQ4_XS", imatrix=im, n_threads=1, progress=False)
    assert two.read_bytes() == (tmp_path / "one.gguf").read_bytes()
    r = gguf.GGUFReader(tmp_path / "one.gguf")
    assert "IQ4_XS" in {t.tensor_type.name for t in r.tensors}
    assert r.fields["quantize.imatrix.file"].contents() == im.name
    # another importance matrix gives another file: the data is used, not only the keys
    _write_imatrix(im, ck["bf16"], seed=1)
    convert_quantized(ck["src"], tmp_path / "other.gguf", "IQ4_XS", imatrix=im, n_threads=1, progress=False)
    assert (tmp_path / "other.gguf").read_bytes() != two.read_bytes()


def test_cli_one_step_and_its_refusals(ck: dict, tmp_path: Path) -> None:
    from clover_convert.cli import main
    from clover_cpp.quant import quantize

    out = tmp_path / "cli.gguf"
    r = CliRunner().invoke(main, [str(ck["src"]), str(out), "--outtype", "q4_k_m", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert "Q4_K_M" in r.output and "one pass" in r.output
    assert out.read_bytes() == quantize(ck["bf16"], tmp_path / "two.gguf", "Q4_K_M", n_threads=1).read_bytes()
    for args, why in ((["--outtype", "iq2_xs"], "needs an importance matrix"),
                      (["--outtype", "q4_k_m", "--split-max-size", "1M"], "--split-max-size"),
                      (["--outtype", "bf16", "--imatrix", str(out)], "--imatrix needs a quantized"),
                      (["--outtype", "q4_k_m", "--imatrix", str(tmp_path / "none.gguf")], "none.gguf"),
                      (["--outtype", "q4_k_m"], "exists")):
        r = CliRunner().invoke(main, [str(ck["src"]), str(out), *args])
        assert r.exit_code == 1, (args, r.output)
        assert r.output.startswith("error: ") and why in r.output and "Traceback" not in r.output, r.output
    # an importance matrix of another model: refused before any work, by clover quantize's check
    bad = tmp_path / "bad.imatrix.gguf"
    import gguf

    w = gguf.GGUFWriter(bad, arch="imatrix")
    w.add_tensor("blk.0.nothing.weight.in_sum2", np.ones(256, np.float32))
    w.add_tensor("blk.0.nothing.weight.counts", np.ones(1, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = CliRunner().invoke(main, [str(ck["src"]), str(tmp_path / "x.gguf"), "--outtype", "iq4_xs", "--imatrix", str(bad)])
    assert r.exit_code == 1 and "name no tensor" in r.output, r.output
    assert not (tmp_path / "x.gguf").exists()


def test_failure_midway_leaves_nothing(ck: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read failing in the middle (here: the 10th range; Ctrl-C is handed back the same way)
    stops llama.cpp's quantizer, is raised, and no output or temporary stays."""
    from clover_convert import quantize_stream as qs

    calls = {"n": 0}
    real = qs._MemFiller.fill

    def fill(self, t, offs, size, dst):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(self, t, offs, size, dst)

    monkeypatch.setattr(qs._MemFiller, "fill", fill)
    with pytest.raises(KeyboardInterrupt):
        qs.convert_quantized(ck["src"], tmp_path / "one.gguf", "Q4_K_M", n_threads=1, progress=False)
    assert calls["n"] == 10
    assert list(tmp_path.iterdir()) == []


def test_unaligned_ranges_are_the_same_bytes(ck: dict) -> None:
    """The filler makes any byte range of a tensor (llama.cpp asks in slabs of whole rows; a
    range across rows or experts must still be the bf16 file's bytes)."""
    import gguf

    from clover_convert.converter import plan_conversion
    from clover_convert.quantize_stream import _MemFiller
    from clover_convert.safetensors_io import CheckpointReader

    plan = plan_conversion(ck["src"], None, "bf16", None, dry_run=False)
    ref = {t.name: t.data.tobytes() for t in gguf.GGUFReader(ck["bf16"]).tensors}
    reader = CheckpointReader(plan.folder)
    f = _MemFiller(reader)
    try:
        for t in plan.tensors:
            if t.name not in ("blk.0.ffn_down_exps.weight", "blk.0.ssm_out.weight", "output_norm.weight"):
                continue
            whole = ref[t.name]
            for offs, size in ((0, len(whole)), (3, 1001), (len(whole) - 777, 777), (len(whole) // 2 - 5, 10)):
                dst = np.zeros(size, np.uint8)
                f.fill(t, offs, size, dst)
                assert dst.tobytes() == whole[offs:offs + size], (t.name, offs, size)
    finally:
        f.close()
        reader.close()
