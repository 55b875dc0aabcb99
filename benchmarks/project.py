#!/usr/bin/env python3
"""Roofline projection of clover's decoding speed on named hardware.

A forward of n tokens (a causal commit, a block pass, or both fused) reads the dense weights
(attention / gated-delta-net projections, router, shared expert, output head), the distinct
routed experts that its n tokens choose in every MoE layer (E(n) of N; uniform routing gives
N * (1 - (1 - k/N)^n), measured on the 35B-A3B slice: 56-58 of 256 for 8 tokens of text, 141-154
for 32), and the recurrent state and KV cache; it computes 2 FLOPs per weight and token for the
weights its tokens use. Its time on a device is

    t(n) = overhead + combine(bytes(n) / bandwidth, flops(n) / compute)

with combine = max on a GPU (copies and kernels overlap) and + on a CPU (the same cores wait
for memory and compute), bandwidth and compute the device's peak times an efficiency, and
overhead a per-forward cost (kernel launches and synchronisation; per layer). Then

    AR (B = 1)       1 token per forward:                   tok/s = 1 / t(1)
    block diffusion  tau tokens per step (a pass of B), one commit fused per block of B:
                     tok/s = B / ((B/tau - 1) t(B) + t(2B))
    draft-self       a tokens kept per verification, one forward of 2B each (the draft's pass
                     rides on the verification's commit): tok/s = a / t(2B)

tau and a come from runs (benchmarks/draft_self.py, gpu.sh, run_all.py); the table spans them.

    python benchmarks/project.py                      # the 35B-A3B at Q4_K_M on the named devices
    python benchmarks/project.py --check              # the model against this machine: measure its
                                                      # bandwidth and compute, project the small preset
                                                      # (f16) and compare with run_all.py's sections 1-2
                                                      # measured in the same round (--results F: a report)
    python benchmarks/project.py --overhead-ms H200=0.06  # per-layer overhead measured by gpu.sh
    python benchmarks/project.py --coreset 24         # block passes with a block expert coreset of C
                                                      # experts (spec/model.md, "MoE"; auto: C = 3k)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# bits per weight of ggml's types (block size and scale bytes included)
BPW = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5, "q4_k": 4.5}


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    attn_every: int       # full_attention_interval: every k-th layer is full attention
    nk: int               # GDN key heads
    nv: int               # GDN value heads
    dk: int
    dv: int
    conv_taps: int        # conv kernel + look-ahead taps
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    shared_width: int
    vocab: int

    @classmethod
    def of(cls, c: dict) -> "Dims":
        return cls(c["hidden_size"], c["num_hidden_layers"], c["full_attention_interval"],
                   c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                   c["linear_value_head_dim"], c["linear_conv_kernel_dim"] + c.get("linear_conv_lookahead", 0),
                   c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["num_experts"],
                   c["num_experts_per_tok"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"],
                   c["vocab_size"])

    @property
    def n_attn(self) -> int:
        return self.layers // self.attn_every

    @property
    def n_gdn(self) -> int:
        return self.layers - self.n_attn

    def params(self) -> dict[str, float]:
        """Weights per class (whole model): experts, the rest of the layers, head, embedding."""
        H = self.hidden
        conv = 2 * self.nk * self.dk + self.nv * self.dv
        gdn = H * conv + H * self.nv * self.dv + 3 * H * self.nv + self.conv_taps * conv + self.nv * self.dv * H
        attn = H * 2 * self.heads * self.head_dim + 2 * H * self.kv_heads * self.head_dim + self.heads * self.head_dim * H
        shared = 3 * H * self.shared_width + H + H * self.experts   # shared expert, its gate, the router
        return {"experts": self.layers * self.experts * 3 * H * self.expert_width,
                "layers": self.n_gdn * gdn + self.n_attn * attn + self.layers * shared,
                "head": H * self.vocab, "embd": H * self.vocab}

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_width


@dataclass(frozen=True)
class Quant:
    """Bits per weight per class: Q4_K_M keeps Q4_K for most matrices, Q6_K for the output head and
    for ffn_down / attn_v in half the layers (llama.cpp's use_more_bits), f32 for norms and the small
    GDN tensors (negligible here)."""
    name: str
    experts: float
    layers: float
    head: float
    embd: float


QUANTS = {
    "Q4_K_M": Quant("Q4_K_M", (2 * BPW["q4_k"] + (BPW["q4_k"] + BPW["q6_k"]) / 2) / 3,
                    (BPW["q4_k"] * 5 + BPW["q6_k"]) / 6, BPW["q6_k"], BPW["q4_k"]),
    "q8_0": Quant("q8_0", BPW["q8_0"], BPW["q8_0"], BPW["q8_0"], BPW["q8_0"]),
    "f16": Quant("f16", 16, 16, 16, 16),
}


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float      # GB/s, peak
    compute: float        # TFLOPS, peak, for the matrix products at this file's type
    memory_gb: float
    gpu: bool
    bw_eff: float = 0.8
    compute_eff: float = 0.5
    overhead_ms_per_layer: float = 0.0
    note: str = ""


# what llama.cpp gets of a CPU's peak read bandwidth and f32 BLAS throughput (its f16 / quantized dot
# products, not a tuned GEMM): assumptions; `--check` tests the compute one against this machine
# (its bandwidth is measured as achieved, below)
CPU_BW_EFF, CPU_COMPUTE_EFF = 0.7, 0.35
# a measured machine's bandwidth is numpy's streaming read, already what a streaming read achieves
# (STREAM-like reads get ~0.7-0.85 of a datasheet peak), and llama.cpp's weight reads are streaming
# reads: used at 1.0, not at CPU_BW_EFF again. Its numpy figure for compute is a tuned GEMM's, which
# llama.cpp's dot products are not: that one keeps CPU_COMPUTE_EFF.
MEASURED_BW_EFF = 1.0

# published peak figures; efficiencies and launch overheads are assumptions (labelled in the output)
DEVICES = [
    Device("H200 (SXM)", 4800, 989, 141, True, 0.8, 0.4, 0.075, "HBM3e; dense f16 tensor-core TFLOPS"),
    Device("RTX 4090", 1008, 165, 24, True, 0.8, 0.4, 0.075, "GDDR6X; f16 tensor core, f32 accumulate"),
    Device("M4 Max (40-core GPU)", 546, 34, 128, True, 0.75, 0.4, 0.1, "unified memory; Metal f16"),
    Device("laptop CPU (8-core Zen 4, DDR5-5600 x2)", 89.6, 1.2, 64, False, CPU_BW_EFF, CPU_COMPUTE_EFF, 0.0,
           "AVX-512 FMA f32 peak; llama.cpp's quantized dot products"),
]


def distinct_experts(d: Dims, n: int) -> float:
    """Distinct experts per MoE layer chosen by n tokens, uniform routing."""
    return d.experts * (1 - (1 - d.top_k / d.experts) ** n)


def forward_experts(d: Dims, canvas: int, commit: int = 0, coreset: int = 0) -> float:
    """Distinct experts per MoE layer of a forward of `commit` committed tokens (full routing) and a
    canvas of `canvas` tokens, whose rows route among a coreset of C experts when C is set."""
    rows = distinct_experts(d, canvas)
    if coreset and canvas >= 2:
        rows = min(rows, max(coreset, d.top_k))
    if not commit:
        return rows
    full = distinct_experts(d, commit)
    return min(d.experts, full + rows) if coreset else distinct_experts(d, commit + canvas)


def forward_bytes_flops(d: Dims, q: Quant, n: int, ctx: int, experts: float | None = None) -> tuple[float, float]:
    p = d.params()
    e = distinct_experts(d, n) if experts is None else experts
    byts = (p["layers"] * q.layers + p["head"] * q.head) / 8 \
        + d.layers * e * d.expert_params() * q.experts / 8 \
        + n * d.hidden * q.embd / 8
    # the recurrent state (f32, read and written) and the KV cache of the attention layers (f16)
    byts += d.n_gdn * d.nv * d.dk * d.dv * 4 * 2 + d.n_attn * ctx * 2 * d.kv_heads * d.head_dim * 2
    active = p["layers"] + p["head"] + d.layers * d.top_k * d.expert_params()
    flops = 2 * n * active + d.n_attn * 4 * n * ctx * d.heads * d.head_dim \
        + d.n_gdn * 6 * n * d.nv * d.dk * d.dv
    return byts, flops


def t_forward(dev: Device, d: Dims, q: Quant, n: int, ctx: int, experts: float | None = None) -> float:
    """Seconds for one forward of n tokens (reading `experts` distinct experts per MoE layer)."""
    byts, flops = forward_bytes_flops(d, q, n, ctx, experts)
    tm = byts / (dev.bandwidth * 1e9 * dev.bw_eff)
    tc = flops / (dev.compute * 1e12 * dev.compute_eff)
    return dev.overhead_ms_per_layer * 1e-3 * d.layers + (max(tm, tc) if dev.gpu else tm + tc)


def ar(dev, d, q, ctx):
    return 1 / t_forward(dev, d, q, 1, ctx)


def diffusion(dev, d, q, ctx, B, tau, coreset=0):
    # B/tau - 1 plain passes, and a block's first pass fused with the previous block's commit
    tau = min(tau, B)
    return B / ((B / tau - 1) * t_forward(dev, d, q, B, ctx, forward_experts(d, B, 0, coreset))
                + t_forward(dev, d, q, 2 * B, ctx, forward_experts(d, B, B, coreset)))


def draft_self(dev, d, q, ctx, B, a, coreset=0):
    # a verification: its commit of B tokens (full routing) fused with the next draft's pass
    return min(a, B) / t_forward(dev, d, q, 2 * B, ctx, forward_experts(d, B, B, coreset))


def model_bytes(d: Dims, q: Quant) -> float:
    p = d.params()
    return (p["experts"] * q.experts + p["layers"] * q.layers + p["head"] * q.head + p["embd"] * q.embd) / 8


def project(d: Dims, q: Quant, devices: list[Device], ctx: int, taus: list[float], accepts: list[float],
            B: int, coreset: int = 0) -> list[str]:
    lines = [f"projected tok/s, {q.name}, context {ctx}, B = {B} (model {model_bytes(d, q) / 1e9:.1f} GB; "
             f"per token {forward_bytes_flops(d, q, 1, ctx)[0] / 1e9:.2f} GB read, "
             f"{forward_experts(d, B, 0, coreset):.0f} / {forward_experts(d, B, B, coreset):.0f} of {d.experts} "
             f"experts per layer for a pass of {B} / a pass fused with a commit of {B}"
             + (f", block passes with a coreset of {coreset})" if coreset else ", full routing)")]
    head = f"{'device':42s} {'AR':>7s} " + " ".join(f"{'diff t=' + format(t, 'g'):>10s}" for t in taus) + " " + \
        " ".join(f"{'ds a=' + format(a, 'g'):>9s}" for a in accepts)
    lines.append(head)
    for dev in devices:
        row = f"{dev.name:42s} {ar(dev, d, q, ctx):7.1f} " + \
            " ".join(f"{diffusion(dev, d, q, ctx, B, t, coreset):10.1f}" for t in taus) + " " + \
            " ".join(f"{draft_self(dev, d, q, ctx, B, a, coreset):9.1f}" for a in accepts)
        if model_bytes(d, q) / 1e9 > dev.memory_gb * 0.9:
            row += "   (does not fit: experts on the CPU, -ot)"
        lines.append(row)
    lines.append("assumed: bandwidth / compute efficiency and per-layer overhead per device: " + "; ".join(
        f"{dev.name.split(' (')[0]} {dev.bw_eff:g} / {dev.compute_eff:g} / {dev.overhead_ms_per_layer:g} ms"
        for dev in devices))
    return lines


# ----------------------------------------------------------------------------- this machine
def measure_machine(threads: int, seconds: float = 1.0) -> Device:
    """This CPU's read bandwidth (numpy sums of a 256 MB array per thread, in parallel) and f32
    matrix-product throughput (numpy's BLAS on `threads` threads)."""
    import numpy as np

    a = [np.ones(1 << 25, dtype=np.float64) for _ in range(threads)]  # 256 MB each
    for x in a:
        x.sum()
    best = math.inf
    for _ in range(10):  # the best of many: a shared host's neighbours only ever take bandwidth away
        ts = [threading.Thread(target=x.sum) for x in a]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    bw = threads * a[0].nbytes / best / 1e9
    del a
    m = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    m @ m
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        m @ m
        k += 1
    tflops = k * 2 * 1024 ** 3 / (time.perf_counter() - t0) / 1e12
    return Device(f"this machine ({threads} threads, measured)", bw, tflops, 24, False, MEASURED_BW_EFF,
                  CPU_COMPUTE_EFF, 0.0, "numpy streaming read (achieved, used at 1.0) and f32 BLAS throughput")


def measured_run_all(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """run_all.py's f16 figures: pass ms per n (section 1) and tok/s per B at k = B (section 2)."""
    text = path.read_text()
    sec = text.split("===================== f16 =====================", 1)[-1]
    cost = {int(a): float(b) for a, b in re.findall(r"^\s+(\d+)\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s*$",
                                                     sec.split("2. clover_generate", 1)[0], re.M)}
    gen = {}
    for B, k, tps in re.findall(r"^\s+(\d+)\s+(\d+)\s+\d+\s+\d+\s+\d+\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+x", sec, re.M):
        if B == k:
            gen[int(B)] = float(tps)
    return cost, gen


def measured_now(threads: int, reps: int) -> tuple[dict[int, float], dict[int, float]]:
    """run_all.py's sections 1 and 2 (f16, k = B), measured now on the same model and runner."""
    import make_baselines
    import native_bench as nb

    path = make_baselines.ensure_models(make_baselines.DEFAULT_CACHE, ["f16"])["f16"]["clover"]
    nb.N.lib().clover_set_verbosity(0)
    with nb.Model(path, threads) as model:
        cost = {n: s["min_s"] * 1e3 for n, s in nb.cost_curve(model, reps=reps).items()}
        tps = nb.tokens_per_second(model, 64, 128, nb.schemes(ks=("B",)), reps=2)
    return cost, {r["B"]: r["tokens_per_second"] for r in tps}


def compare(dev: Device, d: Dims, q: Quant, cost: dict[int, float], gen: dict[int, float]) -> float:
    """Print projected vs measured; return the worst relative error."""
    worst = 0.0
    print(f"{'':24s} {'projected':>10s} {'measured':>10s} {'error':>7s}")
    for n, ms in sorted(cost.items()):
        p = t_forward(dev, d, q, n, 64) * 1e3
        worst = max(worst, abs(p / ms - 1))
        print(f"pass of n = {n:<3d} (ms)    {p:10.1f} {ms:10.1f} {p / ms - 1:+7.0%}")
    for B, tps in sorted(gen.items()):
        # k = B: one step per block, the commit fused with the next block's pass
        p = ar(dev, d, q, 192) if B == 1 else diffusion(dev, d, q, 192, B, B)
        worst = max(worst, abs(p / tps - 1))
        print(f"B = {B:<3d} k = B (tok/s)    {p:10.1f} {tps:10.1f} {p / tps - 1:+7.0%}")
    return worst


def check(threads: int, results: Path | None, tol: float, rounds: int) -> int:
    """Without `results`: each round measures the machine, then the small preset's pass costs and
    tok/s (run_all.py's sections 1-2), then the machine again, and projects with the mean of the
    two machine figures, so that both sides see the same state of a shared host."""
    from clover_testkit.presets import PRESETS

    from run_all import busy_cores

    cfg = dict(PRESETS["small"], vocab_size=1280)
    d, q = Dims.of(cfg), QUANTS["f16"]
    worsts = []
    for r in range(1 if results else rounds):
        # the machine's bandwidth and compute are measured now: on a busy machine they are not its own
        busy = busy_cores()
        if busy >= 0.25:
            print(f"error: the machine is busy ({busy:.2f} cores used by other processes): its bandwidth and compute "
                  "cannot be measured now; run --check on a quiet machine", file=sys.stderr)
            return 2
        before = measure_machine(threads)
        if results:
            cost, gen = measured_run_all(results)
            if not cost or not gen:
                print(f"error: no f16 cost curve / tokens-per-second table in {results}", file=sys.stderr)
                return 2
            dev, what = before, results.name
        else:
            cost, gen = measured_now(threads, reps=10)
            after = measure_machine(threads)
            dev = dataclasses.replace(before, bandwidth=(before.bandwidth + after.bandwidth) / 2,
                                      compute=(before.compute + after.compute) / 2)
            what = (f"now, round {r + 1} of {rounds} (machine before / after: {before.bandwidth:.1f} / "
                    f"{after.bandwidth:.1f} GB/s, {before.compute * 1e3:.0f} / {after.compute * 1e3:.0f} GFLOPS)")
        print(f"this machine: {dev.bandwidth:.1f} GB/s read, {dev.compute * 1e3:.0f} GFLOPS f32 (numpy, {threads} "
              f"threads; used at {dev.bw_eff:g} / {dev.compute_eff:g} of that); small preset f16 "
              f"({model_bytes(d, q) / 1e9:.2f} GB); measured: {what}")
        worsts.append(compare(dev, d, q, cost, gen))
        print(f"worst error {worsts[-1]:.0%}\n")
    worst = max(worsts)
    print(f"worst error over {len(worsts)} round(s): {', '.join(f'{w:.0%}' for w in worsts)} "
          f"(target <= {tol:.0%} in every round: {'met' if worst <= tol else 'MISSED'})")
    return 0 if worst <= tol else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="project this machine and compare with run_all.py's results")
    ap.add_argument("--results", type=Path, default=None,
                    help="--check against this run_all.py report instead of measuring now")
    ap.add_argument("--rounds", type=int, default=3, help="--check: rounds of measuring (each one compared)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.30)
    ap.add_argument("--quant", default="Q4_K_M", choices=sorted(QUANTS))
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--coreset", default="0", help="block expert coreset C of the block passes: N, auto (3k) or 0 (off)")
    ap.add_argument("--tau", default="1.5,2,4,8", help="tokens per diffusion step to tabulate")
    ap.add_argument("--accept", default="2,4,8", help="tokens kept per draft-self verification to tabulate")
    ap.add_argument("--overhead-ms", action="append", default=[], metavar="DEVICE=MS",
                    help="per-layer, per-forward overhead of a device (e.g. from gpu.sh's B = 1 on the default model)")
    args = ap.parse_args(argv)
    if args.check:
        if args.results and not args.results.is_file():
            print(f"error: {args.results}: no such file", file=sys.stderr)
            return 2
        return check(args.threads, args.results, args.tolerance, max(1, args.rounds))
    try:
        taus = [float(x) for x in args.tau.split(",")]
        accepts = [float(x) for x in args.accept.split(",")]
        over = dict(kv.split("=", 1) for kv in args.overhead_ms)
        over = {k: float(v) for k, v in over.items()}
    except ValueError as e:
        print(f"error: bad number: {e}", file=sys.stderr)
        return 2
    devices = [Device(**{**dev.__dict__, "overhead_ms_per_layer": next((v for k, v in over.items() if dev.name.startswith(k)),
                                                                        dev.overhead_ms_per_layer)}) for dev in DEVICES]
    from clover_testkit.presets import PRESETS

    d = Dims.of(PRESETS["35b-a3b"])
    coreset = 3 * d.top_k if args.coreset == "auto" else int(args.coreset) if args.coreset.isdigit() else -1
    if coreset < 0:
        print(f"error: --coreset must be N >= 0 or auto, got {args.coreset!r}", file=sys.stderr)
        return 2
    print("35B-A3B (40 layers: 30 gated-delta-net + 10 attention; 256 experts top-8 of width 512 + a shared one)")
    print("\n".join(project(d, QUANTS[args.quant], devices, args.ctx, taus, accepts, args.block_size, coreset)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
