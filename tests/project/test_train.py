"""Training code (spec v2: causal clean stream, shifted decode blocks): torch forward == a
token-by-token loop (and the numpy reference), masks and losses, resume, export (needs torch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # train/ is not installed

torch = pytest.importorskip("torch")

from clover_testkit.reference import CloverConfig, CloverReference  # noqa: E402
from train.model import CloverTorch  # noqa: E402
from train import train as tr  # noqa: E402


def tiny_cfg(**kw) -> CloverConfig:
    d = dict(vocab_size=50, hidden_size=16, num_hidden_layers=3, full_attention_interval=2,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, linear_conv_lookahead=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5,
             rope_theta=10000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
             shared_expert_intermediate_size=8, block_size=4, mask_token_id=49, eos_token_id=48)
    d.update(kw)
    return CloverConfig.from_dict(d)


def random_model(cfg: CloverConfig, seed: int = 0) -> CloverTorch:
    m = CloverTorch(cfg, seed=seed).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # bigger than the training init so that every path matters
        for name, p in m.p.items():
            if "A_log" in name or "dt_bias" in name:
                continue
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return m


# ---------------------------------------------------------------- the oracle: spec v2, token by token
def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rmsnorm1p(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _rope(x, pos, rot, theta):
    """x [n, dh] at positions pos [n] (NeoX rotate_half on the first rot dims)."""
    half = rot // 2
    out = x.copy()
    for t, ps in enumerate(pos):
        for d in range(half):
            ang = ps * theta ** (-2.0 * d / rot)
            x1, x2 = x[t, d], x[t, d + half]
            out[t, d] = x1 * np.cos(ang) - x2 * np.sin(ang)
            out[t, d + half] = x2 * np.cos(ang) + x1 * np.sin(ang)
    return out


class SlowClover:
    """A plain float64 loop over spec v2: memory = per GDN layer (S, conv tail), per attention
    layer the committed K, V; `step` runs n canvas tokens against it (block size Bsz) and,
    with commit, absorbs them one by one. Independent of train/model.py's chunked algebra."""

    def __init__(self, cfg, weights):
        self.c, self.w = cfg, {k: np.asarray(v, np.float64) for k, v in weights.items()}

    def new_memory(self):
        c, mem = self.c, {"n": 0}
        for i, lt in enumerate(c.layer_types):
            if lt == "linear_attention":
                mem[i] = [np.zeros((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)),
                          np.zeros((c.linear_conv_kernel_dim - 1, c.conv_dim))]
            else:
                mem[i] = [np.zeros((0, c.num_key_value_heads, c.head_dim)),
                          np.zeros((0, c.num_key_value_heads, c.head_dim))]
        return mem

    def _gdn(self, i, x, mem, Bsz, commit):
        c, w, p = self.c, self.w, f"model.layers.{i}.linear_attn."
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        K, R, n = c.linear_conv_kernel_dim, c.linear_conv_lookahead, len(x)
        S, tail = mem[i]
        u = x @ w[p + "in_proj_qkv.weight"].T
        z = x @ w[p + "in_proj_z.weight"].T
        bl, al, ml = (x @ w[p + f"in_proj_{s}.weight"].T for s in "bam")
        U = np.concatenate([tail, u, np.zeros((R, u.shape[1]))])
        wc = w[p + "conv1d.weight"][:, 0]
        cv = np.zeros_like(u)
        for t in range(n):
            for j in range(K):
                cv[t] += wc[:, j] * U[t + j]
            for j in range(R):
                cv[t] += w[p + "conv1d_lookahead.weight"][:, 0, j] * U[K - 1 + t + 1 + j]
        cv = _silu(cv)
        q = _l2(cv[:, :Hk * dk].reshape(n, Hk, dk))
        k = _l2(cv[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk))
        v = cv[:, 2 * Hk * dk:].reshape(n, Hv, dv)
        tau = np.exp(w[p + "block_calib"][0] + w[p + "block_calib"][1] * np.log(Bsz / c.block_size))
        y = np.zeros((n, Hv, dv))
        for t in range(n):
            for j in range(Hv):
                kh = j // (Hv // Hk)
                o_mem = S[j].T @ q[t, kh] / np.sqrt(dk)
                sc = np.array([tau[j] * q[t, kh] @ k[s, kh] for s in range(n)])
                e = np.exp(sc - sc.max())
                o_blk = (e / e.sum()) @ v[:, j]
                lam = 1.0 / (1.0 + np.exp(-ml[t, j]))
                o = lam * o_mem + (1 - lam) * o_blk
                o = o / np.sqrt((o * o).mean() + c.rms_norm_eps)
                y[t, j] = w[p + "norm.weight"] * o * _silu(z[t, j * dv:(j + 1) * dv])
        if commit:
            S = S.copy()
            for t in range(n):
                for j in range(Hv):
                    kh = j // (Hv // Hk)
                    beta = 1.0 / (1.0 + np.exp(-bl[t, j]))
                    g = -np.exp(w[p + "A_log"][j]) * np.log1p(np.exp(al[t, j] + w[p + "dt_bias"][j]))
                    S[j] = np.exp(g) * S[j]
                    S[j] = S[j] + np.outer(k[t, kh], beta * (v[t, j] - S[j].T @ k[t, kh]))
            mem[i] = [S, np.concatenate([tail, u])[-(K - 1):]]
        return y.reshape(n, Hv * dv) @ w[p + "out_proj.weight"].T

    def _attn(self, i, x, mem, commit):
        c, w, p = self.c, self.w, f"model.layers.{i}.self_attn."
        nh, nkv, dh, n = c.num_attention_heads, c.num_key_value_heads, c.head_dim, len(x)
        qf = (x @ w[p + "q_proj.weight"].T).reshape(n, nh, 2 * dh)
        k = (x @ w[p + "k_proj.weight"].T).reshape(n, nkv, dh)
        v = (x @ w[p + "v_proj.weight"].T).reshape(n, nkv, dh)
        pos = mem["n"] + np.arange(n)
        q = _rmsnorm1p(qf[..., :dh], w[p + "q_norm.weight"], c.rms_norm_eps)
        k = _rmsnorm1p(k, w[p + "k_norm.weight"], c.rms_norm_eps)
        q = np.stack([_rope(q[:, h], pos, c.rotary_dim, c.rope_theta) for h in range(nh)], 1)
        k = np.stack([_rope(k[:, h], pos, c.rotary_dim, c.rope_theta) for h in range(nkv)], 1)
        Kc, Vc = np.concatenate([mem[i][0], k]), np.concatenate([mem[i][1], v])
        out = np.zeros((n, nh, dh))
        for t in range(n):
            for h in range(nh):
                sc = Kc[:, h // (nh // nkv)] @ q[t, h] / np.sqrt(dh)
                e = np.exp(sc - sc.max())
                out[t, h] = (e / e.sum()) @ Vc[:, h // (nh // nkv)]
        out = out / (1.0 + np.exp(-qf[..., dh:]))
        if commit:
            mem[i] = [Kc, Vc]
        return out.reshape(n, nh * dh) @ w[p + "o_proj.weight"].T

    def _moe(self, i, x):
        c, w, p = self.c, self.w, f"model.layers.{i}.mlp."
        out = np.zeros_like(x)
        for t in range(len(x)):
            lg = w[p + "gate.weight"] @ x[t]
            pr = np.exp(lg - lg.max())
            pr /= pr.sum()
            top = np.argsort(-pr, kind="stable")[:c.num_experts_per_tok]
            wt = pr[top] / (pr[top].sum() if c.norm_topk_prob else 1.0)
            for e, we in zip(top, wt):
                h = _silu(w[p + f"experts.{e}.gate_proj.weight"] @ x[t]) * (w[p + f"experts.{e}.up_proj.weight"] @ x[t])
                out[t] += we * (w[p + f"experts.{e}.down_proj.weight"] @ h)
            hs = _silu(w[p + "shared_expert.gate_proj.weight"] @ x[t]) * (w[p + "shared_expert.up_proj.weight"] @ x[t])
            sg = 1.0 / (1.0 + np.exp(-(w[p + "shared_expert_gate.weight"] @ x[t])))
            out[t] += sg * (w[p + "shared_expert.down_proj.weight"] @ hs)
        return out

    def step(self, mem, tokens, Bsz, commit):
        """Logits [n, V] of the n tokens run as one block of size Bsz; commit: absorb them."""
        c, w = self.c, self.w
        h = w["model.embed_tokens.weight"][np.asarray(tokens)]
        for i, lt in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            x = _rmsnorm1p(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            h = h + (self._gdn(i, x, mem, Bsz, commit) if lt == "linear_attention" else self._attn(i, x, mem, commit))
            h = h + self._moe(i, _rmsnorm1p(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps))
        if commit:
            mem["n"] += len(tokens)
        head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
        return _rmsnorm1p(h, w["model.norm.weight"], c.rms_norm_eps) @ head.T

    def training_logits(self, clean, noisy, B, o):
        """(clean logits [T, V]: each token committed as a block of one; noisy logits [(nb-1)B, V]:
        the block passes of noisy[o+bB : o+(b+1)B] against the memory of clean[:o+bB])."""
        import copy
        T = len(clean)
        mem, cl, nl = self.new_memory(), [], []
        for t in range(T):
            if t >= o and (t - o) % B == 0 and t + B <= T:
                nl.append(self.step(copy.deepcopy(mem), noisy[t:t + B], B, commit=False))
            cl.append(self.step(mem, [clean[t]], 1, commit=True)[0])
        return np.stack(cl), np.concatenate(nl)


def _states_at_block_starts(slow, clean, B, o):
    """The oracle's GDN states S at every decode block start (after clean[:p])."""
    mem, out = slow.new_memory(), []
    for t in range(len(clean)):
        if t >= o and (t - o) % B == 0 and t + B <= len(clean):
            out.append({i: m[0].copy() for i, m in mem.items() if i != "n" and m[0].ndim == 3})
        slow.step(mem, [clean[t]], 1, commit=True)
    return out, mem


@pytest.mark.parametrize("B,o", [(4, 1), (4, 4), (4, 3), (3, 2), (8, 5), (2, 1)])
def test_forward_matches_token_by_token_loop(B, o):
    """forward_train (chunked delta rule, one batched pass) == a plain loop over spec v2:
    every clean token committed as a block of one, every decode block passed against the
    memory of the clean tokens before its start; float64, <= 1e-6 relative."""
    cfg = tiny_cfg()
    model = random_model(cfg)
    slow = SlowClover(cfg, {k: v.numpy() for k, v in model.hf_state_dict().items()})
    rng = np.random.default_rng(10 * B + o)
    N, T = 2, 3 * B if B > 2 else 8
    clean = rng.integers(0, 48, size=(N, T))
    noisy = np.where(rng.random((N, T)) < 0.5, cfg.mask_token_id, clean)
    trace: dict = {}
    with torch.no_grad():
        cl, nl, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), B, o, trace=trace)
    assert cl.shape == (N, T, cfg.vocab_size) and nl.shape == (N, (T // B - 1) * B, cfg.vocab_size)
    for n in range(N):
        want_c, want_n = slow.training_logits(clean[n], noisy[n], B, o)
        scale = np.abs(want_c).max()
        np.testing.assert_allclose(cl[n].numpy(), want_c, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(nl[n].numpy(), want_n, rtol=0, atol=1e-6 * scale)
        states, mem = _states_at_block_starts(slow, clean[n], B, o)
        for i, S in trace["states"].items():
            for b in range(len(states)):
                np.testing.assert_allclose(S[n, b].numpy(), states[b][i], rtol=0, atol=1e-9)
            np.testing.assert_allclose(trace["final_state"][i][n].numpy(), mem[i][0], rtol=0, atol=1e-9)
            np.testing.assert_allclose(trace["conv_tail"][i][n].numpy(), mem[i][1], rtol=0, atol=1e-12)


def test_forward_is_causal():
    """Clean logits at t depend on clean[:t+1] only; a decode block's logits on its canvas and
    the clean tokens before its start only."""
    cfg = tiny_cfg()
    model = random_model(cfg)
    rng = np.random.default_rng(3)
    B, o, T = 4, 2, 12
    clean = rng.integers(0, 48, size=(1, T))
    noisy = np.where(rng.random((1, T)) < 0.5, cfg.mask_token_id, clean)
    cut = o + B          # the start of the second decode block
    clean2 = clean.copy()
    clean2[0, cut:] = rng.integers(0, 48, size=T - cut)
    noisy2 = noisy.copy()
    noisy2[0, cut:] = rng.integers(0, 48, size=T - cut)
    with torch.no_grad():
        c1, n1, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), B, o)
        c2, n2, _ = model.forward_train(torch.as_tensor(clean2), torch.as_tensor(noisy2), B, o)
    assert torch.allclose(c1[:, :cut], c2[:, :cut], rtol=0, atol=1e-12)
    assert not torch.allclose(c1[:, cut:], c2[:, cut:])
    assert torch.allclose(n1[:, :B], n2[:, :B], rtol=0, atol=1e-12)     # block 0: [o, o + B)
    # outside the decode blocks the noisy input is ignored
    noisy3 = noisy.copy()
    noisy3[0, :o] = cfg.mask_token_id
    with torch.no_grad():
        _, n3, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy3), B, o)
    assert torch.equal(n1, n3)


