"""The commands that measure speed: `clover bench` (block sizes against B = 1 on a model) and
`clover demo` (the default model, generated live, then its speed-up over B = 1)."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ..demo import default_cache_dir, demo_model, machine_load, paired_runs, speed_verdict
from .group import CONTEXT_SETTINGS, UserError, cli
from .live import generate_to_terminal
from .options import (BLOCK_SIZE, LIBRARY_DEFAULT, check_flags, coreset_option, expert_stats_option, flag_errors,
                      library_default, model_option, open_model, runtime_options, use_visual)

DEFAULT_DEMO_PROMPT = 'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n'


def _parse_block_sizes(s: str) -> list[Any]:
    try:
        out: list[Any] = [x if x == "auto" else int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--block-sizes: expected a comma-separated list of integers or 'auto', got {s!r}") from None
    if not out or any(b != "auto" and b < 1 for b in out):
        raise UserError(f"--block-sizes: block sizes must be >= 1, got {s!r}")
    return out


@cli.command(context_settings=CONTEXT_SETTINGS)
@model_option
@click.option("-p", "--prompt", default="The quick brown fox jumps over the lazy dog.", show_default=True,
              help="Prompt text.")
@click.option("--block-sizes", default="1,4,8,16,32,auto", show_default=True, help="Block sizes to compare.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens to generate per run.")
@click.option("--threshold", type=float, default=lambda: library_default("threshold"), show_default=LIBRARY_DEFAULT,
              help="Confidence threshold.")
@click.option("--step-cap", "--max-steps", "max_steps", type=int, default=0, show_default=True,
              help="Step cap per block.")
@click.option("-r", "--repetitions", type=click.IntRange(min=2), default=3, show_default=True,
              help="Rounds; each round runs every block size once (rotated order), so that the "
                   "comparisons are paired.")
@coreset_option
@expert_stats_option
@runtime_options
def bench(model: str, prompt: str, block_sizes: str, n_predict: int, threshold: float, max_steps: int,
          repetitions: int, coreset: Any, expert_stats: bool, threads: int | None, ctx_size: int, n_gpu_layers: int,
          flash_attn: str, rpc: str | None, tensor_split: list[float] | None, override_tensor: str | None,
          verbose: bool) -> None:
    """Tokens/s and tokens per forward pass for each block size, against B = 1 (autoregressive).

    Paired and repeated: every round runs each setting once, in a rotated order; the table
    shows medians with the min-max spread over the rounds, and the speed-up is the median of
    the per-round ratios. EOS is ignored so that every run generates -n tokens."""
    sizes = _parse_block_sizes(block_sizes)
    check_flags(dict(max_tokens=n_predict, threshold=threshold, max_steps=max_steps))
    if 1 not in sizes:
        sizes = [1] + sizes
    with flag_errors(), open_model(model, threads, ctx_size, n_gpu_layers, None, verbose, flash_attn, rpc,
                                   tensor_split, override_tensor, expert_stats=expert_stats) as m:
        m.coreset = coreset
        m.generate(prompt, max_tokens=min(n_predict, 8), block_size="auto", stop_at_eos=False)  # warm-up + curve
        runs = paired_runs(lambda B: m.generate(prompt, max_tokens=n_predict, block_size=B, threshold=threshold,
                                                max_steps=max_steps, stop_at_eos=False).stats,
                           sizes, repetitions)
    base = runs[1]
    click.echo(f"model {model}, prompt {base[0].n_prompt} tok, -n {n_predict}, threshold {threshold}"
               + (f", max steps {max_steps}" if max_steps else "") + f", {repetitions} paired rounds")
    hdr = f"{'B':>6} {'tok/fwd':>8} {'tok/s (median, min-max)':>26} {'x B=1 (median, min-max)':>26}"
    if expert_stats:  # (the counting slows the passes: the times are not a measurement then)
        hdr += f" {'experts/pass':>13} {'bytes x B=1':>12}"
    click.echo(hdr)
    click.echo("-" * len(hdr))
    for B in sizes:
        tps = [s.tokens_per_second for s in runs[B]]
        ratio = [a.tokens_per_second / b.tokens_per_second for a, b in zip(runs[B], base) if b.tokens_per_second]
        row = (f"{B!s:>6} {_median([s.tokens_per_forward for s in runs[B]]):>8.2f} "
               f"{_spread(tps, '.1f'):>26} {_spread(ratio, '.2f', 'x'):>26}")
        if expert_stats:
            row += (f" {_median([s.experts_per_pass for s in runs[B]]):>13.2f}"
                    f" {_median([s.expert_bytes_ratio for s in runs[B]]):>12.2f}")
        click.echo(row)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _spread(xs: Sequence[float], fmt: str, unit: str = "") -> str:
    if not xs:
        return "-"
    return f"{_median(xs):{fmt}}{unit} ({min(xs):{fmt}}-{max(xs):{fmt}})"


@cli.command(context_settings=CONTEXT_SETTINGS)
@click.option("-p", "--prompt", default=DEFAULT_DEMO_PROMPT, show_default=True, help="Prompt text.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=64, show_default=True,
              help="Tokens to generate.")
@click.option("--block-size", "block_size", type=BLOCK_SIZE, default="auto", show_default=True,
              help="Block size, or auto (chosen per block from the measured cost and tokens per pass).")
@click.option("--threshold", type=float, default=lambda: library_default("threshold"), show_default=LIBRARY_DEFAULT,
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
    check_flags(dict(max_tokens=n_predict, block_size=block_size, threshold=threshold))
    path, desc = demo_model(Path(cache_dir) if cache_dir else default_cache_dir())
    click.echo(f"model: {desc}\n       {path}", err=True)
    visual = use_visual(visual)
    with flag_errors(), open_model(str(path), threads, 4096, 0, block_size, False) as m:
        B = block_size
        click.echo(f"prompt: {prompt!r}; block size {B}, threshold {threshold}", err=True)
        kw = dict(max_tokens=n_predict, block_size=B, threshold=threshold)
        r = generate_to_terminal(m, prompt, visual, prefix=prompt, **kw)
        sys.stdout.write("\n")
        sys.stdout.flush()
        click.echo(r.stats.format(), err=True)
        if compare and B != 1:
            # paired and repeated: 5 rounds of (B, B = 1), the order alternating; the load is read
            # before and after, since a busy machine hides per-forward costs
            load = [machine_load()]
            runs = paired_runs(lambda b: m.generate(prompt, max_tokens=n_predict, block_size=b,
                                                    threshold=threshold).stats, [B, 1], 5)
            load.append(machine_load())
            tps = {b: [s.tokens_per_second for s in runs[b]] for b in (B, 1)}
            ratio = [a / b for a, b in zip(tps[B], tps[1]) if b]
            tpf = _median([s.tokens_per_forward for s in runs[B]])
            busy = max((x for x in load if x is not None), default=0.0)
            click.echo(f"[clover] B={B}: {_spread(tps[B], '.1f')} tok/s, {tpf:.2f} tok/forward; "
                       f"B=1 (autoregressive): {_spread(tps[1], '.1f')} tok/s; {speed_verdict(ratio)}"
                       + (f"; the machine was busy (load {busy:.2f} per core): not a measurement"
                          if busy > 0.5 else ""), err=True)
