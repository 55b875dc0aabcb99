"""Check that a training run is reproducible from its seed: re-run its first --steps steps
with the run's own arguments (args.json; same seed, threads, data and --init-from) into a
scratch folder and compare the logged losses with the run's log.csv, step by step.

Identical losses over the first steps mean the run is a deterministic function of its
arguments on this machine (same torch build and thread count), so re-running it whole
reproduces its final weights and held-out loss.

    python -m train.check_repro --run train/runs/default --steps 20
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

from train import train as trainer


def logged_losses(log_csv: Path, n: int) -> list[str]:
    with open(log_csv, newline="") as f:
        return [row["loss"] for row, _ in zip(csv.DictReader(f), range(n))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a run folder with args.json and log.csv")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    run = Path(a.run)
    if not (run / "args.json").is_file() or not (run / "log.csv").is_file():
        print(f"error: {run} has no args.json / log.csv", file=sys.stderr)
        return 2
    args = json.loads((run / "args.json").read_text())
    want = logged_losses(run / "log.csv", a.steps)
    with tempfile.TemporaryDirectory() as tmp:
        # the run's own arguments, then (later options win) a scratch folder, no evaluations
        trainer.main(trainer.run_argv(args) + ["--out", tmp, "--stop-after", str(len(want)), "--eval-every", "0"])
        got = logged_losses(Path(tmp) / "log.csv", a.steps)
    same = sum(x == y for x, y in zip(got, want))
    print(f"{run}: {same}/{len(want)} logged losses identical over the first {len(want)} steps")
    for i, (x, y) in enumerate(zip(got, want)):
        if x != y:
            print(f"  step {i + 1}: rerun {x} vs logged {y}")
    return 0 if same == len(want) == len(got) else 1


if __name__ == "__main__":
    sys.exit(main())
