"""The ``clover`` command's file and measuring subcommands through click's CliRunner: --help of
each, convert, inspect, quantize, bench, demo and perplexity."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from clover_testkit.cli_runs import assert_user_error, clover_process, files, invoke  # noqa: F401

needs_lib = pytest.mark.needs_libclover


# ----------------------------------------------------------------------------- help

@pytest.mark.parametrize("cmd", [[], ["convert"], ["quantize"], ["run"], ["chat"], ["inspect"], ["bench"], ["demo"],
                                 ["perplexity"]])
def test_help(cmd: list[str]) -> None:
    res = invoke(cmd + ["--help"])
    assert res.exit_code == 0
    assert "Usage: clover" in res.output


# ----------------------------------------------------------------------------- happy paths

def test_convert(files, tmp_path: Path) -> None:
    out = tmp_path / "conv.gguf"
    res = invoke(["convert", files["ck"], out, "--outtype", "f16"])
    assert res.exit_code == 0, res.output
    assert out.is_file() and "wrote" in res.output
    res = invoke(["convert", files["ck"], tmp_path / "dry.gguf", "--dry-run"])
    assert res.exit_code == 0 and "token_embd.weight" in res.output
    assert not (tmp_path / "dry.gguf").exists()
    assert_user_error(invoke(["convert", files["ck"], out]), "already exists")
    assert invoke(["convert", files["ck"], out, "--force", "--outtype", "q8_0"]).exit_code == 0


def _gguf_tensor_count(cfg: dict) -> int:
    """The GGUF tensors of a checkpoint with this config: its HF tensors (hf_tensor_shapes) with
    each layer's experts stacked into one."""
    from clover_testkit.reference import CloverConfig, hf_tensor_shapes

    c = CloverConfig.from_dict(cfg)
    return len({re.sub(r"experts\.\d+\.", "experts.", n) for n in hf_tensor_shapes(c, c.tie_word_embeddings)})


def test_inspect(files, tiny_artifacts) -> None:
    from tokenizers import Tokenizer

    from clover_testkit import bpe

    cfg = tiny_artifacts["cfg"]
    n_tensors = _gguf_tensor_count(cfg)
    mask = Tokenizer.from_file(str(files["ck"] / "tokenizer.json")).token_to_id(bpe.MASK_TOKEN)
    res = invoke(["inspect", files["model"]])
    assert res.exit_code == 0, res.output
    for needle in ("architecture:  clover", "diffusion.block_size", "token_embd.weight",
                   "tokenizer:", f"mask {mask}", "chat template: yes"):
        assert needle in res.output
    assert re.search(rf"^tensors:\s+{n_tensors} \(", res.output, re.M), res.output
    res = invoke(["inspect", files["model"], "--json"])
    d = json.loads(res.output)
    assert d["architecture"] == "clover" and d["n_tensors"] == n_tensors
    assert d["hyperparameters"]["block_count"] == cfg["num_hidden_layers"]
    assert len(invoke(["inspect", files["model"], "--tensors"]).output.splitlines()) > n_tensors


