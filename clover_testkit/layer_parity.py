"""One layer of a GGUF, as llama.cpp runs it, against the numpy reference (any size, any type).

The reference (``clover_testkit.reference``, float64) holds every weight of a model in memory,
which the 35B-A3B widths do not allow (one layer's experts are 6.4 GB in float64). So this
compares one layer at a time: llama.cpp's eval callback (``GraphProbe``, through the default
callback of patch 0008 that ``clover imatrix`` uses) copies the layer's input (``l_out-{l-1}``;
for layer 0 the embedding rows of the file) and output (``l_out-{l}``) while libclover commits
a prompt and then runs a block pass; the reference runs that layer alone (the mixer and MoE
code of ``CloverReference`` on a one-layer config) from the same input, token by token for the
commit and as one canvas for the block pass, with weights read lazily:

* the tensors the file stores as F32 (norms, conv taps, A_log, dt_bias, block_calib, routers)
  from the Hugging Face checkpoint (exact);
* the others from the GGUF, dequantized (gguf-py) and put back into the checkpoint's layout
  (the value-head permutation undone), so a quantized file is compared with the reference of
  the weights it really holds and the difference measures the kernels, not the quantization.

``GraphProbe`` also times the layers of a pass (the callback fires when a named node is done)
and records the experts each MUL_MAT_ID selected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["GraphProbe", "LayerWeights", "layer_parity"]


class GraphProbe:
    """llama.cpp's default eval callback: copies the nodes named in ``names`` (in ``captured``,
    one array per graph evaluation), the time each named node was done (``times``: (name,
    perf_counter)), and with ``experts`` the expert ids of every MUL_MAT_ID on an
    ``*ffn_gate_exps*`` weight (``expert_ids``: (weight name, ids [n_tokens, k]))."""

    def __init__(self, names: Sequence[str] = (), copy: bool = True, experts: bool = False) -> None:
        self.names = set(names)
        self.copy = copy
        self.experts = experts
        self.clear()
        self.error: BaseException | None = None

    def clear(self) -> None:
        self.captured: dict[str, list[np.ndarray]] = {}
        self.times: list[tuple[str, float]] = []
        self.expert_ids: list[tuple[str, np.ndarray]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator["GraphProbe"]:
        from clover_cpp._ggml import ggml_backend_sched_eval_callback, set_default_eval_callback
        from clover_cpp._ggml import lib as ggml_lib

        self._ggml = ggml_lib()
        self._cb = ggml_backend_sched_eval_callback(self._callback)
        set_default_eval_callback(self._cb)
        try:
            yield self
        finally:
            set_default_eval_callback(None)

    @staticmethod
    def _array(t: Any) -> np.ndarray:
        from clover_cpp._ggml import tensor_array

        return np.array(tensor_array(t))

    def _callback(self, tp: Any, ask: bool, _ud: Any) -> bool:
        try:
            t = tp.contents
            name = t.name.decode("utf-8", "replace")
            want_ids = False
            if self.experts and t.src[2]:
                src0 = t.src[0].contents.name.decode("utf-8", "replace")
                want_ids = "ffn_gate_exps" in src0 and self._ggml.ggml_op_name(t.op) == b"MUL_MAT_ID"
            if ask:
                return name in self.names or want_ids
            if name in self.names:
                self.times.append((name, time.perf_counter()))
                if self.copy:
                    self.captured.setdefault(name, []).append(self._array(t))
            if want_ids:
                self.expert_ids.append((src0, self._array(t.src[2].contents)[0, 0].copy()))
            return True
        except BaseException as ex:  # noqa: BLE001 - raised by the caller after the pass
            if self.error is None:
                self.error = ex
            return not ask

    def rows(self, name: str) -> np.ndarray:
        """Every captured evaluation of a node, rows stacked ([n_tokens, width])."""
        arrs = self.captured.get(name)
        if not arrs:
            raise RuntimeError(f"the graph had no node {name!r}")
        return np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrs]).astype(np.float64)


class LayerWeights:
    """``model.layers.0.*`` of a one-layer reference = layer ``layer`` of the model, read on
    demand (see the module doc); ``source`` "gguf" takes the non-F32 tensors from the file,
    "checkpoint" takes every tensor from the checkpoint."""

    def __init__(self, gguf_path: str | Path, checkpoint: str | Path, cfg: Any, layer: int, source: str = "gguf",
                 cache: int = 48) -> None:
        import gguf

        from clover_convert.mapping import TENSOR_TABLE, rule_applies
        from clover_convert.safetensors_io import CheckpointReader

        self.reader = gguf.GGUFReader(str(gguf_path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.ckpt = CheckpointReader(checkpoint)
        self.cfg, self.layer, self.source = cfg, layer, source
        self.rules = [(re.compile(re.escape(r.hf).replace(r"\{i\}", str(layer)).replace(r"\{j\}", r"(\d+)")), r)
                      for r in TENSOR_TABLE if r.scope != "global" and rule_applies(r, cfg, layer)]
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache

    def __getitem__(self, name: str) -> np.ndarray:
        hf = name.replace("model.layers.0.", f"model.layers.{self.layer}.", 1)
        got = self._cache.get(hf)
        if got is None:
            got = self._cache[hf] = self._load(hf)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return got

    def _load(self, hf: str) -> np.ndarray:
        from clover_convert.mapping import perm_index
        from gguf.constants import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        for pat, rule in self.rules:
            m = pat.fullmatch(hf)
            if m is None:
                continue
            t = self.tensors[rule.gguf.format(i=self.layer)]
            if self.source == "checkpoint" or t.tensor_type == Q.F32:
                return self.ckpt.read_f32(hf).astype(np.float64)
            assert rule.fn is None, rule
            data = t.data[int(m.group(1))] if rule.scope == "experts" else t.data
            w = dequantize(np.asarray(data), t.tensor_type).astype(np.float64)
            idx = perm_index(rule.perm, self.cfg)
            if idx is not None:
                inv = np.argsort(idx)
                w = w[inv] if rule.perm.startswith("rows") else w[..., inv]
            return w.reshape(rule.shape(self.cfg))
        raise KeyError(hf)

    def embedding_rows(self, tokens: Sequence[int]) -> np.ndarray:
        """Rows of token_embd as llama.cpp's get_rows gives them (dequantized), float64."""
        from gguf.quants import dequantize

        t = self.tensors["token_embd.weight"]
        return dequantize(np.asarray(t.data[np.asarray(tokens)]), t.tensor_type).astype(np.float64)