@pytest.mark.parametrize("B,o,canvas_ffn", [(4, 1, 0), (4, 4, 0), (3, 2, 0), (4, 2, 6)])
def test_forward_matches_reference(B, o, canvas_ffn):
    """forward_train == the numpy reference (commit is causal; block_pass against the memory),
    with a canvas FFN too (on the block passes' rows only)."""
    cfg = tiny_cfg(canvas_ffn_intermediate_size=canvas_ffn)
    model = random_model(cfg)
    ref = CloverReference(cfg, {k: v.numpy() for k, v in model.hf_state_dict().items()})
    rng = np.random.default_rng(B + o)
    N, T = 2, 3 * B
    clean = rng.integers(0, 48, size=(N, T))
    noisy = np.where(rng.random((N, T)) < 0.5, cfg.mask_token_id, clean)
    with torch.no_grad():
        cl, nl, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), B, o)
    for n in range(N):
        mem = ref.new_memory()
        got = ref.commit(mem, clean[n, :o])
        np.testing.assert_allclose(cl[n, :o].numpy(), got, rtol=1e-5, atol=1e-5)
        for b in range(T // B - 1):
            p = o + b * B
            np.testing.assert_allclose(nl[n, b * B:(b + 1) * B].numpy(), ref.block_pass(mem, noisy[n, p:p + B], B),
                                       rtol=1e-5, atol=1e-5)
            got = ref.commit(mem, clean[n, p:min(p + B, T)])
            np.testing.assert_allclose(cl[n, p:p + B].numpy(), got, rtol=1e-5, atol=1e-5)
        if o + (T // B - 1) * B < T:
            got = ref.commit(mem, clean[n, o + (T // B - 1) * B:])
            np.testing.assert_allclose(cl[n, o + (T // B - 1) * B:].numpy(), got, rtol=1e-5, atol=1e-5)


def test_hf_roundtrip_and_tied():
    cfg = tiny_cfg(tie_word_embeddings=True, linear_conv_lookahead=0)
    a, b = random_model(cfg, 1), CloverTorch(cfg, seed=5).double()
    b.load_hf(a.hf_state_dict())
    for k in a.p:
        assert torch.equal(a.p[k], b.p[k])
    assert "lm_head.weight" not in a.hf_state_dict()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in a.hf_state_dict()


def test_growing_the_canvas_ffn_keeps_every_output():
    """load_hf(grow_canvas_ffn=True): a canvas FFN of 6 fills the first columns of one of 10, the
    new columns start as no change, so causal and block-pass logits are those of the narrow model;
    without the flag the width mismatch is an error."""
    narrow = random_model(tiny_cfg(canvas_ffn_intermediate_size=6), 2)
    wide = CloverTorch(tiny_cfg(canvas_ffn_intermediate_size=10), seed=7).double()
    wide.load_hf(narrow.hf_state_dict(), grow_canvas_ffn=True)
    assert wide.W("model.layers.1.mlp.canvas_ffn.up_proj.weight").shape[0] == 10
    clean = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(3))
    noisy = clean.clone()
    noisy[:, 4:] = 49
    with torch.no_grad():
        c0, n0, _ = narrow.forward_train(clean, noisy, 4, 4)
        c1, n1, _ = wide.forward_train(clean, noisy, 4, 4)
    assert torch.equal(c0, c1)
    torch.testing.assert_close(n1, n0, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="canvas_ffn"):
        CloverTorch(tiny_cfg(canvas_ffn_intermediate_size=10)).double().load_hf(narrow.hf_state_dict())


def test_masks_on_shifted_blocks():
    cfg = tiny_cfg()
    rng = np.random.default_rng(0)
    B, T = 4, 16
    for o in range(1, B + 1):
        clean = rng.integers(0, 48, size=(3, T))
        noisy, masked = tr.mask_blocks(clean, B, o, cfg.mask_token_id, rng, t_min=0.05)
        assert np.array_equal(noisy[~masked], clean[~masked])
        assert np.all(noisy[masked] == cfg.mask_token_id)
        assert not masked[:, :o].any() and not masked[:, o + (T // B - 1) * B:].any()
        per_block = masked[:, o:o + (T // B - 1) * B].reshape(3, T // B - 1, B).sum(-1)
        assert per_block.min() >= 1


def test_diffusion_loss_on_masked_positions_after_the_block_start():
    """The diffusion loss reads the noisy logits at q - 1 for exactly the masked q > p
    (p = the block start), against clean[q]; no other logits reach it."""
    cfg = tiny_cfg()
    B, o, T = 4, 3, 16
    masked = np.zeros((2, T), dtype=bool)
    masked[0, [3, 4, 6, 7, 11]] = True      # blocks start at 3, 7, 11: 3, 7 and 11 are block starts
    masked[1, [5, 9, 10, 14]] = True
    sel = tr.diffusion_select(masked, B, o)
    assert np.nonzero(sel[0])[0].tolist() == [3, 5]
    assert np.nonzero(sel[1])[0].tolist() == [4, 8, 9, 13]
    rng = np.random.default_rng(1)
    clean = rng.integers(0, 48, size=(2, T))
    noisy = np.where(masked, cfg.mask_token_id, clean)
    model = random_model(cfg)
    ct = torch.as_tensor(clean)
    _, full, _ = model.forward_train(ct, torch.as_tensor(noisy), B, o)
    full = full.detach().requires_grad_(True)           # [2, (nb-1)B, V] for positions o..
    want = -np.mean([float(torch.log_softmax(full.detach()[n, q - 1 - o], -1)[clean[n, q]])
                     for n, qs in ((0, [4, 6]), (1, [5, 9, 10, 14])) for q in qs])
    picked = full[torch.as_tensor(sel[:, o:o + full.shape[1]])]
    loss = tr.masked_loss(picked, ct, torch.as_tensor(sel))
    assert loss.item() == pytest.approx(want, rel=1e-6)   # the loss is taken in float32
    loss.backward()
    keep = torch.as_tensor(sel[:, o:o + full.shape[1]])
    assert torch.all(full.grad[~keep] == 0) and torch.all(full.grad[keep].abs().sum(-1) > 0)
    # select= gives the same rows as the full logits
    with torch.no_grad():
        _, part, _ = model.forward_train(ct, torch.as_tensor(noisy), B, o, select=torch.as_tensor(sel))
    assert torch.allclose(part, full.detach()[keep])
    # the AR loss: logits at t against clean[t + 1], every position but the last
    cl = torch.randn(2, T, cfg.vocab_size, dtype=torch.float64)
    want_ar = -np.mean([float(torch.log_softmax(cl[n, t], -1)[clean[n, t + 1]]) for n in range(2) for t in range(T - 1)])
    assert tr.ar_loss(cl, ct).item() == pytest.approx(want_ar, rel=1e-6)


def toy_run_args(tmp_path, seed: int) -> list[str]:
    """A random-token data folder and the train.train arguments of a tiny run on it."""
    tokens = np.random.default_rng(seed).integers(0, 48, size=4000).astype(np.int16)
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "train.npy", tokens)
    np.save(data / "heldout.npy", tokens[:400])
    return ["--data", str(data), "--preset", "test", "--batch", "2", "--seq-len", "16",
            "--block-sizes", "4:0.5,8:0.5", "--eval-every", "0", "--warmup", "2"]


def test_resume_matches_uninterrupted(tmp_path):
    common = toy_run_args(tmp_path, 0) + ["--seed", "3"]
    full = tr.main(common + ["--out", str(tmp_path / "a"), "--steps", "6"])
    tr.main(common + ["--out", str(tmp_path / "b"), "--steps", "6", "--stop-after", "3"])
    rest = tr.main(common + ["--out", str(tmp_path / "b"), "--steps", "6", "--resume"])
    assert len(full) == 6 and len(rest) == 3
    np.testing.assert_array_equal(np.array(full[3:]), np.array(rest))


def test_second_stage_and_check_repro(tmp_path, capsys):
    from train import check_repro

    common = toy_run_args(tmp_path, 1)
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    tr.main(common + ["--out", str(s1), "--steps", "4", "--seed", "0"])
    second = tr.main(common + ["--out", str(s2), "--steps", "4", "--seed", "1", "--init-from", str(s1 / "ckpt.pt")])
    fresh = tr.main(common + ["--out", str(tmp_path / "s3"), "--steps", "4", "--seed", "1"])
    assert second != fresh            # the second stage starts from the first stage's weights
    assert check_repro.main(["--run", str(s2), "--steps", "3"]) == 0
    assert "3/3 logged losses identical" in capsys.readouterr().out
    log = (s2 / "log.csv").read_text().splitlines()      # a wrong log must be caught
    cells = log[2].split(",")
    cells[5] = "9.9999"
    log[2] = ",".join(cells)
    (s2 / "log.csv").write_text("\n".join(log) + "\n")
    assert check_repro.main(["--run", str(s2), "--steps", "3"]) == 1


def test_export_and_init_hf(tmp_path):
    """train.export writes a spec v2 checkpoint folder (config.json marks "clover_semantics":
    "causal-shift") that loads back to the run's weights (bf16 matrices); --init-hf starts a
    run from such a folder."""
    import json

    from clover_convert.safetensors_io import CheckpointReader
    from train import export

    common = toy_run_args(tmp_path, 2)
    data = tmp_path / "data"
    (data / "meta.json").write_text(json.dumps({
        "python": "3", "exclude_dirs": [], "heldout_files": ["x.py"], "vocab_size": 50,
        "train": {"files": 1, "tokens": 4000, "bytes": 1}, "heldout": {"files": 1, "tokens": 400, "bytes": 1}}))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    s1, hf = tmp_path / "s1", tmp_path / "hf"
    tr.main(common + ["--out", str(s1), "--steps", "3", "--eval-every", "2"])
    export.main(["--run", str(s1), "--data", str(data), "--out", str(hf), "--tokenizer-from", str(tok),
                 "--card-extra", ""])
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["clover_semantics"] == "causal-shift" and cfg["vocab_size"] == 50
    assert (hf / "tokenizer.json").read_text() == "{}" and (hf / "loss.png").is_file()
    assert "Held-out next-token (AR) loss of the causal stream: **" in (hf / "README.md").read_text()
    model, _ = export.load_run(s1)
    with CheckpointReader(hf) as rd:
        for name, t in model.hf_state_dict().items():
            np.testing.assert_allclose(rd.read_f32(name), t.numpy(), rtol=1e-2, atol=1e-6)
    from_hf = tr.main(common + ["--out", str(tmp_path / "a"), "--steps", "2", "--seed", "4", "--init-hf", str(hf)])
    from_ck = tr.main(common + ["--out", str(tmp_path / "b"), "--steps", "2", "--seed", "4",
                                "--init-from", str(s1 / "ckpt.pt")])
    fresh = tr.main(common + ["--out", str(tmp_path / "c"), "--steps", "2", "--seed", "4"])
    assert from_hf[0] == pytest.approx(from_ck[0], rel=1e-2) and from_hf[0] != pytest.approx(fresh[0], rel=1e-2)


def test_certainty_term_only_on_right_predictions():
    from train.distill import certainty_loss

    logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]], requires_grad=True)
    target = torch.tensor([0, 2, 1])            # right, wrong, tie (argmax 0: wrong)
    loss = certainty_loss(logits, target)
    p = torch.softmax(logits[0], -1)
    assert loss.item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
    loss.backward()
    assert logits.grad[1].abs().sum() == 0 and logits.grad[2].abs().sum() == 0
    assert logits.grad[0].abs().sum() > 0        # more confident on the right one
    assert certainty_loss(logits[1:], target[1:]).item() == 0.0


def _distill_inputs(tmp_path):
    """(a tiny f32 checkpoint, a data folder of random tokens) for the distillation tests."""
    from clover_testkit.checkpoints import write_checkpoint

    init = tmp_path / "init"
    write_checkpoint(init, preset="tiny", dtype="f32")
    data = tmp_path / "data"
    data.mkdir()
    tokens = np.random.default_rng(0).integers(0, 60, size=3000).astype(np.int16)
    np.save(data / "train.npy", tokens)
    np.save(data / "heldout.npy", tokens[:600])
    return init, data


def _finetune_block_only(tmp_path, steps: int, *extra: str):
    """A --train-only block run of `steps` steps on the tiny fixture (plus extra arguments):
    (the init folder, its config, the starting model, the run's final state dict, the trajectories)."""
    from safetensors.torch import load_file

    from train import distill

    init, data = _distill_inputs(tmp_path)
    (tmp_path / "traj").mkdir()
    rows = np.random.default_rng(1).integers(0, 60, size=(4, distill.PROMPT_LEN + distill.NEW_TOKENS))
    np.save(tmp_path / "traj" / "traj.npy", rows.astype(np.int16))
    distill.finetune(distill.build_parser().parse_args(
        ["finetune", "--init", str(init), "--traj", str(tmp_path / "traj"), "--data", str(data),
         "--out", str(tmp_path / "run"), "--batch", "2", "--block-sizes", "8:0.5,16:0.5", "--eval-every", "0",
         "--warmup", "1", "--eval-windows", "2", "--threads", "1", "--steps", str(steps), "--lr", "1e-2",
         "--certainty", "1", "--train-only", "block", *extra]))
    cfg = CloverConfig.from_dict(json.loads((init / "config.json").read_text()))
    before = CloverTorch(cfg)
    before.load_hf({k: v.float() for k, v in load_file(str(init / "model.safetensors")).items()})
    after = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["model"]
    return init, cfg, before, after, rows


def test_distill_train_only_block_keeps_the_causal_path(tmp_path):
    """--train-only block: after a step every tensor the causal path reads is bit-identical
    (the embedding's real-token rows included) and the look-ahead taps have moved."""
    _, cfg, before, after, _ = _finetune_block_only(tmp_path, 2)
    moved = [k for k, w in before.state_dict().items() if not torch.equal(after[k], w)]
    real = torch.arange(cfg.vocab_size) != cfg.mask_token_id
    for key in moved:
        if key.endswith("embed_tokens__weight"):
            assert torch.equal(after[key][real], before.state_dict()[key][real])
        else:
            assert key.endswith(("conv1d_lookahead__weight", "block_calib")), key
    assert any(k.endswith("conv1d_lookahead__weight") for k in moved)


def test_distill_train_only_block_adds_a_canvas_ffn_and_keeps_the_causal_path(tmp_path):
    """--train-only block --canvas-ffn N: the run's model has a canvas FFN (its config says so,
    its export too), only block-only tensors move (the canvas FFN among them), and the causal
    stream's logits are bit-identical to the starting model's."""
    from safetensors.torch import load_file

    from train import distill

    init, cfg, before, after, rows = _finetune_block_only(tmp_path, 3, "--canvas-ffn", "12")
    moved = [k for k, w in after.items() if k not in before.state_dict() or not torch.equal(before.state_dict()[k], w)]
    assert any("canvas_ffn__down_proj" in k for k in moved)
    for key in moved:
        assert "canvas_ffn" in key or key.endswith(("conv1d_lookahead__weight", "block_calib", "embed_tokens__weight")), key
    distill.export_weights(tmp_path / "run", init, tmp_path / "export")
    out_cfg = CloverConfig.from_dict(json.loads((tmp_path / "export" / "config.json").read_text()))
    assert out_cfg.canvas_ffn_intermediate_size == 12
    assert "model.layers.0.mlp.canvas_ffn.down_proj.weight" in load_file(str(tmp_path / "export" / "model.safetensors"))
    trained = CloverTorch(out_cfg)
    trained.load_state_dict(after)
    clean = torch.as_tensor(rows[:2, :32].astype(np.int64))
    noisy = clean.clone()
    noisy[:, 8:] = cfg.mask_token_id
    with torch.no_grad():
        c0, n0, _ = before.forward_train(clean, noisy, 8, 8)
        c1, n1, _ = trained.forward_train(clean, noisy, 8, 8)
    assert torch.equal(c0, c1)                       # the causal path: bit-identical
    assert not torch.allclose(n0, n1)                # the block passes moved


@pytest.mark.needs_libclover
def test_distill_trajectories_and_finetune(tmp_path):
    """Trajectories are the native engine's own B = 1 greedy output; fine-tuning resumes to
    the same losses as an uninterrupted run."""
    from clover_cpp import Clover
    from train import distill

    init, data = _distill_inputs(tmp_path)
    traj = distill.trajectories(init, data, tmp_path / "traj", n_prompts=5, seed=1, threads=1)
    rows = np.load(traj)
    assert rows.shape == (5, distill.PROMPT_LEN + distill.NEW_TOKENS)
    with Clover(tmp_path / "traj" / "model-f32.gguf", n_ctx=512, n_threads=1, block_size=1) as m:
        r = m.generate(rows[2, :distill.PROMPT_LEN].tolist(), max_tokens=distill.NEW_TOKENS, stop_at_eos=False)
    assert r.tokens == rows[2, distill.PROMPT_LEN:].tolist()
    common = ["finetune", "--init", str(init), "--traj", str(tmp_path / "traj"), "--data", str(data),
              "--batch", "2", "--block-sizes", "8:0.5,16:0.5", "--eval-every", "0", "--warmup", "1",
              "--eval-windows", "2", "--threads", "1", "--steps", "4", "--seed", "7"]
    full = distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / "a")]))
    distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"]))
    rest = distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / "b"), "--resume"]))
    assert len(full) == 4 and len(rest) == 2
    np.testing.assert_array_equal(np.array(full[2:]), np.array(rest))


