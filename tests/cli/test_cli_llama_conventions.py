"""``clover run`` and clover-cli follow llama.cpp's conventions: unknown multi-letter flags are
refused, the same flags have the same effect on both tools, --draft-self auto names its mode."""

from __future__ import annotations

import re
import subprocess

import pytest
from click.testing import CliRunner

from clover_cpp.cli import cli

from clover_testkit.cli_runs import CLI_BIN, files, invoke  # noqa: F401

needs_lib = pytest.mark.needs_libclover


# ----------------------------------------------------------------------------- llama.cpp conventions


@pytest.mark.needs_libclover
@pytest.mark.parametrize("flag", ["-ctk", "-sys", "-hf", "-fax"])
def test_unknown_multi_letter_flags(files, flag: str) -> None:
    res = CliRunner().invoke(cli, ["run", "-m", str(files["model"]), "-p", "hi", flag, "x"])
    assert res.exit_code == 1 and f"No such option '{flag}'" in res.output, res.output
    # a value that looks like a flag is still a value
    res = invoke(["run", "-m", files["model"], "-p", "-abc", "-n", "2", "-t", "1", "--no-stats", "--no-visual"])
    assert res.exit_code == 0


@pytest.mark.needs_libclover
def test_same_flags_same_effect_on_both_tools(files) -> None:
    """--block-size, --threshold, --step-cap, -s, --temp, --ignore-eos, -fa, -n on clover and clover-cli."""
    import subprocess
    common = ["-p", "hello", "-n", "16", "--block-size", "4", "--threshold", "0.7", "--step-cap", "3", "-s", "5",
              "--temp", "0.8", "--ignore-eos", "-fa", "off", "-t", "1", "-c", "256"]
    res = invoke(["run", "-m", files["model"], *common, "--no-stats", "--no-visual"])
    assert res.exit_code == 0
    p = subprocess.run([str(CLI_BIN), "-m", str(files["model"]), *common], capture_output=True, text=True,
                       errors="replace", timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == res.output.rstrip("\n")
    # -1 = a random seed on both
    outs = {invoke(["run", "-m", files["model"], "-p", "hello", "-n", "16", "--block-size", "4", "-t", "1",
                    "--temp", "1.5", "-s", "-1", "--no-stats", "--no-visual"]).output for _ in range(4)}
    assert len(outs) > 1
    p = subprocess.run([str(CLI_BIN), "-m", str(files["model"]), "-p", "hi", "-n", "2", "-s", "-1"],
                       capture_output=True, text=True, errors="replace", timeout=60)
    assert p.returncode == 0, p.stderr
    res = invoke(["run", "-m", files["model"], "-p", "hi", "-b", "4"])
    assert res.exit_code != 0  # -b is llama.cpp's batch size: Clover's block size is --block-size only


def _stop_from(text: str, kind: str) -> str:
    """A stop string taken from a generated text, past its first characters (so that the stopped
    output is not empty): "WORD" = the first run of 3 ASCII letters; "PUNCT" = the first 3
    printable ASCII characters with a regular-expression metacharacter among them (a stop string
    is plain text, never a pattern)."""
    import re

    pattern = {"WORD": r"[A-Za-z]{3}", "PUNCT": r"(?=[ -~]{0,2}[()\[\]{}.*+?^$|\\])[ -~]{3}"}[kind]
    m = re.compile(pattern).search(text, 2)
    assert m, f"pick another prompt: no {kind} stop string in {text!r}"
    return m.group(0)


@pytest.mark.needs_libclover
@pytest.mark.parametrize("extra", [["--top-k", "5", "--top-p", "0.9", "--temp", "0.7", "-s", "3"],
                                   ["-r", "WORD"], ["-r", "PUNCT", "-r", "zzz"], ["-ngl", "0", "-c", "512"]])
def test_more_flags_same_effect_on_both_tools(files, tmp_path, extra: list[str]) -> None:
    """-f, --top-k, --top-p, -r/--reverse-prompt, -ngl, -c: the same text from both tools (a
    random model's bytes need not be UTF-8: compared as clover prints them, with replacement).
    The stop strings are read from the unstopped output (WORD, PUNCT: see _stop_from)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    base = ["-f", str(prompt), "-n", "40", "--block-size", "4", "--ignore-eos", "-t", "1", "--no-echo"]
    full = invoke(["run", "-m", files["model"], *base, "--no-stats", "--no-visual"]).output
    extra = [_stop_from(full, a) if a in ("WORD", "PUNCT") else a for a in extra]
    args = [*base, *extra]
    res = invoke(["run", "-m", files["model"], *args, "--no-stats", "--no-visual"])
    assert res.exit_code == 0, res.output
    p = subprocess.run([str(CLI_BIN), "-m", str(files["model"]), *args], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode(errors="replace").rstrip("\n") == res.output.rstrip("\n")
    for i, a in enumerate(extra):
        if a == "-r":
            assert extra[i + 1] not in res.output
    if extra[:1] == ["-r"]:  # the stop string is in the unstopped text, and the output ends before it
        assert extra[1] in full and full.startswith(res.output.rstrip("\n"))
        assert len(res.output.rstrip("\n")) == full.index(extra[1])


MODES = ("autoregressive", "diffusion", "draft-self")


@needs_lib
def test_draft_self_auto_names_the_mode_it_chose(files) -> None:
    """--draft-self (alone = on) is draft-self, whose text is --block-size 1's; --draft-self=auto
    (and --draft-self auto) lets block size auto choose among B = 1, block diffusion and
    draft-self, and the stats line names the mode it chose; clover-cli takes the same flags and
    its stats line says "mode NAME"."""
    base = ["run", "-m", files["model"], "-p", "hello world", "-n", "16", "-t", "1", "--no-visual", "--no-echo",
            "--ignore-eos"]
    one = invoke(base + ["--block-size", "1"])
    assert one.exit_code == 0 and re.search(r"\[clover\] B=1 autoregressive ", one.stderr), one.stderr
    ds = invoke(base + ["--block-size", "4", "--draft-self"])
    assert ds.exit_code == 0 and ds.stdout == one.stdout, ds.output
    assert re.search(r"\[clover\] B=4 draft-self ", ds.stderr), ds.stderr
    diff = invoke(base + ["--block-size", "4", "--draft-self=off"])
    assert diff.exit_code == 0 and re.search(r"\[clover\] B=4 diffusion ", diff.stderr), diff.stderr
    for flag in (["--draft-self=auto"], ["--draft-self", "auto"]):
        res = invoke(base + flag)
        assert res.exit_code == 0, res.output
        m = re.search(r"\[clover\] B=(\d+) (autoregressive|diffusion|draft-self)[ ,(]", res.stderr)
        assert m, res.stderr
        assert "generated=16 tok" in res.stderr and res.stdout.strip()
        n_diffusion = re.search(r"(\d+) diffusion, ", res.stderr)  # the blocks per mode, when more than one ran
        if m.group(2) != "diffusion" and (n_diffusion is None or n_diffusion.group(1) == "0"):
            assert res.stdout == one.stdout  # lossless modes only (B = 1, draft-self): B = 1's text
    assert "--draft-self [on|off|auto]" in invoke(["run", "--help"]).output
    assert "--draft-self [on|off|auto]" in invoke(["chat", "--help"]).output
    # clover-cli: the same flags; the stats line names the mode
    cli = [str(CLI_BIN), "-m", str(files["model"]), "-p", "hello world", "-n", "16", "-t", "1", "--no-echo",
           "--ignore-eos"]
    p1 = subprocess.run(cli + ["--block-size", "1"], capture_output=True, timeout=60)
    assert p1.returncode == 0 and b", mode autoregressive" in p1.stderr, p1.stderr
    assert p1.stdout.decode(errors="replace") == one.stdout
    p = subprocess.run(cli + ["--block-size", "4", "--draft-self"], capture_output=True, timeout=60)
    assert p.returncode == 0 and b", mode draft-self" in p.stderr and p.stdout == p1.stdout, p.stderr
    p = subprocess.run(cli + ["--block-size", "4", "--draft-self=off"], capture_output=True, timeout=60)
    assert p.returncode == 0 and b", mode diffusion" in p.stderr, p.stderr
    for flag in (["--draft-self", "auto"], ["--draft-self=auto"]):
        p = subprocess.run(cli + flag, capture_output=True, timeout=60)
        assert p.returncode == 0, p.stderr
        m = re.search(rb"block size (\d+) \(auto\) \(\d+ switches\), mode (autoregressive|diffusion|draft-self)\n",
                      p.stderr)
        assert m, p.stderr
    p = subprocess.run(cli + ["--draft-self=maybe"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: option --draft-self: expected on, off or auto, got 'maybe'"], p.stderr
    help_text = subprocess.run([str(CLI_BIN), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--draft-self [on|off|auto]" in help_text and "--draft-self=auto" in help_text
