"""What a draft-self verification and a block-diffusion step cost, against one forward of the same
token count.

    .venv/bin/python benchmarks/draft_self_cost.py --callgrind [--n 4,8,16] [--no-small]
    .venv/bin/python benchmarks/draft_self_cost.py [--threads 2] [--reps 5]      # wall clock

On the default model (models/clover-default, f16, as `clover demo` converts it) and the `small`
preset (random weights, f16, benchmarks/make_baselines.py), for each n:

(a) one forward of t tokens: a block pass of t tokens (`clover_block_pass`, every row's logits,
    what the cost curve's pass(t) runs) for t = n and t = 2 n, and a causal commit of n tokens
    (`clover_commit`, the last row's logits);
(b) one verification of n drafted tokens (draft-self at B = n, draft_steps = 1): the forward of the
    n drafted tokens committed with every row's logits plus the next block's canvas of n masks (2 n
    tokens), the acceptance, the rollback on a rejection;
(c) one block-diffusion step at B = n (threshold 0.9, at most 2 steps a block): a plain pass of n tokens, or (the first step
    of every block but the first) the previous block's commit of n fused with it (2 n tokens).

Ratios: (b) and the fused steps of (c) against the block pass of 2 n, plain steps against the
block pass of n. The target: <= 1.25.

--callgrind: instruction counts (repeatable on a busy machine): the script runs itself under
`valgrind --tool=callgrind --instr-atstart=no` (instrumentation starts after the model load and
the warm-up, through a client-request shim compiled here with the system C compiler against
valgrind/callgrind.h) and dumps the cost of every call of clover_block_pass, clover_commit_logits
and libclover's decode_run::verify / decode_run::step (kept out of line for this) on its own, with
1 thread (more threads add the thread pool's spinning, which is not repeatable). Slow: minutes per
model on the default model, longer on the small preset.

Without --callgrind: wall-clock milliseconds (median over --reps) of the same calls as seen from
Python (a verification = the draft-self generation's decode time per forward, and per verification,
which also counts the next draft's own pass after a rejection; a step = the block-diffusion
generation's decode time per forward), flagged when the machine is busy (load average
per core above 0.5): on a busy machine those figures are noise, use --callgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef main():\n")
TARGET = 1.25
CALLS = 4  # verifications / steps measured per n (the generation is cancelled after them)

SHIM_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void cg_mark(const char * s) { CALLGRIND_DUMP_STATS_AT(s); }
"""

# callgrind honours one dump pattern per function (a --dump-after on the pattern of a --dump-before
# never fires): a dump at the entry of every out-of-line method of libclover's decode loop, the
# cost of a call being the segment from its entry to the next method's (callgrind_costs). The
# public calls of (a) are bracketed by client-request dumps (their Python call overhead, small
# against a forward, included).
TRIGGER = "*decode_run::*"


def load_per_core() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


# ----------------------------------------------------------------------------- the measured calls
class Marks:
    """Phase markers: a callgrind dump named after the phase (a no-op outside valgrind)."""

    def __init__(self, shim: str | None):
        self.lib = None
        if shim:
            import ctypes

            self.lib = ctypes.CDLL(shim)

    def start(self) -> None:
        if self.lib:
            self.lib.cg_start()

    def mark(self, label: str) -> None:
        if self.lib:
            self.lib.cg_mark(label.encode())

    def timed(self, label: str, f) -> float:
        self.mark("pre " + label)
        t0 = time.perf_counter()
        f()
        dt = time.perf_counter() - t0
        self.mark("call " + label)
        return dt


