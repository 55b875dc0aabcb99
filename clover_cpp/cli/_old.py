"""The ``clover`` command: convert, quantize, run, chat, inspect, bench, demo.

Flag names follow llama.cpp's tools (-m, -p, -n, -t, -c, --temp, --top-k, --top-p, --seed).
User errors print one line ``error: ...`` on stderr and exit with status 1 (no traceback;
set CLOVER_DEBUG=1 to see one for unexpected errors).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from . import _lib

# Ctrl-C while a command's modules load (numpy, gguf, safetensors: up to a second on a busy
# machine) interrupted an import half-way: a traceback, or a RecursionError from a half-imported
# numpy. As the `clover` command (not when imported), SIGINT is only noted until the command is
# found; then it is raised where CloverGroup.main reports it (`error: interrupted`, exit 130).
_EARLY_SIGINT: list[int] = []


def _note_sigint(signum: int, frame: Any) -> None:  # noqa: ARG001
    _EARLY_SIGINT.append(signum)


def _deliver_early_sigint() -> None:
    """Ctrl-C acts at once from here on; one pressed meanwhile is raised now."""
    try:
        if signal.getsignal(signal.SIGINT) is _note_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread
        return
    if _EARLY_SIGINT:
        _EARLY_SIGINT.clear()
        raise KeyboardInterrupt


if __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") in ("clover", "clover.exe"):
    try:
        signal.signal(signal.SIGINT, _note_sigint)
    except ValueError:  # pragma: no cover - not the main thread
        pass

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
DEFAULT_DEMO_PROMPT = 'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n'


class UserError(click.ClickException):
    """One-line error for the user (exit status 1)."""


def _one_line(msg: object) -> str:
    return " ".join(str(msg).split()) or "unknown error"


def _user_errors() -> tuple[type[BaseException], ...]:
    from .gguf_info import GGUFInfoError
    from .model import CloverError
    from .quant import QuantizeError

    errs: list[type[BaseException]] = [CloverError, GGUFInfoError, QuantizeError, OSError, ValueError]
    try:
        from clover_convert.mapping import ConversionError
        from clover_convert.safetensors_io import CheckpointError

        errs += [ConversionError, CheckpointError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(errs)


def _fail(msg: object, code: int = 1) -> NoReturn:
    click.echo(f"error: {_one_line(msg)}", err=True)
    sys.exit(code)


def _refuse_unknown_multi_letter_flags(group: click.Group, args: list[str]) -> None:
    """llama.cpp users type -fa, -ngl, -ctk, -sys: click would split an unknown one into a short
    option and its value (-ctk -> -c tk) and complain about another option. Say "no such
    option" instead."""
    cmd = group.commands.get(args[0]) if args else None
    if cmd is None:
        return
    opts = {n: p for p in cmd.params if isinstance(p, click.Option) for n in p.opts + p.secondary_opts}
    skip = False
    for tok in args[1:]:
        if tok == "--":
            return
        if skip:
            skip = False
            continue
        p = opts.get(tok.split("=", 1)[0])
        if p is None and re.fullmatch(r"-[A-Za-z]{2,}", tok):
            raise click.NoSuchOption(tok)
        skip = p is not None and not p.is_flag and not p.count and "=" not in tok


