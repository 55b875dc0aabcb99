"""llama.cpp's sampler chain behind Clover's decoding (spec/decoding.md, "Sampler chain"): greedy
B = 1 with penalties is llama-completion's text over our libllama; each sampler changes the
output where it should; draft-self stays B = 1's under the chain; bad values are one-line errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from clover_cpp import Clover
from clover_cpp.errors import CloverError
from clover_testkit.llama_tools import N_CTX, PROMPT, default_gguf, run_logged_tool, tool  # noqa: F401 (fixture)

pytestmark = pytest.mark.needs_libclover

N = 32
REPO = Path(__file__).resolve().parents[2]

# each llama.cpp penalty at a strength that changes the default model's greedy text
PENALTIES = [({"repeat_penalty": 1.5}, ["--repeat-penalty", 1.5]),
             ({"presence_penalty": 1.5}, ["--presence-penalty", 1.5]),
             ({"frequency_penalty": 1.0, "repeat_last_n": 16}, ["--frequency-penalty", 1.0, "--repeat-last-n", 16])]


@pytest.fixture(scope="module")
def model(default_gguf):  # noqa: F811
    with Clover(default_gguf, n_ctx=N_CTX, n_threads=1, block_size=8) as m:
        yield m


def greedy(m: Clover, block_size: int = 1, **kw) -> list[int]:
    return m.generate(PROMPT, max_tokens=N, block_size=block_size, temperature=0, stop_at_eos=False, **kw).tokens


def llama_completion(gguf, flags: list) -> str:
    """llama-completion's greedy text with these sampler flags (its chain: penalties ... temperature 0)."""
    return run_logged_tool([tool("llama-completion"), "-m", gguf, "-p", PROMPT, "-n", N, "--temp", 0, "-t", 1,
                            "-c", N_CTX, "-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup",
                            "--ignore-eos", *flags], last_line="common_perf_print:").stdout


@pytest.mark.parametrize("kw,flags", PENALTIES, ids=lambda x: str(x))
def test_greedy_b1_with_penalties_is_llama_completions(model, default_gguf, kw, flags):  # noqa: F811
    ours = model.detokenize(greedy(model, **kw)).decode()
    assert ours != model.detokenize(greedy(model)).decode(), "the penalty should change the text"
    assert llama_completion(default_gguf, flags).rstrip("\n") == ours.rstrip("\n")  # (the tool ends with a newline)


@pytest.mark.parametrize("kw", [p[0] for p in PENALTIES] + [{"dry_multiplier": 3.0, "dry_allowed_length": 1}])
def test_draft_self_is_b1_under_the_chain(model, kw):
    b1 = greedy(model, **kw)
    assert b1 != greedy(model), "the sampler should change the text"
    assert model.generate(PROMPT, max_tokens=N, block_size=8, temperature=0, stop_at_eos=False, draft_self=True,
                          **kw).tokens == b1


def test_logit_bias_bans_and_forces(model):
    base = greedy(model)
    banned = greedy(model, logit_bias={base[0]: -math.inf})
    assert banned[0] != base[0] and base[0] not in banned
    forced = greedy(model, block_size=8, logit_bias={str(base[3]): 100.0})  # (a JSON object's key)
    assert set(forced) == {base[3]}


def test_penalties_change_block_diffusion(model):
    base = greedy(model, block_size=8)
    pen = greedy(model, block_size=8, repeat_penalty=1.5)
    assert pen != base
    # the penalised history counts the block's own unmasked tokens: fewer repeats than without
    assert len(set(pen)) > len(set(base))


@pytest.mark.parametrize("kw", [{"min_p": 0.3}, {"typical_p": 0.3}, {"top_n_sigma": 0.5},
                                {"xtc_probability": 1.0, "xtc_threshold": 0.05},
                                {"mirostat_mode": 1}, {"mirostat_mode": 2, "mirostat_tau": 2.0},
                                {"samplers": "top_k;temperature", "top_k": 1},
                                {"dynatemp_range": 0.9}, {"dynatemp_range": 0.9, "dynatemp_exponent": 3.0}])
@pytest.mark.parametrize("block_size", [1, 8])
def test_each_sampler_changes_the_seeded_sample(model, kw, block_size):
    def sample(**k):
        return model.generate(PROMPT, max_tokens=N, block_size=block_size, temperature=1.0, seed=7,
                              stop_at_eos=False, **k).tokens
    base = sample()
    out = sample(**kw)
    assert out != base
    assert sample(**kw) == out, "seeded: the same output again"


@pytest.mark.parametrize("kw", [{"min_p": 0.9}, {"top_p": 0.05}])
def test_min_keep_keeps_candidates_the_filter_drops(model, kw):
    def sample(**k):
        return model.generate(PROMPT, max_tokens=N, block_size=1, temperature=1.0, seed=7, stop_at_eos=False,
                              **kw, **k).tokens
    assert sample(min_keep=0) == sample(min_keep=1), "min_keep 1: the filter keeps one anyway"
    assert sample(min_keep=50) != sample(min_keep=0)