@pytest.mark.needs_libclover
def test_distill_on_policy_rounds(tmp_path):
    """--rounds 2: the second round trains on trajectories made from the weights at its first
    step (kept in the run folder); a run resumed at the round boundary makes the same ones and
    logs the same losses as an uninterrupted run."""
    from clover_cpp import Clover
    from train import distill

    init, data = _distill_inputs(tmp_path)
    distill.trajectories(init, data, tmp_path / "traj", n_prompts=3, seed=1, threads=1)
    common = ["finetune", "--init", str(init), "--traj", str(tmp_path / "traj"), "--data", str(data),
              "--batch", "2", "--block-sizes", "1:0.5,16:0.5", "--eval-every", "0", "--warmup", "1",
              "--eval-windows", "2", "--threads", "1", "--steps", "4", "--seed", "7", "--lr", "5e-3",
              "--rounds", "2", "--round-prompts", "3", "--traj-mask", "suffix", "--order", "1"]
    full = distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / "a")]))
    r1 = tmp_path / "a" / "round1"
    rows = np.load(r1 / "traj" / "traj.npy")
    assert rows.shape == (3, distill.PROMPT_LEN + distill.NEW_TOKENS)
    assert not np.array_equal(rows, np.load(tmp_path / "traj" / "traj.npy"))  # new prompts, new weights
    with Clover(r1 / "traj" / "model-f32.gguf", n_ctx=512, n_threads=1, block_size=1) as m:
        r = m.generate(rows[0, :distill.PROMPT_LEN].tolist(), max_tokens=distill.NEW_TOKENS, stop_at_eos=False)
    assert r.tokens == rows[0, distill.PROMPT_LEN:].tolist()
    distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"]))
    assert not (tmp_path / "b" / "round1").exists()
    rest = distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / "b"), "--resume"]))
    np.testing.assert_array_equal(np.load(tmp_path / "b" / "round1" / "traj" / "traj.npy"), rows)
    np.testing.assert_array_equal(np.array(full[2:]), np.array(rest))