class CloverGroup(click.Group):
    """A group whose errors (click's usage errors included) are one line and exit 1."""

    #: subcommands defined elsewhere, imported when named
    LAZY = {"convert": ("clover_convert.cli", "main"), "kld": ("clover_cpp.kld", "main"),
            "imatrix": ("clover_cpp.imatrix", "main")}

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        try:
            if cmd_name in self.LAZY:
                import importlib

                module, attr = self.LAZY[cmd_name]
                return getattr(importlib.import_module(module), attr)
            return super().get_command(ctx, cmd_name)
        finally:
            _deliver_early_sigint()  # the command's modules are loaded: Ctrl-C now interrupts it

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))
        except ValueError:  # not the main thread
            pass
        try:
            _refuse_unknown_multi_letter_flags(self, list(sys.argv[1:] if args is None else args))
            rv = super().main(args=args, prog_name=prog_name or "clover", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except click.exceptions.Abort:
            _fail("interrupted", 130)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except click.ClickException as e:
            _fail(e.format_message())
        except SystemExit:
            raise
        except _user_errors() as e:
            if isinstance(e, OSError) and getattr(e, "filename", None):
                _fail(f"{e.filename}: {e.strerror or e}")
            _fail(e)
        except Exception as e:  # noqa: BLE001
            if os.environ.get("CLOVER_DEBUG"):
                raise
            _fail(f"unexpected {type(e).__name__}: {e} (set CLOVER_DEBUG=1 for a traceback)")
        code = rv if isinstance(rv, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(name="clover", cls=CloverGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="clover-cpp", prog_name="clover")
def cli() -> None:
    """Clover block-diffusion language models on llama.cpp.

    \b
    clover demo                       generate with the bundled default model
    clover convert SRC OUT            Hugging Face checkpoint -> GGUF
    clover quantize IN OUT Q4_K_M     quantize a GGUF
    clover run -m MODEL -p PROMPT     block-diffusion generation (live view on a terminal)
    clover chat -m MODEL              interactive chat
    clover serve -m MODEL             OpenAI-compatible HTTP server
    clover inspect MODEL              what is in a GGUF
    clover bench -m MODEL             tokens/s and tokens per forward vs block size
    clover perplexity -m MODEL FILE   perplexity of the causal model, as llama-perplexity
    clover kld BASE QUANT FILE        KL divergence of a quantized file from its base
    clover imatrix -m MODEL -f FILE   importance matrix from commits and block passes
    """


# ----------------------------------------------------------------------------- shared options

def _model_option(f: Any) -> Any:
    return click.option("-m", "--model", "model", required=True, metavar="FILE", help="Clover GGUF file.")(f)


def _runtime_options(f: Any) -> Any:
    opts = [
        click.option("-t", "--threads", "threads", type=click.IntRange(1, 512), default=None,
                     help="CPU threads (default: from the hardware)."),
        click.option("-c", "--ctx-size", "ctx_size", type=click.IntRange(min=1), default=4096, show_default=True,
                     help="Context size (prompt + generation) in tokens."),
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=click.IntRange(min=-1), default=0,
                     show_default=True, help="Layers to offload to the GPU (-1 = all)."),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
                     show_default=True, help="Flash attention (as llama.cpp's -fa)."),
        click.option("--rpc", "rpc", default=None, metavar="HOST:PORT,...",
                     help="llama.cpp RPC servers (ggml-rpc-server) that hold the offloaded layers (-ngl)."),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1,...",
                     callback=lambda ctx, p, v: _parse_split(v),
                     help="Share of the offloaded layers per device, RPC servers first (as llama.cpp's -ts)."),
        click.option("-ot", "--override-tensor", "override_tensor", default=None, metavar="PATTERN=BUFFER,...",
                     help="Put tensors matching PATTERN in BUFFER (as llama.cpp's -ot), e.g. '^output\\.weight=CPU'."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's log."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _parse_split(value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        split = [float(x) for x in re.split(r"[,/]", value)]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of numbers like 3,1", param_hint="'-ts'") from None
    if any(not (x >= 0) or x == float("inf") for x in split):
        raise click.BadParameter(f"{value!r}: shares must be finite and >= 0", param_hint="'-ts'")
    return split


class BlockSizeType(click.ParamType):
    """A block size: an integer >= 1, or "auto" (chosen per block, see clover.h)."""
    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            v = int(value)
        except ValueError:
            self.fail(f"{value!r} is not an integer >= 1 or 'auto'", param, ctx)
        if v < 1:
            self.fail(f"{v} is not >= 1", param, ctx)
        return v


BLOCK_SIZE = BlockSizeType()


# Greedy by default, unlike llama-cli (temp 0.8, top-k 40, top-p 0.95, seed -1, -n -1): the same
# command prints the same text, as Clover.generate returns it, and --draft-self reproduces it token
# for token (README, "Command-line defaults"); llama-cli's sampling is one set of flags away
DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_SEED, DEFAULT_N_PREDICT = 0.0, 0, 1.0, 0, 128


def _sampling_options(f: Any, n_default: int = DEFAULT_N_PREDICT) -> Any:
    opts = [
        click.option("-n", "--n-predict", "n_predict", type=click.IntRange(-1, 2**31 - 1), default=n_default,
                     show_default=True, help="Tokens to generate at most (-1 = until EOS or the end of the "
                                             "context, as llama-cli)."),
        click.option("--block-size", "block_size", type=BLOCK_SIZE, default="auto", show_default=True,
                     help="Block size B (1 = autoregressive; auto = chosen per block from the pass cost, "
                          "measured once per model and machine and cached, and the tokens per pass)."),
        click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=0.9, show_default=True,
                     help="Unmask every position whose confidence is at least this."),
        click.option("--step-cap", "--max-steps", "max_steps", type=click.IntRange(0, 2**31 - 1), default=0,
                     show_default=True, help="Denoising steps per block at most (0 = no cap)."),
        click.option("--temp", "temperature", type=click.FloatRange(min=0.0), default=DEFAULT_TEMP,
                     show_default=True, help="Sampling temperature (0 = greedy)."),
        click.option("--top-k", type=click.IntRange(min=0), default=DEFAULT_TOP_K, show_default=True,
                     help="Top-k (0 = off)."),
        click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=DEFAULT_TOP_P,
                     show_default=True, help="Top-p (1 = off)."),
        click.option("-s", "--seed", type=click.IntRange(-1, 2**64 - 1), default=DEFAULT_SEED, show_default=True,
                     help="Sampling seed (-1 = random)."),
        click.option("--draft-self", "draft_self", type=click.Choice(["on", "off", "auto"]), is_flag=False,
                     flag_value="on", default="off", show_default=True,
                     help="Lossless self-speculative decoding (--draft-self alone = on): blocks drafted by block "
                          "passes, verified by their causal commit (the output of --block-size 1, faster when "
                          "drafts are good). --draft-self=auto with --block-size auto: the mode too is chosen per "
                          "block (B = 1, block diffusion or draft-self); the stats line names the one chosen."),
        click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token."),
        click.option("-r", "--reverse-prompt", "reverse_prompt", multiple=True, metavar="TEXT",
                     help="Stop before TEXT (repeatable; matched across token boundaries)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _open_model(path: str, threads: int | None, ctx_size: int, n_gpu_layers: int, block_size: Any,
                verbose: bool, flash_attn: str = "auto", rpc: str | None = None,
                tensor_split: list[float] | None = None, override_tensor: str | None = None) -> Any:
    from .model import Clover, CloverError, set_verbosity

    # libclover checks the file (missing, not a GGUF, wrong architecture, bad metadata) with
    # one-line messages in milliseconds; reading the header in Python first cost 0.3 s+
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{path}: is a folder, not a GGUF file")
    if verbose:
        set_verbosity(2)
    try:
        return Clover(path, n_ctx=ctx_size, n_threads=threads, n_gpu_layers=n_gpu_layers,
                      block_size=None if block_size == "auto" else block_size,
                      flash_attn={"on": True, "off": False}.get(flash_attn), rpc_servers=rpc,
                      tensor_split=tensor_split, override_tensor=override_tensor)
    except CloverError as e:
        raise UserError(e.message) from None


