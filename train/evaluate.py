"""Evaluate the exported default model on the native runtime (one run, one machine).

* speed: tokens per forward (decode passes) and tokens/s for thresholds x block sizes
  against B = 1 on the same f16 GGUF, prompts = the first --prompt-len tokens of each
  held-out file, --new-tokens new tokens, stop_at_eos off, greedy, each run the fastest of 3;
* block_size = "auto" at each threshold (cost curve from Clover.calibrate, running
  tokens per pass reset per threshold), and the best fixed (B, threshold) by tokens/s;
* llama.cpp's autoregressive qwen35moe of the same dimensions: decode tokens/s from the
  pinned llama-bench (-p 0 -n --new-tokens), beside ours at threshold 0.9;
* quality proxy: share of generated positions where threshold decoding gives the same
  token as B = 1 greedy (position by position), and the mean length of the common prefix;
* held-out diffusion loss of the GGUFs (Clover.block_logits: block pass of the noisy
  block, logits at q - 1 for the masked q after the block start, then commit of the clean
  block) vs the torch checkpoint, same windows, offsets and masks as train.train.heldout_loss;
* quantization: mean KL(f32 || quant) of the block-pass distributions at the masked
  positions of held-out blocks, and file sizes;
* chart train/eval.png, tables in train/RESULTS.md, raw numbers in train/eval_results.json.

    python -m train.evaluate --model models/clover-default --run train/runs/default --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from clover_cpp import Clover
from clover_cpp.quant import quantize
from clover_convert import convert

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95)
BLOCK_SIZES = (4, 8, 16, 32)
QUANTS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def build_ggufs(model: Path, work: Path) -> dict[str, Path]:
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for t in ("f32", "f16"):
        p = work / f"clover-default-{t}.gguf"
        convert(str(model), str(p), outtype=t, force=True, progress=False)
        out[t] = p
    for q in QUANTS:
        p = work / f"clover-default-{q}.gguf"
        quantize(out["f32"], p, q, force=True)
        out[q] = p
    return out


def prompts(data: Path, n: int, plen: int) -> list[list[int]]:
    held = np.load(data / "heldout.npy").astype(np.int64)
    starts = np.load(data / "heldout_starts.npy")
    ends = list(starts[1:]) + [len(held)]
    out = [held[s:s + plen].tolist() for s, e in zip(starts, ends) if e - s >= plen]
    return out[:n]


REPEATS = 3


def timed(m: Clover, prompt: list[int], **kw):
    """The fastest of REPEATS identical greedy runs (the box is shared and its timings drift)."""
    runs = [m.generate(prompt, stop_at_eos=False, **kw) for _ in range(REPEATS)]
    return max(runs, key=lambda r: r.stats.tokens_per_second)


PAIRED_ROUNDS = 3


def parse_prompts(data_meta: dict, tokenize, n: int, plen: int) -> list[list[int]]:
    """Prompts for the syntax check: the first plen tokens from each top-level `def` / `class`
    line of the held-out files (a place where a complete statement can follow)."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel in data_meta["heldout_files"]:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        for at in [0] + [i + 1 for i in range(len(text)) if text.startswith(("\ndef ", "\nclass "), i)]:
            toks = tokenize(text[at:])[:plen]
            if len(toks) == plen:
                out.append(toks)
    rng = np.random.default_rng(0)
    idx = sorted(rng.choice(len(out), size=min(n, len(out)), replace=False).tolist())
    return [out[i] for i in idx]


def parses(code: str) -> bool:
    """Does Python accept this text, cut at its last complete line?"""
    import ast
    import warnings
    cut = code[: code.rfind("\n") + 1] if "\n" in code else ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(cut)
        return True
    except (SyntaxError, ValueError):
        return False


