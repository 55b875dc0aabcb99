"""Tests of the numpy reference (clover_testkit.reference) on a tiny random model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from clover_testkit.random_model import MASK, TINY, make_weights
from clover_testkit.reference import (CloverConfig, CloverReference, GenerateResult, Memory,
                                      bidirectional_conv, block_tau, causal_logits, generate, perplexity,
                                      rope_neox, ubatch_tokens)


@pytest.fixture(scope="module")
def cfg() -> CloverConfig:
    return CloverConfig.from_dict(TINY)


@pytest.fixture(scope="module")
def weights(cfg) -> dict[str, np.ndarray]:
    return make_weights(cfg)


@pytest.fixture(scope="module")
def model(cfg, weights) -> CloverReference:
    return CloverReference(cfg, weights)


def assert_mem_equal(a: Memory, b: Memory, tol: float = 0.0) -> None:
    assert a.n_committed == b.n_committed
    for d in ("state", "conv_tail", "keys", "values"):
        da, db = getattr(a, d), getattr(b, d)
        assert da.keys() == db.keys()
        for k in da:
            assert da[k].dtype == db[k].dtype == np.float64
            np.testing.assert_allclose(da[k], db[k], rtol=tol, atol=tol)


# ------------------------------------------------------------------------- config

def test_config_defaults_and_layer_types():
    from clover_testkit.presets import PRESETS

    c = CloverConfig.from_dict({**PRESETS["35b-a3b"], "mask_token_id": 0})
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_experts) == (248320, 2048, 40, 256)
    assert c.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert c.rotary_dim == 64 and c.block_size == 32 and c.linear_conv_lookahead == 3
    # one validator: what it needs has no silent default (the converter's rule)
    with pytest.raises(ValueError, match="vocab_size is missing"):
        CloverConfig.from_dict({})
    lt = ["full_attention", "linear_attention"]
    c2 = CloverConfig.from_dict({**TINY, "num_hidden_layers": 2, "layer_types": lt})
    assert c2.layer_types == lt
    c3 = CloverConfig.from_dict({**TINY, "eos_token_id": [7, 9]})
    assert c3.eos_token_id == 7 and c3.eos_token_ids == (7, 9)
    with pytest.raises(ValueError):
        CloverConfig.from_dict({**TINY, "linear_num_value_heads": 3})
    with pytest.raises(ValueError):
        CloverConfig.from_dict({**TINY, "layer_types": lt})  # wrong length
    with pytest.raises(ValueError):
        CloverConfig.from_dict({**TINY, "mask_token_id": 64})


# ------------------------------------------------------------------------- commit

def naive_commit_state(model, S0, rec, layer):
    """Gated delta recurrence written out independently from the pass's raw values."""
    c, p = model.cfg, f"model.layers.{layer}.linear_attn."
    Hk, Hv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
    act = rec["conv"] / (1 + np.exp(-rec["conv"]))                 # silu
    S = S0.astype(np.float64).copy()
    for t in range(act.shape[0]):
        for j in range(Hv):
            kh = j // (Hv // Hk)
            k = act[t, Hk * dk + kh * dk: Hk * dk + (kh + 1) * dk]
            k = k / np.sqrt(np.dot(k, k) + 1e-6)
            v = act[t, 2 * Hk * dk + j * c.linear_value_head_dim: 2 * Hk * dk + (j + 1) * c.linear_value_head_dim]
            beta = 1 / (1 + np.exp(-rec["b"][t, j]))
            g = -np.exp(float(model.w[p + "A_log"][j])) * np.log1p(np.exp(rec["a"][t, j] + model.w[p + "dt_bias"][j]))
            S[j] = np.exp(g) * S[j]
            S[j] = S[j] + np.outer(k, beta * (v - S[j].T @ k))
    return S


def test_commit_matches_naive_recurrence(model):
    toks = [3, 14, 15, 9, 26, 5, 35, 8]
    mem = model.new_memory()
    model.commit(mem, toks[:4])                      # non-zero starting state
    K = model.cfg.linear_conv_kernel_dim
    for n, t in enumerate(toks[4:]):
        before = mem.copy()
        _, layers = model.trace(mem, [t], 1)         # the token as a block of one
        model.commit(mem, [t])
        assert mem.n_committed == 5 + n
        for i, lt in enumerate(model.cfg.layer_types):
            if lt == "full_attention":
                np.testing.assert_array_equal(mem.keys[i][:, -1:], layers[i]["k"])
                np.testing.assert_array_equal(mem.values[i][:, -1:], layers[i]["v"])
                assert mem.keys[i].shape[1] == 5 + n
                continue
            want = naive_commit_state(model, before.state[i], layers[i], i)
            assert mem.state[i].dtype == np.float64
            np.testing.assert_allclose(mem.state[i], want, rtol=1e-12, atol=1e-14)
            assert np.abs(want).max() > 1e-2
            tail = np.concatenate([before.conv_tail[i], layers[i]["u"]])[-(K - 1):]
            np.testing.assert_array_equal(mem.conv_tail[i], tail)


