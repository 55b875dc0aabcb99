"""llama_set_canvas (patch 0003) does what it says or refuses: on clover (the one architecture whose
graph reads the canvas, on hybrid memory) a canvas changes the canvas rows' logits and leaves the
committed rows causal; on a model it is not wired for, a hybrid one whose graph does not read it
(upstream's qwen35moe) or a plain KV-cache one (llama), it returns -1 with one log line naming the
architecture and the decode stays plain causal, never a canvas silently decoded causally."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clover_convert import convert
from clover_testkit import checkpoints

pytestmark = [pytest.mark.needs_libclover, pytest.mark.xdist_group("canvas")]

B = 8

# llama-cpp-python's Llama on our libllama in a process of its own (test_causal_path.py says why):
# per model, the logits of a plain decode, then llama_set_canvas(B, B)'s return value and the
# logits of the same tokens decoded after it, then llama_set_canvas(0, 0)'s return value
CANVAS_OR_REFUSAL = r"""
import ctypes, json, sys
import numpy as np
import clover_cpp
from clover_cpp._lib import import_llama_cpp
llama_cpp = import_llama_cpp()
from llama_cpp import Llama
path, toks, B, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = Llama(model_path=path, n_ctx=256, n_threads=1, n_batch=128, type_k=0, type_v=0, verbose=False, logits_all=True)
lib = llama_cpp.llama_cpp._lib
lib.llama_set_canvas.argtypes, lib.llama_set_canvas.restype = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32
LOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
lines = []
cb = LOG_CB(lambda level, text, user: lines.append((text or b"").decode(errors="replace")))
lib.llama_log_set.argtypes, lib.llama_log_set.restype = [ctypes.c_void_p, ctypes.c_void_p], None
llm.eval(toks)
plain = np.array(llm.scores[: len(toks)])
lib.llama_log_set(ctypes.cast(cb, ctypes.c_void_p), None)  # what llama_set_canvas logs, whoever logged before
rc_set = lib.llama_set_canvas(llm._ctx.ctx, B, B)
print("".join(lines), file=sys.stderr)
llm.reset()
llm.eval(toks)
after = np.array(llm.scores[: len(toks)])
rc_clear = lib.llama_set_canvas(llm._ctx.ctx, 0, 0)
np.savez(out, plain=plain, after=after, rc=np.array([rc_set, rc_clear]))
"""


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("canvas")
    cfg = checkpoints.write_checkpoint(d / "ck", preset="release-tiny", dtype="f32")
    convert(d / "ck", d / "release-f32.gguf", outtype="f32", progress=False)
    return {"dir": d, "cfg": cfg, "gguf": d / "release-f32.gguf"}


def _as_llama(src: Path, dst: Path) -> Path:
    """A plain-attention model (upstream's llama: one layer, a KV cache, no recurrent state) with
    src's tokenizer and width, random weights."""
    import gguf

    from clover_testkit.gguf_files import metadata_fields

    r = gguf.GGUFReader(str(src))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    n_embd = int(r.fields["clover.embedding_length"].contents())
    n_ff, n_head = 2 * n_embd, 2
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, val, vt, sub in metadata_fields(r):
        if key.startswith("tokenizer."):
            w.add_key_value(key, val, vt, sub_type=sub)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(3)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.0.{name}.weight", rand(n_embd, n_embd))
    w.add_tensor("blk.0.ffn_gate.weight", rand(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_up.weight", rand(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_down.weight", rand(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _decode(path: Path, toks: list[int], tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / f"{path.stem}.npz"
    res = subprocess.run([sys.executable, "-c", CANVAS_OR_REFUSAL, str(path), json.dumps(toks), str(B), str(out)],
                         timeout=120, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return dict(np.load(out)), res.stderr


def _tokens(cfg: dict) -> list[int]:
    rng = np.random.default_rng(5)
    toks = [int(t) for t in rng.integers(0, cfg["mask_token_id"], 13 + B)]
    toks[-5:-2] = [cfg["mask_token_id"]] * 3  # a canvas with masked positions, as a block pass has
    return toks


def test_a_canvas_on_clover_changes_only_the_canvas_rows(release, tmp_path):
    got, _ = _decode(release["gguf"], _tokens(release["cfg"]), tmp_path)
    assert list(got["rc"]) == [0, 0]
    plain, after = got["plain"], got["after"]
    np.testing.assert_allclose(after[:-B], plain[:-B], rtol=0, atol=1e-4)  # the commit rows stay causal
    # the canvas rows are a block pass, not the causal logits (what an ignored canvas would give)
    assert np.abs(after[-B:] - plain[-B:]).max() > 1e-2 * np.abs(plain[-B:]).max()


@pytest.mark.parametrize("arch", ["qwen35moe", "llama"])
def test_a_canvas_is_refused_where_it_is_not_wired(release, tmp_path, arch):
    if arch == "qwen35moe":  # hybrid memory, but the graph would write the canvas into its recurrent state
        from clover_testkit.gguf_files import as_qwen35moe

        path = as_qwen35moe(release["gguf"], tmp_path / "qwen35moe.gguf")
    else:  # a plain KV cache: its mask input is not wired
        path = _as_llama(release["gguf"], tmp_path / "llama.gguf")
    got, log = _decode(path, _tokens(release["cfg"]), tmp_path)
    assert list(got["rc"]) == [-1, 0]  # refused; clearing (n_canvas = 0) is always allowed
    assert f"set_canvas: a canvas is not supported for architecture '{arch}'" in log  # one line, in llama's log
    np.testing.assert_array_equal(got["after"], got["plain"])  # nothing changed: plain causal decoding
