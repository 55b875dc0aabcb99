"""One rule, one owner (docs/internals.md, "Who owns which rule"): the front ends read libclover's
rules instead of keeping copies. Each test here fails if a copy creeps back: clover-cli's refusals
are clover_generate_params_check's messages, it accepts what the library accepts (--top-p 0), its
help shows the library's default threshold, and the draft-self figure both tools print is
clover_stats.tokens_per_verification. (The server's and the Python CLI's messages: test_server.py
test_ranges_are_the_runtimes, test_cli_errors.py.)"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from clover_cpp import _native as N

REPO = Path(__file__).resolve().parents[2]
CLI_BIN = REPO / "build" / "bin" / "clover-cli"

pytestmark = pytest.mark.needs_libclover


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI_BIN), *map(str, args)], capture_output=True, text=True, errors="replace",
                          timeout=120)


def _c_message(field: str, value: float) -> str | None:
    gp = N.lib().clover_generate_default_params()
    setattr(gp, field, value)
    return N.generate_params_problem(gp)


@pytest.mark.parametrize("flag,field,value", [("--threshold", "threshold", 2.0), ("--threshold", "threshold", -0.5),
                                              ("--temp", "temperature", -1.0), ("--top-p", "top_p", 1.5),
                                              ("--top-k", "top_k", -1), ("--step-cap", "max_steps", -1)])
def test_clover_cli_refuses_with_libclovers_message(tiny_artifacts, flag: str, field: str, value: float) -> None:
    """clover-cli keeps no range of its own: the one line it prints is the library's."""
    want = _c_message(field, value)
    assert want is not None
    p = _cli("-m", tiny_artifacts["f32"], "-p", "hello", "-t", "1", flag, value)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.splitlines() == [f"error: {want}"]


def test_clover_cli_takes_what_the_library_takes(tiny_artifacts) -> None:
    """--top-p 0 (the most probable token only) is the library's to accept: clover-cli refused it;
    the help's default threshold is clover_generate_default_params's."""
    base = ["-m", tiny_artifacts["f32"], "-p", "hello", "-t", "1", "-n", "8", "--block-size", "4", "--temp", "1"]
    outs = {_cli(*base, "--top-p", "0", "-s", seed).stdout for seed in (1, 2)}
    assert len(outs) == 1 and next(iter(outs)).startswith("hello")
    default = N.lib().clover_generate_default_params().threshold
    assert re.search(rf"--threshold X .*\(default {default:g}, the library's\)", _cli("--help").stdout)


def test_tokens_per_verification_is_libclovers(tiny_artifacts) -> None:
    """The draft-self figure has one owner, clover_stats.tokens_per_verification ((n_accepted +
    n_verifications) / n_verifications): Python's stats carry it, and clover run and clover-cli
    print it for the same call."""
    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1) as m:
        s = m.generate("def add(a, b):", max_tokens=24, block_size=8, draft_self=True, stop_at_eos=False).stats
        assert s.n_verifications > 0
        assert s.tokens_per_verification == (s.n_accepted + s.n_verifications) / s.n_verifications
        assert f"{s.tokens_per_verification:.2f} tok/verification" in s.format()
        plain = m.generate("def add(a, b):", max_tokens=8, block_size=4, stop_at_eos=False).stats
        assert plain.n_verifications == 0 and plain.tokens_per_verification == 0.0
    p = _cli("-m", tiny_artifacts["f32"], "-p", "def add(a, b):", "-n", "24", "-t", "1", "-c", "256",
             "--block-size", "8", "--draft-self", "--ignore-eos")
    assert p.returncode == 0, p.stderr
    assert f"({s.tokens_per_verification:.2f} tokens per verification)" in p.stderr, p.stderr


