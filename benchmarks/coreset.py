"""The block expert coreset: counts, not timings.

For the default model (models/clover-default: 8 experts, top 2) and the `small` preset (random
weights: 32 experts, top 4), with the numpy reference (clover_testkit.reference, the oracle the
native graph is held to within 1e-3):

* distinct routed experts per MoE layer (mean over layers) and the routed expert bytes read per
  pass (distinct experts x the bytes of one expert at the GGUF type given by --bytes-type), for a
  B = 1 step and B = 8 / 32 block passes (an all-mask canvas right after the prompt, and a
  "text" canvas: the prompt's next B tokens, as a nearly denoised block sees), with and without
  the coreset, for each C of the sweep;
* the KL divergence KL(full || coreset) of the block pass's next-token distributions (mean and
  max over canvas rows) against full routing;

and, with libclover (the default model converted to f32 in a temporary folder), greedy block
diffusion's tokens per forward at B = 8 and draft-self's acceptance (accepted / drafted) at
B = 8, per C; draft-self's output is checked equal to B = 1's for every C.

    .venv/bin/python benchmarks/coreset.py [--sweep 1,2,3,4] [--small-sweep 4,6,8,12,16] [--no-native]

Counts only: the machine this runs on may be busy (timings are the lead's, on a quiet machine).
The 35B-A3B slice (clover_testkit.true_dims, 8.8 GB) is not run here.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clover_testkit.reference import CloverReference, softmax  # noqa: E402

BYTES_PER_PARAM = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_k_m": 4.5 / 8}
TEXT = ("The river ran past the old mill, where the miller's daughter kept the accounts and "
        "counted the sacks of grain that came down from the hills every autumn. ") * 4


def expert_params(cfg) -> int:
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size  # gate, up, down


def layer_experts(layers) -> float:
    return float(np.mean([len(np.unique(rec["experts"])) for rec in layers]))


def kl_rows(full: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    p, q = softmax(full, axis=-1), softmax(other, axis=-1)
    kl = (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum(axis=-1)
    return float(kl.mean()), float(kl.max())


def counts(name: str, ref: CloverReference, tokens: list[int], sweep: list[int], bytes_type: str) -> dict:
    cfg = ref.cfg
    per_expert = expert_params(cfg) * BYTES_PER_PARAM[bytes_type]
    n_prompt = 24
    mem = ref.new_memory()
    ref.commit(mem, tokens[:n_prompt])
    _, one = ref.trace(mem, [tokens[n_prompt]], 1)
    step = layer_experts(one)
    out = {"model": name, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
           "expert_mib": per_expert / 2**20, "bytes_type": bytes_type, "b1_experts": step, "passes": []}
    print(f"\n== {name}: E = {cfg.num_experts}, k = {cfg.num_experts_per_tok}, one expert = "
          f"{per_expert / 2**20:.2f} MiB at {bytes_type}; B = 1 step: {step:.2f} experts per layer")
    print(f"{'canvas':<10}{'B':>4}{'C':>6}{'experts/layer':>15}{'x B=1 bytes':>13}{'KL mean':>11}{'KL max':>11}")
    for B in (8, 32):
        for kind in ("mask", "text"):
            canvas = [cfg.mask_token_id] * B if kind == "mask" else tokens[n_prompt:n_prompt + B]
            full, lf = ref.trace(mem, canvas, B)
            rows = [dict(canvas=kind, B=B, C=None, experts=layer_experts(lf), kl_mean=0.0, kl_max=0.0)]
            for C in sweep:
                got, lc = ref.trace(mem, canvas, B, coreset=C)
                km, kx = kl_rows(full, got)
                rows.append(dict(canvas=kind, B=B, C=C, experts=layer_experts(lc), kl_mean=km, kl_max=kx))
            for r in rows:
                r["bytes_vs_b1"] = r["experts"] / step
                print(f"{kind:<10}{B:>4}{'off' if r['C'] is None else r['C']:>6}{r['experts']:>15.2f}"
                      f"{r['bytes_vs_b1']:>13.2f}{r['kl_mean']:>11.2e}{r['kl_max']:>11.2e}")
            out["passes"] += rows
    return out


def native_sweep(ckpt: Path, tokens: list[int], sweep: list[int]) -> list[dict]:
    from clover_convert import convert
    from clover_cpp import Clover

    rows = []
    with tempfile.TemporaryDirectory() as d:
        gguf = Path(d) / "default-f32.gguf"
        convert(ckpt, gguf, outtype="f32", progress=False)
        prompt = tokens[:24]
        with Clover(gguf, n_ctx=1024, n_threads=2, block_size=1, kv_f32=True, flash_attn=False) as ar:
            want = ar.generate(prompt, max_tokens=96, block_size=1, stop_at_eos=False, seed=0).tokens
        with Clover(gguf, n_ctx=1024, n_threads=2, block_size=8, kv_f32=True, flash_attn=False) as m:
            print(f"\n== libclover, default model (f32), prompt {len(prompt)} tokens, 96 generated, greedy, B = 8")
            print(f"{'C':>6}{'tok/forward (diffusion)':>25}{'draft-self accepted':>22}{'draft-self == B=1':>20}")
            for C in [None, *sweep]:
                dif = m.generate(prompt, max_tokens=96, block_size=8, threshold=0.9, stop_at_eos=False, seed=0,
                                 coreset=C)
                ds = m.generate(prompt, max_tokens=96, block_size=8, draft_self=True, stop_at_eos=False, seed=0,
                                coreset=C)
                s = ds.stats
                acc = s.n_accepted / s.n_drafted if s.n_drafted else 0.0
                same = ds.tokens == want
                rows.append(dict(C=C, tpf=dif.stats.tokens_per_forward, accepted=acc, n_accepted=s.n_accepted,
                                 n_drafted=s.n_drafted, draft_self_equals_b1=same))
                print(f"{'off' if C is None else C:>6}{dif.stats.tokens_per_forward:>25.2f}"
                      f"{f'{acc:.3f} ({s.n_accepted}/{s.n_drafted})':>22}{str(same):>20}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default="1,2,3,4,6", help="C values for the default model (8 experts)")
    ap.add_argument("--small-sweep", default="4,6,8,12,16,24", help="C values for the small preset (32 experts)")
    ap.add_argument("--bytes-type", default="q8_0", choices=sorted(BYTES_PER_PARAM))
    ap.add_argument("--no-native", action="store_true", help="skip the libclover tokens-per-forward sweep")
    ap.add_argument("--no-small", action="store_true", help="skip the small preset")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    a = ap.parse_args()
    sweep = [int(x) for x in a.sweep.split(",") if x]
    small_sweep = [int(x) for x in a.small_sweep.split(",") if x]
    from tokenizers import Tokenizer

    report = {}
    ckpt = REPO / "models" / "clover-default"
    if not (ckpt / "config.json").is_file():
        print(f"error: {ckpt}: the default model is missing", file=sys.stderr)
        return 1
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tokens = tok.encode(TEXT).ids
    ref = CloverReference.from_pretrained(ckpt)
    report["default"] = counts("default model (trained)", ref, tokens, sweep, a.bytes_type)
    if not a.no_small:
        from clover_testkit.checkpoints import write_checkpoint
        from clover_testkit.presets import train_fixture_tokenizer

        with tempfile.TemporaryDirectory() as d:
            write_checkpoint(Path(d), preset="small", dtype="f32")
            small = CloverReference.from_pretrained(Path(d))
        stoks = train_fixture_tokenizer("small").encode(TEXT).ids
        report["small"] = counts("small preset (random weights)", small, stoks, small_sweep, a.bytes_type)
    if not a.no_native:
        report["native"] = native_sweep(ckpt, tokens, sweep)
    if a.json:
        tmp = a.json.with_suffix(a.json.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