def parse_share(m: Clover, prompt_list: list[list[int]], new: int, settings: dict) -> dict:
    """Share of prompt + continuation (new tokens, cut at the last complete line) that
    ast.parse accepts, per setting."""
    out = {}
    for name, kw in settings.items():
        ok = [parses(m.detokenize_text(p + m.generate(p, max_tokens=new, stop_at_eos=False, **kw).tokens))
              for p in prompt_list]
        out[name] = {"share": float(np.mean(ok)), "n": len(ok)}
        log(f"ast.parse share {name}: {out[name]['share']:.1%} of {len(ok)}")
    return out


def speed(gguf: Path, prompt_list: list[list[int]], new: int, threads: int,
          syntax_prompts: list[list[int]] = ()) -> dict:
    res: dict = {"runs": []}
    with Clover(gguf, n_ctx=1024, n_threads=threads) as m:
        m.generate(prompt_list[0], max_tokens=16, block_size=1, stop_at_eos=False)   # warm up
        m.generate(prompt_list[0], max_tokens=16, block_size=32, stop_at_eos=False)
        base = []
        for p in prompt_list:
            base.append(timed(m, p, max_tokens=new, block_size=1, threshold=1.0))
        res["B1"] = agg(base, base)
        res["B1_tokens"] = [r.tokens for r in base]
        for B in BLOCK_SIZES:
            for th in THRESHOLDS:
                rs = [timed(m, p, max_tokens=new, block_size=B, threshold=th) for p in prompt_list]
                a = agg(rs, base)
                a.update(B=B, threshold=th)
                res["runs"].append(a)
                log(f"B={B:2d} th={th:.2f}: {a['tpf']:.2f} tok/fwd, {a['tps']:.0f} tok/s, "
                    f"agree {a['agree']:.1%}, prefix {a['prefix']:.1f}")
        # block_size = "auto": the calibrated cost curve, running figures reset per threshold
        curve = m.calibrate(fused=True)
        res["auto_curve"] = {b: v[0] for b, v in curve.items()}
        res["auto_curve_fused"] = {b: v[1] for b, v in curve.items()}
        res["auto"] = []
        for th in THRESHOLDS:
            m.set_cost_curve(res["auto_curve"], res["auto_curve_fused"])
            rs, b1 = [], []
            for p in prompt_list:      # B = 1 timed again next to auto: a paired ratio
                b1.append(timed(m, p, max_tokens=new, block_size=1, threshold=th))
                rs.append(timed(m, p, max_tokens=new, block_size="auto", threshold=th))
            a = agg(rs, base)
            a["vs_B1_paired"] = a["tps"] / agg(b1, base)["tps"]
            a.update(B="auto", threshold=th, last_B=[r.stats.block_size for r in rs],
                     switches=sum(r.stats.n_block_switches for r in rs))
            res["auto"].append(a)
            log(f"auto th={th:.2f}: {a['tpf']:.2f} tok/fwd, {a['tps']:.0f} tok/s ({a['vs_B1_paired']:.2f}x B=1 "
                f"paired), last B {a['last_B']}")
        # paired and repeated: rounds of (B = 1, the best fixed setting, auto at 0.9) over all
        # prompts, the order rotated per round; medians and min-max of tokens/s and of the ratios
        best = max(res["runs"], key=lambda r: r["tps"])
        settings = {"B=1": dict(block_size=1, threshold=1.0),
                    f"B={best['B']} th={best['threshold']}": dict(block_size=best["B"], threshold=best["threshold"]),
                    "auto th=0.9": dict(block_size="auto", threshold=0.9)}
        m.set_cost_curve(res["auto_curve"], res["auto_curve_fused"])
        names = list(settings)
        rounds: dict = {k: [] for k in names}
        for rnd in range(PAIRED_ROUNDS):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for k in order:
                rs = [m.generate(p, max_tokens=new, stop_at_eos=False, **settings[k]) for p in prompt_list]
                rounds[k].append(agg(rs, base)["tps"])
        res["paired"] = {k: {"tps": v, "vs_B1": [a / b for a, b in zip(v, rounds["B=1"])]} for k, v in rounds.items()}
        for k, v in res["paired"].items():
            log(f"paired {k}: tok/s {v['tps']}, vs B=1 {v['vs_B1']}")
        res["fast_setting"] = names[1] if np.median(rounds[names[1]]) >= np.median(rounds[names[2]]) else names[2]
        res["quality"] = parse_share(m, syntax_prompts, new, {"B=1": settings["B=1"],
                                                              res["fast_setting"]: settings[res["fast_setting"]]})
        res["samples"] = {"prompt": m.detokenize_text(prompt_list[0]),
                          "B1": base[0].text,
                          "B32_t0.9": m.generate(prompt_list[0], max_tokens=new, block_size=32,
                                                 threshold=0.9, stop_at_eos=False).text}
    return res