@needs_lib
def test_quantize(files, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    res = invoke(["quantize", files["model"], out, "q8_0", "-t", "1"])
    assert res.exit_code == 0, res.output
    assert out.is_file() and "Q8_0" in res.output
    assert "Q8_0" in invoke(["inspect", out]).output
    assert_user_error(invoke(["quantize", files["model"], out, "Q4_K_M"]), "already exists")
    res = invoke(["quantize", files["model"], out, "Q4_K_M", "--force", "-t", "1"])
    assert res.exit_code == 0, res.output
    assert "Q4_K_M" in invoke(["inspect", out]).output
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@needs_lib
def test_bench(files) -> None:
    res = invoke(["bench", "-m", files["model"], "--block-sizes", "4,8", "-n", "16", "-t", "1"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    rows = [ln.split() for ln in lines if ln.strip() and ln.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "4", "8"]  # B = 1 added as the baseline
    assert "3 paired rounds" in res.stdout
    # B = 1 against itself: every paired ratio is 1
    assert rows[0][-2:] == ["1.00x", "(1.00-1.00)"]
    assert all(r[3].startswith("(") and "-" in r[3] for r in rows)   # the tok/s spread


def test_speed_verdict() -> None:
    """A speed-up or slow-down only when every paired round agrees; a range over 1.0 is none."""
    from clover_cpp.demo import speed_verdict

    assert speed_verdict([1.4]).startswith("no verdict")
    assert speed_verdict([0.9, 1.3, 1.1]).startswith("no measurable speed-up: 1.10x (0.90-1.30)")
    assert speed_verdict([1.2, 1.5, 1.3]).startswith("speed-up 1.30x (1.20-1.50), median of 3 paired rounds")
    assert speed_verdict([0.3, 0.25, 0.32]).startswith("slow-down 0.30x")


@needs_lib
def test_demo(files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo on a GGUF (CLOVER_DEMO_MODEL): the prompt echoed, the stats, the paired B = 1 rounds."""
    from clover_cpp.cli.bench import DEFAULT_DEMO_PROMPT

    monkeypatch.setenv("CLOVER_DEMO_MODEL", str(files["model"]))
    cache = tmp_path / "cache"
    res = invoke(["demo", "--cache-dir", cache, "-n", "16", "-t", "1", "--no-visual"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(DEFAULT_DEMO_PROMPT)
    assert str(files["model"]) in res.stderr and "converting" not in res.stderr  # a GGUF is used as it is
    assert "block size auto" in res.stderr and "[clover] B=" in res.stderr
    assert ("speed-up" in res.stderr or "slow-down" in res.stderr) and "5 paired rounds" in res.stderr
    res = invoke(["demo", "--cache-dir", cache, "-n", "8", "-t", "1", "--no-visual", "--no-compare", "--block-size", "8"])
    assert res.exit_code == 0 and "[clover] B=8" in res.stderr and "speed-up" not in res.stderr, res.output


def test_demo_without_a_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installation without models/clover-default (and no CLOVER_DEMO_MODEL): one line that says
    how to get a model, exit 1, nothing written (the demo no longer builds a random-weight fixture)."""
    import clover_cpp.demo as demo_mod

    monkeypatch.delenv("CLOVER_DEMO_MODEL", raising=False)
    monkeypatch.setattr(demo_mod, "default_model_locations", lambda: [tmp_path / "models" / "clover-default"])
    assert demo_mod.bundled_model_dir() is None
    cache = tmp_path / "cache"
    res = invoke(["demo", "--cache-dir", cache, "-n", "4", "--no-visual"])
    assert res.exit_code == 1 and res.stdout == "", res.output
    assert res.stderr.splitlines() == ["error: this installation has no default model (models/clover-default): set "
                                       "CLOVER_DEMO_MODEL to a Clover checkpoint folder or .gguf, e.g. the "
                                       "repository's models/clover-default"], res.stderr
    assert not cache.exists()


@needs_lib
def test_demo_prefers_bundled_checkpoint(files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint folder in models/clover-default (here: CLOVER_DEMO_MODEL) is used first."""
    monkeypatch.setenv("CLOVER_DEMO_MODEL", str(files["ck"]))
    cache = tmp_path / "cache"
    res = invoke(["demo", "--cache-dir", cache, "-n", "8", "-t", "1", "--no-visual", "--no-compare"])
    assert res.exit_code == 0, res.output
    assert str(files["ck"]) in res.stderr
    assert list(cache.glob("clover-default-*-f16.gguf"))


def _llama_perplexity(ref, toks: list[int], n_ctx: int, bos: int | None) -> tuple[float, int, int]:
    """Perplexity as llama-perplexity computes it, on the float64 reference's causal logits:
    chunks of n_ctx tokens (the tail dropped), each on a fresh memory with its first token
    replaced by BOS when the model adds one, scored on its second half. (ppl, chunks, scored)"""
    from clover_testkit import reference as R

    first, nll, count = n_ctx // 2, 0.0, 0
    for i in range(len(toks) // n_ctx):
        chunk = toks[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        rows = R.causal_logits(ref, chunk)[first:n_ctx - 1]
        logp = rows - rows.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        nll -= float(logp[np.arange(len(rows)), chunk[first + 1:]].sum())
        count += len(rows)
    return float(np.exp(nll / count)), len(toks) // n_ctx, count


@needs_lib
def test_perplexity(files, tmp_path: Path) -> None:
    """clover perplexity -m MODEL TEXT_FILE -c N prints llama-perplexity's line with the figure of
    the reference computed the llama-perplexity way; a missing file or a text shorter than two
    chunks is one error line."""
    import re

    from clover_cpp import Clover
    from clover_testkit.presets import FIXTURE_TEXT
    from clover_testkit.reference import CloverReference

    n_ctx = 16
    text = tmp_path / "text.txt"
    text.write_text(FIXTURE_TEXT[:200], encoding="utf-8")
    with Clover(files["model"], n_threads=1) as m:
        toks = m.tokenize(text.read_text(encoding="utf-8"), add_bos=True, special=True)
        plain = m.tokenize(text.read_text(encoding="utf-8"), add_bos=False, special=True)
    bos = toks[0] if len(toks) == len(plain) + 1 else None
    assert len(toks) // n_ctx >= 3 and len(toks) % n_ctx, "pick another text: 3+ chunks and a dropped tail"
    want, n_chunks, n_scored = _llama_perplexity(CloverReference.from_pretrained(files["ck"]), toks, n_ctx, bos)
    for args in ([text, "-c", n_ctx], ["-f", text, "--ctx-size", n_ctx]):
        res = invoke(["perplexity", "-m", files["model"], *args, "-t", "1"])
        assert res.exit_code == 0, res.output
        got = re.fullmatch(r"Final estimate: PPL = ([0-9]+\.[0-9]{4}) \+/- [0-9]+\.[0-9]{5} \((\d+) chunks of (\d+) "
                           r"tokens, (\d+) positions scored\)\n", res.stdout)
        assert got, res.stdout
        assert float(got.group(1)) == pytest.approx(want, rel=1e-4)
        assert [int(g) for g in got.groups()[1:]] == [n_chunks, n_ctx, n_scored]
    # errors: one line, nothing on stdout
    assert_user_error(invoke(["perplexity", "-m", files["model"], tmp_path / "none.txt"]), "none.txt")
    short = tmp_path / "short.txt"
    short.write_text(FIXTURE_TEXT[:40], encoding="utf-8")
    assert_user_error(invoke(["perplexity", "-m", files["model"], short, "-c", n_ctx, "-t", "1"]),
                      f"at least {2 * n_ctx} tokens")
    assert_user_error(invoke(["perplexity", "-m", files["model"], text, "-f", text]), "once")
    p = clover_process(["perplexity", "-m", files["model"], tmp_path / "none.txt"])
    assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ") and "none.txt" in p.stderr
