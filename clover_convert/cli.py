"""Command line: ``clover-convert SRC OUT`` / ``python -m clover_convert SRC OUT``."""

from __future__ import annotations

import signal
import sys

import click

from clover_gguf.errors import UserFacingError

from .config import ConversionError
from .converter import OUTTYPES, convert
from .quantize_stream import QUANT_OUTTYPES


def _on_sigterm(signum, frame):  # noqa: ARG001
    # turn SIGTERM into an exception so the converter removes its temporary files
    raise SystemExit(128 + signum)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src")
@click.argument("out", required=False)
@click.option("--outtype", type=click.Choice(OUTTYPES + tuple(q.lower() for q in QUANT_OUTTYPES if q != "Q8_0"),
                                             case_sensitive=False), default="auto", show_default=True,
              help="Tensor type (norms, routers, conv taps and 1-D tensors stay f32). A llama.cpp file type "
                   "(q4_k_m, q6_k, iq4_xs, ...) quantizes in one pass: the file of --outtype bf16 + clover quantize, "
                   "without the bf16 file.")
@click.option("--imatrix", default=None, metavar="FILE",
              help="Importance matrix (GGUF, from clover imatrix or llama-imatrix) for a quantized --outtype.")
@click.option("-t", "--threads", default=0, type=click.IntRange(0, 1024), show_default=True,
              help="Quantizer threads for a quantized --outtype (0 = all cores).")
@click.option("--split-max-size", default=None, metavar="SIZE",
              help="Split the output into files of at most SIZE of tensor data (e.g. 50M, 2G).")
@click.option("--dry-run", is_flag=True, help="Print the plan (names, shapes, types, bytes); read and write no weights.")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def main(src: str, out: str | None, outtype: str, split_max_size: str | None, dry_run: bool, force: bool,
         no_progress: bool, imatrix: str | None = None, threads: int = 0) -> None:
    """Convert a Hugging Face Clover checkpoint SRC (a folder, or a hub repo id org/name) to GGUF at OUT.

    OUT may be a folder (the file is then named after the model and type) or omitted
    (the current folder)."""
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass
    quant = outtype.upper() in QUANT_OUTTYPES and outtype.lower() not in OUTTYPES
    try:
        if quant:
            from clover_gguf.files import fmt_bytes
            from .quantize_stream import convert_quantized

            if split_max_size is not None:
                raise ConversionError(f"--split-max-size is not supported with --outtype {outtype} (quantize writes one file)")
            plan = convert_quantized(src, out, outtype.upper(), imatrix=imatrix, n_threads=threads, force=force,
                                     dry_run=dry_run, progress=not no_progress and sys.stderr.isatty())
            if not dry_run:
                click.echo(f"wrote {len(plan.tensors)} tensors, {plan.total_params} parameters, "
                           f"{fmt_bytes(plan.out.stat().st_size)} ({plan.outtype}) to {plan.out} "
                           f"in {plan.elapsed_s:.1f} s (one pass, no intermediate file)", err=True)
                return
        else:
            if imatrix is not None:
                raise ConversionError(f"--imatrix needs a quantized --outtype (q4_k_m, iq4_xs, ...), not {outtype}")
            plan = convert(src, out, outtype=outtype.lower(), split_max_size=split_max_size, dry_run=dry_run,
                           force=force, progress=not no_progress and sys.stderr.isatty())
    except (UserFacingError, OSError) as e:
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
