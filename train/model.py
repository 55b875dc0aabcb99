"""Clover forward in torch, for training (see spec/model.md).

Parameters carry the Hugging Face names and shapes of the spec, except that the experts of
a layer are stored in the spec's fused form (``mlp.experts.gate_up_proj [E, 2I, H]``, gate
half first, and ``mlp.experts.down_proj [E, H, I]``); ``hf_state_dict()`` gives the
per-expert names (``experts.j.{gate,up,down}_proj.weight``) and ``load_hf()`` takes either.

Training forward (``forward_train``, spec v2), vectorised over the batch and over blocks.
A window of T = nb*B tokens and an offset o (1 <= o <= B) run as two streams, layer by layer,
laid out [clean | noisy] along the time axis:

* clean stream: the whole window causally, every token a block of one (exactly what
  ``commit`` computes): GDN conv with causal taps only; memory read before the token is
  written, ``o_mem[t] = S_{t-1}^T q_t / sqrt(dk)``; the block softmax of a block of one is the
  token's own v; full attention plain causal. Its logits at t predict clean[t+1].
* noisy stream: the decode blocks [o + bB, o + (b+1)B), b = 0..nb-2; block b is a block pass
  of its canvas against the clean memory at its start p: the GDN state after the clean
  tokens < p, the conv tail = the K-1 clean pre-conv rows before p, and for full attention
  the clean keys < p plus the block's own keys (bidirectional inside). Lookahead conv taps
  stop at the block end; block calibration ``tau = exp(theta + phi ln(B / B0))``.

The clean GDN states come from the chunked gated delta rule with chunks aligned at o + kB
(B - o null steps in front, o at the end; beta = g = k = 0 there, so they change nothing).
Within a chunk with start state S0 and G the cumulative sum of g:
``Delta = (I + A)^-1 (beta v - beta e^G k S0)`` with ``A[t,s] = beta_t e^(G_t - G_s) k_t.k_s``
(s < t), ``S1 = e^G_n S0 + (k e^(G_n - G))^T Delta``, and the outputs read before the write
``S_{t-1}^T q_t = e^(G_{t-1}) q_t^T S0 + sum_{s<t} e^(G_{t-1} - G_s) (q_t.k_s) Delta_s``
(G_{-1} = 0 at the chunk start). tests/project/test_train.py checks all of it against a
token-by-token loop of the spec.
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
        if name.endswith("canvas_ffn.down_proj.weight"):
            return torch.zeros(shape)        # a new canvas FFN starts as no change to the block pass
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
    def load_hf(self, weights: dict[str, Any], grow_canvas_ffn: bool = False) -> None:
        """Copy HF-named weights (per-expert or fused experts) into the parameters. grow_canvas_ffn:
        a narrower canvas FFN fills the first columns of this model's wider one; the new columns
        keep their start (down_proj = 0), so the block pass is unchanged."""
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
            if ".canvas_ffn." in name and name not in w:
                continue   # a checkpoint from before the canvas FFN: it keeps its start (no change)
            src = w[name]
            if grow_canvas_ffn and ".canvas_ffn." in name and src.shape != prm.shape:
                width = 1 if name.endswith("down_proj.weight") else 0   # the Ic axis
                if src.shape[1 - width] == prm.shape[1 - width] and src.shape[width] < prm.shape[width]:
                    prm.narrow(width, 0, src.shape[width]).copy_(src.to(prm.dtype))
                    continue
            if tuple(src.shape) != tuple(prm.shape):
                raise ValueError(f"{name}: {tuple(src.shape)} != {tuple(prm.shape)}")
            prm.copy_(src.to(prm.dtype))

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
        shared = self._swiglu(p + "shared_expert.", x)
        out = out + torch.sigmoid(x @ self.W(p + "shared_expert_gate.weight").T) * shared
        frac = torch.zeros(E, dtype=x.dtype, device=x.device).index_add_(
            0, topi.reshape(-1), torch.ones(topi.numel(), dtype=x.dtype, device=x.device)) / topi.numel()
        aux = E * (frac.detach() * probs.mean(0)).sum()
        return out, aux

    def _swiglu(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x) of a dense FFN (prefix{gate,up,down}_proj.weight): the shared
        expert, and the canvas FFN on block-pass rows."""
        h = F.silu(x @ self.W(prefix + "gate_proj.weight").T) * (x @ self.W(prefix + "up_proj.weight").T)
        return h @ self.W(prefix + "down_proj.weight").T

    # ------------------------------------------------------------------ mixers
    # Both mixers take the clean stream xc [N, T, H] (positions 0..T-1, causal: every token a
    # block of one) and the noisy stream xn [N, M, H] (M = nbn*B canvas tokens, decode blocks
    # at positions [o + bB, o + (b+1)B), b < nbn) and return their outputs.
    def _gdn(self, i: int, xc: torch.Tensor, xn: torch.Tensor, B: int, o: int, trace: dict | None):
        c, p = self.cfg, f"model.layers.{i}.linear_attn."
        N, T, H = xc.shape
        M = xn.shape[1]
        nbn = M // B
        Hk, Hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                          c.linear_key_head_dim, c.linear_value_head_dim)
        r, C, K, R = Hv // Hk, c.conv_dim, c.linear_conv_kernel_dim, c.linear_conv_lookahead
        Wall = torch.cat([self.W(p + "in_proj_qkv.weight"), self.W(p + "in_proj_z.weight"),
                          self.W(p + "in_proj_b.weight"), self.W(p + "in_proj_a.weight"),
                          self.W(p + "in_proj_m.weight")], 0)
        proj = torch.cat([xc, xn], 1) @ Wall.T                         # [N, T+M, .]
        u, z, b, a, m = torch.split(proj, [C, Hv * dv, Hv, Hv, Hv], dim=-1)
        uc, un = u[:, :T], u[:, T:]
        wc = self.W(p + "conv1d.weight")[:, 0, :]
        # clean conv: causal taps only (zeros before position 0)
        ucp = F.pad(uc, (0, 0, K - 1, 0))                              # [N, T+K-1, C]
        conv_c = sum(wc[:, j] * ucp[:, j:j + T] for j in range(K))
        # noisy conv: tail = the K-1 clean rows before the block start, lookahead inside the block
        starts = o + torch.arange(nbn) * B
        tails = ucp[:, starts[:, None] + torch.arange(K - 1)[None, :]]  # [N, nbn, K-1, C]
        U = torch.cat([tails, un.reshape(N, nbn, B, C), un.new_zeros(N, nbn, R, C)], dim=2)
        conv_n = sum(wc[:, j] * U[:, :, j:j + B] for j in range(K))
        if R:
            wl = self.W(p + "conv1d_lookahead.weight")[:, 0, :]
            conv_n = conv_n + sum(wl[:, j] * U[:, :, K + j:K + j + B] for j in range(R))

        def qkv(cs: torch.Tensor):
            sh = cs.shape[:-1]
            q = l2_norm(cs[..., :Hk * dk].reshape(*sh, Hk, dk)).repeat_interleave(r, dim=-2)
            k = l2_norm(cs[..., Hk * dk:2 * Hk * dk].reshape(*sh, Hk, dk)).repeat_interleave(r, dim=-2)
            v = cs[..., 2 * Hk * dk:].reshape(*sh, Hv, dv)
            return q, k, v

        # ---- clean stream: sequential gated delta rule, chunked with chunks aligned at o + kB
        qc, kc, vc = qkv(F.silu(conv_c))                               # [N, T, Hv, d]
        beta = torch.sigmoid(b[:, :T])                                 # [N, T, Hv]
        g = -torch.exp(self.W(p + "A_log")) * F.softplus(a[:, :T] + self.W(p + "dt_bias"))
        P0 = B - o                                                     # null steps in front
        nc = (T + B) // B                                              # chunks (o null steps at the end)
        padT = lambda x: F.pad(x, (0, 0) * (x.dim() - 2) + (P0, o))  # noqa: E731  pads dim 1

        def chunks(x):   # [N, T, Hv, ...] -> [N, Hv, nc, B, ...]
            x = padT(x)
            x = x.reshape(N, nc, B, *x.shape[2:]).transpose(1, 3).transpose(2, 3)
            return x
        qh, kh, vh = chunks(qc), chunks(kc), chunks(vc)                # [N, Hv, nc, B, d]
        be, gg = chunks(beta), chunks(g)                               # [N, Hv, nc, B]
        G = torch.cumsum(gg, dim=-1)
        Gp = G - gg                                                    # G_{t-1}, 0 at the chunk start
        strict = torch.ones(B, B, dtype=torch.bool, device=xc.device).tril(-1)
        dG = (G[..., :, None] - G[..., None, :]).masked_fill(~strict, float("-inf"))
        A = be[..., None] * torch.exp(dG) * (kh @ kh.transpose(-1, -2))
        IA = A + torch.eye(B, dtype=xc.dtype, device=xc.device)
        rhs = torch.cat([(be * torch.exp(G))[..., None] * kh, be[..., None] * vh], -1)
        sol = torch.linalg.solve_triangular(IA, rhs, upper=False, unitriangular=True)
        Wm, Um = sol[..., :dk], sol[..., dk:]                          # Delta = Um - Wm S0
        dGp = (Gp[..., :, None] - G[..., None, :]).masked_fill(~strict, float("-inf"))
        QK = torch.exp(dGp) * (qh @ kh.transpose(-1, -2))              # [N, Hv, nc, B, B], s < t
        gN = torch.exp(G[..., -1])                                     # [N, Hv, nc]
        Kd = kh * torch.exp(G[..., -1:] - G)[..., None]
        S = xc.new_zeros(N, Hv, dk, dv)
        states, deltas = [], []
        for ch in range(nc):
            states.append(S)
            D = Um[:, :, ch] - Wm[:, :, ch] @ S
            deltas.append(D)
            S = gN[:, :, ch, None, None] * S + Kd[:, :, ch].transpose(-1, -2) @ D
        Sst = torch.stack(states, 2)                                   # [N, Hv, nc, dk, dv]
        Dst = torch.stack(deltas, 2)                                   # [N, Hv, nc, B, dv]
        om = torch.exp(Gp)[..., None] * (qh @ Sst) + QK @ Dst          # o_mem * sqrt(dk)
        om = om.transpose(2, 3).transpose(1, 3).reshape(N, nc * B, Hv, dv)[:, P0:P0 + T]
        lam_c = torch.sigmoid(m[:, :T])[..., None]                     # [N, T, Hv, 1]
        o_c = lam_c * om / math.sqrt(dk) + (1.0 - lam_c) * vc          # block of one: o_blk = v
        if trace is not None:
            trace.setdefault("states", {})[i] = Sst[:, :, 1:1 + nbn].transpose(1, 2)  # [N, nbn, Hv, dk, dv]
            trace.setdefault("final_state", {})[i] = S
            trace.setdefault("conv_tail", {})[i] = ucp[:, T:]
        # ---- noisy stream: block passes against the clean memory at each block start
        qn, kn, vn = qkv(F.silu(conv_n))                               # [N, nbn, B, Hv, d]
        qn, kn, vn = qn.transpose(2, 3), kn.transpose(2, 3), vn.transpose(2, 3)   # [N, nbn, Hv, B, d]
        Sn = Sst[:, :, 1:1 + nbn].transpose(1, 2)                      # [N, nbn, Hv, dk, dv]
        om_n = (qn @ Sn) / math.sqrt(dk)
        calib = self.W(p + "block_calib")
        tau = torch.exp(calib[0] + calib[1] * math.log(B / c.block_size))   # [Hv]
        att = torch.softmax(tau[:, None, None] * (qn @ kn.transpose(-1, -2)), dim=-1)
        ob = att @ vn
        lam_n = torch.sigmoid(m[:, T:].reshape(N, nbn, B, Hv).transpose(2, 3))[..., None]
        o_n = (lam_n * om_n + (1.0 - lam_n) * ob).transpose(2, 3).reshape(N, M, Hv, dv)
        o_all = torch.cat([o_c, o_n], 1)                               # [N, T+M, Hv, dv]
        o_all = o_all * torch.rsqrt(o_all.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        y = self.W(p + "norm.weight") * o_all * F.silu(z.reshape(N, T + M, Hv, dv))
        out = y.reshape(N, T + M, Hv * dv) @ self.W(p + "out_proj.weight").T
        return out[:, :T], out[:, T:]

    def _attn(self, i: int, xc: torch.Tensor, xn: torch.Tensor, B: int, o: int, trace: dict | None):
        c, p = self.cfg, f"model.layers.{i}.self_attn."
        N, T, H = xc.shape
        M = xn.shape[1]
        nh, nkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = torch.cat([xc, xn], 1)                                     # [N, T+M, H]
        qf = (x @ self.W(p + "q_proj.weight").T).reshape(N, T + M, nh, 2 * dh)
        q, gate = qf[..., :dh], qf[..., dh:]
        k = (x @ self.W(p + "k_proj.weight").T).reshape(N, T + M, nkv, dh)
        v = (x @ self.W(p + "v_proj.weight").T).reshape(N, T + M, nkv, dh)
        pos = torch.cat([torch.arange(T), o + torch.arange(M)]).to(x.device)
        q = rope_neox(rms_norm_1p(q, self.W(p + "q_norm.weight"), c.rms_norm_eps).transpose(1, 2),
                      pos, c.rotary_dim, c.rope_theta)                 # [N, nh, T+M, dh]
        k = rope_neox(rms_norm_1p(k, self.W(p + "k_norm.weight"), c.rms_norm_eps).transpose(1, 2),
                      pos, c.rotary_dim, c.rope_theta)                 # [N, nkv, T+M, dh]
        v = v.transpose(1, 2)
        if trace is not None:
            trace.setdefault("keys", {})[i] = k[:, :, :T]
            trace.setdefault("values", {})[i] = v[:, :, :T]
        rep = nh // nkv
        tc, tn = torch.arange(T), torch.arange(M)
        start = o + (tn // B) * B                                      # block start of each canvas token
        mask = torch.cat([torch.cat([tc[None, :] <= tc[:, None], torch.zeros(T, M, dtype=torch.bool)], 1),
                          torch.cat([tc[None, :] < start[:, None], (tn[None, :] // B) == (tn[:, None] // B)], 1)],
                         0).to(x.device)                               # [T+M, T+M], True = attend
        o_ = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                            attn_mask=mask, scale=1.0 / math.sqrt(dh))
        o_ = o_.transpose(1, 2) * torch.sigmoid(gate)                  # [N, T+M, nh, dh]
        out = o_.reshape(N, T + M, nh * dh) @ self.W(p + "o_proj.weight").T
        return out[:, :T], out[:, T:]

    def forward_train(self, clean: torch.Tensor, noisy: torch.Tensor, B: int, offset: int,
                      trace: dict | None = None, select: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """clean, noisy [N, T] token ids (T = nb*B, nb >= 2; 1 <= offset <= B) ->
        (clean logits [N, T, V], noisy logits, aux loss).

        Clean logits at t: the causal (autoregressive) pass over clean[:t+1], predicting
        clean[t+1]. Noisy logits: block passes of the decode blocks [offset + bB, offset +
        (b+1)B), b = 0..nb-2, read from ``noisy`` at those positions (the rest of ``noisy`` is
        ignored), each against the clean memory of the positions before its start: [N, (nb-1)*B,
        V] for positions offset..offset+(nb-1)B-1, or, with ``select`` (bool [N, T] over absolute
        positions, False outside the blocks), [n_selected, V] in row-major order.

        ``trace`` (a dict) receives the clean memory: states[i] [N, nb-1, Hv, dk, dv] (the GDN
        state at each decode block start), final_state[i] (after all T tokens), conv_tail[i]
        (the last K-1 clean pre-conv rows), keys[i]/values[i] [N, nkv, T, dh]."""
        c = self.cfg
        N, T = clean.shape
        if T % B or T // B < 2:
            raise ValueError(f"T={T} must be a multiple of B={B}, at least 2 blocks")
        if not 1 <= offset <= B:
            raise ValueError(f"offset {offset} not in 1..{B}")
        M = (T // B - 1) * B
        emb = self.W("model.embed_tokens.weight")
        hc, hn = emb[clean], emb[noisy[:, offset:offset + M]]
        aux = hc.new_zeros(())
        L = c.num_hidden_layers
        for i, lt in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            w_in = self.W(p + "input_layernorm.weight")
            xc, xn = rms_norm_1p(hc, w_in, c.rms_norm_eps), rms_norm_1p(hn, w_in, c.rms_norm_eps)
            mix = self._gdn if lt == LINEAR else self._attn
            mc, mn = mix(i, xc, xn, B, offset, trace)
            w_post = self.W(p + "post_attention_layernorm.weight")
            h = torch.cat([hc + mc, hn + mn], 1)
            hpost = rms_norm_1p(h, w_post, c.rms_norm_eps)
            y, a = self._moe(i, hpost.reshape(N * (T + M), -1))
            h = h + y.reshape(N, T + M, -1)
            hc, hn = h[:, :T], h[:, T:]
            if c.canvas_ffn_intermediate_size:   # the canvas FFN: block-pass rows only
                hn = hn + self._swiglu(p + "mlp.canvas_ffn.", hpost[:, T:])
            aux = aux + a
        head = emb if self.tied else self.W("lm_head.weight")
        w_out = self.W("model.norm.weight")
        clean_logits = rms_norm_1p(hc, w_out, c.rms_norm_eps) @ head.T
        if select is not None:
            if select[:, :offset].any() or select[:, offset + M:].any():
                raise ValueError("select marks a position outside the decode blocks")
            hn = hn[select[:, offset:offset + M]]
        noisy_logits = rms_norm_1p(hn, w_out, c.rms_norm_eps) @ head.T
        return clean_logits, noisy_logits, aux / L