def test_commit_does_not_depend_on_the_split(model):
    toks = [int(t) for t in np.random.default_rng(1).integers(0, 60, 11)]
    one = model.new_memory()
    l_one = model.commit(one, toks)
    assert l_one.shape == (11, 64) and l_one.dtype == np.float64 and one.n_committed == 11
    each, rows = model.new_memory(), []
    for t in toks:
        rows.append(model.commit(each, [t]))
    np.testing.assert_allclose(np.concatenate(rows), l_one, rtol=1e-12, atol=1e-12)
    assert_mem_equal(each, one, 1e-12)
    chunks, rows, s = model.new_memory(), [], 0
    for n in (3, 1, 5, 2):
        rows.append(model.commit(chunks, toks[s:s + n]))
        s += n
    np.testing.assert_allclose(np.concatenate(rows), l_one, rtol=1e-12, atol=1e-12)
    assert_mem_equal(chunks, one, 1e-12)
    np.testing.assert_array_equal(causal_logits(model, toks), l_one)
    with pytest.raises(ValueError):
        model.commit(model.new_memory(), [])
    with pytest.raises(ValueError):
        model.commit(model.new_memory(), [64])


def test_commit_of_one_token_is_a_block_pass_of_size_one(model):
    mem = model.new_memory()
    model.commit(mem, [7, 3, 50])
    for t in (11, MASK, 2):
        want = model.block_pass(mem, [t], 1)
        np.testing.assert_array_equal(model.commit(mem, [t]), want)
    # a block of one: o_blk = v (softmax over the token alone), whatever tau
    _, layers = model.trace(mem, [9], 1)
    rec = layers[0]
    c = model.cfg
    lam = 1 / (1 + np.exp(-rec["m"]))
    S = mem.state[0]
    for j in range(c.linear_num_value_heads):
        kh = j // (c.linear_num_value_heads // c.linear_num_key_heads)
        o_mem = S[j].T @ rec["q"][0, kh] / math.sqrt(c.linear_key_head_dim)
        np.testing.assert_allclose(rec["o"][0, j], lam[0, j] * o_mem + (1 - lam[0, j]) * rec["v"][0, j],
                                   rtol=1e-12, atol=1e-14)


def test_committed_logits_are_causal_and_block_pass_is_not(model):
    toks = [5, 17, 3, 22, 9, 41, 30]
    base = causal_logits(model, toks)
    for t in range(len(toks)):                     # change token t: rows < t unchanged, row t changes
        other = list(toks)
        other[t] = (toks[t] + 1) % 60
        l2 = causal_logits(model, other)
        np.testing.assert_array_equal(l2[:t], base[:t])
        assert not np.allclose(l2[t], base[t])
    # block pass rows see later canvas tokens (bidirectional inside the canvas)
    mem = model.new_memory()
    model.commit(mem, toks[:3])
    a = model.block_pass(mem, [1, 2, 3, 4], 4)
    b = model.block_pass(mem, [1, 2, 3, 8], 4)
    assert not np.allclose(a[0], b[0]) and not np.allclose(a[2], b[2])


def test_perplexity_by_hand(model):
    toks = [5, 17, 3, 22, 9]
    logits = causal_logits(model, toks)
    nll = []
    for t in range(1, len(toks)):
        p = np.exp(logits[t - 1] - logits[t - 1].max())
        nll.append(-math.log(p[toks[t]] / p.sum()))
    assert perplexity(model, toks) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-12)
    with pytest.raises(ValueError):
        perplexity(model, [5])


def test_block_pass_does_not_change_memory_and_needs_no_alignment(model):
    mem = model.new_memory()
    model.commit(mem, [1, 2, 3, 4, 5])              # 5 committed: any block size may follow
    snap = mem.copy()
    l1 = model.block_pass(mem, [5, 6, MASK], 4)
    l2 = model.block_pass(mem, [5, 6, MASK], 4)
    assert l1.shape == (3, 64) and l1.dtype == np.float64
    np.testing.assert_array_equal(l1, l2)
    assert_mem_equal(mem, snap)
    assert model.block_pass(mem, [1, 2, 3], 3).shape == (3, 64)
    with pytest.raises(ValueError):
        model.block_pass(mem, [1] * 5, 4)
    with pytest.raises(ValueError):
        model.block_pass(mem, [], 4)
    with pytest.raises(ValueError):
        model.block_pass(mem, [1], 0)
    # the block size enters through tau: same canvas, another B, other logits
    assert not np.allclose(model.block_pass(mem, [5, 6, 7], 3), model.block_pass(mem, [5, 6, 7], 8))


