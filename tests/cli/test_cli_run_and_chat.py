"""``clover run`` and ``clover chat`` through click's CliRunner (and clover-cli, the same flags):
plain and sampled runs, the documented defaults, -n -1, --visual only on a terminal, prompt
files and stdin, chat turns, their separators, the context a turn needs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from clover_testkit.cli_runs import CLI_BIN, REPO, assert_user_error, files, in_a_terminal, invoke  # noqa: F401

needs_lib = pytest.mark.needs_libclover


# ----------------------------------------------------------------------------- run and chat
@needs_lib
def test_run_plain(files) -> None:
    from clover_cpp import Clover

    res = invoke(["run", "-m", files["model"], "-p", "hello world", "-n", "24", "-t", "1", "--no-visual"])
    assert res.exit_code == 0, res.output
    with Clover(files["model"], n_threads=1) as m:
        want = m.generate("hello world", max_tokens=24, temperature=0.0).text
    assert res.stdout == "hello world" + want + "\n"  # the prompt echoed first, as llama-cli does
    assert "[clover]" in res.stderr and "tok/forward" in res.stderr and "generated=24" in res.stderr
    for off in ("--no-echo", "--no-display-prompt"):  # ours, llama-cli's
        res = invoke(["run", "-m", files["model"], "-p", "hello world", "-n", "24", "-t", "1", "--no-visual", off])
        assert res.exit_code == 0 and res.stdout == want + "\n", res.output


@needs_lib
def test_defaults_are_greedy_and_documented(files) -> None:
    """The defaults the README states: greedy (--temp 0, top-k off, top-p 1, seed 0: the same
    command prints the same text, equal to Clover.generate's), -n 128; -s -1 is a random seed."""
    from clover_cpp.cli.options import DEFAULT_N_PREDICT, DEFAULT_SEED, DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P

    assert (DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_SEED, DEFAULT_N_PREDICT) == (0.0, 0, 1.0, 0, 128)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "defaults are **greedy** (`--temp 0`, top-k and top-p off, seed 0, `-n 128`)" in readme
    assert "`--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 -s -1 -n -1`" in readme  # llama-cli's, for those who want them
    help_text = " ".join(invoke(["run", "--help"]).output.split())
    for shown in ("greedy). [default: 0.0]", "[default: 128]", "(-1 = random). [default: 0]"):
        assert shown in help_text, help_text
    args = ["run", "-m", files["model"], "-p", "hello", "-n", "16", "-t", "1", "--block-size", "4", "--no-stats",
            "--ignore-eos"]
    plain = {invoke(args).stdout for _ in range(2)}
    greedy = invoke(args + ["--temp", "0", "--top-k", "0", "--top-p", "1", "-s", "0"]).stdout
    assert plain == {greedy}
    # llama-cli's sampling flags: a random seed, so different texts from run to run
    sampled = {invoke(args + ["--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "-s", "-1"]).stdout
               for _ in range(4)}
    assert len(sampled) > 1


@needs_lib
def test_both_command_lines_default_to_the_same_n_predict() -> None:
    """-n's default is each command line's own (not the library's): clover-cli's --help and
    `clover run`'s must show the same number."""
    from clover_cpp.cli.options import DEFAULT_N_PREDICT

    cli_help = subprocess.run([str(CLI_BIN), "--help"], capture_output=True, text=True, timeout=60).stdout
    cli_default = re.search(r"--n-predict N\s+max tokens to generate \(default (-?\d+);", cli_help)
    assert cli_default, cli_help
    run_help = " ".join(invoke(["run", "--help"]).output.split())
    run_default = re.search(r"-n, --n-predict INTEGER .*? \[default: (-?\d+)\]", run_help)
    assert run_default, run_help
    assert int(cli_default.group(1)) == int(run_default.group(1)) == DEFAULT_N_PREDICT


@needs_lib
@pytest.mark.parametrize("block_size", ["1", "4", "auto"])
def test_n_predict_minus_one_runs_to_the_end_of_the_context(files, block_size: str) -> None:
    """-n -1 (llama-cli's "until EOS or the end of the context"): the rest of the context, in
    whole blocks of a fixed B, on both tools; a prompt that fills the context is one line."""
    from clover_cpp import Clover

    with Clover(files["model"], n_threads=1) as m:
        n = len(m.tokenize("hello world", add_bos=True, special=True))
    B = 1 if block_size == "auto" else int(block_size)
    want = (70 - n) // B * B
    args = ["-p", "hello world", "-n", "-1", "-c", "70", "--block-size", block_size, "-t", "1", "--ignore-eos"]
    res = invoke(["run", "-m", files["model"], *args, "--no-visual"])
    assert res.exit_code == 0, res.output
    assert f"generated={want} tok" in res.stderr and "finish=max_tokens" in res.stderr, res.stderr
    p = subprocess.run([str(CLI_BIN), "-m", str(files["model"]), *args], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"generated {want} tok".encode() in p.stderr
    assert p.stdout.decode(errors="replace") == res.stdout
    # without --ignore-eos: EOS or the budget ends it
    res = invoke(["run", "-m", files["model"], "-p", "hello world", "-n", "-1", "-c", "70", "-t", "1", "--no-visual"])
    assert res.exit_code == 0 and re.search(r"finish=(max_tokens|eos)", res.stderr), res.stderr
    assert_user_error(invoke(["run", "-m", files["model"], "-p", "hello world " * 20, "-n", "-1", "-c", "20",
                              "--block-size", "4", "-t", "1"]), "leaves no room", "raise -c")
    p = subprocess.run([str(CLI_BIN), "-m", str(files["model"]), "-p", "hello world " * 20, "-n", "-1", "-c", "20",
                        "-t", "1"], capture_output=True, text=True, errors="replace", timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and "leaves no room" in p.stderr, p.stderr


@needs_lib
def test_visual_only_on_a_terminal(files) -> None:
    """--visual draws the block being denoised with cursor movements on a terminal; into a pipe or
    a file both tools write the plain text (the same bytes as without --visual)."""
    args = ["-m", str(files["model"]), "-p", "hello world", "-n", "16", "-t", "1", "--block-size", "4",
            "--threshold", "0.5"]
    py = [sys.executable, "-m", "clover_cpp.cli", "run", "--no-stats"]
    tty = in_a_terminal(py + args + ["--visual"])
    assert "\u2591".encode() in tty and b"\x1b[" in tty  # masked cells, ANSI redraws
    tty_default = in_a_terminal(py + args)  # the default on a terminal: the live view
    assert b"\x1b[" in tty_default
    tty_cli = in_a_terminal([str(CLI_BIN)] + args + ["--visual"])
    assert b"\x1b[" in tty_cli
    for tool in (py, [str(CLI_BIN)]):
        plain = subprocess.run(tool + args, capture_output=True, timeout=120)
        vis = subprocess.run(tool + args + ["--visual"], capture_output=True, timeout=120)
        assert plain.returncode == 0 and vis.returncode == 0, vis.stderr
        assert b"\x1b" not in vis.stdout and vis.stdout == plain.stdout and plain.stdout.startswith(b"hello world")
    # the CliRunner's stdout is not a terminal either
    res = invoke(["run", *args, "--visual"])
    assert res.exit_code == 0 and "\x1b" not in res.stdout and "\u2591" not in res.stdout


@needs_lib
def test_live_chat_continues_the_conversation_as_plain_chat(files, tmp_path: Path) -> None:
    """The live view of `clover chat` (a terminal) generates through Clover.generate_chat: the
    same replies as the plain chat (the end-of-turn stops, the same token budget) and the second
    turn reads only its new tokens (the first exchange's are reused)."""
    cmd = [sys.executable, "-m", "clover_cpp.cli", "chat", "-m", str(files["model"]), "-n", "12", "-t", "1",
           "--block-size", "4", "--stats"]
    msgs = b"hi there\nhow are you?\n"
    with open(tmp_path / "err", "wb") as err:
        tty = in_a_terminal(cmd + ["--visual"], stdin=msgs, stderr=err)
    assert "\u2591".encode() in tty and b"\x1b[" in tty  # the live view drew the blocks
    plain = subprocess.run(cmd + ["--no-visual"], input=msgs, capture_output=True, timeout=120)
    assert plain.returncode == 0, plain.stderr

    def stats(text: str) -> list[str]:
        return [" ".join(m) for m in re.findall(r"(prompt=\d+ tok(?: \(\d+ reused\))?, generated=\d+ tok, "
                                                r"blocks=\d+, decode passes=\d+).*?(finish=\w+)", text)]
    live = stats((tmp_path / "err").read_text())
    assert len(live) == 2 and live == stats(plain.stderr.decode()), (live, plain.stderr)
    assert "reused)" in live[1]


@needs_lib
def test_run_prompt_file_and_stdin(files, tmp_path: Path) -> None:
    pf = tmp_path / "prompt.txt"
    pf.write_text("hello world")
    a = invoke(["run", "-m", files["model"], "-f", pf, "-n", "8", "-t", "1", "--no-visual", "--no-stats"])
    b = invoke(["run", "-m", files["model"], "-p", "-", "-n", "8", "-t", "1", "--no-visual", "--no-stats"],
               input="hello world")
    assert a.exit_code == 0 and b.exit_code == 0
    assert a.stdout == b.stdout and a.stdout.startswith("hello world") and a.stdout[len("hello world"):].strip()


@needs_lib
def test_chat(files) -> None:
    res = invoke(["chat", "-m", files["model"], "-n", "8", "-t", "1", "--no-visual", "--stats"],
                 input="hi there\nhow are you?\n/exit\nnot read\n")
    assert res.exit_code == 0, res.output
    assert res.stderr.count("[clover]") == 2  # two replies, the line after /exit is not read
    res = invoke(["chat", "-m", files["model"], "-n", "8", "-t", "1", "--no-visual"], input="hello\n")
    assert res.exit_code == 0, res.output  # end of input ends the chat


@needs_lib
def test_chat_separates_replies_when_not_on_a_terminal(files) -> None:
    """Piped, the replies do not run together: a separator line between them (--separator TEXT,
    '' = none); each reply equals the same turn's Clover.chat text."""
    from clover_cpp import Clover

    with Clover(files["model"], n_threads=1) as m:
        msgs = [{"role": "user", "content": "hi there"}]
        one = m.chat(msgs, max_tokens=8, block_size=4).text
        msgs += [{"role": "assistant", "content": one}, {"role": "user", "content": "how are you?"}]
        two = m.chat(msgs, max_tokens=8, block_size=4).text
    # (a fixed B: auto's choice follows the tokens per pass seen so far, and the text follows B)
    args = ["chat", "-m", files["model"], "-n", "8", "-t", "1", "--block-size", "4"]
    res = invoke(args, input="hi there\nhow are you?\n")
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{one}\n----\n{two}\n", res.stdout
    res = invoke(args + ["--separator", "=== next ==="], input="hi there\n/reset\nhi there\n")
    assert res.stdout == f"{one}\n=== next ===\n{one}\n", res.stdout
    res = invoke(args + ["--separator", ""], input="hi there\nhow are you?\n")
    assert res.stdout == f"{one}\n{two}\n", res.stdout
    # -n -1 in a chat: each reply may use the rest of the context
    # (a fixed B: with auto the text follows the B chosen from measured times, and an end-of-turn
    # token, which stops a chat reply whatever --ignore-eos says, may come first)
    res = invoke(["chat", "-m", files["model"], "-n", "-1", "-c", "96", "-t", "1", "--stats", "--ignore-eos",
                  "--block-size", "4"], input="hi there\n")
    assert res.exit_code == 0 and "finish=max_tokens" in res.stderr, res.output


@needs_lib
@pytest.mark.parametrize("block_size", ["3", "5", "auto"])
def test_chat_fits_blocks_after_the_prompt(files, block_size: str) -> None:
    """A chat turn needs the prompt plus -n rounded up to whole blocks, the blocks starting right
    after the prompt (spec v2: no alignment; auto only picks a B whose blocks fit): -c of exactly
    that is answered, one position less is the one-line refusal and the session goes on."""
    from clover_cpp import Clover

    msg = "hi there"
    with Clover(files["model"], n_threads=1) as m:
        n = len(m.tokenize(m.format_chat([{"role": "user", "content": msg}]), add_bos=True, special=True))
        default_B = m.block_size
    if block_size == "auto":
        # (a context of at least 64: auto measures fused commits + passes of up to 2 x 32 tokens)
        B, n_predict = 1, max(64 - n, 1) + 1
        assert (n + n_predict) % default_B, "pick another message: the context is a whole number of blocks"
    else:
        B = int(block_size)
        n_predict = 2 * B  # whole blocks: with the prompt not a whole number of blocks, fewer positions
        assert n % B, "pick another block size: the prompt is a whole number of blocks"  # than aligned blocks
    need = n + -(-n_predict // B) * B
    args = ["chat", "-m", files["model"], "-n", n_predict, "--block-size", block_size, "-t", "1", "--no-visual",
            "--stats", "--ignore-eos"]
    res = invoke(args + ["-c", need], input=msg + "\n")
    assert res.exit_code == 0, res.output
    assert "error" not in res.stderr and f"generated={n_predict} tok" in res.stderr, res.stderr
    res = invoke(args + ["-c", need - 1], input=msg + "\n")
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines() == [f"error: the message ({n} tokens) and -n {n_predict} do not fit the context "
                                       f"({need - 1}); raise -c or lower -n"], res.stderr


@needs_lib
def test_chat_with_draft_self_needs_no_whole_blocks(files) -> None:
    """--draft-self verifies each block by its causal commit, so a turn needs only prompt + -n
    (Clover.fits, libclover's rule): -c of exactly that is answered. (The CLI's own copy of the
    rule rounded -n up to whole blocks and refused it.)"""
    from clover_cpp import Clover

    msg, B, n_predict = "hi there", 5, 7
    with Clover(files["model"], n_threads=1) as m:
        n = len(m.tokenize(m.format_chat([{"role": "user", "content": msg}]), add_bos=True, special=True))
    args = ["chat", "-m", files["model"], "-n", n_predict, "--block-size", B, "--draft-self", "-t", "1",
            "--no-visual", "--stats", "--ignore-eos"]
    res = invoke(args + ["-c", n + n_predict], input=msg + "\n")
    assert res.exit_code == 0 and "error" not in res.stderr, res.output
    assert f"generated={n_predict} tok" in res.stderr, res.stderr
    res = invoke(args + ["-c", n + n_predict - 1], input=msg + "\n")
    assert res.stderr.splitlines() == [f"error: the message ({n} tokens) and -n {n_predict} do not fit the context "
                                       f"({n + n_predict - 1}); raise -c or lower -n"], res.stderr