def test_suffix_masks_are_block_suffixes():
    """--traj-mask suffix: in every decode block [o + bB, o + (b+1)B) the masked positions are
    its last n, 1 <= n <= B, every n occurs, and nothing outside the blocks is masked."""
    from train.distill import mask_suffix

    clean = np.arange(4 * 64).reshape(4, 64)
    o = 3
    noisy, masked = mask_suffix(clean, 8, o, -1, np.random.default_rng(0))
    assert not masked[:, :o].any() and not masked[:, o + 56:].any()
    blocks = masked[:, o:o + 56].reshape(4, 7, 8)
    n = blocks.sum(-1)
    assert n.min() >= 1 and n.max() <= 8 and len(set(n.ravel().tolist())) == 8
    for row, k in zip(blocks.reshape(-1, 8), n.ravel()):
        assert row.tolist() == [False] * (8 - k) + [True] * k
    assert np.array_equal(noisy == -1, masked) and np.array_equal(noisy[~masked], clean[~masked])


def test_order_term_only_on_wrong_later_positions_surer_than_the_first():
    """order_loss: zero when a later masked position is right, or less sure of its wrong
    candidate than the block's first masked position is of its target; else positive, and its
    gradient lowers that later confidence and raises the first position's target."""
    from train.distill import order_loss

    V = 5
    logits = torch.zeros(3, V)
    logits[0, 1] = 4.0            # first masked position: target 1, sure of it
    logits[1, 2] = 1.0            # later, wrong (target 3), not very sure
    logits[2, 4] = 2.0            # later, right
    target = torch.tensor([1, 3, 4])
    block_of, is_first = np.array([0, 0, 0]), np.array([True, False, False])
    assert order_loss(logits, target, block_of, is_first).item() == 0.0
    logits[0, 1] = 0.0            # the first is now unsure of its target: the wrong one counts
    logits.requires_grad_(True)
    loss = order_loss(logits, target, block_of, is_first)
    assert loss.item() > 0
    loss.backward()
    assert logits.grad[1, 2] > 0 and logits.grad[0, 1] < 0 and logits.grad[2].abs().sum() == 0
    assert order_loss(logits, target, np.array([-1, -1, -1]), is_first).item() == 0.0


