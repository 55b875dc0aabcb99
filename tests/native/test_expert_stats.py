"""The routed experts of the block passes (clover_context_params.expert_stats ->
clover_stats.experts_per_pass / expert_bytes_per_pass / expert_bytes_b1, GenerationStats) and the
coreset "auto" (CLOVER_CORESET_AUTO: measured at the first generation, tests/native/test_coreset_auto.py
injects the measurements). On the tiny preset (8 experts, top 2: auto is 6 or off)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from clover_cpp import _native as N

from clover_testkit.native_handles import (L, Model, artifacts, model, random_prompt, ref,  # noqa: F401
                                           vocab_hi)

pytestmark = pytest.mark.needs_libclover


def expert_bytes(gguf) -> tuple[list[float], int, int]:
    """One routed expert's bytes per layer (ffn_gate/up/down_exps over their expert count), E and
    k, read with gguf-py: independent of libclover's count."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    field = lambda key: int(r.fields[f"{arch}.{key}"].parts[-1][0])  # noqa: E731
    n_layer, n_expert, k = field("block_count"), field("expert_count"), field("expert_used_count")
    per = [0.0] * n_layer
    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            per[int(parts[1])] += int(t.n_bytes) / n_expert
    return per, n_expert, k


def run(gguf, prompt, *, block_size, coreset=None, expert_stats=True, **kw):
    from clover_cpp import Clover

    with Clover(gguf, n_ctx=256, n_threads=2, block_size=block_size, kv_f32=True, flash_attn=False,
                coreset=coreset, expert_stats=expert_stats) as m:
        return m.generate(prompt, max_tokens=kw.pop("max_tokens", 24), stop_at_eos=False, seed=0, **kw)


def test_distinct_experts_and_bytes(artifacts, vocab_hi):
    per, n_expert, k = expert_bytes(artifacts["f32"])
    assert len(set(per)) == 1  # (the tiny preset: one expert size, so bytes = mean distinct x layers x size)
    n_layer, size = len(per), per[0]
    prompt = random_prompt(11, 8, vocab_hi)
    full = run(artifacts["f32"], prompt, block_size=8, threshold=0.9).stats
    assert full.n_expert_passes == full.n_decode_passes > 0
    assert k < full.experts_per_pass <= n_expert
    assert full.expert_bytes_b1 == pytest.approx(n_layer * k * size)
    assert full.expert_bytes_per_pass == pytest.approx(full.experts_per_pass * n_layer * size)
    assert full.expert_bytes_ratio == pytest.approx(full.experts_per_pass / k)
    assert f"experts/pass {full.experts_per_pass:.2f}" in full.format() and "x B = 1" in full.format()
    for C in (1, 3, 4):
        s = run(artifacts["f32"], prompt, block_size=8, threshold=0.9, coreset=C).stats
        assert s.n_expert_passes > 0 and k <= s.experts_per_pass <= max(C, k)
        assert s.expert_bytes_per_pass == pytest.approx(s.experts_per_pass * n_layer * size)
    # draft-self's drafts are block passes too; its verifications (causal commits) are not
    ds = run(artifacts["f32"], prompt, block_size=8, draft_self=True, coreset=3).stats
    assert ds.n_verifications > 0 and 0 < ds.n_expert_passes <= ds.n_decode_passes
    assert k <= ds.experts_per_pass <= 3
    # B = 1: no block passes
    ar = run(artifacts["f32"], prompt, block_size=1).stats
    assert ar.n_expert_passes == 0 and ar.experts_per_pass == 0 and ar.expert_bytes_per_pass == 0
    assert "experts/pass" not in ar.format()
    # off (the default): nothing counted, the same tokens
    off = run(artifacts["f32"], prompt, block_size=8, threshold=0.9, expert_stats=False)
    assert off.stats.n_expert_passes == 0 and off.stats.expert_bytes_b1 == 0
    assert off.tokens == run(artifacts["f32"], prompt, block_size=8, threshold=0.9).tokens


@pytest.mark.parametrize("C", [None, 4])
def test_first_pass_matches_the_reference_routing(artifacts, ref, vocab_hi, C):
    """One block of one pass (threshold 0 unmasks every position): the count equals the numpy
    reference's routing of that all-mask canvas (the last layer without a coreset runs only the
    rows whose logits are read: rows 0..B-2)."""
    B = 8
    prompt = random_prompt(21, 6, vocab_hi)
    s = run(artifacts["f32"], prompt, block_size=B, threshold=0.0, max_tokens=B, coreset=C).stats
    assert s.n_expert_passes == 1
    mem = ref.new_memory()
    ref.commit(mem, prompt)
    _, layers = ref.trace(mem, [ref.cfg.mask_token_id] * B, B, coreset=C)
    distinct = [len(np.unique(np.asarray(rec["experts"])[: B - 1 if (i == len(layers) - 1 and not C) else B]))
                for i, rec in enumerate(layers)]
    assert s.experts_per_pass == pytest.approx(np.mean(distinct))


def test_expert_stats_rule():
    eb, el = N.err_buffer()
    cp = L.clover_context_default_params()
    assert cp.expert_stats == 0
    cp.expert_stats = 2
    assert L.clover_context_params_check(ctypes.byref(cp), eb, el) == N.CLOVER_ERR_INVALID_ARG
    assert eb.value.decode() == "expert_stats must be 0 or 1, got 2"