def run_calls(path: Path, prompt, ns: list[int], threads: int, reps: int, marks: Marks) -> dict:
    """Runs (a), (b), (c) for every n; returns wall-clock figures and the stats of each generation."""
    from clover_cpp import Clover

    out: dict = {"n": {}}
    top = 2 * max(ns)
    with Clover(str(path), n_ctx=1024, n_threads=threads, block_size=top) as m:
        toks = m.tokenize(prompt, add_bos=True, special=True) if isinstance(prompt, str) else list(prompt)
        filler = [t for t in toks if t != m.mask_token][:top] if hasattr(m, "mask_token") else toks[:top]
        while len(filler) < top:
            filler += filler
        out["n_prompt"] = len(toks)

        def cancel_after(k: int):
            seen = [0]

            def cb(*_a) -> bool:
                seen[0] += 1
                return seen[0] >= k
            return cb

        m.reset()
        m.commit(toks)

        def gen(n: int, ds: bool, k: int):
            # the prompt: the committed text, so that nothing is committed before the decode (reuse_prefix)
            prompt_now = list(m.committed_tokens)
            if len(prompt_now) > 512:
                m.reset()
                m.commit(toks)
                prompt_now = list(toks)
            t0 = time.perf_counter()
            # (block diffusion: at most 2 steps a block, so that the 4 measured steps reach a fused one)
            r = m.generate(prompt_now, max_tokens=8 * n + 16, block_size=n, draft_self=ds, draft_steps=1,
                           threshold=0.9, max_steps=0 if ds else 2, stop_at_eos=False, reuse_prefix=True, on_step=cancel_after(k))
            return r.stats, time.perf_counter() - t0

        def forwards(n: int) -> dict:
            if m.block_size < 2 * n:
                m.block_size = top  # (clears the memory)
                m.commit(toks)
            res = {}
            for t in (n, 2 * n):  # each twice: after another shape, then repeated
                for rep in range(2):
                    dt = marks.timed(f"pass {t} {rep}", lambda: m.block_logits(filler[:t]))
                    res.setdefault(f"pass{t}", []).append(dt)
            for rep in range(2):
                dt = marks.timed(f"commit {n} {rep}", lambda: m.commit(filler[:n]))
                res.setdefault("commit", []).append(dt)
            return res

        for n in ns:  # warm-up (not instrumented): every shape once
            forwards(n)
            gen(n, True, 2)
            gen(n, False, 2)
        marks.start()
        for n in ns:
            rec: dict = {"wall": {}}
            for rep in range(reps):
                marks.mark(f"phase fwd {n}")
                for k, v in forwards(n).items():
                    rec["wall"].setdefault(k, []).extend(v)
                marks.mark(f"phase ds {n}")
                st, dt = gen(n, True, CALLS)
                rec["ds"] = dict(ver=st.n_verifications, acc=st.n_accepted, fwd=st.n_decode_forwards,
                                 steps=st.n_steps, gen=st.n_generated)
                rec["wall"].setdefault("ds_ms_per_fwd", []).append(st.t_decode_ms / max(st.n_decode_forwards, 1))
                rec["wall"].setdefault("ds_ms_per_ver", []).append(st.t_decode_ms / max(st.n_verifications, 1))
                marks.mark(f"phase bd {n}")
                st, dt = gen(n, False, CALLS)
                rec["bd"] = dict(steps=st.n_steps, fwd=st.n_decode_forwards, gen=st.n_generated)
                rec["wall"].setdefault("bd_ms_per_fwd", []).append(st.t_decode_ms / max(st.n_decode_forwards, 1))
                marks.mark(f"phase end {n}")
            out["n"][n] = rec
    return out


# ----------------------------------------------------------------------------- callgrind
def build_shim(folder: Path) -> Path | str:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return "no C compiler (cc) found: the callgrind client-request shim needs one"
    src, lib = folder / "cgshim.c", folder / "cgshim.so"
    src.write_text(SHIM_C)
    r = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        return "could not build the callgrind shim (valgrind/callgrind.h missing?): " + r.stderr.strip()[:200]
    return lib


def parse_dump(path: Path) -> dict:
    """One callgrind dump: its trigger, total Ir, and the calls made from its top function."""
    trigger, total, calls = "", 0, {}
    cfn = None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("desc: Trigger:"):
                trigger = line.split(":", 2)[2].strip()
            elif line.startswith("totals:") or line.startswith("summary:"):
                total = int(line.split()[1])
            elif line.startswith("cfn="):
                cfn = line[4:].strip()
            elif line.startswith("calls=") and cfn:
                name = re.sub(r"^\(\d+\)\s*", "", cfn)
                calls[name] = calls.get(name, 0) + int(line[6:].split()[0])
                cfn = None
    return {"trigger": trigger, "ir": total, "calls": calls}


def called(d: dict, name: str) -> int:
    return sum(v for k, v in d["calls"].items() if name in k)


