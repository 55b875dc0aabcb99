"""The released checkpoint's layout (docs/release-checkpoint.md): CloverMoeModelLM / clover_moe,
Qwen3.5-MoE config keys, conv_right_weight (R = K - 1), num_shared_experts, and the block softmax
bd_softmax_* (math not public) instead of our in_proj_m / block_calib.

* the converter: identity, the right conv in both shapes, the block-softmax tensors kept as
  blk.{i}.ssm_bd_* with clover.block_operator = release-bd-softmax, num_shared_experts != 1 and a
  checkpoint with both block operators refused with one line;
* libclover vs the numpy reference on the release-tiny fixture: commit logits, block passes (the
  trunk with the block softmax left out), greedy B = 1 tokens; draft-self greedy == B = 1;
* plain block diffusion refused with one line naming the missing operator (C API, Clover.generate,
  clover run), auto never picks it;
* clover inspect: which layout, what it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from clover_convert import ConversionError, convert
from clover_convert.mapping import perm_index, parse_config
from clover_testkit import checkpoints
from clover_testkit.gguf_files import as_qwen35moe
from clover_testkit import reference as R

REPO = Path(__file__).resolve().parents[2]
CLOVER = REPO / ".venv" / "bin" / "clover"
REFUSAL = ("block diffusion (block size 8 without draft-self) needs a block operator this model lacks: its GGUF "
           "has the release's block softmax (bd_softmax_*, clover.block_operator = release-bd-softmax), whose math "
           "is not public, and not Clover's (ssm_mix, ssm_block_calib); use block size 1 or draft-self")
F32_TOL = 1e-3

pytestmark = pytest.mark.xdist_group("release_layout")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("release")
    cfg = checkpoints.write_checkpoint(d / "ck", preset="release-tiny", dtype="f32")
    convert(d / "ck", d / "release-f32.gguf", outtype="f32", progress=False)
    return {"dir": d, "ckpt": d / "ck", "cfg": cfg, "gguf": d / "release-f32.gguf"}


@pytest.fixture(scope="module")
def ref(release) -> R.CloverReference:
    return R.CloverReference.from_pretrained(release["ckpt"])


def _gguf(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


def _tensor(reader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return np.array(t.data).reshape([int(x) for x in reversed(list(t.shape))])


def _rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of checkpoint src with its tensors (a dict name -> array) and config edited."""
    from safetensors.numpy import save_file

    from clover_convert.safetensors_io import CheckpointReader

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    r = CheckpointReader(src)
    tensors = {n: np.ascontiguousarray(r.read_f32(n)) for n in r.names()}
    r.close()
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ----------------------------------------------------------------------------- the converter

def test_the_preset_is_the_release_layout(release):
    cfg, ck = release["cfg"], release["ckpt"]
    assert cfg["model_type"] == "clover_moe" and cfg["architectures"] == ["CloverMoeModelLM"]
    assert "clover_semantics" not in cfg and "linear_conv_lookahead" not in cfg and "rope_theta" not in cfg
    assert cfg["num_shared_experts"] == 1 and "rope_parameters" in cfg
    from clover_convert.safetensors_io import CheckpointReader

    names = set(CheckpointReader(ck).names())
    la = "model.layers.0.linear_attn."
    assert {la + "conv_right_weight", la + "bd_softmax_logit_scale", la + "bd_softmax_history_bias",
            la + "bd_softmax_history_c"} <= names
    assert not any("in_proj_m" in n or "block_calib" in n or "conv1d_lookahead" in n for n in names)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # fused experts, as Qwen3.5-MoE