# ------------------------------------------------------------------------- mixers, written out again

def _sig(x):
    return 1 / (1 + np.exp(-x))


@pytest.fixture(scope="module")
def second_block(model):
    """Memory after one committed block, and the trace of the next (partial) block."""
    mem = model.new_memory()
    model.commit(mem, [3, 14, 15, 9])
    logits, layers = model.trace(mem, [26, MASK, 35], 4)
    return mem, logits, layers


def test_gdn_mixer_matches_formula(model, second_block):
    mem, _, layers = second_block
    c, rec, p = model.cfg, layers[0], "model.layers.0.linear_attn."
    W = {k[len(p):]: v.astype(np.float64) for k, v in model.w.items() if k.startswith(p)}
    x, n = rec["x_in"], 3
    u = x @ W["in_proj_qkv.weight"].T
    np.testing.assert_allclose(rec["u"], u)
    conv = np.stack([sum(W["conv1d.weight"][:, 0, j] * np.concatenate([mem.conv_tail[0], u])[t + j] for j in range(4))
                     + sum(W["conv1d_lookahead.weight"][:, 0, j] * u[t + 1 + j] for j in range(2) if t + 1 + j < n)
                     for t in range(n)])
    act = conv * _sig(conv)
    tau = np.exp(W["block_calib"][0] + W["block_calib"][1] * math.log(4 / 4))
    S = mem.state[0].astype(np.float64)
    assert np.abs(S).max() > 1e-2
    ys = []
    for j in range(4):                                # value heads; key head j // 2
        kh = j // 2
        q = act[:, kh * 8:(kh + 1) * 8]
        k = act[:, 16 + kh * 8:16 + (kh + 1) * 8]
        v = act[:, 32 + j * 8:32 + (j + 1) * 8]
        q = q / np.sqrt((q ** 2).sum(1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k ** 2).sum(1, keepdims=True) + 1e-6)
        o_mem = np.stack([S[j].T @ q[t] for t in range(n)]) / math.sqrt(8)
        sc = tau[j] * q @ k.T
        att = np.exp(sc) / np.exp(sc).sum(1, keepdims=True)
        lam = _sig(x @ W["in_proj_m.weight"][j])[:, None]
        o = lam * o_mem + (1 - lam) * (att @ v)
        np.testing.assert_allclose(rec["o"][:, j], o, rtol=1e-10, atol=1e-12)
        z = x @ W["in_proj_z.weight"][j * 8:(j + 1) * 8].T
        ys.append(W["norm.weight"] * o / np.sqrt((o ** 2).mean(1, keepdims=True) + c.rms_norm_eps) * z * _sig(z))
    np.testing.assert_allclose(rec["mix"], np.concatenate(ys, axis=1) @ W["out_proj.weight"].T, rtol=1e-10, atol=1e-12)


def test_attention_mixer_matches_formula(model, second_block):
    mem, _, layers = second_block
    c, rec, p = model.cfg, layers[3], "model.layers.3.self_attn."
    W = {k[len(p):]: v.astype(np.float64) for k, v in model.w.items() if k.startswith(p)}
    x, n, dh = rec["x_in"], 3, 8
    pos = np.arange(4, 4 + n)                         # absolute positions of the block

    def norm_rope(t, w, where):                      # t [dh], RMSNorm1p then NeoX RoPE (complex form)
        t = t / np.sqrt((t ** 2).mean() + c.rms_norm_eps) * (1 + w)
        z = (t[0:2] + 1j * t[2:4]) * np.exp(1j * where * 10000.0 ** (-np.arange(2) / 2))
        return np.concatenate([z.real, z.imag, t[4:]])

    qf = x @ W["q_proj.weight"].T
    kf = x @ W["k_proj.weight"].T
    vf = x @ W["v_proj.weight"].T
    heads = []
    for h in range(4):
        g = h // 2
        q = np.stack([norm_rope(qf[t, h * 16:h * 16 + 8], W["q_norm.weight"], pos[t]) for t in range(n)])
        gate = qf[:, h * 16 + 8:h * 16 + 16]
        k_blk = np.stack([norm_rope(kf[t, g * 8:(g + 1) * 8], W["k_norm.weight"], pos[t]) for t in range(n)])
        keys = np.concatenate([mem.keys[3][g], k_blk])
        vals = np.concatenate([mem.values[3][g], vf[:, g * 8:(g + 1) * 8]])
        sc = q @ keys.T / math.sqrt(dh)
        att = np.exp(sc - sc.max(1, keepdims=True))
        att /= att.sum(1, keepdims=True)
        heads.append(att @ vals * _sig(gate))
        if h % 2 == 0:
            np.testing.assert_allclose(rec["k"][g], k_blk, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rec["mix"], np.concatenate(heads, axis=1) @ W["o_proj.weight"].T, rtol=1e-10, atol=1e-12)
    # the cache of block 0 holds keys at positions 0..3: recompute one
    assert mem.keys[3].shape == (2, 4, 8)