def _gen_kwargs(n_predict: int, block_size: Any, threshold: float, max_steps: int, temperature: float,
                top_k: int, top_p: float, seed: int, ignore_eos: bool, reverse_prompt: Sequence[str] = (),
                draft_self: bool | str = False) -> dict[str, Any]:
    if seed == -1:  # as in llama.cpp: a random seed
        import secrets
        seed = secrets.randbits(63)
    return dict(max_tokens=n_predict, block_size=block_size, threshold=threshold, max_steps=max_steps,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=not ignore_eos,
                stop=list(reverse_prompt),
                draft_self={"on": True, "off": False}.get(draft_self, draft_self) if isinstance(draft_self, str)
                else draft_self)


def _until_context_end(m: Any, n_prompt: int, block_size: Any) -> int:
    """The budget of -n -1: the rest of the context, in whole blocks of a fixed B (decode blocks
    start right after the prompt; block size auto only picks blocks that fit)."""
    B = 1 if block_size == "auto" else int(block_size)
    budget = (m.n_ctx - n_prompt) // B * B
    if budget < 1:
        raise UserError(f"the prompt ({n_prompt} tokens) leaves no room for a block of {B} in the context "
                        f"({m.n_ctx}); raise -c")
    return budget


CHAT_SEPARATOR = "----"


def _visual_option(f: Any) -> Any:
    return click.option("--visual/--no-visual", default=None,
                        help="Live view of the block being denoised, on a terminal only (default: on when "
                             "stdout is a terminal; a pipe or a file always gets plain text).")(f)


def _use_visual(visual: bool | None) -> bool:
    """--visual draws with cursor movements: only on a terminal, never into a pipe or a file."""
    return (visual is None or visual) and sys.stdout.isatty()


# ----------------------------------------------------------------------------- live view

def _printable(s: str) -> str:
    out = []
    for ch in s:
        if ch == "\n":
            out.append("\u21b5")
        elif ch == "\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn") or unicodedata.east_asian_width(ch) in "WF":
            out.append("\u00b7" if unicodedata.category(ch)[0] == "C" else "?")
        else:
            out.append(ch)
    return "".join(out)


class LiveView:
    """Draws the committed text followed by the block being denoised; masked positions are
    shown as a shaded cell, tokens unmasked in the last step highlighted. The block is redrawn
    in place (ANSI cursor movement), committed text is written once."""

    MASK = "\u2591"

    def __init__(self, model: Any, out: Any = None, color: bool = True, n_prompt: int = 0) -> None:
        self.m = model
        self.n_prompt = n_prompt
        self.out = out or sys.stdout
        self.color = color
        self.col = 0          # cursor column after the committed text
        self.drawn = 0        # printable width of the block drawn after it
        self.prev: list[int] = []
        self.mask = model.mask_token
        self.width = max(20, shutil.get_terminal_size((80, 24)).columns)
        self._piece_cache: dict[int, str] = {}

    def _piece(self, t: int) -> str:
        s = self._piece_cache.get(t)
        if s is None:
            try:
                s = _printable(self.m.token_to_piece(t, special=True).decode("utf-8", "replace"))
            except Exception:  # noqa: BLE001
                s = "?"
            self._piece_cache[t] = s
        return s

    def _erase(self) -> None:
        if self.drawn:
            up = (self.col + self.drawn - 1) // self.width - self.col // self.width
            seq = (f"\x1b[{up}A" if up > 0 else "") + f"\x1b[{self.col % self.width + 1}G\x1b[J"
            self.out.write(seq)
            self.drawn = 0

    def step(self, canvas: list[int], n_masked: int, block_start: int) -> None:
        self._erase()
        dim, hi, rst = ("\x1b[2m", "\x1b[1;32m", "\x1b[0m") if self.color else ("", "", "")
        parts, width = [], 0
        budget = max(10, self.width * 3)
        for i, t in enumerate(canvas):
            if block_start + i < self.n_prompt:
                continue
            if t == self.mask:
                s, style = self.MASK, dim
            else:
                s = self._piece(t)
                style = hi if (i < len(self.prev) and self.prev[i] == self.mask) else ""
            if width + len(s) > budget:
                break
            parts.append(f"{style}{s}{rst}" if style else s)
            width += len(s)
        self.prev = list(canvas) if n_masked else []
        self.out.write("".join(parts))
        self.out.flush()
        self.drawn = width

    def block(self, text: str, tokens: list[int]) -> None:
        self._erase()
        self.write(text)
        self.prev = []

    def write(self, text: str, width_of: str | None = None) -> None:
        self.out.write(text)
        self.out.flush()
        for ch in text if width_of is None else width_of:
            if ch == "\n":
                self.col = 0
            else:
                self.col += 1

    def finish(self) -> None:
        self._erase()
        self.out.flush()