def callgrind_costs(dumps: list[dict]) -> dict:
    """Per phase (the marks): the cost of every measured call, classified. A dump holds the cost
    since the previous one, i.e. of the segment that began at the previous dump's trigger: the
    segment from "before verify" to the next method's entry is the verification (plus the few
    lines of the block's end and the step callback); a block-diffusion step is the segment from
    "before step" (its forward) plus the one from "before pick" (its candidates, unmasking and
    callback)."""
    phase, out, prev = None, {}, None  # prev: the trigger the current segment began at
    step_fwd = None  # a step's forward segment, waiting for its pick segment
    for d in dumps:
        t = d["trigger"]
        seg = prev
        prev = t
        key = (phase[0], int(phase[1])) if phase and phase[0] in ("ds", "bd") else None
        if seg and key and seg.startswith("--dump-before="):
            name = seg.split("=", 1)[1]
            if "::verify(" in name:
                kind = "verify+canvas" if called(d, "read_rows") >= 2 else "verify"
                out.setdefault(key, []).append((kind, d["ir"]))
            elif "::step(" in name:
                kind = ("step fused" if called(d, "fused_commit_pass") else
                        "step pass" if called(d, "block_pass_rows") else "step commit")
                step_fwd = (kind, d["ir"])
                if key[0] == "ds":  # a draft step: its forward only (its candidates ride on the verification's)
                    out.setdefault(key, []).append(("draft " + kind, d["ir"]))
                    step_fwd = None
            elif "::pick(" in name and step_fwd and key[0] == "bd":
                out.setdefault(key, []).append((step_fwd[0], step_fwd[1] + d["ir"]))
                step_fwd = None
        if t.startswith("Client Request: phase"):
            phase = t.split("phase", 1)[1].split()
            step_fwd = None
            continue
        if t.startswith("Client Request: call") and phase and phase[0] == "fwd":
            what = t.split("call", 1)[1].split()  # pass T rep / commit N rep
            out.setdefault(("fwd", int(phase[1])), []).append(("block_pass" if what[0] == "pass" else "commit",
                                                               d["ir"]))
    return out


def run_callgrind(args, models) -> int:
    if not shutil.which("valgrind"):
        print("error: --callgrind needs valgrind on PATH", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="draft-self-cost-"))
    shim = build_shim(tmp)
    if isinstance(shim, str):
        print("error: " + shim, file=sys.stderr)
        return 2
    lines = header(args, callgrind=True)
    for name, path, prompt in models:
        outdir = tmp / re.sub(r"\W+", "-", name)
        outdir.mkdir()
        inner = [sys.executable, str(Path(__file__).resolve()), "--inner", str(path), "--shim", str(shim),
                 "--n", ",".join(map(str, args.n)), "--prompt-json", json.dumps(prompt), "--reps", "1",
                 "--threads", "1", "--out-json", str(outdir / "calls.json")]
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--compress-strings=no", "--compress-pos=no",
               f"--callgrind-out-file={outdir}/cg.out"]
        cmd += [f"--dump-before={TRIGGER}"]
        t0 = time.time()
        print(f"# {name}: running under callgrind (minutes) ...", file=sys.stderr, flush=True)
        r = subprocess.run(cmd + inner, capture_output=True, text=True)
        if r.returncode != 0 or not (outdir / "calls.json").is_file():
            print(f"error: the callgrind run on {name} failed (rc {r.returncode}): "
                  + (r.stderr.strip().splitlines() or ["?"])[-1][:300], file=sys.stderr)
            return 1
        files = sorted(outdir.glob("cg.out*"), key=lambda p: int(p.name.split(".")[-1]) if p.name[-1].isdigit() else 0)
        costs = callgrind_costs([parse_dump(f) for f in files])
        info = json.loads((outdir / "calls.json").read_text())
        lines += report_callgrind(name, path, costs, info, args.n, time.time() - t0)
    lines.append(f"# valgrind command: valgrind --tool=callgrind --instr-atstart=no --compress-strings=no "
                 f"--compress-pos=no --dump-before='{TRIGGER}'"
                 + " python benchmarks/draft_self_cost.py --inner MODEL ...")
    emit(lines, args.out)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report_kept(args) -> int:
    lines = header(args, callgrind=True)
    for outdir in sorted(p for p in Path(args.report).iterdir() if (p / "calls.json").is_file()):
        files = sorted(outdir.glob("cg.out*"), key=lambda p: int(p.name.split(".")[-1]) if p.name[-1].isdigit() else 0)
        info = json.loads((outdir / "calls.json").read_text())
        lines += report_callgrind(outdir.name, outdir, callgrind_costs([parse_dump(f) for f in files]), info, args.n, 0)
    emit(lines, args.out)
    return 0