def _one_layer_reference(cfg: Any, weights: LayerWeights) -> Any:
    from clover_testkit.reference import CloverReference

    ref = object.__new__(CloverReference)  # the oracle's layer code, without loading every weight
    ref.cfg = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=[cfg.layer_types[weights.layer]])
    ref.release, ref.tied, ref.w = False, False, weights
    return ref


def _layer(ref: Any, x: np.ndarray, mem: Any, block_size: int) -> tuple[np.ndarray, dict]:
    """The reference's layer (trace's loop body) on its one layer."""
    from clover_testkit.reference import LINEAR, rms_norm_1p

    c, w = ref.cfg, ref.w
    xn = rms_norm_1p(x, w["model.layers.0.input_layernorm.weight"], c.rms_norm_eps)
    if c.layer_types[0] == LINEAR:
        mix, rec = ref._gdn(0, xn, mem, block_size)
    else:
        mix, rec = ref._attn(0, xn, mem, mem.n_committed + np.arange(len(x)))
    h = x + mix
    hn = rms_norm_1p(h, w["model.layers.0.post_attention_layernorm.weight"], c.rms_norm_eps)
    y = h + ref._moe(0, hn)
    top = np.argsort(-(hn @ w["model.layers.0.mlp.gate.weight"].T), axis=-1, kind="stable")[:, :c.num_experts_per_tok]
    rec.update(x_out=y, experts=[set(map(int, t)) for t in top])  # (the top-k of the softmax's logits)
    return y, rec