@pytest.mark.needs_libclover
def test_fallback_replay_reproduces_the_native_decode(tiny_artifacts):
    """train.fallback_sim's replay with the spec's fallback gives the native decode's tokens
    and passes (so its leftmost variant differs from the native one only by that rule)."""
    from clover_cpp import Clover
    from train import fallback_sim

    prompt = np.random.default_rng(5).integers(0, 500, size=64).tolist()
    with Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1, block_size=1) as m1, \
            Clover(tiny_artifacts["f32"], n_ctx=512, n_threads=1, block_size=fallback_sim.B) as mb:
        base = m1.generate(prompt, max_tokens=40, block_size=1, stop_at_eos=False).tokens
        r = mb.generate(prompt, max_tokens=40, block_size=fallback_sim.B, threshold=fallback_sim.THRESHOLD,
                        stop_at_eos=False)
        out, passes = fallback_sim.decode(mb, prompt, base, False, [0, 0])
        assert out == r.tokens and passes == r.stats.n_decode_passes
        left, left_passes = fallback_sim.decode(mb, prompt, base, True, [0, 0])
        assert len(left) == 40 and (left, left_passes) != (out, passes)  # the rule matters on this model


def test_curriculum_grows_blocks_and_masks():
    """--curriculum: at the start only the smallest block size and masked share 0.05 may be
    drawn; from half-way on, every block size with its own probability and the full --t-min."""
    from train.distill import curriculum

    sizes, probs = [4, 8, 16, 32], [0.1, 0.2, 0.3, 0.4]
    assert curriculum(sizes, probs, 0.3, 0.0) == ([4], [1.0], 0.05)
    mid_sizes, mid_probs, mid_t = curriculum(sizes, probs, 0.3, 0.25)
    assert mid_sizes == [4, 8] and abs(sum(mid_probs) - 1) < 1e-12 and 0.05 < mid_t < 0.3
    late = curriculum(sizes, probs, 0.3, 0.5)
    assert late[0] == sizes and np.allclose(late[1], probs) and abs(late[2] - 0.3) < 1e-12
    assert curriculum(sizes, probs, 0.3, 1.0)[0] == sizes