def test_release_gguf_keys_and_tensors(release):
    c = parse_config(release["cfg"])
    g = _gguf(release["gguf"])
    kv = {k: f.contents() for k, f in g.fields.items() if not k.startswith("GGUF.")}
    assert kv["clover.block_operator"] == "release-bd-softmax"
    assert kv["clover.semantics"] == "causal-shift"  # the release is causal with the next-token shift
    assert kv["clover.ssm.conv_lookahead"] == c.K - 1
    assert kv["clover.expert_shared_count"] == 1
    names = {t.name for t in g.tensors}
    assert not any("ssm_mix" in n or "ssm_block_calib" in n for n in names)
    for i in range(c.L):
        if not c.is_recurrent(i):
            continue
        for kind in ("logit_scale", "history_bias", "history_c"):
            t = next(t for t in g.tensors if t.name == f"blk.{i}.ssm_bd_{kind}")
            assert t.tensor_type.name == "F32"
    # the block softmax kept as it is; the right conv is the look-ahead conv (v channels re-ordered)
    from clover_convert.safetensors_io import CheckpointReader

    r = CheckpointReader(release["ckpt"])
    la = "model.layers.0.linear_attn."
    assert np.array_equal(_tensor(g, "blk.0.ssm_bd_history_c"), r.read_f32(la + "bd_softmax_history_c"))
    right = r.read_f32(la + "conv_right_weight")
    assert right.shape == (c.C, c.K - 1)
    assert np.array_equal(_tensor(g, "blk.0.ssm_conv1d_look.weight"), right[perm_index("rows_qkv", c)])


def test_our_gguf_says_its_block_operator(tiny_artifacts):
    g = _gguf(tiny_artifacts["f32"])
    assert g.fields["clover.block_operator"].contents() == "clover-mix-calib"


def test_conv_right_in_either_shape(release, tmp_path):
    """[C, 1, K-1] (a Conv1d weight) gives the same GGUF tensor as [C, K-1]; another shape is refused."""
    def three_d(t):
        for n in [n for n in t if n.endswith("conv_right_weight")]:
            t[n] = t[n][:, None, :]

    ck = _rewrite(release["ckpt"], tmp_path / "ck3", three_d)
    convert(ck, tmp_path / "r3.gguf", outtype="f32", progress=False)
    a, b = _gguf(release["gguf"]), _gguf(tmp_path / "r3.gguf")
    for t in a.tensors:
        assert np.array_equal(np.array(t.data), _tensor(b, t.name).reshape(np.array(t.data).shape)), t.name

    def too_long(t):
        n = "model.layers.0.linear_attn.conv_right_weight"
        t[n] = np.zeros((t[n].shape[0], 4), np.float32)

    bad = _rewrite(release["ckpt"], tmp_path / "bad", too_long)
    c = parse_config(release["cfg"])
    with pytest.raises(ConversionError) as e:
        convert(bad, tmp_path / "bad.gguf", outtype="f32", progress=False)
    assert str(e.value) == (f"tensor model.layers.0.linear_attn.conv_right_weight: expected shape "
                            f"[{c.C}, 3] or [{c.C}, 1, 3], got [{c.C}, 4]")
    assert not (tmp_path / "bad.gguf").exists()


