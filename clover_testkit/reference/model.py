"""The reference's forward model: the config, the memory, causal commits and block passes
(float64, spec v2), causal logits and perplexity.

Project decisions (beyond the spec):

* Next-token shift: the logits row of position t predicts the token at position t+1,
  for committed and canvas positions alike.
* ``commit(mem, tokens)`` (n >= 1 tokens, positions ``mem.n_committed ...``) is causal:
  each token is processed exactly as a block of ONE (block size 1: look-ahead taps see
  zeros, the block softmax has the token alone so o_blk = v, the memory read uses the
  state BEFORE the token, attention sees the committed keys up to and including the
  token), then written into the memory. It returns the [n, V] logits of the committed
  positions. There is no block size and no alignment: the memory, and every logit, is
  that of an autoregressive pass and does not depend on how the commits are split.
* ``block_pass(mem, tokens, block_size)``: a canvas of 1 <= n <= block_size tokens at
  positions ``mem.n_committed .. +n-1`` (any n_committed), bidirectional inside the
  canvas, look-ahead taps inside the canvas only (zeros past its end), tau computed with
  B = block_size. It does not change mem.
* Block calibration: ``tau_j = exp(theta_j + phi_j * ln(B / B0))``, B the run-time
  block size, B0 = ``config.block_size``.
* Conv: causal taps read the committed conv tail (last K-1 pre-conv rows u of the
  committed tokens; zeros when fewer were committed).
* q/k L2 norm: ``x / sqrt(sum x^2 + 1e-6)``; memory read ``S_j^T q^ / sqrt(dk)``; value
  head j uses key head ``j // (Hv / Hk)``. Block attention logits are ``tau * q^.k^``.
* Full attention: RoPE NeoX style (rotate_half) on the first ``int(dh *
  partial_rotary_factor)`` dims at absolute positions; keys = committed cache + all n
  canvas tokens; q_proj rows per head are [dh query, dh gate]; out = attn * sigmoid(gate).
  The KV cache stores k after k_norm and RoPE.
* Memory is float64 throughout (GDN state S, conv tail, KV cache): no rounding, so a
  commit split any way gives the same memory. Per token the GDN write is
  ``S <- exp(g) S; S <- S + k^ (beta (v - S^T k^))^T``; conv tail = last K-1 rows of
  [tail ; u].
* MoE: softmax over all E, top-k (ties: lower expert index), renormalised when
  norm_topk_prob; shared expert gated by sigmoid(x . w_shared_gate).
* The block expert coreset (``coreset=C`` of trace / block_pass / generate; None or 0 = off;
  spec/model.md "MoE"): in a canvas of n >= 2 rows each MoE layer keeps the C experts with the
  highest router probability summed over the rows (ties: lower index; a C below k is k), and every
  row routes its top k among those only, weights renormalised over them when norm_topk_prob.
  Commits and one-row canvases keep full routing; C >= E is full routing. ``coreset_select`` is the rule.

The released checkpoint's layout (``cfg.block_operator == "release-bd-softmax"``, detected from
the weights: bd_softmax_* instead of in_proj_m / block_calib; docs/release-checkpoint.md):

* The GDN is the trunk's (Qwen3.5) gated delta rule, no mixing gate, no block softmax: per token
  t in order, ``S <- exp(g) S; S <- S + k^ (beta (v - S^T k^))^T`` and then
  ``o_t = S^T q^_t / sqrt(dk)`` (the read of the state AFTER the token's write). A commit does
  this token by token and keeps S; a block pass continues it over the canvas tokens in order
  from the committed state and throws the states away ("the block softmax left out"). The
  bd_softmax_* tensors are never used. Conv (causal taps plus the right conv
  ``conv_right_weight`` as the look-ahead taps inside the canvas), full attention (bidirectional
  inside the canvas), MoE, norms, logits and the next-token shift are as above, so a canvas of
  one token is exactly the causal step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from clover_convert import mapping
from clover_testkit.reference.primitives import (bidirectional_conv, block_tau, l2_norm, rms_norm_1p, rope_neox,
                                                 sigmoid, silu, softmax, softplus)

LINEAR, FULL = "linear_attention", "full_attention"


# ----------------------------------------------------------------------------- config

CloverConfig = mapping.CloverConfig  # the project's one config class (validated by parse_config)


# ----------------------------------------------------------------------------- memory

@dataclass
class Memory:
    """Everything committed so far, all float64. Per layer index: GDN state S [Hv, dk, dv]
    and conv tail [K-1, C] (linear layers); keys/values [nkv, T, dh] (full attention)."""
    n_committed: int
    state: dict[int, np.ndarray]
    conv_tail: dict[int, np.ndarray]
    keys: dict[int, np.ndarray]
    values: dict[int, np.ndarray]

    def copy(self) -> "Memory":
        cp = lambda d: {k: v.copy() for k, v in d.items()}  # noqa: E731
        return Memory(self.n_committed, cp(self.state), cp(self.conv_tail),
                      cp(self.keys), cp(self.values))


# ----------------------------------------------------------------------------- model

def hf_tensor_shapes(cfg: CloverConfig, tied: bool, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of a Clover checkpoint and its shape, in checkpoint order: the converter's
    table (clover_convert.mapping.TENSOR_TABLE), the project's one tensor list."""
    return mapping.hf_tensor_shapes(dataclasses.replace(cfg, tie_word_embeddings=bool(tied)), fused_experts)


