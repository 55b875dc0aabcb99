"""clover imatrix: importance data from causal commits and block passes, in llama.cpp's format."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.needs_libclover

WIDE = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)
BIN = Path(__file__).resolve().parents[2] / "build" / "bin"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from clover_convert import convert
    from clover_testkit.checkpoints import write_checkpoint
    from clover_testkit.presets import FIXTURE_TEXT

    d = tmp_path_factory.mktemp("imatrix")
    ck = d / "ck"
    write_checkpoint(ck, preset="tiny", dtype="bf16", config_overrides=WIDE)
    out = {"dir": d, "ck": ck, "f32": d / "f32.gguf", "bf16": d / "bf16.gguf"}
    convert(ck, out["f32"], outtype="f32", progress=False)
    convert(ck, out["bf16"], outtype="bf16", progress=False)
    out["text"] = d / "calib.txt"
    out["text"].write_text(FIXTURE_TEXT, encoding="utf-8")
    return out


def _layer0_inputs(f32: Path, tokens: list[int]) -> np.ndarray:
    """numpy: the input of layer 0's first matmul for each token: rmsnorm(embedding) * attn_norm
    (it depends on the token only)."""
    import gguf

    r = gguf.GGUFReader(f32)
    t = {x.name: np.asarray(x.data, dtype=np.float64) for x in r.tensors}
    eps = float(r.fields["clover.attention.layer_norm_rms_epsilon"].contents())
    x = t["token_embd.weight"][tokens]
    return x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + eps) * t["blk.0.attn_norm.weight"]


@pytest.mark.parametrize("ratios", [(), (1.0,)])
def test_sums_are_the_activations(files: dict, ratios: tuple) -> None:
    """Layer 0's in-projection sees rmsnorm(embedding) of every token run: the committed text
    and, with block passes at mask ratio 1, a canvas of mask tokens per decode block. The
    collected sums and counts equal numpy's over exactly those tokens."""
    from clover_cpp.imatrix import collect_imatrix
    from clover_cpp.model import Clover

    text = files["text"].read_text(encoding="utf-8")
    n_ctx = 128
    coll, n = collect_imatrix(files["f32"], text, n_ctx=n_ctx, mask_ratios=ratios, max_chunks=2, n_threads=1)
    assert n == 2 and coll.error is None
    with Clover(files["f32"], n_ctx=n_ctx, n_threads=1) as m:
        toks, bos, mask, B = m.tokenize(text, add_bos=True, special=True), m.bos_token, m.mask_token, m.block_size
    run: list[int] = []
    for i in range(n):
        chunk = list(toks[i * n_ctx:(i + 1) * n_ctx])
        if bos >= 0:
            chunk[0] = bos
        run += chunk
        if ratios:
            run += [mask] * sum(min(B, n_ctx - p) for p in range(n_ctx // 2, n_ctx, B) if min(B, n_ctx - p) >= 2)
    want = (_layer0_inputs(files["f32"], run) ** 2).sum(axis=0)
    e = coll.stats["blk.0.attn_qkv.weight"]
    assert e.counts.tolist() == [len(run)]
    np.testing.assert_allclose(e.values[0], want, rtol=2e-5)
    # every matrix of every layer has data; stacked experts one row of sums per expert, and the
    # routed rows (top-k per token) add up to k per token
    for i in range(4):
        for w in ("ffn_gate_inp", "ffn_up_shexp", "ffn_down_exps"):
            assert f"blk.{i}.{w}.weight" in coll.stats
        ex = coll.stats[f"blk.{i}.ffn_up_exps.weight"]
        assert ex.values.shape == (8, 256) and ex.counts.sum() == 2 * len(run)
    assert "output.weight" not in coll.stats and "token_embd.weight" not in coll.stats


def test_file_round_trip_and_quantizers_read_it(files: dict, tmp_path: Path) -> None:
    import gguf

    from clover_convert.quantize_stream import convert_quantized
    from clover_cpp.imatrix import collect_imatrix, write_imatrix
    from clover_cpp.quant import quantize
    from clover_gguf.quant import load_imatrix

    coll, n = collect_imatrix(files["bf16"], files["text"].read_text(encoding="utf-8"), n_ctx=128, max_chunks=1,
                              n_threads=1)
    im = write_imatrix(coll, tmp_path / "calib.imatrix.gguf", ["calib.txt"], n, 128)
    r = gguf.GGUFReader(im)
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["calib.txt"]
    assert r.fields["imatrix.chunk_count"].contents() == 1 and r.fields["imatrix.chunk_size"].contents() == 128
    names = [t.name for t in r.tensors]  # as llama-imatrix: weights sorted, in_sum2 then counts
    weights = [n[:-len(".in_sum2")] for n in names[::2]]
    assert weights == sorted(weights) and names[1::2] == [w + ".counts" for w in weights]
    assert names[::2] == [w + ".in_sum2" for w in weights]
    back = load_imatrix(im)  # clover quantize's reader: sums over counts per expert
    for name, e in coll.stats.items():
        want = (e.values / np.maximum(e.counts, 1)[:, None]).astype(np.float32).reshape(-1)
        np.testing.assert_allclose(back.entries[name], want, rtol=1e-6)
    # clover quantize, the one-step convert and llama-quantize all take it, to the same tensors
    a = quantize(files["bf16"], tmp_path / "a.gguf", "IQ4_XS", imatrix=im, n_threads=1)
    b = convert_quantized(files["ck"], tmp_path / "b.gguf", "IQ4_XS", imatrix=im, n_threads=1, progress=False).out
    assert a.read_bytes() == b.read_bytes()
    res = subprocess.run([str(BIN / "llama-quantize"), "--imatrix", str(im), str(files["bf16"]), str(tmp_path / "c.gguf"),
                          "IQ4_XS", "1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    ta = {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(a).tensors}
    tc = {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(tmp_path / "c.gguf").tensors}
    assert ta == tc
    assert any(tt == gguf.GGMLQuantizationType.IQ4_XS for tt, _ in ta.values())
    # the data matters: without the importance matrix the IQ4_XS tensors differ
    plain = quantize(files["bf16"], tmp_path / "plain.gguf", "IQ4_XS", n_threads=1)
    tp = {t.name: t.data.tobytes() for t in gguf.GGUFReader(plain).tensors}
    assert any(tp[k] != v for k, (_, v) in ta.items())


def test_cli(files: dict, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from clover_cpp.cli import cli

    out = tmp_path / "im.gguf"
    args = ["imatrix", "-m", str(files["bf16"]), "-f", str(files["text"]), "-o", str(out), "-c", "128", "--chunks", "1",
            "-t", "1"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert out.is_file() and "chunks of 128 tokens" in r.output
    for extra, why in (([], "exists"), (["--no-causal", "--mask-ratios", "", "--force"], "collects nothing"),
                       (["--mask-ratios", "0", "--force"], "mask ratios")):
        r = CliRunner().invoke(cli, args + extra)
        assert r.exit_code == 1 and why in r.output and "Traceback" not in r.output, (extra, r.output)
