"""Models for the native benchmarks: clover `small` and same-size upstream baselines.

Everything is written into a cache folder (default ``~/.cache/clover-cpp/bench``) and
reused when present (``--force`` rewrites):

* ``src-small/``                   synthetic Clover checkpoint (preset ``small``, bf16, seed 0)
* ``clover-small-{f16,q8_0}.gguf`` converted with ``clover_convert.convert``
* ``qwen35moe-small-{f16,q8_0}.gguf``
      llama.cpp's own Qwen3.5-MoE architecture with the same dimensions: every tensor and
      key of the clover GGUF except the clover-only ones (``ssm_mix``, ``ssm_conv1d_look``,
      ``ssm_block_calib``; ``ssm.conv_lookahead``, ``diffusion.block_size``), keys renamed
      ``clover.*`` -> ``qwen35moe.*`` plus ``rope.dimension_sections``. The tensors are
      copied byte for byte, so the weights (random) and the per-tensor types (f16/q8_0/f32)
      are exactly those of the clover model.
* ``llada-moe-small-{f16,q8_0}.gguf``
      upstream's diffusion MoE (``llada-moe``, the largest model family that
      ``llama-diffusion-cli`` supports) as close to the same size as the architecture allows:
      hidden 1024, 8 layers (all full attention: 8 heads, 2 kv heads, head dim 128), 32
      experts top-4 of width 512, no shared expert, same tokenizer; random weights
      (seed 0). f32 for norms and the router, the rest f16 or q8_0 (numpy Q8_0 from gguf-py).
      Its chat template is the identity (llama-diffusion-cli always applies one).

    .venv/bin/python benchmarks/make_baselines.py [--cache DIR] [--types f16,q8_0] [--force]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from clover_testkit.qwen35moe import copy_field as _copy_field, qwen35moe_from_clover  # noqa: E402, F401
DEFAULT_CACHE = Path(os.environ.get("CLOVER_BENCH_CACHE", Path.home() / ".cache" / "clover-cpp" / "bench"))
PRESET = "small"
TYPES = ("f16", "q8_0")

IDENTITY_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _log(msg: str) -> None:
    print(f"[make_baselines] {msg}", file=sys.stderr, flush=True)


def _atomic_target(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


# ----------------------------------------------------------------------------- clover
def clover_source(cache: Path, force: bool = False) -> Path:
    from clover_testkit.checkpoints import write_checkpoint

    src = cache / f"src-{PRESET}"
    if force or not (src / "config.json").is_file() or not any(src.glob("model*.safetensors")):
        t0 = time.perf_counter()
        _log(f"writing the {PRESET} checkpoint (bf16) to {src}")
        tmp = cache / f"src-{PRESET}.tmp"
        write_checkpoint(tmp, preset=PRESET, dtype="bf16")
        if src.exists():
            for p in src.iterdir():
                p.unlink()
            src.rmdir()
        tmp.rename(src)
        _log(f"  done in {time.perf_counter() - t0:.1f} s")
    return src


def clover_gguf(cache: Path, outtype: str, force: bool = False) -> Path:
    from clover_convert import convert

    out = cache / f"clover-{PRESET}-{outtype}.gguf"
    if force or not out.is_file():
        src = clover_source(cache, force=False)
        t0 = time.perf_counter()
        _log(f"converting to {out.name}")
        tmp = _atomic_target(out)
        convert(src, tmp, outtype=outtype, force=True, progress=False)
        tmp.rename(out)
        _log(f"  done in {time.perf_counter() - t0:.1f} s")
    return out


# ----------------------------------------------------------------------------- GGUF helpers
def _tokenizer_fields(reader):
    skip = ("tokenizer.chat_template",)  # diffusion-cli would wrap the prompt in it
    return [(k, f) for k, f in reader.fields.items() if k.startswith("tokenizer.") and k not in skip]


# ----------------------------------------------------------------------------- qwen35moe
def qwen35moe_gguf(cache: Path, outtype: str, force: bool = False) -> Path:
    out = cache / f"qwen35moe-{PRESET}-{outtype}.gguf"
    if not force and out.is_file():
        return out
    src = clover_gguf(cache, outtype)
    t0 = time.perf_counter()
    _log(f"writing {out.name} from {src.name}")
    n = qwen35moe_from_clover(src, out)
    _log(f"  {n} tensors kept of the clover GGUF's, {time.perf_counter() - t0:.1f} s")
    return out


# ----------------------------------------------------------------------------- llada-moe
def llada_moe_gguf(cache: Path, outtype: str, force: bool = False) -> Path:
    import gguf
    from gguf import quants
    from clover_testkit.presets import preset_config

    out = cache / f"llada-moe-{PRESET}-{outtype}.gguf"
    if not force and out.is_file():
        return out
    cfg = preset_config(PRESET)
    tok_src = clover_gguf(cache, "f16")
    t0 = time.perf_counter()
    _log(f"writing {out.name} (random weights)")
    reader = gguf.GGUFReader(tok_src)
    arch = "llada-moe"
    H = cfg["hidden_size"]
    L = cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = H // nh                      # llada-moe: q projection is H -> H
    E, k, I = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    V = cfg["vocab_size"]
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]

    tmp = _atomic_target(out)
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name("llada-moe benchmark baseline (random weights)")
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_expert_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(dh)
    w.add_value_length(dh)
    w.add_rope_dimension_count(dh)
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_expert_weights_norm(True)
    w.add_key_value("diffusion.shift_logits", False, gguf.GGUFValueType.BOOL)
    for key, field in _tokenizer_fields(reader):
        _copy_field(w, field, key)
    del reader
    # llama-diffusion-cli always formats the prompt with the model's chat template: make it the
    # identity, so that the prompt tokens are exactly the given text's
    w.add_chat_template(IDENTITY_TEMPLATE)

    rng = np.random.default_rng(0)

    def mat(name: str, shape: tuple[int, ...], std: float = 0.02) -> None:
        a = (rng.standard_normal(shape, dtype=np.float32) * std)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def vec(name: str, n: int, value: float = 1.0) -> None:
        w.add_tensor(name, np.full((n,), value, dtype=np.float32))

    mat("token_embd.weight", (V, H))
    vec("output_norm.weight", H)
    mat("output.weight", (V, H))
    for i in range(L):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", H)
        mat(p + "attn_q.weight", (nh * dh, H))
        mat(p + "attn_k.weight", (nkv * dh, H))
        mat(p + "attn_v.weight", (nkv * dh, H))
        mat(p + "attn_output.weight", (H, nh * dh))
        vec(p + "attn_q_norm.weight", dh)
        vec(p + "attn_k_norm.weight", dh)
        vec(p + "ffn_norm.weight", H)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, H), dtype=np.float32) * 0.02)
        mat(p + "ffn_gate_exps.weight", (E, I, H))
        mat(p + "ffn_up_exps.weight", (E, I, H))
        mat(p + "ffn_down_exps.weight", (E, H, I))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    _log(f"  done in {time.perf_counter() - t0:.1f} s")
    return out


# ----------------------------------------------------------------------------- all
def ensure_models(cache: Path = DEFAULT_CACHE, types=TYPES, force: bool = False) -> dict[str, dict[str, Path]]:
    """{outtype: {"clover": path, "qwen35moe": path, "llada-moe": path}}"""
    cache = Path(cache).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if force:
        clover_source(cache, force=True)
    out: dict[str, dict[str, Path]] = {}
    for t in types:
        out[t] = {
            "clover": clover_gguf(cache, t, force),
            "qwen35moe": qwen35moe_gguf(cache, t, force),
            "llada-moe": llada_moe_gguf(cache, t, force),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--force", action="store_true", help="rewrite every model")
    a = ap.parse_args(argv)
    models = ensure_models(a.cache, [t for t in a.types.split(",") if t], a.force)
    for t, d in models.items():
        for name, p in d.items():
            print(f"{t:5s} {name:10s} {p}  ({p.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