def test_moe_and_head_match_formula(model, second_block):
    _, logits, layers = second_block
    c = model.cfg
    for i in (0, 3):
        rec, p = layers[i], f"model.layers.{i}.mlp."
        W = lambda k: model.w[p + k].astype(np.float64)  # noqa: E731
        h = rec["h"]
        x = h / np.sqrt((h ** 2).mean(1, keepdims=True) + c.rms_norm_eps) * (1 + model.w[f"model.layers.{i}.post_attention_layernorm.weight"])
        for t in range(len(x)):
            lg = W("gate.weight") @ x[t]
            pr = np.exp(lg) / np.exp(lg).sum()
            top = sorted(range(4), key=lambda e: -pr[e])[:2]
            wts = pr[top] / pr[top].sum()
            silu = lambda a: a * _sig(a)  # noqa: E731
            out = sum(wt * W(f"experts.{e}.down_proj.weight") @ (silu(W(f"experts.{e}.gate_proj.weight") @ x[t]) * (W(f"experts.{e}.up_proj.weight") @ x[t]))
                      for e, wt in zip(top, wts))
            sh = W("shared_expert.down_proj.weight") @ (silu(W("shared_expert.gate_proj.weight") @ x[t]) * (W("shared_expert.up_proj.weight") @ x[t]))
            out = out + _sig(W("shared_expert_gate.weight")[0] @ x[t]) * sh
            np.testing.assert_allclose(rec["x_out"][t], h[t] + out, rtol=1e-10, atol=1e-12)
    y = layers[-1]["x_out"]
    yn = y / np.sqrt((y ** 2).mean(1, keepdims=True) + c.rms_norm_eps) * (1 + model.w["model.norm.weight"])
    np.testing.assert_allclose(logits, yn @ model.w["lm_head.weight"].T.astype(np.float64), rtol=1e-10, atol=1e-10)
    # the logits are not degenerate: top probabilities spread between 0.05 and 0.999
    pr = np.exp(logits - logits.max(1, keepdims=True))
    pr = (pr / pr.sum(1, keepdims=True)).max(1)
    assert np.all(pr < 0.999) and np.all(pr > 0.05)


# ------------------------------------------------------------------------- conv, tau, rope

def test_bidirectional_conv_taps():
    rng = np.random.default_rng(2)
    C, K, R, n = 3, 4, 2, 5
    tail, u = rng.normal(size=(K - 1, C)), rng.normal(size=(n, C))
    wc, wl = rng.normal(size=(C, K)), rng.normal(size=(C, R))
    c = bidirectional_conv(tail, u, wc, wl)
    # hand formula for t = 1, with U = [tail; u]
    want1 = wc[:, 0] * tail[1] + wc[:, 1] * tail[2] + wc[:, 2] * u[0] + wc[:, 3] * u[1] \
        + wl[:, 0] * u[2] + wl[:, 1] * u[3]
    np.testing.assert_allclose(c[1], want1)
    # last row: lookahead reads zeros past the block end
    want_last = wc[:, 0] * u[1] + wc[:, 1] * u[2] + wc[:, 2] * u[3] + wc[:, 3] * u[4]
    np.testing.assert_allclose(c[n - 1], want_last)
    # a shorter block: rows far from its end are unchanged, rows near its end lose lookahead
    m = 3
    cm = bidirectional_conv(tail, u[:m], wc, wl)
    np.testing.assert_allclose(cm[:m - R], c[:m - R])
    assert not np.allclose(cm[m - 1], c[m - 1])     # lookahead within the block matters
    cz = bidirectional_conv(tail, np.concatenate([u[:m], np.zeros((2, C))]), wc, wl)
    np.testing.assert_allclose(cm, cz[:m])           # == zeros past the end


