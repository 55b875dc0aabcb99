"""clover kld: KL divergence of a quantized file from its base, causal and on block passes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.needs_libclover

WIDE = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from clover_convert import convert
    from clover_convert.quantize_stream import convert_quantized
    from clover_testkit.checkpoints import write_checkpoint
    from clover_testkit.presets import FIXTURE_TEXT

    d = tmp_path_factory.mktemp("kld")
    ck = d / "ck"
    write_checkpoint(ck, preset="tiny", dtype="bf16", config_overrides=WIDE)
    out = {"f16": d / "f16.gguf"}
    convert(ck, out["f16"], outtype="f16", progress=False)
    for q in ("Q8_0", "Q4_K_M"):
        out[q] = convert_quantized(ck, d / f"{q}.gguf", q, n_threads=1, progress=False).out
    text = d / "text.txt"
    text.write_text(FIXTURE_TEXT, encoding="utf-8")
    out["text"] = text
    return out


def test_stats_are_the_definitions() -> None:
    """KLDStats: KL(P || Q) = sum P log(P / Q) per row, argmax agreement, next-token NLL."""
    from clover_cpp.kld import KLDStats

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 11)).astype(np.float32), rng.normal(size=(5, 11)).astype(np.float32)
    t = rng.integers(0, 11, 5)
    s = KLDStats()
    s.add(a, b, t)
    P = np.exp(a.astype(np.float64)) / np.exp(a.astype(np.float64)).sum(1, keepdims=True)
    Q = np.exp(b.astype(np.float64)) / np.exp(b.astype(np.float64)).sum(1, keepdims=True)
    want = (P * np.log(P / Q)).sum(1)
    np.testing.assert_allclose(s.values, want, rtol=1e-12)
    r = s.summary()
    assert r["top1_agree"] == np.mean(a.argmax(1) == b.argmax(1))
    assert math.isclose(r["ppl_base"], math.exp(-np.log(P[np.arange(5), t]).mean()), rel_tol=1e-12)
    assert math.isclose(r["ppl_ratio"], r["ppl_quant"] / r["ppl_base"])


def test_kld_self_zero_and_q4_worse_than_q8(files: dict) -> None:
    from clover_cpp.kld import kl_divergence
    from clover_cpp.model import Clover

    text = files["text"].read_text(encoding="utf-8")
    res = {}
    with Clover(files["f16"], n_ctx=128, n_threads=1) as base:
        for q in ("f16", "Q8_0", "Q4_K_M"):
            with Clover(files[q], n_ctx=128, n_threads=1) as m:
                res[q] = kl_divergence(base, m, text, n_ctx=128, max_chunks=2, mask_ratios=(1.0, 0.5))
                assert base.n_committed == 0 and m.n_committed == 0
    same = res["f16"]
    for s in (same.causal, *same.blocks.values()):
        assert s["n"] > 0 and s["mean_kld"] == 0.0 and s["max_kld"] == 0.0 and s["top1_agree"] == 1.0
        assert s["ppl_ratio"] == 1.0
    assert same.causal["n"] == 2 * 64  # the second half of each chunk
    for path in ("causal", 1.0, 0.5):
        k8 = res["Q8_0"].causal if path == "causal" else res["Q8_0"].blocks[path]
        k4 = res["Q4_K_M"].causal if path == "causal" else res["Q4_K_M"].blocks[path]
        assert 0.0 < k8["mean_kld"] < k4["mean_kld"], (path, k8, k4)
        assert k4["top1_agree"] < 1.0
    # the same seed, the same canvases: the same numbers
    with Clover(files["f16"], n_ctx=128, n_threads=1) as base, Clover(files["Q4_K_M"], n_ctx=128, n_threads=1) as m:
        again = kl_divergence(base, m, text, n_ctx=128, max_chunks=2, mask_ratios=(1.0, 0.5))
    assert again.blocks == res["Q4_K_M"].blocks and again.causal == res["Q4_K_M"].causal


def test_cli(files: dict, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from clover_cpp.cli import cli

    r = CliRunner().invoke(cli, ["kld", str(files["f16"]), str(files["Q8_0"]), str(files["text"]), "-c", "128",
                                 "--chunks", "1", "--mask-ratios", "1", "-t", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["causal"]["mean_kld"] > 0 and out["blocks"]["1"]["n"] > 0
    r = CliRunner().invoke(cli, ["kld", str(files["f16"]), str(files["Q8_0"]), str(files["text"]), "-c", "128",
                                 "--chunks", "1", "--mask-ratios", "", "-t", "1"])
    assert r.exit_code == 0 and "causal" in r.output and "block B=" not in r.output, r.output
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n", encoding="utf-8")
    for args, why in (([str(files["text"]), "-c", "128", "--mask-ratios", "2"], "mask ratios"),
                      ([str(short), "-c", "128"], "fewer than one chunk"),
                      ([str(tmp_path / "none.txt")], "cannot read")):
        r = CliRunner().invoke(cli, ["kld", str(files["f16"]), str(files["Q8_0"]), *args])
        assert r.exit_code == 1 and why in r.output and "Traceback" not in r.output, (args, r.output)