def ar_baseline(f16: Path, work: Path, threads: int, new: int) -> dict:
    """llama.cpp's own autoregressive qwen35moe with the same dimensions (the clover GGUF's
    tensors minus the clover-only ones): decode tokens/s from the pinned llama-bench."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from make_baselines import qwen35moe_from_clover
    from run_all import llama_bench

    out = work / "qwen35moe-default-f16.gguf"
    qwen35moe_from_clover(f16, out)
    r = llama_bench(out, threads, 3, p=0, n=new)
    return {"cmd": "llama-bench " + r["cmd"], "tps": r["avg_ts"]}


def agg(rs, base) -> dict:
    n_tok = sum(len(r.tokens) for r in rs)
    passes = sum(r.stats.n_decode_passes for r in rs)
    t_ms = sum(r.stats.t_decode_ms for r in rs)
    same = tot = 0
    prefix = []
    for r, b in zip(rs, base):
        k = min(len(r.tokens), len(b.tokens))
        eq = np.asarray(r.tokens[:k]) == np.asarray(b.tokens[:k])
        same += int(eq.sum())
        tot += k
        prefix.append(int(np.argmin(eq)) if not eq.all() else k)
    return {"tpf": n_tok / passes, "tps": n_tok / (t_ms / 1000.0), "agree": same / max(tot, 1),
            "prefix": float(np.mean(prefix)), "tokens": n_tok, "passes": passes, "decode_ms": t_ms}


def heldout_windows(data: Path, T: int, n: int):
    """(clean, noisy, targets, offsets): the held-out windows, offsets and masks of
    train.train.heldout_loss (B = 32; same draws in the same order); targets marks the masked
    positions q after each block start, whose block-pass logits at q - 1 predict clean[q]."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from train.train import EVAL_SEED, heldout_windows as hw, mask_blocks
    w = hw(data, T, n)
    rng = np.random.default_rng(EVAL_SEED)
    noisy, targets, offsets = [], [], []
    for s in range(0, len(w), 8):     # same draws, in the same order, as train.train.heldout_loss
        o = int(rng.integers(1, 32 + 1))
        nz, mk = mask_blocks(w[s:s + 8], 32, o, MASK_ID, rng)
        mk[:, o::32] = False          # block starts: the clean stream's (AR) prediction
        noisy.append(nz)
        targets.append(mk)
        offsets += [o] * len(nz)
    return w, np.concatenate(noisy), np.concatenate(targets), offsets


MASK_ID = 4095