def test_model_conv_never_reads_past_block_end(model):
    mem = model.new_memory()
    model.commit(mem, [7, 8, 9, 10])
    K = model.cfg.linear_conv_kernel_dim
    w_c = model.w["model.layers.0.linear_attn.conv1d.weight"][:, 0, :]
    _, full = model.trace(mem, [11, 12, 13, 14], 4)
    _, part = model.trace(mem, [11, 12], 4)
    _, other = model.trace(mem, [11, 12, 40, 41], 4)
    u, c = part[0]["u"], part[0]["conv"]             # layer 0: u is per token
    np.testing.assert_array_equal(u, full[0]["u"][:2])
    # last row of the 2-token pass: causal taps only (tail rows + u), no lookahead
    U = np.concatenate([mem.conv_tail[0], u])
    causal = sum(w_c[:, j] * U[1 + j] for j in range(K))
    np.testing.assert_allclose(c[1], causal)
    # in the full block the same rows see tokens 2, 3 through the lookahead taps
    assert not np.allclose(full[0]["conv"][:2], c)
    assert not np.allclose(full[0]["conv"][:2], other[0]["conv"][:2])
    # causal taps of the first row read the committed tail (last K-1 rows of block 0)
    np.testing.assert_allclose(mem.conv_tail[0], model.trace(model.new_memory(), [7, 8, 9, 10], 4)[1][0]["u"][1:],
                               rtol=1e-12, atol=1e-14)


def test_block_calibration(cfg, weights):
    calib = np.array([[0.3, -0.2], [0.5, 1.5]])
    np.testing.assert_allclose(block_tau(calib, 4, 4), np.exp([0.3, -0.2]))
    np.testing.assert_allclose(block_tau(calib, 8, 4), [math.exp(0.3) * math.sqrt(2), math.exp(-0.2) * 2 ** 1.5])
    np.testing.assert_allclose(block_tau(calib, 2, 8), [math.exp(0.3) * 0.25 ** 0.5, math.exp(-0.2) * 0.25 ** 1.5])
    # model level: run at B = 8 with B0 = 4 == theta shifted by phi*ln 2 with phi = 0
    shifted = dict(weights)
    for i, lt in enumerate(cfg.layer_types):
        if lt == "linear_attention":
            k = f"model.layers.{i}.linear_attn.block_calib"
            th, ph = weights[k].astype(np.float64)
            shifted[k] = np.stack([th + ph * math.log(2), np.zeros_like(ph)])
    toks = [1, 2, 3, 4, 5, MASK, MASK, 6]
    a = CloverReference(cfg, weights).block_pass(CloverReference(cfg, weights).new_memory(), toks, 8)
    mb = CloverReference(cfg, shifted)
    np.testing.assert_allclose(a, mb.block_pass(mb.new_memory(), toks, 8), rtol=1e-6, atol=1e-6)
    # and it is not the uncalibrated value
    mc = CloverReference(dataclasses.replace(cfg, block_size=8), weights)
    assert not np.allclose(a, mc.block_pass(mc.new_memory(), toks, 8))


def test_rope_neox_hand_value():
    x = np.arange(1.0, 9.0).reshape(1, 1, 8)         # dh 8, rotary dims 4: pairs (0,2), (1,3)
    y = rope_neox(x, np.array([3]), 4, 100.0)
    a0, a1 = 3.0, 3.0 / 100.0 ** 0.5
    want = [1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
            3 * math.cos(a0) + 1 * math.sin(a0), 4 * math.cos(a1) + 2 * math.sin(a1), 5, 6, 7, 8]
    np.testing.assert_allclose(y[0, 0], want)


# ------------------------------------------------------------------------- weights

def test_fused_experts_and_tied_lm_head(cfg, weights, model):
    toks = [3, 1, 4, 1]
    ref = model.block_pass(model.new_memory(), toks, 4)
    fused = CloverReference(cfg, make_weights(cfg, fused=True))
    np.testing.assert_array_equal(fused.block_pass(fused.new_memory(), toks, 4), ref)
    # tied: lm_head absent, or config says tied (lm_head ignored) == lm_head equal to embeddings
    no_head = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    emb_head = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    t1 = CloverReference(cfg, no_head)
    t2 = CloverReference(dataclasses.replace(cfg, tie_word_embeddings=True), weights)
    u = CloverReference(cfg, emb_head)
    l1 = t1.block_pass(t1.new_memory(), toks, 4)
    np.testing.assert_array_equal(l1, t2.block_pass(t2.new_memory(), toks, 4))
    np.testing.assert_array_equal(l1, u.block_pass(u.new_memory(), toks, 4))
    assert not np.allclose(l1, ref)
    with pytest.raises(ValueError):
        CloverReference(cfg, {k: v for k, v in weights.items() if "in_proj_m" not in k})


def test_from_pretrained_single_file(tmp_path, cfg, weights, model):
    import json
    from safetensors.numpy import save_file
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    loaded = CloverReference.from_pretrained(tmp_path)
    toks = [9, 8, 7]
    np.testing.assert_array_equal(loaded.block_pass(loaded.new_memory(), toks, 4),
                                  model.block_pass(model.new_memory(), toks, 4))