@pytest.mark.needs_libclover
def test_distill_ar_rows_data_changes_only_the_causal_loss(tmp_path):
    """--ar-rows data: the causal loss of the first step is computed on the real-text rows only
    (a different number from --ar-rows all), the diffusion loss of that step is the same."""
    import csv

    from train import distill

    init, data = _distill_inputs(tmp_path)
    distill.trajectories(init, data, tmp_path / "traj", n_prompts=3, seed=1, threads=1)
    common = ["finetune", "--init", str(init), "--traj", str(tmp_path / "traj"), "--data", str(data),
              "--batch", "4", "--block-sizes", "8:0.5,16:0.5", "--eval-every", "0", "--warmup", "1",
              "--eval-windows", "2", "--threads", "1", "--steps", "1", "--seed", "7", "--curriculum"]
    for rows in ("all", "data"):
        distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / rows),
                                                                     "--ar-rows", rows]))
    first = {rows: list(csv.DictReader(open(tmp_path / rows / "log.csv")))[-1] for rows in ("all", "data")}
    assert first["all"]["ar_loss"] != first["data"]["ar_loss"]
    diff = {rows: float(r["loss"]) - float(r["ar_loss"]) for rows, r in first.items()}
    assert abs(diff["all"] - diff["data"]) < 1e-3