def gguf_block_logprobs(gguf: Path, clean, noisy, targets, offsets, B: int, threads: int) -> list[np.ndarray]:
    """Per window: log-softmax of the block-pass logits at q - 1 for the target positions q
    [n_targets, V]: commit the clean tokens before the first block (offset o), then per decode
    block [o + bB, o + (b+1)B) a block pass of its noisy tokens, then the commit of its clean ones."""
    out = []
    with Clover(gguf, n_ctx=1024, n_threads=threads, block_size=B) as m:
        for c, nz, tg, o in zip(clean, noisy, targets, offsets):
            m.reset()
            m.commit(c[:o].tolist())
            rows = []
            for s in range(o, o + (len(c) // B - 1) * B, B):
                lg = m.block_logits(nz[s:s + B].tolist()).astype(np.float64)
                q = np.nonzero(tg[s:s + B])[0]
                rows.append(lg[q - 1])
                m.commit(c[s:s + B].tolist())
            lg = np.concatenate(rows)
            lg = lg - lg.max(-1, keepdims=True)
            out.append(lg - np.log(np.exp(lg).sum(-1, keepdims=True)))
    return out


def masked_ce(logp: list[np.ndarray], clean, masked) -> float:
    tot = cnt = 0.0
    for lp, c, mk in zip(logp, clean, masked):
        tgt = c[mk]
        tot -= float(lp[np.arange(len(tgt)), tgt].sum())
        cnt += len(tgt)
    return tot / cnt


def torch_loss(run: Path, data: Path, n: int, threads: int) -> tuple[float, float]:
    """(AR loss, diffusion loss) of a run's checkpoint, as train.train.heldout_loss."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from train.export import load_run
    from train.train import heldout_loss, heldout_windows as hw
    torch.set_num_threads(threads)
    model, st = load_run(run)
    return heldout_loss(model, hw(data, st["args"]["seq_len"], n), model.cfg.block_size, model.cfg.mask_token_id)


def chart(res: dict, path: Path, old: dict | None = None) -> None:
    """Tokens per forward, tokens/s and agreement vs threshold per B; with `old` (an earlier
    evaluation's speed results) the old model dashed beside the new one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, 3, figsize=(14, 4.2), dpi=100)
    colors = dict(zip(BLOCK_SIZES, ("C0", "C1", "C2", "C3")))
    for label, r_, ls in (("new", res, "-"), ("old", old, ":")):
        if r_ is None:
            continue
        for B in BLOCK_SIZES:
            rr = [r for r in r_["runs"] if r["B"] == B]
            th = [r["threshold"] for r in rr]
            kw = dict(color=colors[B], ls=ls, marker="o" if ls == "-" else ".", label=f"B={B} {label}")
            axs[0].plot(th, [r["tpf"] for r in rr], **kw)
            axs[1].plot(th, [r["tps"] for r in rr], **kw)
            axs[2].plot(th, [100 * r["agree"] for r in rr], **kw)
        th = [r["threshold"] for r in r_["auto"]]
        for ax, key, f in ((axs[0], "tpf", 1), (axs[1], "tps", 1), (axs[2], "agree", 100)):
            ax.plot(th, [f * r[key] for r in r_["auto"]], color="gray", ls=ls, marker="s", label=f"auto {label}")
        axs[1].axhline(r_["B1"]["tps"], color="k", ls=ls, lw=1, label=f"B=1 {label}")
    axs[0].axhline(1.0, color="k", ls="--", lw=1)
    axs[0].set_ylabel("tokens per forward")
    axs[1].set_ylabel("tokens / s (decode, 2 threads)")
    axs[2].set_ylabel("% tokens equal to B=1 greedy")
    for ax in axs:
        ax.set_xlabel("confidence threshold")
        ax.grid(alpha=0.3)
    axs[2].legend(fontsize=7, ncol=2)
    fig.suptitle("clover-default (f16 GGUF), held-out stdlib prompts" + (": new (solid) vs old (dotted)" if old else ""))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_md(res: dict, path: Path, cmd: str) -> None:
    sp = res["speed"]
    b1 = sp["B1"]
    L = [f"# clover-default: evaluation\n",
         f"Measured in one run of `{cmd}` on {res['machine']} ({res['threads']} threads), "
         f"{res['date']}. Model: `models/clover-default` converted to an f16 GGUF. Prompts: the first "
         f"{res['prompt_len']} tokens of each of the {res['n_prompts']} held-out stdlib files, "
         f"{res['new_tokens']} new tokens each, greedy, stop_at_eos off; every tokens/s figure is the fastest of 3 identical runs per prompt (the box is shared; single runs drift by +-30%).\n",
         f"Baseline B = 1 (autoregressive, same weights): {b1['tpf']:.2f} tokens per forward, "
         f"{b1['tps']:.0f} tokens/s.\n",
         "## Tokens per forward (decode passes)\n",
         "| threshold | " + " | ".join(f"B={B}" for B in BLOCK_SIZES) + " | auto |",
         "|---|" + "---|" * (len(BLOCK_SIZES) + 1)]
    for key, title, fmt in (("tpf", None, "{:.2f}"), ("tps", "Tokens per second (decode; B=1: %.0f)" % b1["tps"], "{:.0f}"),
                            ("speedup", "Speed-up in tokens/s over B = 1", "{:.2f}x"),
                            ("agree", "Agreement with B = 1 greedy (share of positions)", "{:.1%}"),
                            ("prefix", "Mean common prefix with B = 1 greedy (tokens)", "{:.1f}")):
        if title:
            L += ["", f"## {title}\n", "| threshold | " + " | ".join(f"B={B}" for B in BLOCK_SIZES) + " | auto |",
                  "|---|" + "---|" * (len(BLOCK_SIZES) + 1)]
        for th in THRESHOLDS:
            row = []
            for B in BLOCK_SIZES + ("auto",):
                r = next(x for x in sp["runs"] + sp["auto"] if x["B"] == B and x["threshold"] == th)
                v = r["tps"] / b1["tps"] if key == "speedup" else r[key]
                row.append(fmt.format(v))
            L.append(f"| {th} | " + " | ".join(row) + " |")
    best = max(sp["runs"] + [{**b1, "B": 1, "threshold": "any"}], key=lambda r: r["tps"])
    t09 = {r["B"]: r for r in sp["runs"] + sp["auto"] if r["threshold"] == 0.9}
    curve = ", ".join(f"{b}: {v:.2f}" for b, v in sp["auto_curve"].items())
    ar = res["ar_baseline"]
    L += ["", f"Best fixed setting by tokens/s: B = {best['B']}, threshold {best['threshold']} "
              f"({best['tps']:.0f} tok/s, {best['tps'] / b1['tps']:.2f}x B = 1, {best['tpf']:.2f} tokens per "
              f"forward, {best['agree']:.1%} agreement). `auto` at threshold 0.9: {t09['auto']['tps']:.0f} tok/s "
              f"({t09['auto']['tps'] / b1['tps']:.2f}x the B = 1 baseline above; "
              f"paired with B = 1 runs timed right next to it, per threshold: "
              + ", ".join(f"{r['threshold']}: {r['vs_B1_paired']:.2f}x" for r in sp["auto"])
              + f"; last block sizes {t09['auto']['last_B']}, "
              f"{t09['auto']['switches']} switches over the prompts). Its cost curve (ms per block pass at B, "
              f"measured by `Clover.calibrate`): {curve}.\n",
          "## Autoregressive baseline of the same size\n",
          f"llama.cpp's own `qwen35moe` with the same dimensions and tensors (the clover-only tensors "
          f"dropped), `{ar['cmd']}`: {ar['tps']:.0f} tokens/s decode, beside ours at threshold 0.9 "
          "(tokens/s, and the ratio to qwen35moe):\n",
          "| qwen35moe | B=1 | " + " | ".join(f"B={B}" for B in BLOCK_SIZES) + " | auto |",
          "|---|---|" + "---|" * (len(BLOCK_SIZES) + 1),
          f"| {ar['tps']:.0f} | {b1['tps']:.0f} ({b1['tps'] / ar['tps']:.2f}x) | "
          + " | ".join(f"{t09[B]['tps']:.0f} ({t09[B]['tps'] / ar['tps']:.2f}x)" for B in BLOCK_SIZES + ("auto",))
          + " |"]
    pr = sp.get("paired")
    if pr:
        L += ["", f"## Paired, repeated: B = 1, the best fixed setting, auto\n",
              f"{PAIRED_ROUNDS} rounds; each round runs every setting once over all prompts (order rotated "
              "per round). Median tokens/s (min-max) and the median of the per-round ratios to B = 1.\n",
              "| setting | tok/s | vs B = 1 |", "|---|---|---|"]
        for k, v in pr.items():
            L.append(f"| {k} | {np.median(v['tps']):.0f} ({min(v['tps']):.0f}-{max(v['tps']):.0f}) | "
                     f"{np.median(v['vs_B1']):.2f}x ({min(v['vs_B1']):.2f}-{max(v['vs_B1']):.2f}) |")
        L.append(f"\nAgainst upstream autoregressive `qwen35moe` ({ar['tps']:.0f} tok/s): "
                 + ", ".join(f"{k} {np.median(v['tps']) / ar['tps']:.2f}x" for k, v in pr.items()) + ".")
    q = sp.get("quality")
    if q:
        L += ["", "## Does the output parse?\n",
              f"Share of {next(iter(q.values()))['n']} continuations ({res['new_tokens']} new tokens after a "
              f"{res['prompt_len']}-token prompt starting at a top-level `def`/`class` of a held-out file, "
              "prompt + continuation cut at the last complete line) that `ast.parse` accepts.\n",
              "| setting | parses |", "|---|---|"]
        for k, v in q.items():
            L.append(f"| {k} | {v['share']:.1%} |")
    L += ["", "![eval](eval.png)", "", "## Held-out masked-token loss\n",
          f"Same {res['loss_windows']} held-out windows of 256 tokens, B = 32, fixed masks "
          "(t ~ U(0.05, 1] per block), mean cross-entropy over the masked positions (nats).\n",
          "| model | loss |", "|---|---|"]
    for k, v in res["loss"].items():
        L.append(f"| {k} | {v:.4f} |")
    L += ["", "## Confidence at the masked positions\n",
          "Share of masked held-out positions (same windows and masks as the loss) whose top "
          f"candidate's probability reaches the threshold (f16 GGUF, B = 32; mean top probability "
          f"{res['confidence_mean_max_prob']:.3f}). Threshold decoding unmasks more than one token "
          "per pass only where several positions of a block pass this bar.\n",
          "| threshold | " + " | ".join(res["confidence"]) + " |", "|---|" + "---|" * len(res["confidence"]),
          "| share >= threshold | " + " | ".join(f"{v:.1%}" for v in res["confidence"].values()) + " |"]
    L += ["", "## Quantization\n",
          f"Mean KL(f32 || quant) of the block-pass token distributions at the masked positions "
          f"of {res['kl_windows']} held-out windows (B = 32, memory built from the clean blocks by "
          "each model itself), file sizes, and the held-out loss on those windows.\n",
          "| GGUF | size (MB) | mean KL | held-out loss |", "|---|---|---|---|"]
    for k, v in res["quant"].items():
        kl = "-" if v["kl"] is None else f"{v['kl']:.5f}"
        L.append(f"| {k} | {v['mb']:.2f} | {kl} | {v['loss']:.4f} |")
    s = sp["samples"]
    L += ["", "## Sample (first held-out prompt)\n", "Prompt:\n", "```python", s["prompt"], "```",
          "\nB = 1 greedy:\n", "```python", s["B1"], "```", "\nB = 32, threshold 0.9:\n",
          "```python", s["B32_t0.9"], "```", ""]
    path.write_text("\n".join(L) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/clover-default")
    ap.add_argument("--run", default="train/runs/default", help="torch run folder (ckpt.pt) for the loss comparison")
    ap.add_argument("--data", default="train/runs/data")
    ap.add_argument("--work", default="train/runs/eval")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--loss-windows", type=int, default=32)
    ap.add_argument("--kl-windows", type=int, default=16)
    ap.add_argument("--parse-prompts", type=int, default=48, help="prompts of the ast.parse check")
    ap.add_argument("--baseline", default="", help="an earlier eval_results.json to chart against (old model)")
    ap.add_argument("--out", default="train")
    a = ap.parse_args(argv)
    cmd = "python -m train.evaluate " + " ".join(argv if argv is not None else sys.argv[1:])
    model, data, work, out = Path(a.model), Path(a.data), Path(a.work), Path(a.out)
    global MASK_ID
    MASK_ID = json.loads((model / "config.json").read_text())["mask_token_id"]
    t0 = time.time()
    g = build_ggufs(model, work)
    log(f"GGUFs built in {time.time() - t0:.0f}s")
    ps = prompts(data, a.n_prompts, a.prompt_len)
    res: dict = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip() + ", shared 2-core CPU box",
                 "threads": a.threads, "date": time.strftime("%Y-%m-%d"), "prompt_len": a.prompt_len,
                 "n_prompts": len(ps), "new_tokens": a.new_tokens, "loss_windows": a.loss_windows,
                 "kl_windows": a.kl_windows}
    with Clover(g["f16"], n_ctx=256, n_threads=1, block_size=1) as tk:
        pps = parse_prompts(json.loads((data / "meta.json").read_text()), lambda t: tk.tokenize(t), a.parse_prompts,
                            a.prompt_len)
    res["speed"] = speed(g["f16"], ps, a.new_tokens, a.threads, pps)
    log(f"speed done at {time.time() - t0:.0f}s")
    res["ar_baseline"] = ar_baseline(g["f16"], work, a.threads, a.new_tokens)
    log(f"qwen35moe baseline: {res['ar_baseline']}")
    clean, noisy, masked, offs = heldout_windows(data, 256, a.loss_windows)
    res["loss"] = {}
    if Path(a.run, "ckpt.pt").is_file():
        ar, dl = torch_loss(Path(a.run), data, a.loss_windows, a.threads)
        res["loss"]["torch checkpoint (f32)"] = dl
        res["loss_ar_torch"] = ar
    lp = {}
    for k in ("f32", "f16"):
        lp[k] = gguf_block_logprobs(g[k], clean, noisy, masked, offs, 32, a.threads)
        res["loss"][f"GGUF {k}"] = masked_ce(lp[k], clean, masked)
    mx = np.concatenate([np.exp(lp_.max(-1)) for lp_ in lp["f16"]])
    res["confidence"] = {str(th): float(np.mean(mx >= th)) for th in THRESHOLDS}
    res["confidence_mean_max_prob"] = float(mx.mean())
    kc, kn, km, ko = clean[:a.kl_windows], noisy[:a.kl_windows], masked[:a.kl_windows], offs[:a.kl_windows]
    ref = lp["f32"][:a.kl_windows]
    res["quant"] = {}
    for k in ("f32", "f16") + QUANTS:
        q = lp[k][:a.kl_windows] if k in lp else gguf_block_logprobs(g[k], kc, kn, km, ko, 32, a.threads)
        kl = None if k == "f32" else float(np.mean(np.concatenate(
            [(np.exp(p) * (p - qq)).sum(-1) for p, qq in zip(ref, q)])))
        res["quant"][k] = {"mb": g[k].stat().st_size / 1e6, "kl": kl, "loss": masked_ce(q, kc, km)}
        log(f"{k}: {res['quant'][k]}")
    res["seconds"] = time.time() - t0
    (out / "eval_results.json").write_text(json.dumps(res, indent=1) + "\n")
    old = json.loads(Path(a.baseline).read_text())["speed"] if a.baseline else None
    chart(res["speed"], out / "eval.png", old)
    write_md(res, out / "RESULTS.md", cmd)
    log(f"done in {res['seconds']:.0f}s")


if __name__ == "__main__":
    main()