def test_from_pretrained_generated_checkpoint(tmp_path):
    ckpt = pytest.importorskip("clover_testkit.checkpoints")
    ckpt.write_checkpoint(tmp_path, preset="tiny", dtype="bf16", shards=2, fused_experts=True, tied=True)
    m = CloverReference.from_pretrained(tmp_path)
    B = m.cfg.block_size
    logits = m.block_pass(m.new_memory(), [1, 2, 3][:B], B)
    assert np.all(np.isfinite(logits)) and logits.shape[1] == m.cfg.vocab_size


# ------------------------------------------------------------------------- decoding

PROMPT = [5, 17, 3, 22, 9, 41]



def greedy(logits: np.ndarray) -> int:
    l = logits.copy()
    l[MASK] = -np.inf
    return int(np.argmax(l))


def test_generate_argument_checks(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], max_tokens=4, block_size=4)
    with pytest.raises(ValueError):
        generate(model, PROMPT, max_tokens=4, block_size=0)
    with pytest.raises(ValueError):
        generate(model, PROMPT, max_tokens=4, block_size=4, top_p=0.0)
    r = generate(model, PROMPT, max_tokens=0, block_size=4)
    assert (r.tokens, r.n_forward, r.n_steps, r.n_commits, r.tokens_per_forward) == ([], 0, 0, 0, 0.0)


def test_b1_is_autoregressive(model):
    for kw in (dict(block_size=1), dict(block_size=4, block_schedule=[1])):
        steps = []
        res = generate(model, PROMPT, max_tokens=6, stop_at_eos=False, threshold=1.0,
                       step_callback=lambda s, c, n: steps.append((s, c, n)) and False, **kw)
        want = []
        for _ in range(6):
            want.append(greedy(causal_logits(model, PROMPT + want)[-1]))
        assert res.tokens == want
        assert res.n_steps == 0                          # no block pass ever
        assert res.n_commits == 5                        # one 1-token commit per token after the first
        assert res.n_forward == 1 + 5 and res.tokens_per_forward == pytest.approx(6 / 5)
        assert steps == [(6 + i, [t], 0) for i, t in enumerate(want)]