def test_no_front_end_restates_generates_ranges_or_defaults() -> None:
    """The server declares generate's fields with their JSON types only (no pydantic bounds, no
    default of libclover's: the runtime checks and fills them), and neither the server, the
    clover CLI nor clover-cli writes the default threshold 0.9 (they read the library's)."""
    tree = ast.parse((REPO / "clover_cpp" / "server" / "types.py").read_text(encoding="utf-8"))
    knobs = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Knobs")
    ranged = {"threshold", "max_steps", "temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens"}
    found = []
    for st in knobs.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id in ranged:
            if isinstance(st.value, ast.Call):
                found.append(f"{st.target.id}: {ast.unparse(st.value)}")
            elif st.target.id != "temperature" and not (isinstance(st.value, ast.Constant) and st.value.value is None):
                found.append(f"{st.target.id} = {ast.unparse(st.value)} (the default is Clover.generate's)")
    assert not found, found
    for path in [*(REPO / "clover_cpp" / "server").glob("*.py"), *(REPO / "clover_cpp" / "cli").glob("*.py"),
                 REPO / "native" / "tools" / "clover-cli.cpp"]:
        assert not re.search(r"(?<![\d.])0\.9(?!\d)", path.read_text(encoding="utf-8")), path


def test_clover_cli_block_size_bound_is_clover_context_news(tiny_artifacts) -> None:
    """A block size above -c: clover-cli prints clover_context_new's refusal (its own check with
    its own wording is gone), and so does the Python runtime (clover_context_params_check, before
    loading the model: it restated the rule with its own words), naming block_size."""
    from clover_cpp import Clover, CloverValueError

    import ctypes

    L = N.lib()
    err, n = N.err_buffer()
    model = L.clover_model_load(str(tiny_artifacts["f32"]).encode(), ctypes.byref(L.clover_model_default_params()),
                                err, n)
    assert model
    try:
        cp = L.clover_context_default_params()
        cp.n_ctx, cp.block_size, cp.n_threads = 64, 128, 1
        assert not L.clover_context_new(model, ctypes.byref(cp), err, n)
        want = err.value.decode()
    finally:
        L.clover_model_free(model)
    p = _cli("-m", tiny_artifacts["f32"], "-p", "hello", "-t", "1", "-c", 64, "--block-size", 128)
    assert p.returncode == 1 and p.stderr.splitlines() == [f"error: {want}"], p.stderr
    with pytest.raises(CloverValueError) as e:
        Clover(tiny_artifacts["f32"], n_ctx=64, block_size=128, n_threads=1)
    assert (e.value.message, e.value.param) == (want, "block_size")
    cp = L.clover_context_default_params()
    cp.n_ctx = 2
    assert L.clover_context_params_check(ctypes.byref(cp), err, n) == N.CLOVER_ERR_INVALID_ARG
    with pytest.raises(CloverValueError) as e:
        Clover(tiny_artifacts["f32"], n_ctx=2, block_size=1, n_threads=1)
    assert (e.value.message, e.value.param) == (err.value.decode(), "n_ctx")


def test_stats_after_a_stop_string_are_libclovers(tiny_artifacts) -> None:
    """A stop string ends the output after the call: the stats' rates for the kept tokens come from
    clover_stats_cut (the formulas of clover_stats; Python recomputed them itself)."""
    import ctypes

    from clover_cpp import Clover

    with Clover(tiny_artifacts["f32"], n_ctx=256, n_threads=1) as m:
        kw = dict(max_tokens=24, block_size=4, stop_at_eos=False)
        full = m.generate("def add(a, b):", **kw)
        half = len(full.text) // 2
        stop = full.text[half:half + 2]
        assert stop.strip()
        r = m.generate("def add(a, b):", stop=[stop], **kw)
    s = r.stats
    assert r.text == full.text[:full.text.index(stop)] and r.finish_reason == "stop"
    assert s.n_generated == len(r.tokens) < full.stats.n_generated
    native = N.clover_stats(n_generated=full.stats.n_generated, n_decode_forwards=s.n_decode_forwards,
                            t_decode_ms=s.t_decode_ms)
    assert N.lib().clover_stats_cut(ctypes.byref(native), s.n_generated) == N.CLOVER_OK
    assert (s.tokens_per_forward, s.tokens_per_second) == (native.tokens_per_forward, native.tokens_per_second)
    assert s.tokens_per_forward == s.n_generated / s.n_decode_forwards
    assert N.lib().clover_stats_cut(ctypes.byref(native), -1) == N.CLOVER_ERR_INVALID_ARG
    assert N.lib().clover_stats_cut(None, 1) == N.CLOVER_ERR_INVALID_ARG