def _generate_to_terminal(m: Any, prompt: Any, visual: bool, chat_messages: Any = None, prefix: str = "",
                          **kw: Any) -> Any:
    """Run one generation, writing prefix then its text to stdout (live view or plain streaming).
    The prefix (the echoed prompt) is written once the generation runs: a refused call (the
    context too small, a bad argument) prints only its one-line error."""
    if visual:
        # tokenize here so that the view knows which canvas positions hold the prompt
        if chat_messages is not None:
            text = m.format_chat(chat_messages)
            toks = m.chat_tokens(text)  # the earlier turns' tokens, so the memory is reused
            kw = dict(kw, stop_tokens=list(kw.get("stop_tokens", ())) + m._stop_tokens(), _chat_text=text)
        else:
            toks = m.tokenize(prompt, add_special=True, parse_special=True)
        view = LiveView(m, color=True, n_prompt=len(toks))
        pending = [prefix]

        def echo() -> None:
            if pending and pending.pop():
                view.write(f"\x1b[1m{prefix}\x1b[0m", width_of=prefix)

        def step(*a: Any) -> Any:
            echo()
            return view.step(*a)

        def block(*a: Any) -> Any:
            echo()
            return view.block(*a)
        try:
            r = m.generate(toks, on_step=step, on_block=block, **kw)
            echo()
        finally:
            view.finish()
        return r
    stream = m.chat(chat_messages, stream=True, **kw) if chat_messages is not None else \
        m.generate(prompt, stream=True, **kw)
    try:
        for piece in stream:
            if prefix:
                sys.stdout.write(prefix)
                prefix = ""
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        stream.close()
    if prefix:  # nothing generated (EOS first, -n 0): the echo still comes
        sys.stdout.write(prefix)
    return stream.result


# ----------------------------------------------------------------------------- convert
# `clover convert` is clover_convert's own command (also `clover-convert`, `python -m
# clover_convert`), imported only when used: the converter is not needed to start `clover run`.

# ----------------------------------------------------------------------------- quantize

@cli.command(context_settings=CONTEXT_SETTINGS)
@click.argument("inp", metavar="IN")
@click.argument("out")
@click.argument("qtype", metavar="TYPE")
@click.option("-t", "--threads", type=click.IntRange(min=0), default=0, help="Threads (0 = all cores).")
@click.option("--force", is_flag=True, help="Overwrite an existing OUT.")
@click.option("--allow-requantize", is_flag=True, help="Allow requantizing already quantized tensors.")
@click.option("--leave-output-tensor", is_flag=True, help="Keep output.weight unquantized.")
@click.option("--pure", is_flag=True, help="Use TYPE for all tensors (no mixtures).")
@click.option("--imatrix", default=None, metavar="FILE",
              help="Importance matrix (llama.cpp's GGUF imatrix format), as llama-quantize --imatrix.")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's log.")
def quantize(inp: str, out: str, qtype: str, threads: int, force: bool, allow_requantize: bool,
             leave_output_tensor: bool, pure: bool, imatrix: str | None, verbose: bool) -> None:
    """Quantize the Clover GGUF IN to TYPE (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16, BF16, ...) at OUT.

    Runs llama.cpp's llama_model_quantize; writes a temporary file and renames it."""
    from .gguf_info import human_bytes
    from .quant import parse_quant_type
    from .quant import quantize as do_quantize

    name, _ = parse_quant_type(qtype)
    if verbose:
        from .model import set_verbosity

        set_verbosity(2)
    t0 = time.monotonic()
    bar = None

    def progress(i: int, n: int, tensor: str) -> None:
        nonlocal bar
        if verbose or not sys.stderr.isatty():
            return
        if bar is None:
            from tqdm import tqdm
            bar = tqdm(total=n, unit="tensor", desc="Quantizing", leave=False)
        bar.set_postfix_str(tensor, refresh=False)
        bar.update(i - bar.n)
    try:
        dst = do_quantize(inp, out, name, n_threads=threads, force=force, allow_requantize=allow_requantize,
                          leave_output_tensor=leave_output_tensor, pure=pure, imatrix=imatrix, progress=progress,
                          verbose=verbose)
    finally:
        if bar is not None:
            bar.close()
    click.echo(f"quantized {inp} ({human_bytes(Path(inp).stat().st_size)}) -> {dst} "
               f"({human_bytes(dst.stat().st_size)}, {name}) in {time.monotonic() - t0:.1f} s", err=True)


# ----------------------------------------------------------------------------- run

def _read_prompt(prompt: str | None, file: str | None) -> str:
    if prompt is not None and file is not None:
        raise UserError("give either -p/--prompt or -f/--file, not both")
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"{file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UserError(f"{file}: not UTF-8 text") from None
    if prompt is None:
        raise UserError("missing prompt: give -p/--prompt TEXT or -f/--file FILE")
    if prompt == "-":
        return sys.stdin.read()
    return prompt