def test_b1_sampling_is_autoregressive_sampling(model):
    """temperature > 0 at B = 1: one rng draw per token, from the causal logits."""
    T, seed = 1.3, 4
    res = generate(model, PROMPT, max_tokens=5, block_size=1, temperature=T, seed=seed, stop_at_eos=False)
    rng, want = np.random.default_rng(seed), []
    for _ in range(5):
        z = causal_logits(model, PROMPT + want)[-1] / T
        z[MASK] = -np.inf
        p = np.exp(z - z.max())
        cdf = np.cumsum(p / p.sum())
        want.append(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")))
    assert res.tokens == want


def test_counters_by_hand(model):
    """threshold 0: every candidate is unmasked in a block's first step, so a block with
    n_cand > 1 costs one pass and a block with n_cand = 1 none."""
    starts = []
    cb = lambda s, c, n: starts.append((s, c.count(MASK), n)) and False  # noqa: E731
    # prompt 6, B 4, 10 tokens: blocks at 6, 10, 14 with 4, 4, 2 candidates
    r = generate(model, PROMPT, max_tokens=10, block_size=4, threshold=0.0, step_callback=cb, stop_at_eos=False)
    assert starts == [(6, 0, 0), (10, 0, 0), (14, 2, 0)]   # the last block: 2 positions past the budget
    assert (len(r.tokens), r.n_steps, r.n_commits, r.n_forward) == (10, 3, 2, 1 + 3)
    assert r.tokens_per_forward == pytest.approx(10 / 3) and r.finish_reason == "max_tokens"
    # 9 tokens: the last block has 1 candidate (no pass), so the commit before it is a forward of its own
    starts.clear()
    r = generate(model, PROMPT, max_tokens=9, block_size=4, threshold=0.0, step_callback=cb, stop_at_eos=False)
    assert starts == [(6, 0, 0), (10, 0, 0), (14, 3, 0)]
    assert (len(r.tokens), r.n_steps, r.n_commits, r.n_forward) == (9, 2, 2, 1 + 2 + 1)
    assert r.tokens_per_forward == pytest.approx(9 / 3)
    # schedule 4, 2, 1 (1 repeats): blocks at 6, 10, 12, 13
    starts.clear()
    r = generate(model, PROMPT, max_tokens=8, block_size=32, block_schedule=[4, 2, 1], threshold=0.0,
                 step_callback=cb, stop_at_eos=False)
    assert [s for s, _, _ in starts] == [6, 10, 12, 13]
    assert (len(r.tokens), r.n_steps, r.n_commits, r.n_forward) == (8, 2, 3, 1 + 2 + 2)
    assert r.tokens_per_forward == pytest.approx(8 / 4)
    # the prompt's forwards: ubatches of ubatch_tokens(B_0) tokens
    assert (ubatch_tokens(1), ubatch_tokens(4), ubatch_tokens(32), ubatch_tokens(300)) == (512, 512, 512, 600)


def test_budget_inside_a_block(model):
    """threshold 0: every pass sees an all-mask canvas, so a shorter budget gives a prefix."""
    full = generate(model, PROMPT, max_tokens=10, block_size=4, threshold=0.0, stop_at_eos=False)
    assert len(full.tokens) == 10 and MASK not in full.tokens
    for m in range(1, 10):
        r = generate(model, PROMPT, max_tokens=m, block_size=4, threshold=0.0, stop_at_eos=False)
        assert r.tokens == full.tokens[:m] and r.finish_reason == "max_tokens"
        assert r.n_commits == (m - 1) // 4
    # and the first token of any decode run is the argmax of the prompt's last committed logits
    assert full.tokens[0] == greedy(causal_logits(model, PROMPT)[-1])
    # position 0 of every block comes from the previous commit's last row (greedy)
    for k in (1, 2):
        assert full.tokens[4 * k] == greedy(causal_logits(model, PROMPT + full.tokens[:4 * k])[-1])


def test_step_cap_and_threshold(model):
    steps, canvases = [], []
    cb = lambda start, canvas, n_masked: steps.append((start, n_masked)) or canvases.append(canvas)  # noqa: E731
    r1 = generate(model, PROMPT, max_tokens=10, block_size=4, threshold=1.0, step_callback=cb,
                  stop_at_eos=False)
    # threshold 1: one position per step; blocks at 6, 10 (4 candidates), 14 (2)
    assert steps == [(6, 3), (6, 2), (6, 1), (6, 0), (10, 3), (10, 2), (10, 1), (10, 0), (14, 1), (14, 0)]
    assert len(r1.tokens) == 10 and r1.n_commits == 2 and MASK not in r1.tokens
    # a step runs a pass iff, before it, some candidate position i > 0 was masked
    befores = [[MASK] * 4] + canvases[:3] + [[MASK] * 4] + canvases[4:7] + [[MASK] * 4] + canvases[8:9]
    n_cands = [4] * 8 + [2] * 2
    passes = sum(any(b[i] == MASK for i in range(1, n)) for b, n in zip(befores, n_cands))
    assert r1.n_steps == passes and 7 <= passes <= 10
    assert r1.n_forward == 1 + r1.n_steps
    steps.clear()
    r0 = generate(model, PROMPT, max_tokens=10, block_size=4, threshold=0.0, stop_at_eos=False)
    assert r0.n_steps == 3
    # max_steps cap: at most 2 steps per block even with threshold 1
    steps.clear()
    r2 = generate(model, PROMPT, max_tokens=12, block_size=4, threshold=1.0, max_steps=2,
                  step_callback=cb, stop_at_eos=False)
    assert [n for _, n in steps] == [2, 0, 2, 0, 2, 0] and r2.n_steps == 6   # 2 masked left: one is > 0
    # max_steps 3 on 4 masks: ceil(4/3)=2, then ceil(2/2)=1, then 1
    steps.clear()
    generate(model, PROMPT, max_tokens=4, block_size=4, threshold=1.0, max_steps=3, step_callback=cb)
    assert [n for _, n in steps] == [2, 1, 0]


def test_eos_inside_a_block(cfg, weights, model):
    full = generate(model, PROMPT, max_tokens=14, block_size=4, stop_at_eos=False)
    assert len(full.tokens) == 14
    # make a token the greedy run produces be EOS: output stops before its first occurrence
    eos = full.tokens[5]
    first = full.tokens.index(eos)
    me = CloverReference(dataclasses.replace(cfg, eos_token_id=eos, eos_token_ids=(eos,)), weights)
    r = generate(me, PROMPT, max_tokens=14, block_size=4)
    assert r.tokens == full.tokens[:first] and r.finish_reason == "eos"
    assert r.n_commits == first // 4                 # the blocks before the one holding EOS
    r_no = generate(me, PROMPT, max_tokens=14, block_size=4, stop_at_eos=False)
    assert r_no.tokens == full.tokens and r_no.finish_reason == "max_tokens"


def test_sampling_seeded_and_never_mask(model):
    kw = dict(max_tokens=12, block_size=4, temperature=1.5, top_k=20, top_p=0.95, stop_at_eos=False)
    a = generate(model, PROMPT, seed=1, **kw)
    b = generate(model, PROMPT, seed=1, **kw)
    c = generate(model, PROMPT, seed=2, **kw)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert MASK not in a.tokens + c.tokens
    greedy_run = generate(model, PROMPT, max_tokens=12, block_size=4, stop_at_eos=False)
    assert a.tokens != greedy_run.tokens
    # top_k = 1 sampling is greedy at any temperature
    k1 = generate(model, PROMPT, max_tokens=12, block_size=4, temperature=2.0, top_k=1,
                  threshold=0.0, stop_at_eos=False)
    g0 = generate(model, PROMPT, max_tokens=12, block_size=4, threshold=0.0, stop_at_eos=False)
    assert k1.tokens == g0.tokens


def test_cancel(model):
    r = generate(model, PROMPT, max_tokens=12, block_size=4, threshold=1.0,
                 step_callback=lambda s, c, n: True)
    assert r.tokens == [] and r.finish_reason == "cancelled" and r.n_steps == 1 and r.n_commits == 0
    # cancelling right after a finished block keeps that block
    r = generate(model, PROMPT, max_tokens=12, block_size=4, threshold=0.0,
                 step_callback=lambda s, c, n: n == 0 and s == 10, stop_at_eos=False)
    assert len(r.tokens) == 8 and r.finish_reason == "cancelled" and r.n_commits == 1
    assert isinstance(r, GenerateResult)
    # B = 1: the callback also runs after steps without a pass
    r = generate(model, PROMPT, max_tokens=12, block_size=1, step_callback=lambda s, c, n: s == 7)
    assert len(r.tokens) == 2 and r.finish_reason == "cancelled" and r.n_steps == 0 and r.n_commits == 1


def test_mask_token_is_never_a_candidate(model):
    """A model that loves the mask token decodes exactly like the plain one."""
    class MaskLover(CloverReference):
        def block_pass(self, mem, tokens, block_size):
            logits = super().block_pass(mem, tokens, block_size)
            logits[:, MASK] += 1e3
            return logits

        def commit(self, mem, tokens):
            logits = super().commit(mem, tokens)
            logits[:, MASK] += 1e3
            return logits
    lover = MaskLover(model.cfg, model.w)
    for kw in (dict(), dict(temperature=1.0, top_k=8, top_p=0.9, seed=3)):
        a = generate(lover, PROMPT, max_tokens=9, block_size=4, stop_at_eos=False, **kw)
        b = generate(model, PROMPT, max_tokens=9, block_size=4, stop_at_eos=False, **kw)
        assert a.tokens == b.tokens and a.n_steps == b.n_steps and MASK not in a.tokens


@pytest.mark.parametrize("threshold,max_steps", [(1.0, 0), (0.3, 0), (1.0, 3)])
def test_unmask_choice_replayed(model, threshold, max_steps):
    """Replay each step of one greedy block: position 0 from the prompt's last logits, position
    i > 0 from pass row i-1; check which positions were unmasked and count the passes."""
    canvases = []
    r = generate(model, PROMPT, max_tokens=4, block_size=4, threshold=threshold, max_steps=max_steps,
                 step_callback=lambda s, c, n: canvases.append(c))
    mem = model.new_memory()
    L_last = model.commit(mem, PROMPT)[-1]
    prev, passes = [MASK] * 4, 0
    for step, cur in enumerate(canvases):
        masked = [p for p in range(4) if prev[p] == MASK]
        if any(p > 0 for p in masked):
            logits = model.block_pass(mem, prev, 4)
            passes += 1
        conf, tok = {}, {}
        for p in masked:
            lg = np.delete(L_last if p == 0 else logits[p - 1], MASK)   # the mask token is not a candidate
            pr = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
            conf[p], tok[p] = pr.max(), int(np.argmax(pr))
            tok[p] += tok[p] >= MASK
        by_conf = sorted(masked, key=lambda p: (-conf[p], p))
        n = max(1, sum(conf[p] >= threshold for p in masked))
        if max_steps:
            n = max(n, math.ceil(len(masked) / (max_steps - step)))
        want = sorted(by_conf[:n])
        assert [p for p in masked if cur[p] != MASK] == want
        assert all(cur[p] == tok[p] for p in want)
        prev = cur
    assert MASK not in prev and r.tokens == prev
    assert r.n_steps == passes and r.n_forward == 1 + passes and r.n_commits == 0


def test_top_p_tiny_is_greedy(model):
    g = generate(model, PROMPT, max_tokens=10, block_size=4, threshold=0.0, stop_at_eos=False)
    s = generate(model, PROMPT, max_tokens=10, block_size=4, temperature=1.0, top_p=1e-9,
                 threshold=0.999, seed=5, stop_at_eos=False)
    assert s.tokens == g.tokens and s.n_steps == g.n_steps == 3   # confidence 1: one step a block
