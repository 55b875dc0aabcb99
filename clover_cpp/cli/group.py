"""The ``clover`` group: one-line errors, Ctrl-C while a command loads, lazily imported commands.

User errors print one line ``error: ...`` on stderr and exit with status 1 (no traceback;
set CLOVER_DEBUG=1 to see one for unexpected errors).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from clover_gguf.errors import UserFacingError

# Ctrl-C while a command's modules load (numpy, gguf, safetensors: up to a second on a busy
# machine) interrupted an import half-way: a traceback, or a RecursionError from a half-imported
# numpy. As the `clover` command (not when imported), SIGINT is only noted until the command is
# found; then it is raised where CloverGroup.main reports it (`error: interrupted`, exit 130).
_EARLY_SIGINT: list[int] = []


def _note_sigint(signum: int, frame: Any) -> None:  # noqa: ARG001
    _EARLY_SIGINT.append(signum)


def note_early_sigint() -> None:
    """From now until a command is found, Ctrl-C is only noted (the `clover` command's start)."""
    try:
        signal.signal(signal.SIGINT, _note_sigint)
    except ValueError:  # pragma: no cover - not the main thread
        pass


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


if os.path.basename(sys.argv[0] if sys.argv else "") in ("clover", "clover.exe"):
    note_early_sigint()  # (`python -m clover_cpp.cli`: __main__.py does it)

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class UserError(click.ClickException):
    """One-line error for the user (exit status 1)."""


def _one_line(msg: object) -> str:
    return " ".join(str(msg).split()) or "unknown error"


#: what is reported as one line: our errors (the converter's, the reader's, the quantizer's, the
#: runtime's all derive from UserFacingError), the system's and argument errors
_USER_ERRORS = (UserFacingError, OSError, ValueError)


def fail(msg: object, code: int = 1) -> NoReturn:
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
            fail("interrupted", 130)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except click.ClickException as e:
            fail(e.format_message())
        except SystemExit:
            raise
        except _USER_ERRORS as e:
            if isinstance(e, OSError) and getattr(e, "filename", None):
                fail(f"{e.filename}: {e.strerror or e}")
            fail(e)
        except Exception as e:  # noqa: BLE001
            if os.environ.get("CLOVER_DEBUG"):
                raise
            fail(f"unexpected {type(e).__name__}: {e} (set CLOVER_DEBUG=1 for a traceback)")
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
