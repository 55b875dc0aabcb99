"""benchmarks/project.py's roofline with a block expert coreset: a pass's canvas rows read at most C
experts per MoE layer, a causal commit fused with a pass still routes every committed token."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import project  # noqa: E402

from clover_testkit.presets import PRESETS  # noqa: E402

D = project.Dims.of(PRESETS["35b-a3b"])
Q = project.QUANTS["Q4_K_M"]


def test_a_coreset_bounds_a_pass_and_not_the_commit_it_rides_on() -> None:
    full_pass = project.forward_experts(D, 32)
    assert 100 < full_pass < D.experts                                  # uniform routing of 32 rows
    assert project.forward_experts(D, 32, coreset=24) == 24
    assert project.forward_experts(D, 1, coreset=24) == D.top_k          # B = 1 routes as ever
    fused = project.forward_experts(D, 32, commit=32, coreset=24)
    assert fused == project.distinct_experts(D, 32) + 24
    assert project.forward_experts(D, 32, commit=32) == project.distinct_experts(D, 64)


def test_the_coreset_speeds_up_projected_diffusion_on_a_bandwidth_bound_gpu() -> None:
    h200 = next(d for d in project.DEVICES if d.name.startswith("H200"))
    off = project.diffusion(h200, D, Q, 4096, 32, 4)
    on = project.diffusion(h200, D, Q, 4096, 32, 4, coreset=24)
    assert on > 1.3 * off


def test_the_command_line_takes_auto_and_refuses_a_bad_value() -> None:
    ok = subprocess.run([sys.executable, str(REPO / "benchmarks" / "project.py"), "--coreset", "auto"],
                        capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert "coreset of 24" in ok.stdout
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "project.py"), "--coreset", "x"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--coreset" in bad.stderr
