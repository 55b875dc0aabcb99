"""The ``clover`` command's user errors: one ``error:`` line, exit status 1, no traceback (bad
model files, bad flags, libclover's ranges, a refused run with nothing on stdout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clover_testkit.cli_runs import CLI_BIN, assert_user_error, files, invoke  # noqa: F401

needs_lib = pytest.mark.needs_libclover


# ----------------------------------------------------------------------------- user errors

@pytest.mark.parametrize("case", ["missing", "junk", "llama", "folder"])
@pytest.mark.parametrize("cmd", ["run", "inspect", "quantize", "bench"])
def test_bad_model_files(files, tmp_path: Path, case: str, cmd: str) -> None:
    path = {"missing": tmp_path / "nope.gguf", "junk": files["junk"], "llama": files["llama"],
            "folder": tmp_path}[case]
    args = {"run": ["run", "-m", path, "-p", "x"], "inspect": ["inspect", path],
            "quantize": ["quantize", path, tmp_path / "o.gguf", "Q8_0"], "bench": ["bench", "-m", path]}[cmd]
    needle = {"missing": "no such file", "junk": "not a GGUF", "llama": "not a Clover model",
              "folder": "folder"}[case]
    if case == "llama" and cmd in ("run", "bench"):   # libclover's own message
        needle = "not a 'clover' model"
    assert_user_error(invoke(args), needle)


@pytest.mark.parametrize("args,needle", [
    (["--threshold", "2"], "--threshold"),
    (["--threshold", "-0.5"], "--threshold"),
    (["--block-size", "0"], "--block-size"),
    (["--block-size", "zero"], "--block-size"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["-s", "-2"], "--seed"),
    (["-n", "-3"], "--n-predict"),
    (["-c", "8", "-n", "64"], "n_ctx"),
    (["--bogus-flag"], "bogus"),
    (["--draft-self=maybe"], "--draft-self"),
])
def test_bad_run_flags(files, args: list[str], needle: str) -> None:
    assert_user_error(invoke(["run", "-m", files["model"], "-p", "hello", "-t", "1", "--no-visual"] + args),
                      needle)


@needs_lib
def test_generate_flag_ranges_are_libclovers(files, tmp_path: Path) -> None:
    """The generating flags' ranges have one owner, libclover (clover_generate_params_check): the
    CLI reports the value Clover refuses with its message, under the flag's name."""
    from clover_cpp import Clover, CloverError

    cases = [("--threshold", "threshold", 2.0), ("--temp", "temperature", -1.0), ("--top-p", "top_p", 1.5),
             ("--top-k", "top_k", -1), ("--step-cap", "max_steps", -1), ("--n-predict", "max_tokens", -3),
             ("--seed", "seed", -2)]
    with Clover(files["model"], n_threads=1) as m:
        for flag, kw, value in cases:
            with pytest.raises(CloverError) as e:
                m.generate("hello", **{kw: value})
            assert e.value.param == kw
            res = invoke(["run", "-m", files["model"], "-p", "hello", "-t", "1", "--no-visual", flag, value])
            assert res.exit_code == 1 and res.stdout == "", res.output
            assert res.stderr.splitlines() == [f"error: {flag}: {e.value.message}"], res.stderr
    # refused before the model loads (Clover.check_generate_args): a missing file is not reached
    for cmd in (["run", "-p", "hello"], ["chat"], ["bench"]):
        res = invoke([*cmd, "-m", tmp_path / "no-such.gguf", "--threshold", "2"])
        assert res.exit_code == 1 and res.stderr.startswith("error: --threshold: threshold must be"), res.output
    res = invoke(["demo", "--threshold", "2", "--cache-dir", tmp_path / "cache"])
    assert res.exit_code == 1 and res.stderr.startswith("error: --threshold: threshold must be"), res.output
    assert not (tmp_path / "cache").exists()


def test_other_user_errors(files, tmp_path: Path) -> None:
    assert_user_error(invoke(["quantize", files["model"], tmp_path / "o.gguf", "Q9_X"]), "unknown quantization type")
    assert_user_error(invoke(["run", "-m", files["model"]]), "missing prompt")
    assert_user_error(invoke(["run", "-p", "x"]), "-m")
    assert_user_error(invoke(["bench", "-m", files["model"], "--block-sizes", "4,0"]), "block-sizes")
    assert_user_error(invoke(["convert", tmp_path / "no-such-ckpt", tmp_path / "x.gguf"]))
    assert_user_error(invoke(["nosuchcommand"]), "nosuchcommand")
    assert_user_error(invoke(["run", "-m", files["model"], "-f", tmp_path / "none.txt"]), "none.txt")


@needs_lib
def test_a_refused_run_prints_only_its_error(files) -> None:
    """The prompt is echoed once the generation runs: a refusal (the context too small) leaves
    stdout empty on both tools, with the one-line error."""
    args = ["-m", str(files["model"]), "-p", "hello", "-c", "8", "-n", "64", "-t", "1"]
    for tool in ([sys.executable, "-m", "clover_cpp.cli", "run"], [str(CLI_BIN)]):
        p = subprocess.run(tool + args, capture_output=True, text=True, errors="replace", timeout=60)
        assert p.returncode == 1 and p.stdout == "", (tool, p.stdout)
        assert p.stderr.startswith("error: ") and "n_ctx" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