def report_callgrind(name: str, path: Path, costs: dict, info: dict, ns: list[int], secs: float) -> list[str]:
    lines = [f"## {name}: {Path(path).name} (prompt {info['n_prompt']} tokens; {secs:.0f} s under callgrind)",
             f"{'n':>3s} {'what':34s} {'Mi instr':>9s} {'ref':>12s} {'ratio':>6s}"]
    for n in ns:
        fwd = costs.get(("fwd", n), [])
        bp = [c for k, c in fwd if k == "block_pass"]  # pass n (x2), pass 2n (x2)
        cm = [c for k, c in fwd if k == "commit"]
        if len(bp) < 4:
            lines.append(f"{n:3d} (the forwards were not all measured: {fwd})")
            continue
        ref = {n: bp[0], 2 * n: bp[2]}
        lines.append(f"{n:3d} {'(a) block pass of ' + str(n):34s} {bp[0] / 1e6:9.2f} {'':12s} {'':6s}"
                     f"  (repeated: {bp[1] / 1e6:.2f})")
        lines.append(f"{n:3d} {'(a) block pass of ' + str(2 * n):34s} {bp[2] / 1e6:9.2f} {'':12s} {'':6s}"
                     f"  (repeated: {bp[3] / 1e6:.2f})")
        if cm:
            lines.append(f"{n:3d} {'(a) causal commit of ' + str(n):34s} {cm[-1] / 1e6:9.2f}")
        groups: dict[str, list[int]] = {}
        for k, c in costs.get(("ds", n), []) + costs.get(("bd", n), []):
            if k.startswith("verify") or k.startswith("step"):
                groups.setdefault(k, []).append(c)
        rec = info["n"].get(str(n), {})
        for k, label, t in (("verify+canvas", f"(b) verification of {n} + canvas {n}", 2 * n),
                            ("verify", f"(b) verification of {n}, no canvas", n),
                            ("draft step fused", "    draft-self's draft: commit + pass", None),
                            ("draft step pass", "    draft-self's draft: pass", None),
                            ("step fused", f"(c) step: commit {n} + pass {n}", 2 * n),
                            ("step pass", f"(c) step: pass of {n}", n)):
            v = groups.get(k)
            if not v:
                continue
            mean = sum(v) / len(v)
            if t is None:
                lines.append(f"{n:3d} {label:34s} {mean / 1e6:9.2f}  ({len(v)} calls)")
                continue
            r = mean / ref[t]
            flag = "" if r <= TARGET else "  > target"
            lines.append(f"{n:3d} {label:34s} {mean / 1e6:9.2f} {'pass ' + str(t):>12s} {r:6.3f}{flag}"
                         f"  ({len(v)} calls, min {min(v) / ref[t]:.3f}, max {max(v) / ref[t]:.3f})")
        if rec.get("ds"):
            d = rec["ds"]
            lines.append(f"    draft-self run: {d['ver']} verifications, {d['gen']} tokens, {d['fwd']} forwards")
    lines.append("")
    return lines


# ----------------------------------------------------------------------------- report
def header(args, callgrind: bool) -> list[str]:
    import run_all

    cmd = "python benchmarks/draft_self_cost.py " + " ".join(sys.argv[1:])
    lpc = load_per_core()
    lines = [f"# draft-self cost, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"# command: {cmd}",
             f"# {run_all.cpu_name()}, {os.cpu_count()} cores; loadavg {run_all.loadavg()}"]
    if callgrind:
        lines.append("# instruction counts (callgrind, 1 thread; Mi instr = 1e6 instructions): repeatable on a "
                     "busy machine")
    else:
        lines.append(f"# wall clock, {args.threads} threads, median of {args.reps}"
                     + ("  ** BUSY MACHINE (load per core %.2f > 0.5): these timings are noise; use --callgrind **"
                        % lpc if lpc > 0.5 else ""))
    lines.append(f"# ratio: against one block pass of the same token count (target <= {TARGET})")
    lines.append("")
    return lines


