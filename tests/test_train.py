"""Training code: torch forward == numpy reference, masking, resume (needs torch)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # train/ is not installed

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


@pytest.mark.parametrize("B", [4, 2, 8, 3])
def test_forward_matches_reference(B):
    cfg = tiny_cfg()
    model = random_model(cfg)
    ref = CloverReference(cfg, {k: v.numpy() for k, v in model.hf_state_dict().items()})
    rng = np.random.default_rng(B)
    N, nb = 2, 3
    T = nb * B
    clean = rng.integers(0, 48, size=(N, T))
    noisy = np.where(rng.random((N, T)) < 0.5, cfg.mask_token_id, clean)
    trace: dict = {}
    with torch.no_grad():
        logits, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), B, trace=trace)
    for n in range(N):
        mem = ref.new_memory()
        for b in range(nb):
            sl = slice(b * B, (b + 1) * B)
            want = ref.block_pass(mem, noisy[n, sl], B)
            np.testing.assert_allclose(logits[n, sl].numpy(), want, rtol=1e-5, atol=1e-6)
            ref.commit(mem, clean[n, sl], B)
            for i, S in mem.state.items():   # states after committing block b (f32 in the reference)
                np.testing.assert_allclose(trace["states"][i][n, b + 1].numpy(), S, rtol=1e-5, atol=1e-6)
        for i, tail in mem.conv_tail.items():
            np.testing.assert_allclose(trace["conv_tail"][i][n].numpy(), tail, rtol=1e-5, atol=1e-6)
        for i, k in mem.keys.items():
            np.testing.assert_allclose(trace["keys"][i][n].numpy(), k, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(trace["values"][i][n].numpy(), mem.values[i], rtol=1e-5, atol=1e-6)


def test_hf_roundtrip_and_tied():
    cfg = tiny_cfg(tie_word_embeddings=True, linear_conv_lookahead=0)
    a, b = random_model(cfg, 1), CloverTorch(cfg, seed=5).double()
    b.load_hf(a.hf_state_dict())
    for k in a.p:
        assert torch.equal(a.p[k], b.p[k])
    assert "lm_head.weight" not in a.hf_state_dict()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in a.hf_state_dict()


def test_mask_and_loss_only_on_masked():
    cfg = tiny_cfg()
    rng = np.random.default_rng(0)
    clean = rng.integers(0, 48, size=(3, 16))
    noisy, masked = tr.mask_blocks(clean, 4, cfg.mask_token_id, rng, t_min=0.05)
    assert np.array_equal(noisy[~masked], clean[~masked])
    assert np.all(noisy[masked] == cfg.mask_token_id)
    per_block = masked.reshape(3, 4, 4).sum(-1)
    assert per_block.min() >= 1
    # the loss ignores the logits of unmasked positions
    model = random_model(cfg)
    logits, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), 4)
    loss = tr.masked_loss(logits, torch.as_tensor(clean), torch.as_tensor(masked))
    poked = logits.detach().clone()
    poked[torch.as_tensor(~masked)] += torch.randn(int((~masked).sum()), cfg.vocab_size, dtype=poked.dtype) * 10
    assert torch.allclose(loss, tr.masked_loss(poked, torch.as_tensor(clean), torch.as_tensor(masked)))
    logits2 = logits.detach().clone().requires_grad_(True)
    tr.masked_loss(logits2, torch.as_tensor(clean), torch.as_tensor(masked)).backward()
    assert torch.all(logits2.grad[torch.as_tensor(~masked)] == 0)


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


def test_select_equals_full_logits():
    cfg = tiny_cfg()
    model = random_model(cfg)
    rng = np.random.default_rng(1)
    clean = rng.integers(0, 48, size=(2, 8))
    noisy, masked = tr.mask_blocks(clean, 4, cfg.mask_token_id, rng)
    with torch.no_grad():
        full, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), 4)
        sel, _ = model.forward_train(torch.as_tensor(clean), torch.as_tensor(noisy), 4, select=torch.as_tensor(masked))
    assert torch.allclose(full[torch.as_tensor(masked)], sel)


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
    """--traj-mask suffix: in every block the masked positions are its last n, 1 <= n <= B, and
    every n occurs."""
    from train.distill import mask_suffix

    clean = np.arange(4 * 64).reshape(4, 64)
    noisy, masked = mask_suffix(clean, 8, -1, np.random.default_rng(0))
    blocks = masked.reshape(4, 8, 8)
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