def _unfuse_experts(cfg: CloverConfig, w: dict[str, np.ndarray]) -> None:
    """Rewrite fused experts.gate_up_proj [E,2I,H] / experts.down_proj [E,H,I] per expert."""
    I = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        m = f"model.layers.{i}.mlp.experts."
        if m + "gate_up_proj" not in w and m + "down_proj" not in w:
            continue
        gu, dn = w.pop(m + "gate_up_proj", None), w.pop(m + "down_proj", None)
        if gu is None or dn is None:
            raise ValueError(f"{m}: fused experts need both gate_up_proj and down_proj")
        E, H = cfg.num_experts, cfg.hidden_size
        if gu.shape != (E, 2 * I, H) or dn.shape != (E, H, I):
            raise ValueError(f"{m}: fused expert shapes {gu.shape}, {dn.shape} != "
                             f"{(E, 2 * I, H)}, {(E, H, I)}")
        for e in range(E):
            w[m + f"{e}.gate_proj.weight"] = gu[e, :I]
            w[m + f"{e}.up_proj.weight"] = gu[e, I:]
            w[m + f"{e}.down_proj.weight"] = dn[e]


class CloverReference:
    def __init__(self, cfg: CloverConfig, weights: dict[str, np.ndarray]):
        self.cfg = cfg
        w = {k: np.asarray(v) for k, v in weights.items()}
        cfg = mapping.detect_block_operator(cfg, w)  # Clover's block operator or the release's
        self.cfg = cfg
        self.release = cfg.block_operator == mapping.BLOCK_OPERATOR_RELEASE
        _unfuse_experts(cfg, w)
        # tied when the config says so or when lm_head is absent (then embed_tokens is used)
        self.tied = cfg.tie_word_embeddings or "lm_head.weight" not in w
        want = hf_tensor_shapes(cfg, self.tied)
        missing = [k for k in want if k not in w]
        if missing:
            raise ValueError(f"missing {len(missing)} tensors, e.g. {missing[:3]}")
        for k, shp in want.items():
            if k.endswith("linear_attn.conv_right_weight"):  # [C, R] or [C, 1, R]
                w[k] = w[k].reshape(w[k].shape[0], -1)
            if "linear_attn.bd_softmax_" in k:  # kept, never used: any shape
                continue
            if tuple(w[k].shape) != shp:
                raise ValueError(f"{k}: shape {tuple(w[k].shape)} != expected {shp}")
        self.w = {k: w[k].astype(np.float64) for k in want}
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "CloverReference":
        folder = Path(folder)
        cfg = CloverConfig.from_dict(json.loads((folder / "config.json").read_text()))
        from clover_convert.safetensors_io import CheckpointReader
        reader = CheckpointReader(folder)
        return cls(cfg, {n: reader.read_f32(n) for n in reader.names()})

    # -- memory ---------------------------------------------------------------------
    def new_memory(self) -> Memory:
        c = self.cfg
        mem = Memory(0, {}, {}, {}, {})
        for i, lt in enumerate(c.layer_types):
            if lt == LINEAR:
                mem.state[i] = np.zeros((c.linear_num_value_heads, c.linear_key_head_dim,
                                         c.linear_value_head_dim))
                mem.conv_tail[i] = np.zeros((c.linear_conv_kernel_dim - 1, c.conv_dim))
            else:
                mem.keys[i] = np.zeros((c.num_key_value_heads, 0, c.head_dim))
                mem.values[i] = np.zeros((c.num_key_value_heads, 0, c.head_dim))
        return mem

    # -- mixers ---------------------------------------------------------------------
    def _gdn(self, i: int, x: np.ndarray, mem: Memory, B: int) -> tuple[np.ndarray, dict]:
        c, p = self.cfg, f"model.layers.{i}.linear_attn."
        W = lambda name: self.w[p + name]  # noqa: E731
        n = x.shape[0]
        Hk, Hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        r = Hv // Hk
        u, z = x @ W("in_proj_qkv.weight").T, x @ W("in_proj_z.weight").T
        b, a = x @ W("in_proj_b.weight").T, x @ W("in_proj_a.weight").T
        m = None if self.release else x @ W("in_proj_m.weight").T
        if not c.linear_conv_lookahead:
            w_look = np.zeros((c.conv_dim, 0))
        else:
            w_look = W("conv_right_weight") if self.release else W("conv1d_lookahead.weight")[:, 0, :]
        conv = bidirectional_conv(mem.conv_tail[i], u, W("conv1d.weight")[:, 0, :], w_look)
        cs = silu(conv)
        q = l2_norm(cs[:, :Hk * dk].reshape(n, Hk, dk))
        k = l2_norm(cs[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk))
        v = cs[:, 2 * Hk * dk:].reshape(n, Hv, dv)
        S = mem.state[i]
        if self.release:
            o = self._trunk_delta_rule(i, S, q, k, v, b, a)
            on = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + c.rms_norm_eps)
            y = W("norm.weight") * on * silu(z.reshape(n, Hv, dv))
            out = y.reshape(n, Hv * dv) @ W("out_proj.weight").T
            return out, dict(u=u, conv=conv, q=q, k=k, v=v, b=b, a=a, m=m, z=z, tau=None, o=o)
        tau = block_tau(W("block_calib"), B, c.block_size)
        lam = sigmoid(m)
        o = np.zeros((n, Hv, dv))
        for j in range(Hv):
            kh = j // r
            o_mem = q[:, kh] @ S[j] / math.sqrt(dk)                  # [n, dv] = (S^T q)^T
            att = softmax(tau[j] * (q[:, kh] @ k[:, kh].T), axis=-1)  # [n, n]
            o_blk = att @ v[:, j]
            o[:, j] = lam[:, j:j + 1] * o_mem + (1.0 - lam[:, j:j + 1]) * o_blk
        on = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + c.rms_norm_eps)
        y = W("norm.weight") * on * silu(z.reshape(n, Hv, dv))
        out = y.reshape(n, Hv * dv) @ W("out_proj.weight").T
        return out, dict(u=u, conv=conv, q=q, k=k, v=v, b=b, a=a, m=m, z=z, tau=tau, o=o)

    def _trunk_delta_rule(self, i: int, S0: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          b: np.ndarray, a: np.ndarray) -> np.ndarray:
        """The release's GDN output o [n, Hv, dv]: the gated delta rule over the n tokens in order
        from S0 (not changed), each token's output read from the state after its write."""
        c, p = self.cfg, f"model.layers.{i}.linear_attn."
        Hv, dk = c.linear_num_value_heads, c.linear_key_head_dim
        r = Hv // c.linear_num_key_heads
        heads = np.arange(Hv) // r
        beta = sigmoid(b)                                                       # [n, Hv]
        g = -np.exp(self.w[p + "A_log"]) * softplus(a + self.w[p + "dt_bias"])  # [n, Hv]
        S = S0.copy()
        o = np.zeros((len(q), Hv, c.linear_value_head_dim))
        for t in range(len(q)):
            kt, qt = k[t][heads], q[t][heads]                                   # [Hv, dk]
            S = S * np.exp(g[t])[:, None, None]
            err = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * err[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, qt) / math.sqrt(dk)
        return o

    def _attn(self, i: int, x: np.ndarray, mem: Memory, pos: np.ndarray) -> tuple[np.ndarray, dict]:
        c, p = self.cfg, f"model.layers.{i}.self_attn."
        n, nh, nkv, dh = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qf = (x @ self.w[p + "q_proj.weight"].T).reshape(n, nh, 2 * dh)
        q, gate = qf[..., :dh], qf[..., dh:]
        k = (x @ self.w[p + "k_proj.weight"].T).reshape(n, nkv, dh)
        v = (x @ self.w[p + "v_proj.weight"].T).reshape(n, nkv, dh)
        q = rms_norm_1p(q, self.w[p + "q_norm.weight"], c.rms_norm_eps).transpose(1, 0, 2)
        k = rms_norm_1p(k, self.w[p + "k_norm.weight"], c.rms_norm_eps).transpose(1, 0, 2)
        q = rope_neox(q, pos, c.rotary_dim, c.rope_theta)           # [nh, n, dh]
        k = rope_neox(k, pos, c.rotary_dim, c.rope_theta)           # [nkv, n, dh]
        v = v.transpose(1, 0, 2)
        K = np.concatenate([mem.keys[i], k], axis=1)                # cache + whole block
        Vv = np.concatenate([mem.values[i], v], axis=1)
        out = np.zeros((n, nh, dh))
        for h in range(nh):
            g = h // (nh // nkv)
            att = softmax(q[h] @ K[g].T / math.sqrt(dh), axis=-1)
            out[:, h] = (att @ Vv[g]) * sigmoid(gate[:, h])
        return out.reshape(n, nh * dh) @ self.w[p + "o_proj.weight"].T, dict(k=k, v=v)

    def _moe(self, i: int, x: np.ndarray, coreset: int | None = None,
             routed: list | None = None) -> np.ndarray:
        c, p = self.cfg, f"model.layers.{i}.mlp."
        W = lambda name: self.w[p + name]  # noqa: E731
        probs = softmax(x @ W("gate.weight").T, axis=-1)             # [n, E]
        top, pw = coreset_select(probs, c.num_experts_per_tok, c.norm_topk_prob, coreset)
        if routed is not None:
            routed.append(top)
        out = np.zeros_like(x)
        for e in np.unique(top):  # the tokens routed to expert e (each at most once), together
            rows, slot = np.nonzero(top == e)
            e_, xe = f"experts.{e}.", x[rows]
            hmid = silu(xe @ W(e_ + "gate_proj.weight").T) * (xe @ W(e_ + "up_proj.weight").T)
            out[rows] += pw[rows, slot][:, None] * (hmid @ W(e_ + "down_proj.weight").T)
        shared = self._swiglu(p + "shared_expert.", x)
        return out + sigmoid(x @ W("shared_expert_gate.weight").T) * shared

    def _swiglu(self, prefix: str, x: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * up x) of the dense FFN whose weights are prefix{gate,up,down}_proj.weight:
        the shared expert, and the canvas FFN (spec/model.md) on block-pass rows."""
        W = lambda name: self.w[f"{prefix}{name}_proj.weight"]  # noqa: E731
        return (silu(x @ W("gate").T) * (x @ W("up").T)) @ W("down").T

    # -- passes ---------------------------------------------------------------------
    def _tokens(self, tokens: Sequence[int]) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(toks) and (toks.min() < 0 or toks.max() >= self.cfg.vocab_size):
            raise ValueError("token id outside the vocabulary")
        return toks

    def trace(self, mem: Memory, tokens: Sequence[int], block_size: int,
              coreset: int | None = None, canvas: bool = True) -> tuple[np.ndarray, list[dict]]:
        """Block pass that also returns per-layer intermediates (for checks and commit).

        The canvas is tokens (1 <= n <= block_size) at positions mem.n_committed .. +n-1.
        Each layer's dict has x_in (normed mixer input), mix (mixer output), h (after the
        mixer residual), x_out (layer output); GDN layers add u, conv (pre-silu), q, k
        (L2-normed, per key head), v, b, a, m, z (projections), tau and o (mixed, pre-norm);
        attention layers add k, v as appended to the KV cache ([nkv, n, dh], k after RoPE);
        every layer adds experts ([n, k'] the routed experts of each row). coreset: the block
        expert coreset C (None or 0 = off; a canvas of one row always routes fully). canvas:
        the rows are a block pass's (the canvas FFN runs on them, when the model has one), not a
        commit's token (commit traces each token with canvas=False).
        """
        B = block_size
        if isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1:
            raise ValueError(f"block_size must be a positive integer, got {B!r}")
        toks = self._tokens(tokens)
        if not 1 <= len(toks) <= B:
            raise ValueError(f"a block pass takes 1..{B} tokens, got {len(toks)}")
        c = self.cfg
        pos = mem.n_committed + np.arange(len(toks))
        x = self.w["model.embed_tokens.weight"][toks]
        layers = []
        for i, lt in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            xn = rms_norm_1p(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            if lt == LINEAR:
                mix, rec = self._gdn(i, xn, mem, B)
            else:
                mix, rec = self._attn(i, xn, mem, pos)
            h = x + mix
            routed: list = []
            hn = rms_norm_1p(h, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = h + self._moe(i, hn, coreset if len(toks) > 1 else None, routed)
            if canvas and c.canvas_ffn_intermediate_size:
                x = x + self._swiglu(p + "mlp.canvas_ffn.", hn)
            rec.update(x_in=xn, mix=mix, h=h, x_out=x, experts=routed[0])
            layers.append(rec)
        logits = rms_norm_1p(x, self.w["model.norm.weight"], c.rms_norm_eps) @ self.lm_head.T
        return logits, layers

    def block_pass(self, mem: Memory, tokens: Sequence[int], block_size: int,
                   coreset: int | None = None) -> np.ndarray:
        """Logits [n, V] of the canvas tokens (row t predicts position t+1); mem unchanged.
        coreset: the block expert coreset C (None or 0 = full routing)."""
        return self.trace(mem, tokens, block_size, coreset)[0]

    def _write_token(self, mem: Memory, layers: list[dict]) -> None:
        """Write ONE token, traced as a block of one on mem, into mem."""
        c = self.cfg
        r = c.linear_num_value_heads // c.linear_num_key_heads
        for i, (lt, rec) in enumerate(zip(c.layer_types, layers)):
            assert len(rec["x_out"]) == 1
            if lt == FULL:
                mem.keys[i] = np.concatenate([mem.keys[i], rec["k"]], axis=1)
                mem.values[i] = np.concatenate([mem.values[i], rec["v"]], axis=1)
                continue
            p = f"model.layers.{i}.linear_attn."
            beta = sigmoid(rec["b"][0])                                          # [Hv]
            g = -np.exp(self.w[p + "A_log"]) * softplus(rec["a"][0] + self.w[p + "dt_bias"])
            k = rec["k"][0][np.arange(c.linear_num_value_heads) // r]            # [Hv, dk]
            v = rec["v"][0]                                                      # [Hv, dv]
            S = mem.state[i] * np.exp(g)[:, None, None]                          # [Hv, dk, dv]
            err = beta[:, None] * (v - np.einsum("hkv,hk->hv", S, k))
            mem.state[i] = S + k[:, :, None] * err[:, None, :]
            U = np.concatenate([mem.conv_tail[i], rec["u"]], axis=0)
            mem.conv_tail[i] = U[len(U) - (c.linear_conv_kernel_dim - 1):].copy()
        mem.n_committed += 1

    def commit(self, mem: Memory, tokens: Sequence[int]) -> np.ndarray:
        """Causal commit of n >= 1 tokens at positions mem.n_committed...: each token is a
        block of one (block size 1), traced on the memory before it, then written. Returns
        the [n, V] logits of the committed positions (row t predicts position t+1)."""
        toks = self._tokens(tokens)
        if len(toks) < 1:
            raise ValueError("commit takes at least one token")
        rows = []
        for t in toks:
            logits, layers = self.trace(mem, [int(t)], 1, canvas=False)
            self._write_token(mem, layers)
            rows.append(logits[0])
        return np.stack(rows)


def coreset_select(probs: np.ndarray, k: int, norm_topk_prob: bool,
                   coreset: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The routing of n rows: router probabilities [n, E] (softmax over all E) -> (experts
    [n, k], weights [n, k]). Full routing: each row's top k (ties: lower index). With a
    coreset C >= 1 (spec/model.md, "MoE"; applied by the caller to canvases of n >= 2 rows
    only): the max(C, k) experts of highest summed probability over the rows (ties: lower
    index; all E = full routing), each row's top k among them. Weights: the rows'
    probabilities, renormalised over the k chosen when norm_topk_prob."""
    probs = np.asarray(probs)
    n, E = probs.shape
    if coreset is None or int(coreset) <= 0 or max(int(coreset), k) >= E:
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    else:
        C = max(int(coreset), k)
        core = np.sort(np.argsort(-probs.sum(axis=0), kind="stable")[:C])   # [C], ascending index
        sub = probs[:, core]                                                 # [n, C]
        top = core[np.argsort(-sub, axis=-1, kind="stable")[:, :k]]          # ties: lower index
    pw = np.take_along_axis(probs, top, axis=-1)
    if norm_topk_prob:
        pw = pw / pw.sum(axis=-1, keepdims=True)
    return top, pw


def causal_logits(model: CloverReference, tokens: Sequence[int]) -> np.ndarray:
    """The autoregressive logits [n, V] of tokens: a commit on a fresh memory."""
    return model.commit(model.new_memory(), tokens)


def perplexity(model: CloverReference, tokens: Sequence[int]) -> float:
    """exp of the mean next-token cross-entropy: tokens 1..n-1 predicted from rows 0..n-2."""
    toks = [int(t) for t in tokens]
    if len(toks) < 2:
        raise ValueError("perplexity needs at least two tokens")
    logits = causal_logits(model, toks)[:-1]
    mx = logits.max(axis=-1, keepdims=True)
    logz = (mx + np.log(np.exp(logits - mx).sum(axis=-1, keepdims=True)))[:, 0]
    nll = logz - logits[np.arange(len(toks) - 1), toks[1:]]
    return float(np.exp(nll.mean()))

