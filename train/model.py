"""Clover forward in torch, for training (see spec/model.md).

Parameters carry the Hugging Face names and shapes of the spec, except that the experts of
a layer are stored in the spec's fused form (``mlp.experts.gate_up_proj [E, 2I, H]``, gate
half first, and ``mlp.experts.down_proj [E, H, I]``); ``hf_state_dict()`` gives the
per-expert names (``experts.j.{gate,up,down}_proj.weight``) and ``load_hf()`` takes either.

Training forward (``forward_train``), BD3-LM style, vectorised over the batch and over
blocks. A sequence of T = nb*B tokens is run as two streams, layer by layer:

* clean stream: block b is a block pass of the clean block b against the memory of the
  clean blocks < b (exactly what ``commit`` computes);
* noisy stream: block b is a block pass of the noisy (partly masked) block b against the
  same memory; its logits are the training output.

The memory of a GDN layer at the start of block b is the state S after committing clean
blocks 0..b-1 (chunked gated delta rule, one chunk per block, exact in exact arithmetic:
``Delta = (I + A)^-1 (beta v - beta e^G k S0)``, ``S1 = e^G_n S0 + (k e^(G_n - G))^T Delta``)
and the conv tail = the K-1 clean pre-conv rows before the block. Full attention: clean
queries see clean keys of blocks <= b; noisy queries see clean keys of blocks < b and the
noisy keys of their own block (bidirectional). Lookahead conv taps stop at the block end;
block calibration ``tau = exp(theta + phi ln(B / B0))`` and the memory/block gate are used.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from clover_testkit.reference import LINEAR, CloverConfig, hf_tensor_shapes

QK_NORM_EPS = 1e-6


def rms_norm_1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + QK_NORM_EPS)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """x [..., T, dh], pos [T]; rotate_half on the first rot dims."""
    if rot == 0:
        return x
    half = rot // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / rot)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)


def _key(name: str) -> str:
    return name.replace(".", "__")


class CloverTorch(nn.Module):
    def __init__(self, cfg: CloverConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tied = bool(cfg.tie_word_embeddings)
        self.p = nn.ParameterDict()
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        for name, shape in self.shapes().items():
            self.p[_key(name)] = nn.Parameter(self._init(name, shape, gen))

    # ------------------------------------------------------------------ parameters
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return hf_tensor_shapes(self.cfg, self.tied, fused_experts=True)

    def _init(self, name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        c = self.cfg
        L = c.num_hidden_layers
        randn = lambda std: torch.randn(shape, generator=gen) * std  # noqa: E731
        leaf = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
        if name == "model.embed_tokens.weight":
            return randn(0.02 if not self.tied else 1.0 / math.sqrt(c.hidden_size))
        if name == "lm_head.weight":
            return randn(1.0 / math.sqrt(c.hidden_size))
        if leaf.endswith("A_log"):
            return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
        if leaf.endswith("dt_bias"):
            dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            return dt + torch.log(-torch.expm1(-dt))
        if leaf.endswith("block_calib"):
            out = torch.zeros(shape)
            out[0] = math.log(8.0)          # tau = 8 on L2-normed q.k at B = B0
            return out
        if leaf.endswith("linear_attn.norm"):
            return torch.ones(shape)
        if leaf.endswith("norm"):            # (1 + w) norms
            return torch.zeros(shape)
        if leaf.endswith("conv1d"):
            out = randn(0.1)
            out[..., -1] += 1.0             # start near identity on the current token
            return out
        if leaf.endswith("conv1d_lookahead"):
            return randn(0.1)
        if leaf.endswith("in_proj_m"):
            return torch.zeros(shape)        # lambda = 0.5 at start
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) or name.endswith("experts.down_proj"):
            return randn(0.02 / math.sqrt(2 * L))
        return randn(0.02)

    def W(self, name: str) -> torch.Tensor:
        return self.p[_key(name)]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF names with per-expert tensors (experts.j.{gate,up,down}_proj.weight)."""
        c = self.cfg
        I = c.moe_intermediate_size
        out: dict[str, torch.Tensor] = {}
        for k, v in self.p.items():
            name = k.replace("__", ".")
            v = v.detach()
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                for e in range(c.num_experts):
                    out[base + f"{e}.gate_proj.weight"] = v[e, :I]
                    out[base + f"{e}.up_proj.weight"] = v[e, I:]
            elif name.endswith("mlp.experts.down_proj"):
                base = name[: -len("down_proj")]
                for e in range(c.num_experts):
                    out[base + f"{e}.down_proj.weight"] = v[e]
            else:
                out[name] = v
        return out

    @torch.no_grad()
    def load_hf(self, weights: dict[str, Any]) -> None:
        """Copy HF-named weights (per-expert or fused experts) into the parameters."""
        c = self.cfg
        w = {k: torch.as_tensor(v) for k, v in weights.items()}
        for i in range(c.num_hidden_layers):
            m = f"model.layers.{i}.mlp.experts."
            if m + "gate_up_proj" not in w:
                w[m + "gate_up_proj"] = torch.stack([torch.cat([w.pop(m + f"{e}.gate_proj.weight"),
                                                                w.pop(m + f"{e}.up_proj.weight")])
                                                     for e in range(c.num_experts)])
                w[m + "down_proj"] = torch.stack([w.pop(m + f"{e}.down_proj.weight")
                                                  for e in range(c.num_experts)])
        for k, prm in self.p.items():
            name = k.replace("__", ".")
            if tuple(w[name].shape) != tuple(prm.shape):
                raise ValueError(f"{name}: {tuple(w[name].shape)} != {tuple(prm.shape)}")
            prm.copy_(w[name].to(prm.dtype))

    # ------------------------------------------------------------------ blocks
    def _moe(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (out [M, H], load-balancing loss scalar)."""
        c, p = self.cfg, f"model.layers.{i}.mlp."
        E, k, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        probs = torch.softmax(x @ self.W(p + "gate.weight").T, dim=-1)
        topv, topi = torch.topk(probs, k, dim=-1)
        if c.norm_topk_prob:
            topv = topv / topv.sum(-1, keepdim=True)
        gu, dn = self.W(p + "experts.gate_up_proj"), self.W(p + "experts.down_proj")
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = torch.nonzero(topi == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            h = xe @ gu[e].T
            h = F.silu(h[:, :I]) * h[:, I:]
            out.index_add_(0, rows, (h @ dn[e].T) * topv[rows, slot, None])
        hs = F.silu(x @ self.W(p + "shared_expert.gate_proj.weight").T) * (x @ self.W(p + "shared_expert.up_proj.weight").T)
        shared = hs @ self.W(p + "shared_expert.down_proj.weight").T
        out = out + torch.sigmoid(x @ self.W(p + "shared_expert_gate.weight").T) * shared
        frac = torch.zeros(E, dtype=x.dtype, device=x.device).index_add_(
            0, topi.reshape(-1), torch.ones(topi.numel(), dtype=x.dtype, device=x.device)) / topi.numel()
        aux = E * (frac.detach() * probs.mean(0)).sum()
        return out, aux

    def _gdn(self, i: int, xc: torch.Tensor, xn: torch.Tensor, B: int, trace: dict | None):
        """xc, xn [N, T, H] (normed) -> mixer outputs (clean, noisy) [N, T, H]."""
        c, p = self.cfg, f"model.layers.{i}.linear_attn."
        N, T, H = xc.shape
        nb = T // B
        Hk, Hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        r, C, K, R = Hv // Hk, c.conv_dim, c.linear_conv_kernel_dim, c.linear_conv_lookahead
        Wall = torch.cat([self.W(p + "in_proj_qkv.weight"), self.W(p + "in_proj_z.weight"),
                          self.W(p + "in_proj_b.weight"), self.W(p + "in_proj_a.weight"),
                          self.W(p + "in_proj_m.weight")], 0)
        x = torch.cat([xc, xn], 0)                                     # [2N, T, H]
        proj = x @ Wall.T
        u, z, b, a, m = torch.split(proj, [C, Hv * dv, Hv, Hv, Hv], dim=-1)
        # conv: tails from the clean stream, lookahead inside the block only
        ucp = F.pad(u[:N], (0, 0, K - 1, 0))                           # [N, T+K-1, C]
        idx = (torch.arange(nb) * B)[:, None] + torch.arange(K - 1)[None, :]   # [nb, K-1]
        tails = ucp[:, idx]                                            # [N, nb, K-1, C]
        tails = torch.cat([tails, tails], 0)
        ub = u.reshape(2 * N, nb, B, C)
        U = torch.cat([tails, ub, u.new_zeros(2 * N, nb, R, C)], dim=2)   # [2N, nb, K-1+B+R, C]
        wc = self.W(p + "conv1d.weight")[:, 0, :]
        conv = sum(wc[:, j] * U[:, :, j:j + B] for j in range(K))
        if R:
            wl = self.W(p + "conv1d_lookahead.weight")[:, 0, :]
            conv = conv + sum(wl[:, j] * U[:, :, K + j:K + j + B] for j in range(R))
        cs = F.silu(conv)                                              # [2N, nb, B, C]
        q = l2_norm(cs[..., :Hk * dk].reshape(2 * N, nb, B, Hk, dk))
        k = l2_norm(cs[..., Hk * dk:2 * Hk * dk].reshape(2 * N, nb, B, Hk, dk))
        v = cs[..., 2 * Hk * dk:].reshape(2 * N, nb, B, Hv, dv)
        q = q.repeat_interleave(r, dim=3).transpose(2, 3)              # [2N, nb, Hv, B, dk]
        k = k.repeat_interleave(r, dim=3).transpose(2, 3)
        v = v.transpose(2, 3)                                          # [2N, nb, Hv, B, dv]
        # clean-stream states at every block start (chunked gated delta rule)
        bc = b[:N].reshape(N, nb, B, Hv).transpose(2, 3)               # [N, nb, Hv, B]
        ac = a[:N].reshape(N, nb, B, Hv).transpose(2, 3)
        beta = torch.sigmoid(bc)
        g = -torch.exp(self.W(p + "A_log"))[:, None] * F.softplus(ac + self.W(p + "dt_bias")[:, None])
        G = torch.cumsum(g, dim=-1)                                    # [N, nb, Hv, B]
        kc, vc = k[:N], v[:N]
        lower = torch.ones(B, B, dtype=torch.bool, device=x.device).tril(-1)
        dG = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf"))
        A = beta[..., None] * torch.exp(dG) * (kc @ kc.transpose(-1, -2))
        IA = A + torch.eye(B, dtype=x.dtype, device=x.device)
        rhs = torch.cat([beta[..., None] * torch.exp(G)[..., None] * kc, beta[..., None] * vc], -1)
        sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
        Wm, Um = sol[..., :dk], sol[..., dk:]                          # [N, nb, Hv, B, dk|dv]
        gN = torch.exp(G[..., -1])                                     # [N, nb, Hv]
        Kd = kc * torch.exp(G[..., -1:] - G)[..., None]                # [N, nb, Hv, B, dk]
        S = x.new_zeros(N, Hv, dk, dv)
        states = [S]
        for blk in range(nb - 1 if trace is None else nb):
            Delta = Um[:, blk] - Wm[:, blk] @ S
            S = gN[:, blk, :, None, None] * S + Kd[:, blk].transpose(-1, -2) @ Delta
            states.append(S)
        if trace is not None:
            trace.setdefault("states", {})[i] = torch.stack(states, 1)  # [N, nb+1, Hv, dk, dv]
            trace.setdefault("conv_tail", {})[i] = ucp[:, T:]           # last K-1 clean rows
            states = states[:nb]
        Sst = torch.stack(states, 1)                                   # [N, nb, Hv, dk, dv]
        Sst = torch.cat([Sst, Sst], 0)
        o_mem = (q @ Sst) / math.sqrt(dk)                              # [2N, nb, Hv, B, dv]
        calib = self.W(p + "block_calib")
        tau = torch.exp(calib[0] + calib[1] * math.log(B / c.block_size))   # [Hv]
        att = torch.softmax(tau[:, None, None] * (q @ k.transpose(-1, -2)), dim=-1)
        o_blk = att @ v
        lam = torch.sigmoid(m.reshape(2 * N, nb, B, Hv).transpose(2, 3))[..., None]
        o = lam * o_mem + (1.0 - lam) * o_blk                          # [2N, nb, Hv, B, dv]
        o = o.transpose(2, 3).reshape(2 * N, T, Hv, dv)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        y = self.W(p + "norm.weight") * o * F.silu(z.reshape(2 * N, T, Hv, dv))
        out = y.reshape(2 * N, T, Hv * dv) @ self.W(p + "out_proj.weight").T
        return out[:N], out[N:]

    def _attn(self, i: int, xc: torch.Tensor, xn: torch.Tensor, B: int, trace: dict | None):
        c, p = self.cfg, f"model.layers.{i}.self_attn."
        N, T, H = xc.shape
        nh, nkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = torch.cat([xc, xn], 0)
        qf = (x @ self.W(p + "q_proj.weight").T).reshape(2 * N, T, nh, 2 * dh)
        q, gate = qf[..., :dh], qf[..., dh:]
        k = (x @ self.W(p + "k_proj.weight").T).reshape(2 * N, T, nkv, dh)
        v = (x @ self.W(p + "v_proj.weight").T).reshape(2 * N, T, nkv, dh)
        pos = torch.arange(T, device=x.device)
        q = rope_neox(rms_norm_1p(q, self.W(p + "q_norm.weight"), c.rms_norm_eps).transpose(1, 2),
                      pos, c.rotary_dim, c.rope_theta)                 # [2N, nh, T, dh]
        k = rope_neox(rms_norm_1p(k, self.W(p + "k_norm.weight"), c.rms_norm_eps).transpose(1, 2),
                      pos, c.rotary_dim, c.rope_theta)                 # [2N, nkv, T, dh]
        v = v.transpose(1, 2)
        if trace is not None:
            trace.setdefault("keys", {})[i] = k[:N]
            trace.setdefault("values", {})[i] = v[:N]
        # queries [clean; noisy], keys [clean; noisy] along the time axis
        Q = torch.cat([q[:N], q[N:]], 2)                               # [N, nh, 2T, dh]
        Kk = torch.cat([k[:N], k[N:]], 2).repeat_interleave(nh // nkv, dim=1)
        Vv = torch.cat([v[:N], v[N:]], 2).repeat_interleave(nh // nkv, dim=1)
        blk = torch.arange(T, device=x.device) // B
        bq, bk = blk[:, None], blk[None, :]
        mask = torch.cat([torch.cat([bk <= bq, torch.zeros(T, T, dtype=torch.bool)], 1),
                          torch.cat([bk < bq, bk == bq], 1)], 0)       # [2T, 2T], True = attend
        o = F.scaled_dot_product_attention(Q, Kk, Vv, attn_mask=mask, scale=1.0 / math.sqrt(dh))
        o = torch.cat([o[:, :, :T], o[:, :, T:]], 0).transpose(1, 2)   # [2N, T, nh, dh]
        o = o * torch.sigmoid(gate)
        out = o.reshape(2 * N, T, nh * dh) @ self.W(p + "o_proj.weight").T
        return out[:N], out[N:]

    def forward_train(self, clean: torch.Tensor, noisy: torch.Tensor, B: int,
                      trace: dict | None = None, select: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """clean, noisy [N, T] token ids (T a multiple of B) -> (noisy logits [N, T, V], aux loss).

        With ``select`` (bool [N, T]) the logits are computed only there: [n_selected, V].

        ``trace`` (a dict) receives the clean memory: states[i] [N, nb+1, Hv, dk, dv] (the
        GDN state before each block and after the last), conv_tail[i], keys[i]/values[i]."""
        c = self.cfg
        N, T = clean.shape
        if T % B:
            raise ValueError(f"T={T} is not a multiple of B={B}")
        emb = self.W("model.embed_tokens.weight")
        hc, hn = emb[clean], emb[noisy]
        aux = hc.new_zeros(())
        L = c.num_hidden_layers
        for i, lt in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            last = i == L - 1 and trace is None
            w_in = self.W(p + "input_layernorm.weight")
            xc, xn = rms_norm_1p(hc, w_in, c.rms_norm_eps), rms_norm_1p(hn, w_in, c.rms_norm_eps)
            mix = self._gdn if lt == LINEAR else self._attn
            mc, mn = mix(i, xc, xn, B, trace)
            w_post = self.W(p + "post_attention_layernorm.weight")
            if last:   # the clean stream of the last layer feeds nothing
                hn = hn + mn
                y, a = self._moe(i, rms_norm_1p(hn, w_post, c.rms_norm_eps).reshape(N * T, -1))
                hn = hn + y.reshape(N, T, -1)
            else:
                h = torch.cat([hc + mc, hn + mn], 0)
                y, a = self._moe(i, rms_norm_1p(h, w_post, c.rms_norm_eps).reshape(2 * N * T, -1))
                h = h + y.reshape(2 * N, T, -1)
                hc, hn = h[:N], h[N:]
            aux = aux + a
        head = emb if self.tied else self.W("lm_head.weight")
        if select is not None:
            hn = hn[select]
        logits = rms_norm_1p(hn, self.W("model.norm.weight"), c.rms_norm_eps) @ head.T
        return logits, aux / L