def test_whole_masks_are_drafts():
    """mask_whole (--draft-frac): every decode block is masked whole, nothing outside them."""
    from train.distill import mask_whole

    clean = np.arange(2 * 64).reshape(2, 64)
    noisy, masked = mask_whole(clean, 8, 5, -1)
    assert not masked[:, :5].any() and not masked[:, 5 + 56:].any() and masked[:, 5:5 + 56].all()
    assert np.array_equal(noisy == -1, masked) and np.array_equal(noisy[~masked], clean[~masked])


@pytest.mark.needs_libclover
def test_distill_draft_steps_and_kl_term(tmp_path):
    """--draft-frac 1: every step trains at --draft-block with the trajectory blocks masked whole;
    --kl adds a term with a gradient (the block-only weights move differently) and leaves the
    logged losses of the first step alone."""
    import csv

    from train import distill

    init, data = _distill_inputs(tmp_path)
    distill.trajectories(init, data, tmp_path / "traj", n_prompts=3, seed=1, threads=1)
    common = ["finetune", "--init", str(init), "--traj", str(tmp_path / "traj"), "--data", str(data),
              "--batch", "2", "--block-sizes", "16:1", "--eval-every", "0", "--warmup", "1",
              "--eval-windows", "2", "--threads", "1", "--steps", "2", "--seed", "7", "--lr", "5e-3",
              "--train-only", "block", "--draft-frac", "1", "--draft-block", "8"]
    for kl in ("0", "1"):
        distill.finetune(distill.build_parser().parse_args(common + ["--out", str(tmp_path / kl), "--kl", kl]))
    logs = {kl: list(csv.DictReader(open(tmp_path / kl / "log.csv")))[1:] for kl in ("0", "1")}
    assert [r["block_size"] for r in logs["0"]] == ["8", "8"]
    assert logs["0"][0]["loss"] == logs["1"][0]["loss"]
    s0, s1 = (torch.load(tmp_path / kl / "ckpt.pt", weights_only=False)["model"] for kl in ("0", "1"))
    assert any(not torch.equal(s0[n], s1[n]) for n in s0)


@pytest.mark.needs_libclover
def test_targets_draft_steps(tmp_path):
    """train.targets --draft-steps: a draft denoised by the threshold rule (S = 0) takes more forwards per
    verification than a one-pass draft can (a random model is never 0.9-sure of 7 positions at once)."""
    from train import targets

    init, data = _distill_inputs(tmp_path)
    np.save(data / "heldout_starts.npy", np.arange(0, 600, 70))
    res = targets.measure(init, data, threads=1, draft_steps=(1, 0))
    assert "draft_self_B8_S1_tok_per_verification" not in res  # S = 1: the plain keys

    def forwards_per_verification(key):
        return res[f"{key}_tok_per_verification"] / res[f"{key}_tok_per_forward"]

    # a one-pass draft costs at most two forwards (the verification, then the next draft's pass)
    assert forwards_per_verification("draft_self_B8") <= 2.01
    assert forwards_per_verification("draft_self_B8_S0") > 3.0
    assert 0 <= res["draft_self_B8_S0_same_as_B1"] <= 1  # (the f16 GGUF of random weights has near-ties)
