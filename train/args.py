"""Command-line options shared by train.train and train.distill (no torch needed to parse them)."""

from __future__ import annotations

import argparse


def add_optimizer_args(ap: argparse.ArgumentParser, *, lr: float, warmup: int, threads: int) -> None:
    """The schedule, optimizer, evaluation and checkpoint options of train and distill."""
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--ckpt-every", type=float, default=180.0, help="seconds between checkpoints")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--resume", action="store_true")
