"""All native benchmarks side by side in one run, with ratios against upstream llama.cpp.

    .venv/bin/python benchmarks/run_all.py [--quick] [--threads 2] [--types f16,q8_0]
                                           [--cache ~/.cache/clover-cpp/bench] [--json out.json]

Models (the clover `small` preset and same-size upstream baselines, random weights) are
generated/converted by make_baselines.py into the cache folder and reused when present.
For each type (f16, q8_0) it measures, at --threads threads:

1. cost curve: one clover block pass of n tokens (context block size n, empty memory),
   n in {1,2,4,8,16,32}, against `llama-bench -p n -n 0 -t T -r 3` on llama.cpp's own
   qwen35moe architecture of the same dimensions (same weights and tensor types minus
   the clover-only tensors), as time per n-token pass; medians; ratio clover / upstream
   (target <= 1.25). The two are interleaved per n, so that a change of machine load
   hits both. Also `llama-bench -p 0 -n 128` (upstream autoregressive decode) for part 2.
2. tokens/s and tokens per forward (TPF) of clover_generate (64-token prompt, 128 new
   tokens, greedy, stop_at_eos off, threshold 1.0, step cap S = B/k so that exactly k
   tokens are unmasked per step) for B in {1,4,8,16,32}, k = B and k = 4; ratio to B = 1
   (clover's own autoregressive mode) and the crossover.
3. one B = 32 block pass after 128, 1024 and 4096 committed tokens; ratio 4096/128
   (target <= 1.3).
4. end to end: llama-diffusion-cli on a same-size llada-moe (512-token canvas = 256 prompt
   + 256 new tokens, 64 steps of 4 tokens) against clover_generate (same 256-token prompt,
   256 new tokens, B = 32, S = 8, i.e. 4 tokens per step), seconds and speedup
   (target >= 10x).
5. the prompt's causal commit: clover_commit of a 2048-token prompt (one llama_decode per
   ubatch of max(512, 2B) tokens) against `llama-bench -p 2048 -n 0` (target >= 0.8x).

--quick shrinks everything for a smoke run (f16 only, 1 repetition, n in {1,4,32},
B in {1,8,32} with 32 new tokens, depths 128/256, end to end with a 64-token prompt and
64 new tokens and 2 upstream steps extrapolated to 16); its figures are not the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import make_baselines  # noqa: E402
import native_bench as nb  # noqa: E402

BIN = Path(os.environ.get("CLOVER_BIN_DIR", REPO / "build" / "bin"))


def log(msg: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Lines(list):
    """The report: every line is also echoed to stderr as soon as it is known."""

    def append(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        super().append(line)


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v), idle


def busy_cores(interval: float = 1.0) -> float:
    """CPU cores busy (all processes) over `interval` seconds; call while nothing of ours runs."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(interval)
        t1, i1 = _cpu_times()
    except OSError:
        return 0.0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(t1 - t0, 1))


WAITED = {"s": 0.0, "busy_seen": []}


def wait_idle(max_wait: float, threshold: float = 0.25) -> None:
    """Wait (at most max_wait s) until other processes use < threshold cores."""
    if max_wait <= 0:
        return
    t0 = time.perf_counter()
    b = busy_cores()
    while b >= threshold and time.perf_counter() - t0 < max_wait:
        b = busy_cores(2.0)
    WAITED["s"] += time.perf_counter() - t0
    WAITED["busy_seen"].append(round(b, 2))
    if b >= threshold:
        log(f"machine still busy ({b:.2f} cores used by others) after {max_wait:.0f} s; measuring anyway")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def need_tool(name: str) -> Path:
    p = BIN / name
    if not p.is_file():
        raise SystemExit(f"{p} is missing: cmake --build build --target llama-bench llama-diffusion-cli")
    return p


# ----------------------------------------------------------------------------- upstream runs
def llama_bench(model: Path, threads: int, reps: int, p: int = 0, n: int = 0) -> dict:
    cmd = [str(need_tool("llama-bench")), "-m", str(model), "-p", str(p), "-n", str(n),
           "-t", str(threads), "-r", str(reps), "-o", "json", "-ngl", os.environ.get("CLOVER_NGL_UPSTREAM", "0")]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rows = json.loads(r.stdout)
    row = rows[0]
    samples = [x / 1e9 for x in row["samples_ns"]]
    return {"cmd": " ".join(cmd[1:]), "median_s": statistics.median(samples), "mean_s": row["avg_ns"] / 1e9,
            "min_s": min(samples), "samples_s": samples, "avg_ts": row["avg_ts"]}