def test_coreset_auto(model, artifacts, vocab_hi, tmp_path):
    from clover_cpp import Clover

    eb, el = N.err_buffer()
    cp = L.clover_context_default_params()
    cp.n_ctx, cp.block_size, cp.coreset = 64, 4, N.CLOVER_CORESET_AUTO
    c = L.clover_context_new(model.p, ctypes.byref(cp), eb, el)
    assert c, eb.value.decode()
    try:
        # undecided until a generation measures it; then 3 k = 6 where this machine's pass is 10%
        # faster with it and agrees with full routing, else off (a CPU: the same time, docs/benchmarks.md)
        assert L.clover_coreset(c) == N.CLOVER_CORESET_AUTO
        assert L.clover_set_coreset(c, 0, eb, el) == N.CLOVER_OK and L.clover_coreset(c) == 0
        assert L.clover_set_coreset(c, N.CLOVER_CORESET_AUTO, eb, el) == N.CLOVER_OK
        assert L.clover_coreset(c) == N.CLOVER_CORESET_AUTO
    finally:
        L.clover_context_free(c)
    prompt = random_prompt(31, 5, vocab_hi)
    with Clover(artifacts["f32"], n_ctx=128, n_threads=2, block_size=8, coreset="auto") as m:
        assert m.coreset == N.CLOVER_CORESET_AUTO
        assert m.generate(prompt, max_tokens=4, coreset=None).stats.coreset == 0
        m.coreset = None
        auto = m.generate(prompt, max_tokens=4, coreset="auto").stats.coreset
        assert auto in (0, 6)
        m.coreset = "auto"
        assert m.coreset == auto  # decided once per context
    # draft-self with the auto coreset: block size 1's output
    b1 = run(artifacts["f32"], prompt, block_size=1, expert_stats=False).tokens
    ds = run(artifacts["f32"], prompt, block_size=8, draft_self=True, coreset="auto", expert_stats=False)
    assert ds.stats.coreset in (0, 6) and ds.tokens == b1
    # 3 k >= E: off
    from clover_convert import convert
    from clover_testkit.checkpoints import write_checkpoint

    write_checkpoint(tmp_path / "ck", preset="tiny", dtype="f32", config_overrides={"num_experts_per_tok": 3})
    convert(tmp_path / "ck", tmp_path / "k3.gguf", outtype="f32", progress=False)
    with Clover(tmp_path / "k3.gguf", n_ctx=64, n_threads=1, block_size=4, coreset="auto") as m:
        m.generate([1, 2, 3], max_tokens=1)
        assert m.coreset == 0  # no candidate: nothing to measure


def test_server_coreset_auto(tiny_server):
    """A request's coreset "auto": the reply's clover.coreset is the C it resolved to (measured:
    6 or off on the tiny preset)."""
    import httpx

    server, _ = tiny_server
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4,
                                                         "temperature": 0, "block_size": 4, "coreset": "auto"},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["clover"]["coreset"] in (0, 6)


def test_low_level_passes_counted(artifacts, ref, vocab_hi):
    """Clover.expert_stats(): the block passes since the count last started (block_logits
    included: every row, so every layer counts the whole canvas), then afresh; refused without
    expert_stats."""
    from clover_cpp import Clover, CloverError

    prompt, B = random_prompt(41, 6, vocab_hi), 8
    canvas = random_prompt(42, B, vocab_hi)
    with Clover(artifacts["f32"], n_ctx=128, n_threads=2, block_size=B, kv_f32=True, flash_attn=False,
                expert_stats=True) as m:
        m.expert_stats()
        m.block_logits(canvas, commit_before=prompt)
        s = m.expert_stats()
        assert m.expert_stats().n_expert_passes == 0
    mem = ref.new_memory()
    ref.commit(mem, prompt)
    _, layers = ref.trace(mem, canvas, B)
    assert s.n_expert_passes == 1
    assert s.experts_per_pass == pytest.approx(np.mean([len(np.unique(rec["experts"])) for rec in layers]))
    with Clover(artifacts["f32"], n_ctx=64, n_threads=1, block_size=4) as m:
        with pytest.raises(CloverError):
            m.expert_stats()


def test_slice_benchmark_smoke():
    """benchmarks/coreset_slice.py --smoke: the whole script (build, Q4_K_M, counts, times) on the
    tiny preset; its table has a row per B, canvas and C, with C = 3 k and k."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "coreset_slice.py"
    r = subprocess.run([sys.executable, str(script), "--smoke", "--reps", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 8 ") or line.startswith("| 32 ")]
    assert len(rows) == 2 * 2 * 3 and {row.split("|")[3].strip() for row in rows} == {"off", "6", "2"}
    assert "SMOKE RUN" in r.stdout


def test_command_lines(artifacts):
    """--expert-stats and --coreset auto on clover run and clover-cli: the stats lines say the count."""
    import subprocess

    from clover_testkit.native_handles import CLI, REPO

    r = subprocess.run([str(REPO / ".venv" / "bin" / "clover"), "run", "-m", str(artifacts["f32"]), "-p", "hello",
                        "-n", "16", "--no-visual", "--block-size", "8", "--coreset", "auto", "--expert-stats"],
                       capture_output=True, text=True, errors="replace", timeout=300)
    assert r.returncode == 0, r.stderr
    # auto is measured: 6, or off (then the line names no coreset)
    assert ("coreset 6" in r.stderr or "coreset" not in r.stderr) and "experts/pass" in r.stderr
    assert "x B = 1" in r.stderr
    if CLI.exists():
        r = subprocess.run([str(CLI), "-m", str(artifacts["f32"]), "-p", "hello", "-n", "16", "--block-size", "8",
                            "--coreset", "auto", "--expert-stats"], capture_output=True, text=True, errors="replace",
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert "distinct routed experts per MoE layer of a block pass" in r.stderr