@cli.command(context_settings=CONTEXT_SETTINGS)
@_model_option
@click.option("-p", "--prompt", default=None, help="Prompt text ('-' = read stdin).")
@click.option("-f", "--file", default=None, metavar="FILE", help="Read the prompt from FILE.")
@_sampling_options
@_runtime_options
@_visual_option
@click.option("--echo/--no-echo", default=True, show_default=True,
              help="Print the prompt before the output, as llama-cli does.")
@click.option("--no-display-prompt", "no_display_prompt", is_flag=True, hidden=True,
              help="llama-cli's name for --no-echo.")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Statistics line on stderr.")
@click.option("--grammar-file", "grammar_file", default=None, metavar="FILE",
              help="Constrain the output to the GBNF grammar in FILE (llama.cpp's format); decoded at block "
                   "size 1, or verified by --draft-self.")
@click.option("--json", "json_object", is_flag=True, help="Constrain the output to a JSON object.")
def run(model: str, prompt: str | None, file: str | None, n_predict: int, block_size: Any,
        threshold: float, max_steps: int, temperature: float, top_k: int, top_p: float, seed: int, draft_self: str,
        ignore_eos: bool, reverse_prompt: tuple[str, ...], threads: int | None, ctx_size: int, n_gpu_layers: int,
        flash_attn: str, rpc: str | None, tensor_split: list[float] | None, override_tensor: str | None,
        verbose: bool, visual: bool | None, echo: bool, no_display_prompt: bool, stats: bool,
        grammar_file: str | None = None, json_object: bool = False) -> None:
    """Generate text from a prompt with block-diffusion decoding (the prompt is echoed first,
    as llama-cli does; --no-echo leaves it out)."""
    text = _read_prompt(prompt, file)
    kw = _gen_kwargs(n_predict, block_size, threshold, max_steps, temperature, top_k, top_p, seed, ignore_eos,
                     reverse_prompt, draft_self)
    if grammar_file and json_object:
        raise UserError("give either --grammar-file or --json, not both")
    if grammar_file:
        if not Path(grammar_file).is_file():  # (a FIFO would block the read)
            raise UserError(f"grammar file {grammar_file}: not a readable file")
        try:
            kw["grammar"] = Path(grammar_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read grammar file {grammar_file}: {getattr(e, 'strerror', None) or e}") from None
    elif json_object:
        kw["response_format"] = {"type": "json_object"}
    visual = _use_visual(visual)
    with _open_model(model, threads, ctx_size, n_gpu_layers, block_size, verbose, flash_attn, rpc,
                     tensor_split, override_tensor) as m:
        if n_predict == -1:
            n_prompt = len(m.tokenize(text, add_special=True, parse_special=True))
            kw["max_tokens"] = _until_context_end(m, n_prompt, block_size)
        r = _generate_to_terminal(m, text, visual, prefix=text if echo and not no_display_prompt else "", **kw)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stats:
            click.echo(r.stats.format(), err=True)


@cli.command(context_settings=CONTEXT_SETTINGS)
@_model_option
@click.argument("file", metavar="TEXT_FILE", required=False)
@click.option("-f", "--file", "file_opt", default=None, metavar="TEXT_FILE", help="The text (as llama-perplexity's -f).")
@click.option("-c", "--ctx-size", "chunk", type=click.IntRange(min=2), default=512, show_default=True,
              help="Tokens per chunk (as llama-perplexity's -c): each chunk is scored on its second half.")
@click.option("-t", "--threads", "threads", type=click.IntRange(1, 512), default=None,
              help="CPU threads (default: from the hardware).")
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=click.IntRange(min=-1), default=0, show_default=True,
              help="Layers to offload to the GPU (-1 = all).")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's log.")
def perplexity(model: str, file: str | None, file_opt: str | None, chunk: int, threads: int | None,
               n_gpu_layers: int, verbose: bool) -> None:
    """Perplexity of the causal model over a text file, computed and printed as llama-perplexity does."""
    if (file is None) == (file_opt is None):
        raise UserError("give the text file once, as TEXT_FILE or with -f")
    path = Path(file or file_opt)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the text ({e.__class__.__name__}: {e})") from None
    with _open_model(model, threads, chunk, n_gpu_layers, 1, verbose) as m:
        r = m.perplexity(text, n_ctx=chunk)
    click.echo(f"Final estimate: PPL = {r.ppl:.4f} ({r.n_chunks} chunks of {r.n_ctx} tokens, "
               f"{r.n_tokens} positions scored)")


# ----------------------------------------------------------------------------- chat

@cli.command(context_settings=CONTEXT_SETTINGS)
@_model_option
@click.option("--system", default=None, help="System message.")
@_sampling_options
@_runtime_options
@_visual_option
@click.option("--stats/--no-stats", default=False, show_default=True, help="Statistics line after each reply.")
@click.option("--separator", default=CHAT_SEPARATOR, show_default=True, metavar="TEXT",
              help="Line written between replies when stdout is not a terminal ('' = none).")
