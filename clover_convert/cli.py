"""Command line: ``clover-convert SRC OUT`` / ``python -m clover_convert SRC OUT``."""

from __future__ import annotations

import signal
import sys

import click

from .converter import OUTTYPES, convert
from .mapping import ConversionError
from .safetensors_io import CheckpointError


def _on_sigterm(signum, frame):  # noqa: ARG001
    # turn SIGTERM into an exception so the converter removes its temporary files
    raise SystemExit(128 + signum)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("out", required=False)
@click.option("--outtype", type=click.Choice(OUTTYPES, case_sensitive=False), default="auto", show_default=True,
              help="Tensor type (norms, routers, conv taps and 1-D tensors stay f32).")
@click.option("--split-max-size", default=None, metavar="SIZE",
              help="Split the output into files of at most SIZE of tensor data (e.g. 50M, 2G).")
@click.option("--dry-run", is_flag=True, help="Print the plan (names, shapes, types, bytes); read and write no weights.")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def main(src: str, out: str | None, outtype: str, split_max_size: str | None, dry_run: bool, force: bool,
         no_progress: bool) -> None:
    """Convert a Hugging Face Clover checkpoint SRC (a folder, or a hub repo id org/name) to GGUF at OUT.

    OUT may be a folder (the file is then named after the model and type) or omitted
    (the current folder)."""
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass
    try:
        plan = convert(src, out, outtype=outtype.lower(), split_max_size=split_max_size, dry_run=dry_run,
                       force=force, progress=not no_progress and sys.stderr.isatty())
    except (ConversionError, CheckpointError, OSError) as e:
        msg = " ".join(str(e).split()) if not isinstance(e, OSError) or not e.filename else \
            f"{e.filename}: {e.strerror or e}"
        click.echo(f"error: {msg}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    if dry_run:
        click.echo(plan.format())
    else:
        click.echo(plan.summary(), err=True)


if __name__ == "__main__":  # pragma: no cover
    main()