def test_num_shared_experts_other_than_1_refused(release, tmp_path):
    ck = _rewrite(release["ckpt"], tmp_path / "ck", edit_config=lambda c: c.update(num_shared_experts=2))
    msg = "config.json: num_shared_experts must be 1 (the graph has one gated shared expert), got 2"
    with pytest.raises(ConversionError) as e:
        convert(ck, tmp_path / "x.gguf", outtype="f32", progress=False)
    assert str(e.value) == msg
    r = subprocess.run([str(REPO / ".venv" / "bin" / "clover"), "convert", str(ck), str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {msg}", r.stderr
    assert not (tmp_path / "x.gguf").exists()


def _no_mask(what: str) -> str:
    return (f"{what} needs a mask token and this model has none (its GGUF has no tokenizer.ggml.mask_token_id: the "
            "release publishes none), so it runs causally only (block size 1); to enable it, add \"mask_token_id\" "
            "to the checkpoint's config.json and convert again")


NO_MASK_WARNING = ("warning: config.json names no mask_token_id (the release publishes none): the GGUF runs causally "
                   "only (block size 1); to enable draft-self, add \"mask_token_id\" (its mask token's id) to "
                   "config.json and convert again")


@pytest.fixture(scope="module")
def nomask(release, tmp_path_factory) -> dict:
    """The release checkpoint as published: config.json names no mask token."""
    d = tmp_path_factory.mktemp("nomask")
    ck = _rewrite(release["ckpt"], d / "ck", edit_config=lambda c: c.pop("mask_token_id"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        convert(ck, d / "nomask.gguf", outtype="f32", progress=False)
    return {"ckpt": ck, "gguf": d / "nomask.gguf", "stderr": err.getvalue()}


def test_release_config_without_a_mask_token_converts_causal_only(nomask, tmp_path):
    assert nomask["stderr"].strip() == NO_MASK_WARNING
    md = _gguf(nomask["gguf"]).fields
    assert "tokenizer.ggml.mask_token_id" not in md and "tokenizer.ggml.eos_token_id" in md
    r = subprocess.run([str(CLOVER), "convert", str(nomask["ckpt"]), str(tmp_path / "x.gguf"), "--outtype", "f32"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and NO_MASK_WARNING in r.stderr.splitlines(), r.stderr
    assert "tokenizer.ggml.mask_token_id" not in _gguf(tmp_path / "x.gguf").fields


def test_our_layout_still_needs_its_mask_token(tiny_artifacts, tmp_path):
    ck = _rewrite(Path(tiny_artifacts["ckpt"]), tmp_path / "ck", edit_config=lambda c: c.pop("mask_token_id"))
    with pytest.raises(ConversionError) as e:
        convert(ck, tmp_path / "x.gguf", outtype="f32", progress=False)
    assert "mask_token_id" in str(e.value)
    assert not (tmp_path / "x.gguf").exists()


def test_two_block_operators_refused(release, tmp_path):
    c = parse_config(release["cfg"])

    def add_ours(t):
        t["model.layers.0.linear_attn.in_proj_m.weight"] = np.zeros((c.Hv, c.H), np.float32)

    ck = _rewrite(release["ckpt"], tmp_path / "ck", add_ours)
    with pytest.raises(ConversionError, match=r"^the checkpoint has two block operators, Clover's"):
        convert(ck, tmp_path / "x.gguf", outtype="f32", progress=False)


def test_identity_by_architectures_and_nested_text_config(release, tmp_path):
    """architectures CloverMoeModelLM alone names the release; a Qwen3.5 text_config is read."""
    def nest(c):
        trunk = {k: c.pop(k) for k in list(c) if k not in ("architectures", "auto_map", "torch_dtype",
                                                            "tie_word_embeddings", "model_type")}
        c.pop("model_type")
        c["text_config"] = trunk

    ck = _rewrite(release["ckpt"], tmp_path / "ck", edit_config=nest)
    assert "hidden_size" not in json.loads((ck / "config.json").read_text())
    convert(ck, tmp_path / "n.gguf", outtype="f32", progress=False)
    a, b = _gguf(release["gguf"]), _gguf(tmp_path / "n.gguf")
    assert b.fields["clover.block_operator"].contents() == "release-bd-softmax"
    assert {t.name for t in a.tensors} == {t.name for t in b.tensors}


# ----------------------------------------------------------------------------- libclover

@pytest.fixture(scope="module")
def model(release):
    from clover_cpp import Clover

    with Clover(release["gguf"], block_size=8, n_ctx=1024, kv_f32=True, n_threads=1) as m:
        yield m


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))


def _prompts(cfg: dict, n: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, cfg["mask_token_id"], int(rng.integers(1, 40)))] for _ in range(n)]


@pytest.mark.needs_libclover
def test_commit_and_block_pass_match_the_reference(model, ref, release):
    """Commit logits (causal: the trunk's gated delta rule) and block passes (the trunk with the
    block softmax left out) against the float64 reference, at several B and memory lengths."""
    mask = release["cfg"]["mask_token_id"]
    rng = np.random.default_rng(3)
    for n_prompt in (1, 5, 23):
        prompt = [int(t) for t in rng.integers(0, mask, n_prompt)]
        model.reset()
        mem = ref.new_memory()
        assert _rel(model.commit(prompt, logits=True), ref.commit(mem, prompt)) <= F32_TOL
        for B in (1, 4, 8):
            canvas = [mask] * B
            for j in rng.choice(B, size=B // 2, replace=False):
                canvas[int(j)] = int(rng.integers(0, mask))
            assert _rel(model.block_logits(canvas), ref.block_pass(mem, canvas, B)) <= F32_TOL, (n_prompt, B)
        more = [int(t) for t in rng.integers(0, mask, 3)]  # the memory after a pass is unchanged
        assert _rel(model.commit(more, logits=True), ref.commit(mem, more)) <= F32_TOL


@pytest.mark.needs_libclover
def test_a_canvas_of_one_token_is_the_causal_step(model, ref, release):
    prompt = _prompts(release["cfg"], 1)[0]
    model.reset()
    model.commit(prompt[:-1])
    one = model.block_logits([prompt[-1]])[0]
    model.commit([prompt[-1]])
    assert _rel(one, model.last_logits()) <= 1e-5


@pytest.mark.needs_libclover
def test_greedy_block_size_1_matches_the_reference(model, ref, release):
    for prompt in _prompts(release["cfg"], 4):
        got = model.generate(prompt, max_tokens=20, block_size=1, stop_at_eos=False)
        want = R.generate(ref, prompt, max_tokens=20, block_size=1, stop_at_eos=False)
        assert list(got.tokens) == want.tokens


@pytest.mark.needs_libclover
@pytest.mark.parametrize("B", [4, 8, 16])
def test_greedy_draft_self_equals_block_size_1(model, release, B):
    drafted = 0
    for prompt in _prompts(release["cfg"], 8):
        want = list(model.generate(prompt, max_tokens=30, block_size=1, stop_at_eos=False).tokens)
        for threshold, max_steps in ((0.9, 4), (0.0, 0)):
            r = model.generate(prompt, max_tokens=30, block_size=B, threshold=threshold, max_steps=max_steps,
                               stop_at_eos=False, draft_self=True)
            assert list(r.tokens) == want, (prompt, B, threshold)
            drafted += r.stats.n_drafted
    assert drafted > 0  # block passes really drafted


@contextlib.contextmanager
def _c_model(path: Path):
    """(libclover, a loaded model, error buffer, its length) through the C API; the model freed after."""
    from clover_cpp import _native as N

    L = N.load_library()
    eb, el = N.err_buffer()
    mp = L.clover_model_default_params()
    m = L.clover_model_load(str(path).encode(), ctypes.byref(mp), eb, el)
    assert m, eb.value.decode()
    try:
        yield L, m, eb, el
    finally:
        L.clover_model_free(m)


@pytest.mark.needs_libclover
def test_block_diffusion_refused_through_the_c_api(release):
    from clover_cpp import _native as N

    with _c_model(release["gguf"]) as (L, m, eb, el):
        cp = L.clover_context_default_params()
        cp.n_ctx, cp.block_size, cp.n_threads = 256, 8, 1
        c = L.clover_context_new(m, ctypes.byref(cp), eb, el)
        try:
            assert c, eb.value.decode()
            for B in (0, 8):  # the context's B (8) and an explicit 8
                gp = L.clover_generate_default_params()
                gp.block_size, gp.max_tokens, gp.draft_self = B, 8, 0
                out, n, st = (ctypes.c_int32 * 8)(), ctypes.c_int32(), N.clover_stats()
                rc = L.clover_generate(c, N.as_int32_array([5, 6, 7]), 3, ctypes.byref(gp), out, 8, ctypes.byref(n),
                                       ctypes.byref(st), eb, el)
                assert rc == N.CLOVER_ERR_INVALID_ARG and eb.value.decode() == REFUSAL and n.value == 0
            gp = L.clover_generate_default_params()
            gp.block_size, gp.max_tokens, gp.draft_self = 1, 8, 0  # B = 1 runs
            rc = L.clover_generate(c, N.as_int32_array([5, 6, 7]), 3, ctypes.byref(gp), out, 8, ctypes.byref(n),
                                   ctypes.byref(st), eb, el)
            assert rc == N.CLOVER_OK and n.value > 0
        finally:
            L.clover_context_free(c)


@pytest.mark.needs_libclover
def test_block_diffusion_refused_in_python_and_auto_stays_at_1(model, release):
    from clover_cpp import CloverError

    prompt = _prompts(release["cfg"], 1)[0]
    with pytest.raises(CloverError) as e:
        model.generate(prompt, max_tokens=8, block_size=8, draft_self=False)
    assert str(e.value) == REFUSAL
    want = model.generate(prompt, max_tokens=12, block_size=1, stop_at_eos=False)
    auto = model.generate(prompt, max_tokens=12, block_size="auto", stop_at_eos=False, draft_self=False)
    assert list(auto.tokens) == list(want.tokens) and auto.stats.block_size == 1


@pytest.mark.needs_libclover
def test_clover_run_block_size_8_never_runs_block_diffusion(release):
    """clover run --block-size 8 on a release file either refuses with the one line (the command asks
    for block diffusion) or, where the command leaves the mode to libclover (draft_self = auto),
    runs draft-self, whose text is the --block-size 1 text: never block diffusion."""
    base = [str(CLOVER), "run", "-m", str(release["gguf"]), "-p", "def add(a, b):", "-n", "8", "-t", "1",
            "--ignore-eos", "--no-visual"]
    r = subprocess.run(base + ["--block-size", "8"], capture_output=True, text=True, timeout=120)
    ds = subprocess.run(base + ["--block-size", "8", "--draft-self"], capture_output=True, text=True, timeout=120)
    one = subprocess.run(base + ["--block-size", "1"], capture_output=True, text=True, timeout=120)
    assert ds.returncode == 0 and one.returncode == 0, ds.stderr + one.stderr
    assert ds.stdout == one.stdout and "draft-self" in ds.stderr
    assert "Traceback" not in r.stderr
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0] == f"error: {REFUSAL}", r.stderr
    else:
        assert r.stdout == one.stdout and "draft-self" in r.stderr, r.stderr


@pytest.mark.needs_libclover
def test_no_mask_token_runs_block_size_1_like_the_reference_and_auto_stays_at_1(nomask, release):
    from clover_cpp import Clover

    ref = R.CloverReference.from_pretrained(nomask["ckpt"])
    with Clover(nomask["gguf"], n_ctx=256, kv_f32=True, n_threads=1) as m:
        assert m.mask_token == -1 and m.block_size == 1  # (the context's default B: causal only)
        for prompt in _prompts(release["cfg"], 3):
            got = m.generate(prompt, max_tokens=16, block_size=1, stop_at_eos=False)
            want = R.generate(ref, prompt, max_tokens=16, block_size=1, stop_at_eos=False)
            assert list(got.tokens) == want.tokens
            for kw in ({"block_size": "auto"}, {"block_size": "auto", "draft_self": "auto"}, {}):
                auto = m.generate(prompt, max_tokens=16, stop_at_eos=False, **kw)
                assert list(auto.tokens) == want.tokens, kw
                assert auto.stats.block_size == 1 and auto.stats.calibration == "", kw  # no block passes measured


@pytest.mark.needs_libclover
def test_no_mask_token_refuses_draft_self_block_passes_and_b_gt_1(nomask, release):
    from clover_cpp import Clover, CloverError
    from clover_cpp import _native as N

    prompt = _prompts(release["cfg"], 1)[0]
    with Clover(nomask["gguf"], n_ctx=256, kv_f32=True, n_threads=1) as m:
        for kw, what in (({"draft_self": True}, "draft-self"), ({"block_size": 8, "draft_self": True}, "draft-self"),
                         ({"block_size": 8}, "block size 8")):
            with pytest.raises(CloverError) as e:
                m.generate(prompt, max_tokens=8, **kw)
            assert str(e.value) == _no_mask(what), kw
        with pytest.raises(CloverError) as e:
            m.block_logits(prompt[:1])
        assert str(e.value) == _no_mask("a block pass")
        with pytest.raises(CloverError) as e:
            m.calibrate()
        assert str(e.value) == "block-size calibration: " + _no_mask("block-size calibration (block passes)")
    with pytest.raises(CloverError) as e:
        Clover(nomask["gguf"], n_ctx=256, block_size=8, n_threads=1)
    assert str(e.value) == _no_mask("block size 8")
    # the C API says the same line
    with _c_model(nomask["gguf"]) as (L, mdl, eb, el):
        cp = L.clover_context_default_params()
        cp.n_ctx, cp.block_size, cp.n_threads = 256, 8, 1
        assert not L.clover_context_new(mdl, ctypes.byref(cp), eb, el)
        assert eb.value.decode() == _no_mask("block size 8")
        cp.block_size = 0
        c = L.clover_context_new(mdl, ctypes.byref(cp), eb, el)
        try:
            assert c, eb.value.decode()
            assert L.clover_set_block_size(c, 4, eb, el) == N.CLOVER_ERR_INVALID_ARG
            assert eb.value.decode() == _no_mask("block size 4")
            out, n, st = (ctypes.c_int32 * 8)(), ctypes.c_int32(), N.clover_stats()
            for B, ds, what in ((8, 0, "block size 8"), (1, 1, "draft-self"), (0, 0, None)):
                gp = L.clover_generate_default_params()
                gp.block_size, gp.max_tokens, gp.draft_self = B, 8, ds
                rc = L.clover_generate(c, N.as_int32_array(prompt), len(prompt), ctypes.byref(gp), out, 8,
                                       ctypes.byref(n), ctypes.byref(st), eb, el)
                if what is None:
                    assert rc == N.CLOVER_OK and n.value == 8 and st.block_size == 1
                else:
                    assert rc == N.CLOVER_ERR_INVALID_ARG and eb.value.decode() == _no_mask(what) and n.value == 0
        finally:
            L.clover_context_free(c)


@pytest.mark.needs_libclover
def test_clover_run_without_a_mask_token(nomask):
    base = [str(CLOVER), "run", "-m", str(nomask["gguf"]), "-p", "def add(a, b):", "-n", "8", "-t", "1",
            "--ignore-eos", "--no-visual"]
    one = subprocess.run(base + ["--block-size", "1"], capture_output=True, text=True, timeout=120)
    auto = subprocess.run(base + ["--block-size", "auto"], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and auto.returncode == 0, one.stderr + auto.stderr
    assert auto.stdout == one.stdout and "[clover] B=1 autoregressive" in auto.stderr
    for extra, what in ((["--draft-self"], "draft-self"), (["--block-size", "8"], "block size 8")):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"error: {_no_mask(what)}"], r.stderr


# ----------------------------------------------------------------------------- clover inspect

def test_inspect_says_a_file_without_a_mask_token_runs_causal_only(nomask):
    r = subprocess.run([str(CLOVER), "inspect", str(nomask["gguf"])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("runs:          causal (B = 1): yes; draft-self: no: no mask token (tokenizer.ggml.mask_token_id); "
            "add mask_token_id to config.json and convert again; block diffusion: no: the release's") in r.stdout
    assert ", mask " not in r.stdout



def test_inspect_says_layout_and_what_runs(release, tiny_artifacts):
    rel = subprocess.run([str(CLOVER), "inspect", str(release["gguf"])], capture_output=True, text=True, timeout=60)
    ours = subprocess.run([str(CLOVER), "inspect", str(tiny_artifacts["f32"])], capture_output=True, text=True,
                          timeout=60)
    assert rel.returncode == 0 and ours.returncode == 0, rel.stderr + ours.stderr
    assert "layout:        release (CloverMoeModelLM / clover_moe), block operator release-bd-softmax" in rel.stdout
    assert ("runs:          causal (B = 1): yes; draft-self: yes (drafts from the trunk, the block softmax left "
            "out); block diffusion: no: the release's block softmax (bd_softmax_*) is not public") in rel.stdout
    assert "layout:        clover (ours: CloverForBlockDiffusion), block operator clover-mix-calib" in ours.stdout
    assert "runs:          causal (B = 1): yes; draft-self: yes; block diffusion: yes" in ours.stdout


@pytest.mark.needs_libclover
def test_quantized_release_file_keeps_the_block_softmax_and_runs(release, tmp_path):
    from clover_cpp import Clover, quantize

    out = tmp_path / "q8.gguf"
    quantize(release["gguf"], out, "Q8_0")
    g = _gguf(out)
    assert g.fields["clover.block_operator"].contents() == "release-bd-softmax"
    assert all(t.tensor_type.name == "F32" for t in g.tensors if ".ssm_bd_" in t.name or "conv1d_look" in t.name)
    prompt = _prompts(release["cfg"], 1)[0]
    with Clover(out, block_size=8, n_ctx=256, n_threads=1) as m:
        one = m.generate(prompt, max_tokens=10, block_size=1, stop_at_eos=False)
        ds = m.generate(prompt, max_tokens=10, block_size=8, stop_at_eos=False, draft_self=True)
        assert len(one.tokens) == 10 and list(ds.tokens) == list(one.tokens)


# llama-cpp-python's Llama on our libllama, in a process of its own (test_causal_path.py says why)
LLAMA_LOGITS = r"""
import json, sys
import numpy as np
import clover_cpp
from clover_cpp._lib import import_llama_cpp
llama_cpp = import_llama_cpp()
from llama_cpp import Llama
path, toks, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_ctx=256, n_threads=1, n_batch=64, type_k=0, type_v=0, verbose=False, logits_all=True)
llm.eval(toks)
np.save(out, np.array(llm.scores[:len(toks)]))
"""


# one llama_decode of [committed tokens | a canvas] on the release file through llama.cpp's own
# llama_set_canvas (patch 0003): the logits of the commit rows and of the canvas rows
LLAMA_CANVAS = r"""
import ctypes, json, sys
import numpy as np
import clover_cpp
from clover_cpp._lib import import_llama_cpp
llama_cpp = import_llama_cpp()
from llama_cpp import Llama
path, commit, canvas, B, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = Llama(model_path=path, n_ctx=256, n_threads=1, n_batch=128, type_k=0, type_v=0, verbose=False, logits_all=True)
lib = llama_cpp.llama_cpp._lib
lib.llama_set_canvas.argtypes, lib.llama_set_canvas.restype = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], None
lib.llama_set_canvas(llm._ctx.ctx, len(canvas), B)
llm.eval(commit + canvas)
np.save(out, np.array(llm.scores[: len(commit) + len(canvas)]))
"""


@pytest.mark.needs_libclover
def test_a_commit_and_a_canvas_in_one_forward(ref, release, tmp_path):
    """The graph's fused form (a block's causal commit and the next canvas in one ubatch, as
    draft-self's verification runs them): the commit rows are the reference's commit, the canvas
    rows its block pass after that commit (the delta rule continued from the committed state)."""
    import sys

    mask, B = release["cfg"]["mask_token_id"], 8
    rng = np.random.default_rng(5)
    commit = [int(t) for t in rng.integers(0, mask, 13)]
    canvas = [int(t) for t in rng.integers(0, mask, B)]
    canvas[2:5] = [mask] * 3
    subprocess.run([sys.executable, "-c", LLAMA_CANVAS, str(release["gguf"]), json.dumps(commit), json.dumps(canvas),
                    str(B), str(tmp_path / "rows.npy")], check=True, timeout=120, capture_output=True)
    got = np.load(tmp_path / "rows.npy")
    mem = ref.new_memory()
    assert _rel(got[: len(commit)], ref.commit(mem, commit)) <= F32_TOL
    assert _rel(got[len(commit):], ref.block_pass(mem, canvas, B)) <= F32_TOL


@pytest.mark.needs_libclover
def test_the_causal_path_is_upstream_qwen35moe(model, ref, release, tmp_path):
    """B = 1 on a release file is the trunk llama.cpp runs for the release: upstream's qwen35moe
    graph on the same weights (what the release's converter writes) gives the same logits as
    libclover's commit and the reference."""
    import sys

    qwen = as_qwen35moe(release["gguf"], tmp_path / "qwen35moe.gguf")
    toks = _prompts(release["cfg"], 1)[0] + [5, 17, 33, 90, 12, 7, 100, 200]
    subprocess.run([sys.executable, "-c", LLAMA_LOGITS, str(qwen), json.dumps(toks), str(tmp_path / "up.npy")],
                   check=True, timeout=120, capture_output=True)
    upstream = np.load(tmp_path / "up.npy")
    model.reset()
    ours = model.commit(toks, logits=True)
    want = ref.commit(ref.new_memory(), toks)
    assert _rel(upstream, want) <= F32_TOL and _rel(ours, upstream) <= F32_TOL