def chat(model: str, system: str | None, n_predict: int, block_size: Any, threshold: float,
         max_steps: int, temperature: float, top_k: int, top_p: float, seed: int, draft_self: str, ignore_eos: bool,
         reverse_prompt: tuple[str, ...], threads: int | None, ctx_size: int, n_gpu_layers: int, flash_attn: str,
         rpc: str | None, tensor_split: list[float] | None, override_tensor: str | None,
         verbose: bool, visual: bool | None, stats: bool, separator: str) -> None:
    """Interactive chat: one user message per line; /exit, /quit or end of input to leave,
    /reset to forget the conversation. Earlier turns stay in the context's memory and are
    not read again (prefix reuse). When stdout is not a terminal, a separator line is written
    between replies."""
    kw = _gen_kwargs(n_predict, block_size, threshold, max_steps, temperature, top_k, top_p, seed, ignore_eos,
                     reverse_prompt, draft_self)
    interactive = sys.stdin.isatty()
    visual = _use_visual(visual)
    separate = bool(separator) and not sys.stdout.isatty()
    n_replies = 0
    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    with _open_model(model, threads, ctx_size, n_gpu_layers, block_size, verbose, flash_attn, rpc,
                     tensor_split, override_tensor) as m:
        m.format_chat([{"role": "user", "content": "x"}])  # template problems show up now, not later
        history: list[dict[str, str]] = []
        if interactive:
            click.echo("clover chat - /exit to quit, /reset to start over", err=True)
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                history = []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            try:
                msgs, budget = _fit_history(m, base, history, n_predict, kw["block_size"])
            except UserError as e:  # this message does not fit: say so, keep the session and its history
                history.pop()
                click.echo(f"error: {e.format_message()}", err=True)
                continue
            if separate and n_replies:
                sys.stdout.write(separator + "\n")
            r = _generate_to_terminal(m, None, visual, chat_messages=msgs, **dict(kw, max_tokens=budget))
            sys.stdout.write("\n")
            sys.stdout.flush()
            n_replies += 1
            history.append({"role": "assistant", "content": r.text})
            if stats:
                click.echo(r.stats.format(), err=True)