def test_top_k_1_through_the_chain_is_greedy_b1(model):
    assert model.generate(PROMPT, max_tokens=N, block_size=1, temperature=1.0, seed=3, stop_at_eos=False,
                          samplers=["top_k", "temperature"], top_k=1).tokens == greedy(model)


@pytest.mark.parametrize("kw,words", [({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
                                      ({"repeat_penalty": 0.0}, "repeat_penalty must be finite and > 0"),
                                      ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
                                      ({"mirostat_mode": 3}, "mirostat must be 0, 1 or 2"),
                                      ({"samplers": "top_k;bogus"}, "samplers: unknown sampler 'bogus'"),
                                      ({"samplers": "kq"}, "samplers: unknown sampler letter 'q'"),
                                      ({"logit_bias": {10 ** 7: 1.0}}, "logit_bias: token 10000000 is past"),
                                      ({"dry_base": 0.5}, "dry_base must be finite and >= 1"),
                                      ({"dynatemp_range": -0.5}, "dynatemp_range must be finite and >= 0"),
                                      ({"dynatemp_exponent": math.inf}, "dynatemp_exponent must be finite and >= 0"),
                                      ({"min_keep": -1}, "min_keep must be >= 0, got -1")])
def test_bad_values_are_one_line_errors(model, kw, words):
    with pytest.raises(CloverError) as e:
        greedy(model, **kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_values_are_refused_before_loading():
    with pytest.raises(CloverError, match=r"^typical_p must be in \(0, 1\], got 0$") as e:
        Clover.check_generate_args(typical_p=0.0)
    assert e.value.param == "typical_p"


CLI_FLAGS = ["--repeat-penalty", "1.5", "--presence-penalty", "0.5", "--samplers", "penalties;top_k;temperature",
             "-l", "5-inf", "--dry-multiplier", "2", "--dry-sequence-breaker", "\n", "--dynatemp-range", "0.5",
             "--dynatemp-exp", "2", "--min-keep", "3"]


def cli_text(args: list) -> str:
    res = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("exe", ["clover-cli", "clover run"])
def test_the_command_lines_take_llama_clis_sampler_flags(model, default_gguf, exe):  # noqa: F811
    want = model.detokenize(greedy(model, repeat_penalty=1.5, presence_penalty=0.5, logit_bias={5: -math.inf},
                                   samplers="penalties;top_k;temperature", dry_multiplier=2.0,
                                   dry_sequence_breakers=["\n"], dynatemp_range=0.5, dynatemp_exponent=2.0,
                                   min_keep=3)).decode()
    cmd = [REPO / "build" / "bin" / "clover-cli"] if exe == "clover-cli" else [sys.executable, "-m", "clover_cpp.cli", "run"]
    common = ["-m", default_gguf, "-p", PROMPT, "-n", N, "--block-size", 1, "--ignore-eos", "--no-echo", "-c", N_CTX]
    assert cli_text(cmd + common + CLI_FLAGS).rstrip("\n") == want.rstrip("\n")
    bad = subprocess.run([str(a) for a in cmd + common + ["--min-p", "2"]], capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert bad.returncode != 0 and "min_p must be in [0, 1], got 2" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_windows_past_the_context_are_the_context(model):
    """repeat_last_n / dry_penalty_last_n past n_ctx are n_ctx (llama.cpp would allocate the window)."""
    big = dict(repeat_penalty=1.5, dry_multiplier=1.0, repeat_last_n=2**31 - 1, dry_penalty_last_n=2**31 - 1)
    assert greedy(model, **big) == greedy(model, **dict(big, repeat_last_n=-1, dry_penalty_last_n=-1))


def test_grammar_then_the_chain_and_draft_self_stays_b1(model):
    """The grammar applies first, then the chain; draft-self's verification of a constrained call stays
    the constrained B = 1 output under the chain."""
    g = 'root ::= [a-z ]+'
    kw = dict(grammar=g, repeat_penalty=1.5, presence_penalty=0.5)
    b1 = model.generate(PROMPT, max_tokens=N, block_size=1, temperature=0, **kw)
    assert b1.text.strip() and set(b1.text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert b1.tokens != model.generate(PROMPT, max_tokens=N, block_size=1, temperature=0, grammar=g).tokens
    ds = model.generate(PROMPT, max_tokens=N, block_size=8, temperature=0, draft_self=True, **kw)
    assert ds.stats.grammar_mode == "draft-self" and ds.tokens == b1.tokens


def test_draft_self_acceptance_reads_the_post_chain_distribution(model):
    """At temperature > 0 draft-self accepts against the distributions after the chain: with top_k 1 in
    the chain they are one-hot, so every mode gives greedy B = 1's text under the same penalties."""
    want = greedy(model, repeat_penalty=1.5)
    kw = dict(max_tokens=N, temperature=1.0, stop_at_eos=False, samplers="penalties;top_k;temperature", top_k=1,
              repeat_penalty=1.5)
    for seed in (1, 2):
        assert model.generate(PROMPT, block_size=1, seed=seed, **kw).tokens == want
        assert model.generate(PROMPT, block_size=8, draft_self=True, seed=seed, **kw).tokens == want