def emit(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out:
        p = Path(out)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.rename(p)


def report_wall(name: str, path: Path, res: dict, ns: list[int]) -> list[str]:
    busy = load_per_core() > 0.5
    lines = [f"## {name}: {Path(path).name} (prompt {res['n_prompt']} tokens)" + ("  [busy machine]" if busy else ""),
             f"{'n':>3s} {'what':40s} {'ms':>8s} {'ratio':>6s}"]
    for n in ns:
        w = res["n"][n]["wall"]
        med = {k: statistics.median(v) * (1000 if not k.startswith(("ds_", "bd_")) else 1) for k, v in w.items()}
        for k, label in ((f"pass{n}", f"(a) block pass of {n}"), (f"pass{2 * n}", f"(a) block pass of {2 * n}"),
                         ("commit", f"(a) causal commit of {n}")):
            lines.append(f"{n:3d} {label:40s} {med[k]:8.3f}")
        lines.append(f"{n:3d} {'(b) draft-self: ms per forward':40s} {med['ds_ms_per_fwd']:8.3f} "
                     f"{med['ds_ms_per_fwd'] / med[f'pass{2 * n}']:6.3f}")
        # a rejected draft costs a second forward (the kept tokens committed again with the next draft)
        lines.append(f"{n:3d} {'(b) draft-self: ms per verification':40s} {med['ds_ms_per_ver']:8.3f} "
                     f"{med['ds_ms_per_ver'] / med[f'pass{2 * n}']:6.3f}")
        lines.append(f"{n:3d} {'(c) block diffusion: ms per forward':40s} {med['bd_ms_per_fwd']:8.3f} "
                     f"{med['bd_ms_per_fwd'] / med[f'pass{2 * n}']:6.3f}")
    lines.append("(wall clock: ratios against the block pass of 2 n include the Python call overhead of the "
                 "references; use --callgrind for the per-call figures)")
    lines.append("")
    return lines


def models_of(args) -> list[tuple[str, Path, object]]:
    from clover_cpp.demo import default_cache_dir, demo_model

    out: list[tuple[str, Path, object]] = []
    if args.model:
        out.append((Path(args.model).name, Path(args.model), PROMPT))
    else:
        out.append(("default model", Path(demo_model(default_cache_dir(), log=lambda s: None)[0]), PROMPT))
    if not args.no_small:
        import make_baselines

        out.append(("small preset (random weights)", make_baselines.clover_gguf(make_baselines.DEFAULT_CACHE, "f16"),
                    list(range(5, 69))))
    return out


def parse_ns(s: str) -> list[int]:
    try:
        ns = sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--n takes block sizes like 4,8,16, got {s!r}") from None
    if not ns or any(n < 2 or n > 128 for n in ns):
        raise argparse.ArgumentTypeError(f"--n: block sizes in [2, 128], got {s!r}")
    return ns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--callgrind", action="store_true", help="instruction counts under valgrind's callgrind")
    ap.add_argument("--n", type=parse_ns, default=[4, 8, 16], help="block sizes n (default 4,8,16)")
    ap.add_argument("--threads", type=int, default=2, help="threads for wall-clock figures (callgrind: 1)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions for wall-clock figures")
    ap.add_argument("--model", help="a clover GGUF instead of the default model")
    ap.add_argument("--no-small", action="store_true", help="skip the small preset")
    ap.add_argument("--out", help="also write the report here")
    ap.add_argument("--keep", action="store_true", help="keep the callgrind dumps (their folder is printed)")
    ap.add_argument("--report", metavar="DIR", help="report the kept dumps of an earlier --callgrind --keep run "
                    "(its model folder: DIR/<model>/)")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--shim", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-json", help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        if a.inner:  # the process callgrind runs
            res = run_calls(Path(a.inner), json.loads(a.prompt_json), a.n, 1, 1, Marks(a.shim))
            Path(a.out_json).write_text(json.dumps(res))
            return 0
        if a.report:
            return report_kept(a)
        models = models_of(a)
        if a.callgrind:
            return run_callgrind(a, models)
        lines = header(a, callgrind=False)
        for name, path, prompt in models:
            lines += report_wall(name, path, run_calls(path, prompt, a.n, a.threads, a.reps, Marks(None)), a.n)
        emit(lines, a.out)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line, no traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