def _fit_history(m: Any, base: list[dict[str, str]], history: list[dict[str, str]],
                 max_tokens: int, block_size: Any) -> tuple[list[dict[str, str]], int]:
    """Drop the oldest turns until the prompt plus the budget fits the context: decode blocks of
    B start right after the prompt, so they need the budget rounded up to whole blocks
    (clover_generate's rule; with block size auto, B is only ever one whose blocks fit).
    max_tokens -1: at least one block must fit, and the budget is the rest of the context.
    Returns the messages and the token budget."""
    B = 1 if block_size == "auto" else block_size
    while True:
        msgs = base + history
        n = len(m.tokenize(m.format_chat(msgs), add_special=True, parse_special=True))
        need = n + (B if max_tokens == -1 else -(-max_tokens // B) * B)
        if need <= m.n_ctx or len(history) <= 1:
            if need > m.n_ctx:
                raise UserError(f"the message ({n} tokens) and -n {max_tokens} do not fit the context "
                                f"({m.n_ctx}); raise -c or lower -n")
            return msgs, (_until_context_end(m, n, block_size) if max_tokens == -1 else max_tokens)
        del history[:2]


# ----------------------------------------------------------------------------- serve

@cli.command(context_settings=CONTEXT_SETTINGS)
@_model_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port.")
@click.option("-np", "--parallel", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="Requests served at once (one decoding context each, one model).")
@click.option("--queue-size", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a context; more get 503.")
@click.option("--api-key", default=None, envvar="CLOVER_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' (also $CLOVER_API_KEY).")
@click.option("--max-body", type=click.IntRange(min=1024), default=8 * 2**20, show_default=True, metavar="BYTES",
              help="Largest request body; larger gets 413.")
@click.option("--max-messages", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Most chat messages per request.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True, metavar="S",
              help="Seconds to receive a request body; slower (or a Content-Length larger than the body) gets 408.")
@click.option("--max-block-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="Largest block_size a request may ask for.")
@click.option("--stuck-timeout", type=click.FloatRange(min=0.1), default=120.0, show_default=True, metavar="S",
              help="A generation without progress this long is stopped, and /health answers 503 meanwhile.")
@_runtime_options
def serve(model: str, host: str, port: int, parallel: int, queue_size: int, api_key: str | None, max_body: int,
          max_messages: int, body_timeout: float, max_block_size: int, stuck_timeout: float,
          threads: int | None, ctx_size: int, n_gpu_layers: int, flash_attn: str, rpc: str | None,
          tensor_split: list[float] | None, override_tensor: str | None, verbose: bool) -> None:
    """OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics, /props, /tokenize, /detokenize. Clover's knobs are extra request
    fields (block_size, threshold); endpoints, fields and limits: docs/server.md."""
    try:
        from .server import Limits
        from .server import serve as run_server
    except ImportError as e:
        raise UserError(str(e)) from None
    if Path(model).is_dir():
        raise UserError(f"{model}: is a folder, not a GGUF file")
    if verbose:
        from .model import set_verbosity
        set_verbosity(2)
    click.echo(f"clover serve: http://{host}:{port}/v1 ({parallel} context(s)); Ctrl-C to stop", err=True)
    run_server(model, host=host, port=port, parallel=parallel, api_key=api_key, n_ctx=ctx_size, n_threads=threads,
               n_gpu_layers=n_gpu_layers, max_queue=queue_size, log_level="info" if verbose else "warning",
               flash_attn={"on": True, "off": False}.get(flash_attn), rpc_servers=rpc, tensor_split=tensor_split,
               override_tensor=override_tensor,
               limits=Limits(max_body_bytes=max_body, max_messages=max_messages, body_timeout=body_timeout,
                             max_block_size=max_block_size, stuck_after=stuck_timeout))


# ----------------------------------------------------------------------------- inspect

@cli.command(context_settings=CONTEXT_SETTINGS)
@click.argument("model")
@click.option("--tensors", "all_tensors", is_flag=True, help="List every tensor (default: one layer of each kind).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(model: str, all_tensors: bool, as_json: bool) -> None:
    """Architecture, hyperparameters, tensors, size and tokenizer of a Clover GGUF."""
    from .gguf_info import format_info, read_info

    info = read_info(model, require_clover=True)
    if as_json:
        md = {k: v for k, v in info.metadata.items()}
        click.echo(json.dumps({
            "path": str(info.path), "file_size": info.file_size, "gguf_version": info.version,
            "architecture": info.architecture, "hyperparameters": info.hparams(),
            "n_tensors": len(info.tensors), "n_params": info.n_params, "types": dict(info.type_counts),
            "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.type} for t in info.tensors],
            "metadata": md}, indent=2, default=str))
        return
    click.echo(format_info(info, all_tensors=all_tensors))


# ----------------------------------------------------------------------------- bench

def _parse_block_sizes(s: str) -> list[Any]:
    try:
        out: list[Any] = [x if x == "auto" else int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--block-sizes: expected a comma-separated list of integers or 'auto', got {s!r}") from None
    if not out or any(b != "auto" and b < 1 for b in out):
        raise UserError(f"--block-sizes: block sizes must be >= 1, got {s!r}")
    return out


@cli.command(context_settings=CONTEXT_SETTINGS)
@_model_option
@click.option("-p", "--prompt", default="The quick brown fox jumps over the lazy dog.", show_default=True,
              help="Prompt text.")
@click.option("--block-sizes", default="1,4,8,16,32,auto", show_default=True, help="Block sizes to compare.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens to generate per run.")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=0.9, show_default=True,
              help="Confidence threshold.")
@click.option("--step-cap", "--max-steps", "max_steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="Step cap per block.")
@click.option("-r", "--repetitions", type=click.IntRange(min=2), default=3, show_default=True,
              help="Rounds; each round runs every block size once (rotated order), so that the "
                   "comparisons are paired.")
@_runtime_options
def bench(model: str, prompt: str, block_sizes: str, n_predict: int, threshold: float, max_steps: int,
          repetitions: int, threads: int | None, ctx_size: int, n_gpu_layers: int, flash_attn: str,
          rpc: str | None, tensor_split: list[float] | None, override_tensor: str | None,
          verbose: bool) -> None:
    """Tokens/s and tokens per forward pass for each block size, against B = 1 (autoregressive).

    Paired and repeated: every round runs each setting once, in a rotated order; the table
    shows medians with the min-max spread over the rounds, and the speed-up is the median of
    the per-round ratios. EOS is ignored so that every run generates -n tokens."""
    sizes = _parse_block_sizes(block_sizes)
    if 1 not in sizes:
        sizes = [1] + sizes
    with _open_model(model, threads, ctx_size, n_gpu_layers, None, verbose, flash_attn, rpc, tensor_split,
                     override_tensor) as m:
        m.generate(prompt, max_tokens=min(n_predict, 8), block_size="auto", stop_at_eos=False)  # warm-up + curve
        runs = paired_runs(lambda B: m.generate(prompt, max_tokens=n_predict, block_size=B, threshold=threshold,
                                                max_steps=max_steps, stop_at_eos=False).stats,
                           sizes, repetitions)
    base = runs[1]
    click.echo(f"model {model}, prompt {base[0].n_prompt} tok, -n {n_predict}, threshold {threshold}"
               + (f", max steps {max_steps}" if max_steps else "") + f", {repetitions} paired rounds")
    hdr = f"{'B':>6} {'tok/fwd':>8} {'tok/s (median, min-max)':>26} {'x B=1 (median, min-max)':>26}"
    click.echo(hdr)
    click.echo("-" * len(hdr))
    for B in sizes:
        tps = [s.tokens_per_second for s in runs[B]]
        ratio = [a.tokens_per_second / b.tokens_per_second for a, b in zip(runs[B], base) if b.tokens_per_second]
        click.echo(f"{B!s:>6} {_median([s.tokens_per_forward for s in runs[B]]):>8.2f} "
                   f"{_spread(tps, '.1f'):>26} {_spread(ratio, '.2f', 'x'):>26}")


def paired_runs(run: Callable[[Any], Any], settings: Sequence[Any], rounds: int) -> dict[Any, list[Any]]:
    """run(setting) for every setting in each of `rounds` rounds, the order rotated per round
    (so slow drifts of the machine hit every setting alike); {setting: [result per round]}."""
    out: dict[Any, list[Any]] = {s: [] for s in settings}
    for r in range(rounds):
        k = r % len(settings)
        for s in list(settings[k:]) + list(settings[:k]):
            out[s].append(run(s))
    return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _spread(xs: Sequence[float], fmt: str, unit: str = "") -> str:
    if not xs:
        return "-"
    return f"{_median(xs):{fmt}}{unit} ({min(xs):{fmt}}-{max(xs):{fmt}})"


# ----------------------------------------------------------------------------- demo

def default_cache_dir() -> Path:
    env = os.environ.get("CLOVER_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "clover-cpp" / "demo"


def bundled_model_dir() -> Path | None:
    """The trained default checkpoint shipped in the repository (models/clover-default/), if any."""
    env = os.environ.get("CLOVER_DEMO_MODEL")
    if env:  # an explicit choice must not silently fall back to another model
        d = Path(env)
        if (d.is_file() and d.suffix == ".gguf") or (d / "config.json").is_file():
            return d
        raise UserError(f"CLOVER_DEMO_MODEL={env}: not a .gguf file or a checkpoint folder with config.json")
    cands: list[Path] = []
    cands += [_lib.repo_root() / "models" / "clover-default", Path(__file__).resolve().parent / "models" / "clover-default"]
    for d in cands:
        if d.is_file() and d.suffix == ".gguf":
            return d
        if (d / "config.json").is_file():
            return d
    return None


def _folder_fingerprint(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def demo_model(cache_dir: Path, log: Any = None) -> tuple[Path, str]:
    """The demo GGUF (built and cached on first use) and a description of its source.

    Sources, in order: ``CLOVER_DEMO_MODEL`` (a checkpoint folder or a .gguf), the checkpoint
    folder ``models/clover-default/`` of the repository, the synthetic ``tiny`` preset
    (random weights: the text is gibberish, the decoding mechanics are real)."""
    from clover_convert import convert as do_convert

    say = log or (lambda s: click.echo(s, err=True))
    cache_dir.mkdir(parents=True, exist_ok=True)
    src = bundled_model_dir()
    if src is not None and src.suffix == ".gguf":
        return src, f"{src}"
    if src is not None:
        out = cache_dir / f"clover-default-{_folder_fingerprint(src)}-f16.gguf"
        desc = f"{src} (converted to f16)"
        if not out.is_file():
            say(f"converting {src} -> {out} ...")
            do_convert(str(src), str(out), outtype="f16", force=True, progress=sys.stderr.isatty())
        return out, desc
    from clover_testkit.checkpoints import write_checkpoint  # (the fallback only: no bundled model)

    out = cache_dir / "clover-tiny-f16.gguf"
    desc = "synthetic 'tiny' preset (random weights: expect gibberish; the decoding is real)"
    if not out.is_file():
        ck = cache_dir / "tiny-checkpoint"
        say(f"writing the tiny preset checkpoint to {ck} and converting it to {out} ...")
        write_checkpoint(ck, preset="tiny", dtype="f32")
        do_convert(str(ck), str(out), outtype="f16", force=True, progress=False)
    return out, desc


@cli.command(context_settings=CONTEXT_SETTINGS)
@click.option("-p", "--prompt", default=DEFAULT_DEMO_PROMPT, show_default=True, help="Prompt text.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=64, show_default=True,
              help="Tokens to generate.")
@click.option("--block-size", "block_size", type=BLOCK_SIZE, default="auto", show_default=True,
              help="Block size, or auto (chosen per block from the measured cost and tokens per pass).")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=0.9, show_default=True,
              help="Confidence threshold.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="CPU threads.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where the demo model is built (default: ~/.cache/clover-cpp/demo, or $CLOVER_CACHE_DIR).")
@click.option("--visual/--no-visual", default=None, help="Live view (default: when stdout is a terminal).")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also run B = 1 (autoregressive) and show the speed-up.")
def demo(prompt: str, n_predict: int, block_size: Any, threshold: float, threads: int | None,
         cache_dir: str | None, visual: bool | None, compare: bool) -> None:
    """Block-diffusion generation with the bundled default model (built on first use)."""
    path, desc = demo_model(Path(cache_dir) if cache_dir else default_cache_dir())
    click.echo(f"model: {desc}\n       {path}", err=True)
    visual = _use_visual(visual)
    with _open_model(str(path), threads, 4096, 0, block_size, False) as m:
        B = block_size
        click.echo(f"prompt: {prompt!r}; block size {B}, threshold {threshold}", err=True)
        kw = dict(max_tokens=n_predict, block_size=B, threshold=threshold)
        r = _generate_to_terminal(m, prompt, visual, prefix=prompt, **kw)
        sys.stdout.write("\n")
        sys.stdout.flush()
        click.echo(r.stats.format(), err=True)
        if compare and B != 1:
            # paired and repeated: 3 rounds of (B, B = 1), the order alternating
            runs = paired_runs(lambda b: m.generate(prompt, max_tokens=n_predict, block_size=b,
                                                    threshold=threshold).stats, [B, 1], 3)
            tps = {b: [s.tokens_per_second for s in runs[b]] for b in (B, 1)}
            ratio = [a / b for a, b in zip(tps[B], tps[1]) if b]
            tpf = _median([s.tokens_per_forward for s in runs[B]])
            click.echo(f"[clover] B={B}: {_spread(tps[B], '.1f')} tok/s, {tpf:.2f} tok/forward; "
                       f"B=1 (autoregressive): {_spread(tps[1], '.1f')} tok/s; "
                       f"speed-up {_spread(ratio, '.2f', 'x')} (median of 3 paired rounds, min-max)", err=True)


def main(argv: Sequence[str] | None = None) -> Any:
    """Entry point of the ``clover`` command."""
    return cli.main(args=list(argv) if argv is not None else None, prog_name="clover")


if __name__ == "__main__":  # pragma: no cover
    main()