def diffusion_cli(model: Path, threads: int, n_prompt: int, n_new: int, tokens_per_step: int,
                  steps_run: int | None = None) -> dict:
    """llama-diffusion-cli on a canvas of n_prompt + n_new tokens. The full run has
    n_new / tokens_per_step steps; with steps_run < that, only steps_run steps are run and
    the time is extrapolated (every step is one forward of the whole canvas)."""
    steps_full = n_new // tokens_per_step
    steps = steps_run or steps_full
    canvas = n_prompt + n_new
    prompt = " the" * n_prompt  # one token per " the" with the benchmark tokenizer (checked)
    # --diffusion-block-length = canvas: a single block (all of the generated region) with
    # steps transfers of n_new/steps tokens each. diffusion.cpp counts blocks over the whole
    # canvas (prompt included), so -block-length 32 would need 2x the steps and run one
    # wasted forward per empty block; one block gives exactly `steps` forwards.
    cmd = [str(need_tool("llama-diffusion-cli")), "-m", str(model), "-p", prompt,
           "-ub", str(canvas), "-b", str(canvas), "-c", str(canvas), "-t", str(threads),
           "--diffusion-steps", str(steps), "--diffusion-block-length", str(canvas),
           "--temp", "0", "--seed", "0"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600)
    wall = time.perf_counter() - t0
    text = r.stdout + r.stderr
    m = re.search(r"total time: ([0-9.]+)ms, time per step: ([0-9.]+)ms", text)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"llama-diffusion-cli failed (rc {r.returncode}):\n{text[-2000:]}")
    total = float(m.group(1)) / 1e3
    per_step = total / steps
    # per-step times from the log timestamps (m.ss.ms.us) of the progress line printed at
    # the start of every step: robust to a burst of load during one step
    marks = {}
    for mm, ss, ms, us, i in re.findall(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I\s+diffusion step: (\d+)/", text):
        marks[int(i)] = int(mm) * 60 + int(ss) + int(ms) / 1e3 + int(us) / 1e6
    steps_s = [marks[i + 1] - marks[i] for i in range(steps - 1) if i in marks and i + 1 in marks]
    shown = " ".join(c if c != prompt else f"\"{' the' * 2}...\" ({n_prompt} tokens)" for c in cmd[1:])
    return {"cmd": shown, "steps_run": steps, "steps_full": steps_full, "measured_s": total,
            "per_step_s": per_step, "total_s": per_step * steps_full, "extrapolated": steps != steps_full,
            "step_samples_s": steps_s, "step_min_s": min(steps_s) if steps_s else per_step,
            "step_median_s": statistics.median(steps_s) if steps_s else per_step, "process_wall_s": wall}


# ----------------------------------------------------------------------------- sections
def run_type(t: str, paths: dict, a, rep: list[str], res: dict) -> None:
    T = a.threads
    q = a.quick
    ns = (1, 4, 32) if q else (1, 2, 4, 8, 16, 32)
    reps = 1 if q else a.reps
    out = res.setdefault(t, {})
    with nb.Model(paths["clover"], T) as model:
        # ---------------------------------------------------------------- 1
        log(f"{t}: 1. cost curve")
        la0 = loadavg()
        cost = {}
        for n in ns:
            wait_idle(a.wait_idle)
            ours = nb.cost_curve(model, (n,), reps=max(reps, 1))[n]
            up = llama_bench(paths["qwen35moe"], T, max(reps, 1), p=n)
            cost[n] = {"clover": ours, "upstream": up, "ratio": ours["min_s"] / up["min_s"]}
        tg = None if q else llama_bench(paths["qwen35moe"], T, reps, n=128)
        out["cost"] = cost
        out["upstream_tg128"] = tg
        rep.append(f"1. Cost of one pass of n tokens: clover_block_pass (context B = n, empty memory) vs")
        rep.append(f"   upstream qwen35moe `llama-bench -p n -n 0 -t {T} -r {max(reps, 1)}` (same dims/weights);")
        rep.append(f"   best of {max(reps, 1)} after a warm-up, both sides (shared machine: noise only adds time)")
        rep.append(f"   {'n':>3} {'clover ms':>10} {'upstream ms':>12} {'ratio':>6}  {'clover tok/s':>12} {'upstream tok/s':>14}")
        worst = 0.0
        for n, c in cost.items():
            o, u = c["clover"]["min_s"], c["upstream"]["min_s"]
            worst = max(worst, c["ratio"])
            rep.append(f"   {n:>3} {o * 1e3:>10.1f} {u * 1e3:>12.1f} {c['ratio']:>6.2f}  {n / o:>12.1f} {n / u:>14.1f}")
        rep.append(f"   worst ratio {worst:.2f} (target <= 1.25: {'met' if worst <= 1.25 else 'MISSED'});"
                   f" load average {la0} -> {loadavg()}")
        out["cost_worst_ratio"] = worst

        # ---------------------------------------------------------------- 2
        log(f"{t}: 2. tokens/s vs block size")
        wait_idle(a.wait_idle)
        la0 = loadavg()
        cases = nb.schemes((1, 8, 32)) if q else nb.schemes()
        new = 32 if q else 128
        tps = nb.tokens_per_second(model, prompt_len=64, max_new=new, cases=cases, reps=1 if q else 2)
        out["tps"] = tps
        base = next(r for r in tps if r["B"] == 1)["tokens_per_second"]
        rep.append("")
        rep.append(f"2. clover_generate: 64-token prompt, {new} new tokens, greedy, stop_at_eos off, threshold 1.0,")
        rep.append("   step cap S = B/k (exactly k tokens unmasked per step: k = B -> one step per block, k = 4);")
        rep.append("   tok/s = generated / decode time (the prompt's commit excluded; best of " + ("1" if q else "2")
                   + " runs); steps = block passes;")
        rep.append("   a block's commit rides on the next block's first pass, or is a forward of its own where that")
        rep.append("   step needs no pass (B = 1: a 1-token commit per token, no pass): decode forwards = passes +")
        rep.append("   lone commits = generated / tok/fwd")
        up_tps = 128 / tg["min_s"] if tg else None
        rep.append(f"   {'B':>3} {'k':>3} {'S':>3} {'steps':>6} {'commits':>7} {'tok/fwd':>7} {'tok/s':>8} {'vs B=1':>7}"
                   + (f" {'vs AR':>6}" if up_tps else ""))
        for r in tps:
            ok = "" if r["expected_steps"] in (None, r["n_steps"]) else f"  (expected {r['expected_steps']} steps!)"
            rep.append(f"   {r['B']:>3} {r['k']:>3} {r['max_steps']:>3} {r['n_steps']:>6} {r['n_commits']:>7} "
                       f"{r['tokens_per_forward']:>7.2f} {r['tokens_per_second']:>8.1f} "
                       f"{r['tokens_per_second'] / base:>6.2f}x"
                       + (f" {r['tokens_per_second'] / up_tps:>5.2f}x" if up_tps else "") + ok)
        if up_tps:
            b32 = next((r for r in tps if r["B"] == 32 and r["k"] == 32), None)
            out["b1_vs_ar"] = base / up_tps
            rep.append(f"   B = 1 vs upstream autoregressive: {base / up_tps:.2f}x (target >= 0.9: "
                       f"{'met' if base / up_tps >= 0.9 else 'MISSED'}); B = 1 is autoregressive decoding: one "
                       f"1-token forward per token (its commit), as upstream's")
            if b32:
                out["b32_vs_ar"] = b32["tokens_per_second"] / up_tps
                rep.append(f"   B = 32, k = 32 vs upstream autoregressive: {out['b32_vs_ar']:.2f}x (target >= 2.0: "
                           f"{'met' if out['b32_vs_ar'] >= 2.0 else 'MISSED'}); one 64-token forward per 32 tokens "
                           f"(a block's commit fused with the next block's pass)")
        for label, sel in (("k = B (one step per block)", lambda r: r["k"] == r["B"]),
                           ("k = 4", lambda r: r["k"] == 4 and r["B"] >= 4)):
            rows = [r for r in tps if sel(r) and r["B"] > 1]
            if not rows:
                continue
            win = [r["B"] for r in rows if r["tokens_per_second"] > base]
            best = max(rows, key=lambda r: r["tokens_per_second"])
            cross = (f"faster than B = 1 from B = {min(win)}" if win else "never faster than B = 1 here")
            rep.append(f"   crossover, {label}: {cross}; best B = {best['B']} "
                       f"({best['tokens_per_second']:.1f} tok/s, {best['tokens_per_second'] / base:.2f}x)")
        c1 = cost[1]
        rep.append(f"   references: clover B = 1 runs one 1-token forward per token ({base:.1f} tok/s); one 1-token pass "
                   f"alone = {1 / c1['clover']['min_s']:.1f}/s;")
        if tg:
            rep.append(f"   upstream qwen35moe autoregressive decode `llama-bench -p 0 -n 128 -r {reps}`: "
                       f"{128 / tg['min_s']:.1f} tok/s (best run; = {tg['min_s'] / 128 * 1e3:.1f} ms/token)")
        rep.append(f"   load average {la0} -> {loadavg()}")

        # ---------------------------------------------------------------- 3
        log(f"{t}: 3. depth")
        wait_idle(a.wait_idle)
        la0 = loadavg()
        depths = (128, 256) if q else (128, 1024, 4096)
        dep = nb.depth_latency(model, depths, B=32, reps=max(reps, 1))
        out["depth"] = dep
        rep.append("")
        rep.append("3. One denoising step (block pass, B = 32, fully masked block) after d committed random tokens")
        rep.append(f"   {'d':>5} {'best ms':>8} {'median ms':>10}   (causal commit to reach d)   best of {max(reps, 1)}")
        for d, r in dep.items():
            rep.append(f"   {d:>5} {r['min_s'] * 1e3:>8.1f} {r['median_s'] * 1e3:>10.1f}   ({r['commit_s']:.1f} s)")
        dmax = max(dep)
        ratio = dep[dmax]["min_s"] / dep[128]["min_s"]
        out["depth_ratio"] = ratio
        tgt = f"target <= 1.3: {'met' if ratio <= 1.3 else 'MISSED'}" if dmax == 4096 else "quick run: 4096 not measured"
        rep.append(f"   ratio {dmax}/128 = {ratio:.2f} ({tgt}); load average {la0} -> {loadavg()}")

        # ---------------------------------------------------------------- 4
        log(f"{t}: 4. end to end vs llama-diffusion-cli")
        wait_idle(a.wait_idle)
        la0 = loadavg()
        n_prompt, n_new, k = (64, 64, 4) if q else (256, 256, 4)
        up_steps = a.upstream_steps or (2 if q else None)
        up = diffusion_cli(paths["llada-moe"], T, n_prompt, n_new, k, steps_run=up_steps)
        prompt = _the_tokens(model, n_prompt)
        e2e = {B: nb.end_to_end(model, prompt, max_new=n_new, B=B, tokens_per_step=k, reps=1 if q else 2)
               for B in ((32,) if q else (32, 16))}
        out["e2e"] = {"upstream": up, "clover": e2e}
        rep.append("")
        rep.append(f"4. End to end, {n_prompt}-token prompt, {n_new} new tokens, {k} tokens per step:")
        rep.append(f"   upstream: llama-diffusion-cli {up['cmd']}")
        lab = (f"EXTRAPOLATED from {up['steps_run']} of {up['steps_full']} steps" if up["extrapolated"]
               else f"all {up['steps_full']} steps measured")
        rep.append(f"     llada-moe (same dims, no shared expert, all attention): {up['total_s']:.2f} s "
                   f"({up['per_step_s'] * 1e3:.0f} ms/step x {up['steps_full']} steps, {lab})")
        up_best = up["step_min_s"] * up["steps_full"]
        rep.append(f"     per step from the log timestamps: median {up['step_median_s'] * 1e3:.0f} ms, best "
                   f"{up['step_min_s'] * 1e3:.0f} ms -> {up['steps_full']} x best = {up_best:.2f} s")
        for B, r in e2e.items():
            sp = up["total_s"] / r["wall_s"]
            sp_best = up_best / r["wall_s"]
            rep.append(f"   clover B = {B:>2}, S = {r['max_steps']}: {r['wall_s']:.2f} s (best of {len(r['runs_wall_s'])}; "
                       f"prompt commit {r['t_prefill_s']:.2f} s; {r['n_forward']} forwards: the prompt's, "
                       f"{r['n_steps']} passes and the block commits that rode on none; {r['n_commits']} block(s) committed)")
            rep.append(f"     speedup {sp:.1f}x vs the measured upstream total, {sp_best:.1f}x vs {up['steps_full']} x its best step "
                       f"(target >= 10x: {'met' if min(sp, sp_best) >= 10 else 'MISSED' if max(sp, sp_best) < 10 else 'met on one'})")
            r["speedup"] = sp
            r["speedup_vs_best_step"] = sp_best
        rep.append(f"   load average {la0} -> {loadavg()}")

        # ---------------------------------------------------------------- 5
        log(f"{t}: 5. causal commit of a long prompt")
        wait_idle(a.wait_idle)
        la0 = loadavg()
        n_long = 512 if q else 2048
        up_pp = llama_bench(paths["qwen35moe"], T, max(reps, 1), p=n_long)
        toks = model.tokens(n_long, seed=5)
        pre = {}
        for B in (1, 32):
            ctx = model.context(B, n_long + 64)
            model.commit(ctx, toks[:64])  # warm-up
            times = []
            for _ in range(max(reps, 1)):
                model.L.clover_reset(ctx)
                times.append(model.commit(ctx, toks))
            pre[B] = min(times)
        out["prefill"] = {"n": n_long, "upstream_s": up_pp["min_s"], "clover_s": pre}
        rep.append("")
        rep.append(f"5. Prefill of a {n_long}-token prompt: clover_commit (causal, one llama_decode per ubatch of "
                   f"max(512, 2B) tokens; the memory does not depend on B) vs upstream `llama-bench -p {n_long} -n 0`, "
                   f"best of {max(reps, 1)}")
        up_rate = n_long / up_pp["min_s"]
        rep.append(f"   upstream qwen35moe: {up_rate:.1f} tok/s")
        for B, sec in pre.items():
            rep.append(f"   clover B = {B:>2}: {n_long / sec:.1f} tok/s = {n_long / sec / up_rate:.2f}x (target >= 0.8: "
                       f"{'met' if n_long / sec / up_rate >= 0.8 else 'MISSED'})")
        rep.append(f"   load average {la0} -> {loadavg()}")


def startup(a, rep: list[str], res: dict) -> None:
    """Wall time of `clover run -n 1` and `clover-cli -n 1` on the default model, twice each:
    the first run may measure the cost curve and build the GGUF; the second reads the caches."""
    import subprocess

    from clover_cpp.demo import default_cache_dir, demo_model
    gguf, _ = demo_model(default_cache_dir(), log=lambda s: None)
    cmds = {"clover run": [str(REPO / ".venv" / "bin" / "clover"), "run", "-m", str(gguf)],
            "clover-cli": [str(REPO / "build" / "bin" / "clover-cli"), "-m", str(gguf)]}
    rep.append("")
    rep.append(f"6. Start-up to the first token on the default model ({gguf.name}), -n 1, block size auto, "
               f"{a.threads} threads; the first run of each fills the calibration cache if it is empty")
    out = res.setdefault("startup", {})
    for name, cmd in cmds.items():
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(cmd + ["-p", "def ", "-n", "1", "-t", str(a.threads)], capture_output=True, check=True)
            walls.append(time.perf_counter() - t0)
        out[name] = walls
        rep.append(f"   {name}: " + ", ".join(f"{w:.2f} s" for w in walls)
                   + f" (target for later runs <= 0.3 s: {'met' if min(walls[1:]) <= 0.3 else 'MISSED'})")


def _the_tokens(model: nb.Model, n: int) -> list[int]:
    """The token ids of ' the' * n (the prompt given to llama-diffusion-cli), checked to be n."""
    import ctypes
    from clover_cpp import _native as N

    text = (" the" * n).encode()
    arr = (ctypes.c_int32 * (n + 16))()
    cnt = ctypes.c_int32()
    rc = model.L.clover_tokenize(model.m, text, len(text), arr, n + 16, 1, 1, ctypes.byref(cnt))
    if rc != N.CLOVER_OK or cnt.value != n:
        raise RuntimeError(f"' the' * {n} tokenizes to {cnt.value} tokens (rc {rc}), expected {n}")
    return list(arr[:n])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="clover native benchmarks vs upstream llama.cpp, one report")
    ap.add_argument("--quick", action="store_true", help="smoke run: f16 only, fewer sizes/reps, shorter runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per timing (the best is reported)")
    ap.add_argument("--types", default=None, help="comma list of f16,q8_0 (default both; --quick: f16)")
    ap.add_argument("--cache", type=Path, default=make_baselines.DEFAULT_CACHE)
    ap.add_argument("--upstream-steps", type=int, default=None,
                    help="run only this many llama-diffusion-cli steps and extrapolate to 64")
    ap.add_argument("--wait-idle", type=float, default=None,
                    help="before each measurement wait up to this many seconds for other processes to "
                         "use < 0.25 cores (default 90, --quick 0)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    a = ap.parse_args(argv)
    if a.wait_idle is None:
        a.wait_idle = 0.0 if a.quick else 90.0
    types = [x for x in (a.types or ("f16" if a.quick else "f16,q8_0")).split(",") if x]

    t_start = time.perf_counter()
    from clover_testkit.presets import count_params, preset_config
    cfg = preset_config("small")
    log("models")
    models = make_baselines.ensure_models(a.cache, types)
    nb.N.lib().clover_set_verbosity(0)

    head = [
        "Clover native benchmarks" + (" (QUICK smoke run: reduced sizes)" if a.quick else ""),
        f"model: `small` preset, {count_params(cfg) / 1e6:.0f}M params (hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers, 1 in {cfg['full_attention_interval']} full attention, "
        f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} + shared, expert width "
        f"{cfg['moe_intermediate_size']}, vocab {cfg['vocab_size']}), random weights",
        f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {a.threads} threads; load average at start {loadavg()}",
        f"upstream: pinned llama.cpp in third_party/llama.cpp, tools from build/bin",
    ]
    report: list[str] = []
    res: dict = {"threads": a.threads, "quick": a.quick}
    for t in types:
        rep = Lines()
        for line in ("", f"===================== {t} =====================", ""):
            rep.append(line)
        run_type(t, models[t], a, rep, res)
        report += rep
    rep = Lines()
    startup(a, rep, res)
    report += rep

    summary = ["", "===================== targets ====================="]
    for t in types:
        r = res[t]
        sp = "  ".join(f"B={B}: {x['speedup']:.1f}x / {x['speedup_vs_best_step']:.1f}x"
                       for B, x in r["e2e"]["clover"].items())
        summary.append(f"{t:5s} cost ratio worst {r['cost_worst_ratio']:.2f} (<= 1.25) | depth {max(r['depth'])}/128 "
                       f"{r['depth_ratio']:.2f} (<= 1.3) | vs diffusion-cli (measured / best step) {sp} (>= 10)")
        pf = r["prefill"]
        summary.append(f"      B=1 vs AR {r.get('b1_vs_ar', float('nan')):.2f}x (>= 0.9) | B=32 k=32 vs AR "
                       f"{r.get('b32_vs_ar', float('nan')):.2f}x (>= 2.0) | prefill {pf['n']} B=32 "
                       f"{pf['upstream_s'] / pf['clover_s'][32]:.2f}x, B=1 {pf['upstream_s'] / pf['clover_s'][1]:.2f}x (>= 0.8)")
    for name, walls in res.get("startup", {}).items():
        summary.append(f"start-up {name}: later runs {min(walls[1:]):.2f} s (<= 0.3)")
    summary.append(f"total wall time {time.perf_counter() - t_start:.0f} s (of which {WAITED['s']:.0f} s waiting for an "
                   f"idle machine); load average at end {loadavg()}")
    if WAITED["busy_seen"]:
        summary.append("cores busy with other processes just before each measurement: "
                       + " ".join(f"{x:.2f}" for x in WAITED["busy_seen"]))
    print("\n".join(head + report + summary))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