def _err(a: np.ndarray, b: np.ndarray, got_experts: list[set[int]], want_experts: list[set[int]]) -> dict[str, Any]:
    """Errors of llama.cpp's rows a against the reference's b, and the tokens whose top-k experts
    differ (a routing flip: one token's MoE output then differs by a whole expert)."""
    return {"max_abs": float(np.abs(a - b).max()), "max_rel": float(np.abs(a - b).max() / np.abs(b).max()),
            "rms_rel": float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))),
            "row_rms_rel": [round(float(v), 5) for v in np.sqrt(np.mean((a - b) ** 2, axis=1) / np.mean(b ** 2, axis=1))],
            "routing_flips": sum(g != w for g, w in zip(got_experts, want_experts))}


def layer_parity(gguf_path: str | Path, checkpoint: str | Path, layer: int, prompt: Sequence[int],
                 canvas: Sequence[int], n_threads: int | None = None, sources: Sequence[str] = ("gguf",)
                 ) -> dict[str, Any]:
    """Layer ``layer`` of the file, run by libclover (a commit of ``prompt`` on an empty memory,
    then a block pass of ``canvas`` at B = len(canvas)), against the reference of that layer from
    the same inputs. Returns per source in ``sources`` ("gguf": the weights the file holds;
    "checkpoint": the checkpoint's) the errors of the commit rows and the block pass rows
    (max_abs, max_rel = max_abs / max |reference|, rms_rel), and the output scale."""
    from clover_convert.mapping import CloverConfig
    from clover_cpp import Clover

    cfg = CloverConfig.from_dict(json.loads((Path(checkpoint) / "config.json").read_text()))
    out_name, in_name = f"l_out-{layer}", f"l_out-{layer - 1}"
    probe = GraphProbe([out_name] + ([in_name] if layer > 0 else []), experts=True)
    exps = f"blk.{layer}.ffn_gate_exps.weight"

    def experts_of() -> list[set[int]]:
        return [set(map(int, row)) for name, ids in probe.expert_ids if name == exps for row in ids]

    B = len(canvas)
    with probe.installed(), Clover(str(gguf_path), n_ctx=max(64, len(prompt) + B), n_threads=n_threads,
                                   block_size=B) as m:
        m.commit(list(prompt), logits=True)  # every row reaches the last layer
        got_commit = {n: probe.rows(n) for n in probe.names}
        exp_commit = experts_of()
        probe.clear()
        m.block_logits(list(canvas))
        got_pass = {n: probe.rows(n) for n in probe.names}
        exp_pass = experts_of()
    if probe.error is not None:
        raise probe.error
    if (len(exp_commit), len(exp_pass)) != (len(prompt), B):
        raise RuntimeError(f"{exps}: expert ids of {len(exp_commit)} + {len(exp_pass)} rows, expected {len(prompt)} + {B}")
    result: dict[str, Any] = {"layer": layer, "type": cfg.layer_types[layer], "n_commit": len(prompt), "B": B}
    for source in sources:
        w = LayerWeights(gguf_path, checkpoint, cfg, layer, source)
        ref = _one_layer_reference(cfg, w)
        if layer == 0:
            x_commit, x_pass = w.embedding_rows(prompt), w.embedding_rows(canvas)
        else:
            x_commit, x_pass = got_commit[in_name], got_pass[in_name]
        mem = ref.new_memory()
        rows, experts = [], []
        for t in range(len(prompt)):  # causal: each token a block of one, then written
            y, rec = _layer(ref, x_commit[t:t + 1], mem, 1)
            ref._write_token(mem, [rec])
            rows.append(y[0])
            experts += rec["experts"]
        want_commit = np.stack(rows)
        want_pass, rec = _layer(ref, x_pass, mem, B)
        result[source] = {"commit": _err(got_commit[out_name], want_commit, exp_commit, experts),
                          "block_pass": _err(got_pass[out_name], want_pass, exp_pass, rec["experts"]),
                          "scale": float(np.abs(want_commit).max())}
    return result
