"""Export a training checkpoint as a Hugging Face checkpoint folder (models/clover-default/).

Writes model.safetensors (matrices in BF16; the small per-channel tensors — norms, conv
taps, A_log, dt_bias, block_calib — in F32), config.json, generation_config.json,
tokenizer.json + tokenizer_config.json (the BPE of train/data.py, ChatML template; from the
data folder, or from --tokenizer-from when the data were encoded with an existing model's
tokenizer), loss.png (training curve) and README.md (model card). config.json carries
``"clover_semantics": "causal-shift"``: the weights are for spec v2 (causal commit, logits at
t predict the token at t+1), the objective of train/train.py.

    python -m train.export --run train/runs/causal --data train/runs/data --out models/clover-default \
        --tokenizer-from models/clover-default --card-extra ''
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import torch

from clover_convert.safetensors_io import write_safetensors
from clover_testkit.presets import HF_IDENTITY
from clover_convert.mapping import keeps_f32
from clover_testkit.reference import CloverConfig
from train.model import CloverTorch
from train.train import run_argv

SEMANTICS_KEY, SEMANTICS = "clover_semantics", "causal-shift"   # spec v2 weights (see train/train.py)
HF_EXTRA = {
    **HF_IDENTITY,
    SEMANTICS_KEY: SEMANTICS,
    "bos_token_id": None,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def load_run(run: Path) -> tuple[CloverTorch, dict]:
    st = torch.load(run / "ckpt.pt", weights_only=False, map_location="cpu")
    cfg = CloverConfig.from_dict(st["config"])
    model = CloverTorch(cfg)
    model.load_state_dict(st["model"])
    model.eval()
    return model, st


def is_f32(name: str, arr: np.ndarray) -> bool:
    """F32 in the exported checkpoint exactly where the converter keeps F32 (one rule, the table's)."""
    return keeps_f32(name)


def hf_config(cfg: CloverConfig) -> dict:
    keys = ["vocab_size", "hidden_size", "num_hidden_layers", "full_attention_interval", "layer_types",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "linear_conv_lookahead",
            "num_attention_heads", "num_key_value_heads", "head_dim", "partial_rotary_factor",
            "rope_theta", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "norm_topk_prob", "rms_norm_eps", "block_size",
            "mask_token_id", "eos_token_id", "tie_word_embeddings"]
    d = {k: getattr(cfg, k) for k in keys}
    d["layer_types"] = list(d["layer_types"])
    d["pad_token_id"] = cfg.eos_token_id
    if cfg.canvas_ffn_intermediate_size:
        d["canvas_ffn_intermediate_size"] = cfg.canvas_ffn_intermediate_size
    d.update(HF_EXTRA)
    return dict(sorted(d.items()))


def read_log(run: Path) -> list[dict]:
    with open(run / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def run_chain(run: Path) -> list[dict]:
    """The stages that made `run`, oldest first: each with its folder, args and log rows
    (a stage started with --init-from continues the run whose ckpt.pt it names)."""
    stages = []
    while True:
        args = json.loads((run / "args.json").read_text())
        stages.insert(0, {"run": run, "args": args, "rows": read_log(run)})
        if not args.get("init_from"):
            return stages
        run = Path(args["init_from"]).parent


def chain_rows(stages: list[dict]) -> list[dict]:
    """The stages' log rows with step and tokens_seen counted from the first stage."""
    out, step0, tok0 = [], 0, 0
    for st in stages:
        for r in st["rows"]:
            out.append({**r, "step": str(int(r["step"]) + step0),
                        "tokens_seen": str(int(r["tokens_seen"]) + tok0)})
        last = st["rows"][-1]
        step0 += int(last["step"])
        tok0 += int(last["tokens_seen"])
    return out


def plot_loss(rows: list[dict], path: Path) -> None:
    """Training curves (per step and smoothed) and the held-out points: the AR (next-token)
    and diffusion losses of the spec v2 objective; rows without them (a run of the retired
    objective) show its masked-token loss."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = 25
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    tok_all = np.array([float(r["tokens_seen"]) for r in rows]) / 1e6
    if all(r.get("ar_loss") for r in rows):
        series = [("ar_loss", "heldout_ar", "AR (next token)", "C0", "C2"),
                  ("diff_loss", "heldout_loss", "diffusion (masked, next token)", "C1", "C3")]
    else:
        series = [("loss", "heldout_loss", "masked-token", "C0", "C3")]
    lo, hi = 9.0, 0.0
    for col, hcol, label, c_tr, c_ev in series:
        loss = np.array([float(r[col]) for r in rows])
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid") if len(loss) > k else loss
        ev = [(float(r["tokens_seen"]) / 1e6, float(r[hcol])) for r in rows if r.get(hcol)]
        ax.plot(tok_all, loss, color="#cccccc", lw=0.5)
        ax.plot(tok_all[len(tok_all) - len(smooth):], smooth, color=c_tr, lw=1.5, label=f"{label}: train ({k}-step mean)")
        if ev:
            ax.plot(*zip(*ev), "o-", color=c_ev, ms=3, lw=1.2, label=f"{label}: held-out")
        lo = min(lo, float(loss.min()), min((e[1] for e in ev), default=9.0))
        hi = max(hi, float(np.percentile(loss, 99)))
    ax.set_xlabel("training tokens seen (millions, clean windows)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("clover-default: training on Python stdlib sources")
    ax.set_ylim(bottom=max(0.0, lo - 0.3), top=min(9.0, hi + 0.3))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_weights(model: CloverTorch, out: Path) -> dict:
    """out/model.safetensors: matrices BF16, norms / conv taps / calibration F32."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.hf_state_dict().items():
        arr = t.float().numpy()
        tensors[name] = (arr, "F32" if is_f32(name, arr) else "BF16")
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    return tensors


def tokenizer_folder(data: Path, tokenizer_from: Path | None) -> Path:
    """Where tokenizer.json / tokenizer_config.json come from: --tokenizer-from, else the data
    folder (train.data writes them there when it trains the BPE)."""
    src = tokenizer_from if tokenizer_from is not None else data
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (src / f).is_file():
            raise SystemExit(f"{src / f} not found: pass --tokenizer-from <a model folder with the data's tokenizer>")
    return src


def export(run: Path, data: Path, out: Path, card_extra: str = "", tokenizer_from: Path | None = None) -> dict:
    model, st = load_run(run)
    cfg = model.cfg
    tok_src = tokenizer_folder(data, tokenizer_from)
    tok_files = {f: (tok_src / f).read_bytes() for f in ("tokenizer.json", "tokenizer_config.json")}
    tensors = write_weights(model, out)
    hfc = hf_config(cfg)
    (out / "config.json").write_text(json.dumps(hfc, indent=2) + "\n")
    gen = {"_from_model_config": False, "bos_token_id": None, "eos_token_id": cfg.eos_token_id,
           "pad_token_id": cfg.eos_token_id, "mask_token_id": cfg.mask_token_id,
           "block_size": cfg.block_size, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for f, b in tok_files.items():     # read first: the source may be `out` itself
        (out / f).write_bytes(b)
    stages = run_chain(run)
    rows = chain_rows(stages)
    plot_loss(rows, out / "loss.png")
    meta = json.loads((data / "meta.json").read_text())
    args = st["args"]
    ev = [r for r in stages[-1]["rows"] if r["heldout_loss"] and int(r["step"]) <= st["step"]]
    for s_ in stages:
        last = s_["rows"][-1] if s_ is not stages[-1] else next(r for r in s_["rows"] if int(r["step"]) == st["step"])
        s_.update(steps=int(last["step"]), minutes=float(last["elapsed_s"]) / 60, tokens=int(last["tokens_seen"]))
    info = {"step": sum(s_["steps"] for s_ in stages), "steps_planned": sum(s_["args"].get("stop_after") or s_["args"]["steps"] for s_ in stages),
            "elapsed_s": sum(s_["minutes"] for s_ in stages) * 60,
            "tokens_seen": sum(s_["tokens"] for s_ in stages),
            "heldout_loss": float(ev[-1]["heldout_loss"]) if ev else None,
            "heldout_ar": float(ev[-1]["heldout_ar"]) if ev and ev[-1].get("heldout_ar") else None,
            "params": sum(int(np.prod(a.shape)) for a, _ in tensors.values())}
    (out / "README.md").write_text(model_card(hfc, args, meta, info, card_extra, stages))
    return info


def train_command(args: dict) -> str:
    shown = ("data", "out", "seed", "steps", "batch", "seq_len", "lr", "warmup", "eval_every", "block_sizes", "threads",
             "init_hf")
    return "nice -n 10 python -m train.train " + " ".join(run_argv(args, keep=shown))


def stage_lines(stages: list[dict]) -> str:
    out = []
    for i, s in enumerate(stages, 1):
        a = s["args"]
        start = (f"from the weights of stage {i - 1} (fresh AdamW state and schedule)" if a.get("init_from")
                 else f"from the weights of `{a['init_hf']}` (the model trained for the retired "
                      f"in-place semantics; fresh AdamW state and schedule)" if a.get("init_hf")
                 else "from scratch")
        sched = (f"cosine to 10% over {a['steps']} steps, stopped at step {s['steps']}"
                 if s["steps"] < a["steps"] else "cosine to 10%")
        out.append(f"  {i}. {start}: seed {a['seed']}, {s['steps']} steps, lr {a['lr']} ({a['warmup']} warmup "
                   f"steps, {sched}), {a['threads']} CPU thread(s), {s['minutes']:.0f} minutes.")
    return "\n".join(out)


def model_card(hfc: dict, args: dict, meta: dict, info: dict, extra: str, stages: list[dict]) -> str:
    E, k = hfc["num_experts"], hfc["num_experts_per_tok"]
    H, I, Is = hfc["hidden_size"], hfc["moe_intermediate_size"], hfc["shared_expert_intermediate_size"]
    n_active = info["params"] - hfc["num_hidden_layers"] * (E - k) * 3 * H * I - hfc["vocab_size"] * H
    cmd_data = f"python -m train.data --out {args['data']}" + (
        f" --tokenizer {args['init_hf']}/tokenizer.json" if args.get("init_hf") else "")
    cmd_train = "\n".join(train_command(s["args"]) for s in stages)
    cmd_export = f"python -m train.export --run {args['out']} --data {args['data']} --out models/clover-default"
    if args.get("init_hf"):
        cmd_export += f" --tokenizer-from {args['init_hf']}"
    hl = f"{info['heldout_loss']:.3f}" if info["heldout_loss"] is not None else "n/a"
    har = f"{info['heldout_ar']:.3f}" if info.get("heldout_ar") is not None else "n/a"
    partial = ("" if info["step"] >= info["steps_planned"] else
               f" (exported from an intermediate checkpoint: {info['step']} of {info['steps_planned']} planned steps)")
    # YAML front matter: what the hub shows, and what the converter turns into general.* keys
    return f"""---
license: mit
basename: clover
finetune: default
language:
- en
tags:
- clover
- block-diffusion
pipeline_tag: text-generation
library_name: clover-cpp
---

# clover-default

A small **Clover** block-diffusion MoE language model trained on CPU (see Training), shipped
with clover-cpp as the default model of `clover demo`. It is a toy: it has learned the
surface of Python code (indentation, `def`/`self.`/`return` patterns, common stdlib
identifiers), not to program. It was trained to give the decoder real (non-flat)
distributions, which random weights never do; see Evaluation for how far that got.

## Data

* The Python {meta['python']} standard library's own `*.py` sources
  (`sysconfig.get_paths()["stdlib"]`), excluding the directories
  {', '.join('`' + d + '`' for d in meta['exclude_dirs'])} (tests, IDLE, demos, and the
  data-like `pydoc_data` and `encodings` tables).
* Held out: {meta['heldout']['files']} files (a deterministic 2%: `sha1(relative path) % 100 < 2`):
  {', '.join('`' + f + '`' for f in meta['heldout_files'])}.
* Training set: {meta['train']['files']} files, {meta['train']['bytes'] / 1e6:.1f} MB,
  {meta['train']['tokens']:,} tokens; held-out {meta['heldout']['tokens']:,} tokens. Files are
  joined with `<|endoftext|>`.

## Tokenizer

Byte-level BPE (Qwen2-style pre-tokenizer) trained on all training files by `train.data` (the
default model's tokenizer predates the move of `clover_testkit.bpe` to Hugging Face `tokenizers`): {meta['vocab_size']} tokens = 256 bytes + merges + the specials
`<|endoftext|>` ({hfc['eos_token_id']}, EOS/pad), `<|im_start|>`, `<|im_end|>`, `<|mask|>`
({hfc['mask_token_id']}). ChatML chat template (the model was never trained on chat).

## Architecture (config.json)

| | |
|---|---|
| parameters | {info['params'] / 1e6:.2f} M total, ~{n_active / 1e6:.2f} M active per token (excluding the embedding) |
| layers | {hfc['num_hidden_layers']}: {', '.join('GDN' if t == 'linear_attention' else 'full attention' for t in hfc['layer_types'])} |
| hidden | {H} |
| GDN | Hk={hfc['linear_num_key_heads']}, Hv={hfc['linear_num_value_heads']}, dk=dv={hfc['linear_key_head_dim']}, conv K={hfc['linear_conv_kernel_dim']} + lookahead R={hfc['linear_conv_lookahead']}, block calibration, memory/block gate |
| full attention | {hfc['num_attention_heads']} heads, {hfc['num_key_value_heads']} KV heads, head_dim {hfc['head_dim']}, partial RoPE {hfc['partial_rotary_factor']} (theta {hfc['rope_theta']:g}) |
| MoE | {E} experts, top-{k}, expert width {I}, shared expert {Is} |
| vocab | {hfc['vocab_size']} |
| block size B0 | {hfc['block_size']} |

Weights: matrices BF16, norms / conv taps / A_log / dt_bias / block_calib F32.

## Training

* Semantics (`"clover_semantics": "causal-shift"`, spec v2): the logits at position t predict
  the token at t+1; committed text is processed causally (as an autoregressive model), and
  decode blocks are denoised in parallel on top of that causal prefix.
* Objective: windows of {args['seq_len']} tokens, one block size B per step (drawn from
  `{args['block_sizes']}` so that the block calibration `tau = exp(theta + phi ln(B/B0))` sees
  several B) and one offset o ~ U{{1..B}}. Clean stream: the whole window causally (each token
  a block of one); AR loss = next-token cross-entropy at every position. Noisy stream: decode
  blocks at [o + bB, o + (b+1)B), per block t ~ U(0.05, 1] and max(1, round(tB)) random
  positions become `<|mask|>`; each block is passed bidirectionally against the clean memory
  (GDN state, conv tail, KV) of the text before it; diffusion loss = cross-entropy of the
  logits at q-1 for clean[q], over the masked q after the block start (the block start is
  the clean stream's prediction). Total = AR + diffusion + 0.01 MoE load-balancing loss.
* AdamW (0.9, 0.95), weight decay {args['weight_decay']}, grad clip {args['clip']}, batch
  {args['batch']} x {args['seq_len']} tokens, fp32 (torch {torch.__version__}), in {len(stages)} stage(s):
{stage_lines(stages)}
* {info['step']} steps in all{partial}, {info['tokens_seen']:,} training tokens
  ({info['tokens_seen'] / max(1, meta['train']['tokens']):.2f} epochs), {info['elapsed_s'] / 60:.0f} minutes.
* Held-out next-token (AR) loss of the causal stream: **{har} nats**; held-out diffusion loss
  (B = 32, fixed offsets and masks, t ~ U(0.05, 1]): **{hl} nats**.

![loss](loss.png)
{extra}
## Reproduce

From the repository root, with `pip install -e .[train]` (torch CPU build), on the same
Python {meta['python']} standard library (each stage is a deterministic function of its
arguments on a given torch build and thread count: `python -m train.check_repro --run <stage folder>`
re-runs a stage's first steps and compares the logged losses):

```
{cmd_data}
{cmd_train}
{cmd_export}
```

## Limits

Trained on {args['seq_len']}-token windows only; longer contexts are untested. Tiny model,
tiny data: expect plausible-looking but wrong code. Not for any real use.
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="train/runs/default")
    ap.add_argument("--data", default="train/runs/data")
    ap.add_argument("--out", default="models/clover-default")
    ap.add_argument("--card-extra", default=str(Path(__file__).with_name("card_extra.md")),
                    help="a markdown file appended to the model card ('' = none)")
    ap.add_argument("--tokenizer-from", default="",
                    help="copy tokenizer.json / tokenizer_config.json from this folder (default: --data)")
    a = ap.parse_args(argv)
    extra = Path(a.card_extra).read_text() if a.card_extra else ""
    info = export(Path(a.run), Path(a.data), Path(a.out), extra, Path(a.tokenizer_from) if a.tokenizer_from else None)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
