"""The ``clover`` command: every subcommand's happy path through click's CliRunner, a few real
subprocesses, and user errors (one ``error:`` line, exit status 1, no traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from clover_cpp.cli import cli

needs_lib = pytest.mark.needs_libclover

REPO = Path(__file__).resolve().parent.parent
CLOVER_BIN = REPO / ".venv" / "bin" / "clover"


@pytest.fixture(scope="session")
def files(tiny_artifacts, llama_gguf) -> dict[str, Path]:
    d = tiny_artifacts["dir"]
    junk = d / "junk.gguf"
    junk.write_bytes(np.random.default_rng(1).bytes(2048))
    return {"dir": d, "ck": tiny_artifacts["ckpt"], "model": tiny_artifacts["f32"], "junk": junk, "llama": llama_gguf}


def invoke(args: list[str], input: str | None = None):
    runner = CliRunner()
    return runner.invoke(cli, [str(a) for a in args], input=input, catch_exceptions=False)


def assert_user_error(res, *needles: str) -> None:
    assert res.exit_code == 1, res.output
    out = res.output
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for n in needles:
        assert n in lines[0], out


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


def _in_a_terminal(cmd: list[str], timeout: float = 120, stdin: bytes | None = None, stderr: Any = None) -> bytes:
    """cmd's stdout when it is a terminal (a pseudo-terminal; stdin and stderr stay pipes or files:
    stdin gets the bytes given, stderr goes to the file given)."""
    import pty
    import select

    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=slave, stderr=stderr or subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE)
    os.close(slave)
    if stdin is not None:
        assert p.stdin is not None
        p.stdin.write(stdin)
        p.stdin.close()
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], timeout)
            if not r:
                raise AssertionError(f"no output for {timeout} s from {cmd}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        assert p.wait(timeout=timeout) == 0, cmd
    return out


@needs_lib
def test_visual_only_on_a_terminal(files) -> None:
    """--visual draws the block being denoised with cursor movements on a terminal; into a pipe or
    a file both tools write the plain text (the same bytes as without --visual)."""
    args = ["-m", str(files["model"]), "-p", "hello world", "-n", "16", "-t", "1", "--block-size", "4",
            "--threshold", "0.5"]
    py = [sys.executable, "-m", "clover_cpp.cli", "run", "--no-stats"]
    tty = _in_a_terminal(py + args + ["--visual"])
    assert "\u2591".encode() in tty and b"\x1b[" in tty  # masked cells, ANSI redraws
    tty_default = _in_a_terminal(py + args)  # the default on a terminal: the live view
    assert b"\x1b[" in tty_default
    tty_cli = _in_a_terminal([str(CLI_BIN)] + args + ["--visual"])
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
        tty = _in_a_terminal(cmd + ["--visual"], stdin=msgs, stderr=err)
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
    p = _sub(["perplexity", "-m", files["model"], tmp_path / "none.txt"])
    assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ") and "none.txt" in p.stderr


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


# ----------------------------------------------------------------------------- real processes

def _sub(args: list[str], **kw) -> subprocess.CompletedProcess:
    exe = [str(CLOVER_BIN)] if CLOVER_BIN.exists() else [sys.executable, "-m", "clover_cpp.cli"]
    env = dict(os.environ)
    env.pop("CLOVER_DEBUG", None)
    return subprocess.run(exe + [str(a) for a in args], capture_output=True, text=True, timeout=120, env=env, **kw)


def test_subprocess_help() -> None:
    p = _sub(["--help"])
    assert p.returncode == 0 and "convert" in p.stdout and "demo" in p.stdout


@needs_lib
def test_subprocess_run(files) -> None:
    p = _sub(["run", "-m", files["model"], "-p", "hello world", "-n", "16", "-t", "1", "--no-visual"])
    assert p.returncode == 0, p.stderr
    assert "\x1b[" not in p.stdout and p.stdout.endswith("\n") and len(p.stdout) > len("hello world\n")
    assert p.stderr.startswith("[clover]") and "Traceback" not in p.stderr
    # stdout is a pipe: plain text even without --no-visual
    q = _sub(["run", "-m", files["model"], "-p", "hello world", "-n", "16", "-t", "1"])
    assert q.returncode == 0 and q.stdout == p.stdout


def test_subprocess_errors(files) -> None:
    p = _sub(["run", "-m", files["junk"], "-p", "x"])
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr
    p = _sub(["run", "-m", files["model"], "-p", "x", "--threshold", "2"])
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stderr.startswith("error: ")


# ----------------------------------------------------------------------------- llama.cpp conventions

CLI_BIN = Path(__file__).resolve().parents[1] / "build" / "bin" / "clover-cli"


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


# ----------------------------------------------------------------------------- Ctrl-C
@needs_lib
def test_ctrl_c_exits_130_with_one_line(files, tmp_path) -> None:
    """Ctrl-C while each tool is busy (generating, waiting for a chat line, serving, benchmarking):
    exit status 130 and the single line 'error: interrupted', no traceback, no ctypes noise."""
    import select
    import signal
    import time

    g = str(files["model"])
    py = [sys.executable, "-m", "clover_cpp.cli"]
    long_run = ["-m", g, "-p", "hi", "-n", "4000", "-c", "8192", "--ignore-eos", "--block-size", "1", "-t", "1"]
    cmds = {
        "run": py + ["run", "--no-stats"] + long_run,
        "run --visual": py + ["run", "--visual", "--no-stats"] + long_run,
        "clover-cli": [str(REPO / "build" / "bin" / "clover-cli")] + long_run,
        "chat": py + ["chat", "-m", g, "-t", "1"],
        "serve": py + ["serve", "-m", g, "--port", "0", "-t", "1"],
        "bench": py + ["bench", "-m", g, "-n", "3000", "-t", "1"],
    }
    t0 = time.monotonic()
    procs = {k: subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
             for k, c in cmds.items()}
    for k, p in procs.items():  # busy: the generators have printed text, the server its address
        if k not in ("chat", "bench"):
            assert select.select([p.stderr if k == "serve" else p.stdout], [], [], 60)[0], k
    time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))  # chat and bench print nothing while busy
    for p in procs.values():
        p.send_signal(signal.SIGINT)
    for k, p in procs.items():
        _, err = p.communicate(timeout=60)
        text = err.decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("clover serve:", "[block"))]
        assert p.returncode == 130, (k, p.returncode, text[-500:])
        assert lines == ["error: interrupted"], (k, text[-500:])


@needs_lib
def test_a_refused_run_prints_only_its_error(files) -> None:
    """The prompt is echoed once the generation runs: a refusal (the context too small) leaves
    stdout empty on both tools, with the one-line error."""
    args = ["-m", str(files["model"]), "-p", "hello", "-c", "8", "-n", "64", "-t", "1"]
    for tool in ([sys.executable, "-m", "clover_cpp.cli", "run"], [str(CLI_BIN)]):
        p = subprocess.run(tool + args, capture_output=True, text=True, errors="replace", timeout=60)
        assert p.returncode == 1 and p.stdout == "", (tool, p.stdout)
        assert p.stderr.startswith("error: ") and "n_ctx" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def test_the_product_does_not_import_the_test_kit() -> None:
    """The wheel's packages (clover_cpp, clover_convert) import neither clover_testkit nor
    tokenizers (its fixture tokenizers' trainer): both stay out of the runtime install
    (pyproject: the test extra; the wheel's packages)."""
    import ast

    found = []
    for p in _python_files("clover_cpp", "clover_convert"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{p.relative_to(REPO)}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ("clover_testkit", "tokenizers")]
    assert not found, found
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert not [d for d in project["project"]["dependencies"] if d.startswith("tokenizers")]
    assert "clover_testkit" not in project["tool"]["scikit-build"]["wheel"]["packages"]


def test_the_cli_uses_public_names_only() -> None:
    """The front end (clover_cpp/cli/, clover_cpp/demo.py) reaches the runtime through its public
    names: no `obj._name` on another object, no private keyword argument (`_chat_text=`) and no
    private name imported from another module."""
    import ast

    found = []
    for p in _python_files("clover_cpp/cli") + [REPO / "clover_cpp" / "demo.py"]:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} {node.arg}=")
            if isinstance(node, ast.ImportFrom) and node.module not in ("group", "options", "live") \
                    and any(a.name.startswith("_") and a.name != "__future__" for a in node.names):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} from {node.module} import _...")
    assert not found, found


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
