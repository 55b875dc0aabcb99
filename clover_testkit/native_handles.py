"""libclover through ctypes for the tests that hold it to the numpy reference: thin Model / Ctx
handles over the C API (clover_cpp._native), the parity tolerance, and the module fixtures of the
tiny preset (its GGUFs, the reference, the loaded model). Import it only where libclover is built."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from clover_cpp import _native as N

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "build" / "bin" / "clover-cli"

try:  # a test module importing this is skipped, whole, where libclover is not built
    L = N.load_library()
except N.CloverLibraryNotFound as e:  # pragma: no cover - CI always builds it
    pytest.skip(f"libclover is not built ({e})", allow_module_level=True)

F32_TOL = 1e-3  # native f32 logits vs the float64 reference: max |diff| / max(1, max |logit|)


class NativeError(RuntimeError):
    def __init__(self, code: int, msg: str):
        super().__init__(f"{N.lib().clover_status_str(code).decode()} ({code}): {msg}")
        self.code, self.msg = code, msg


def float_ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class Model:
    def __init__(self, path: Path | str):
        eb, el = N.err_buffer()
        mp = L.clover_model_default_params()
        mp.n_gpu_layers = int(os.environ.get("CLOVER_TEST_NGL", "0"))  # benchmarks/gpu.sh: -1 = all on the GPU
        self.p = L.clover_model_load(str(path).encode(), ctypes.byref(mp), eb, el)
        if not self.p:
            raise NativeError(N.CLOVER_ERR_LOAD, eb.value.decode())
        self.n_vocab = L.clover_n_vocab(self.p)
        self.mask = L.clover_mask_token(self.p)
        self.eos = L.clover_eos_token(self.p)

    def close(self):
        if self.p:
            L.clover_model_free(self.p)
            self.p = None


class Ctx:
    def __init__(self, model: Model, block_size: int, n_ctx: int = 512, n_threads: int = 2, kv_f32: bool = True,
                 flash_attn: int = 0):
        """kv_f32 / flash_attn: exact-parity settings by default (f32 KV cache, no flash
        attention, whose CPU kernel rounds Q to f16)."""
        self.model = model
        cp = L.clover_context_default_params()
        cp.n_ctx, cp.block_size, cp.n_threads = n_ctx, block_size, n_threads
        cp.kv_f32, cp.flash_attn = int(kv_f32), flash_attn
        eb, el = N.err_buffer()
        self.p = L.clover_context_new(model.p, ctypes.byref(cp), eb, el)
        if not self.p:
            raise NativeError(N.CLOVER_ERR_INVALID_ARG, eb.value.decode())

    def close(self):
        if self.p:
            L.clover_context_free(self.p)
            self.p = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    @property
    def n_committed(self) -> int:
        return L.clover_n_committed(self.p)

    def committed_tokens(self) -> list[int]:
        n = L.clover_committed_tokens(self.p, None, 0)
        out = (ctypes.c_int32 * max(n, 1))()
        assert L.clover_committed_tokens(self.p, out, n) == n
        return list(out[:n])

    def _check(self, rc, eb):
        if rc != N.CLOVER_OK:
            raise NativeError(rc, eb.value.decode())

    def block_pass(self, tokens) -> np.ndarray:
        out = np.zeros((len(tokens), self.model.n_vocab), np.float32)
        eb, el = N.err_buffer()
        self._check(L.clover_block_pass(self.p, N.as_int32_array(tokens), len(tokens), float_ptr(out), eb, el), eb)
        return out

    def commit(self, tokens) -> None:
        eb, el = N.err_buffer()
        self._check(L.clover_commit(self.p, N.as_int32_array(tokens), len(tokens), eb, el), eb)

    def commit_logits(self, tokens) -> np.ndarray:
        """Commit, returning the [n, V] logits of the committed positions."""
        out = np.zeros((len(tokens), self.model.n_vocab), np.float32)
        eb, el = N.err_buffer()
        self._check(L.clover_commit_logits(self.p, N.as_int32_array(tokens), len(tokens), float_ptr(out), eb, el), eb)
        return out

    def last_logits(self) -> np.ndarray:
        out = np.zeros(self.model.n_vocab, np.float32)
        rc = L.clover_last_logits(self.p, float_ptr(out))
        if rc != N.CLOVER_OK:
            raise NativeError(rc, "clover_last_logits")
        return out

    def reset(self):
        assert L.clover_reset(self.p) == N.CLOVER_OK

    def generate(self, prompt, *, max_tokens=24, block_size=N.CLOVER_BLOCK_SIZE_CONTEXT, threshold=0.9, max_steps=0, temperature=0.0,
                 top_k=0, top_p=1.0, seed=0, stop_at_eos=True, step_cb=None, block_cb=None, reuse_prefix=None,
                 stop_tokens=(), draft_self=0):
        gp = L.clover_generate_default_params()
        gp.draft_self = draft_self
        stops = N.as_int32_array(stop_tokens)
        gp.stop_tokens, gp.n_stop_tokens = stops, len(stop_tokens)
        if reuse_prefix is not None:
            gp.reuse_prefix = int(reuse_prefix)
        gp.block_size, gp.threshold, gp.max_steps = block_size, threshold, max_steps
        gp.temperature, gp.top_k, gp.top_p, gp.seed = temperature, top_k, top_p, seed
        gp.max_tokens, gp.stop_at_eos = max_tokens, int(stop_at_eos)
        keep = []
        if step_cb is not None:
            f = N.clover_step_callback(lambda s, c, b, nm, u: int(bool(step_cb(s, list(c[:b]), nm))))
            gp.step_callback = f
            keep.append(f)
        if block_cb is not None:
            g = N.clover_block_callback(lambda s, t, n, u: int(bool(block_cb(s, list(t[:n])))))
            gp.block_callback = g
            keep.append(g)
        cap = max(max_tokens, 1)
        out = (ctypes.c_int32 * cap)()
        n = ctypes.c_int32()
        st = N.clover_stats()
        eb, el = N.err_buffer()
        rc = L.clover_generate(self.p, N.as_int32_array(prompt), len(prompt), ctypes.byref(gp), out, cap,
                               ctypes.byref(n), ctypes.byref(st), eb, el)
        return rc, list(out[:n.value]), st, eb.value.decode()


@pytest.fixture(scope="module")
def artifacts(tiny_artifacts):
    return tiny_artifacts


@pytest.fixture(scope="module")
def ref(artifacts):
    from clover_testkit.reference import CloverReference

    return CloverReference.from_pretrained(artifacts["ckpt"])


@pytest.fixture(scope="module")
def model(artifacts):
    m = Model(artifacts["f32"])
    yield m
    m.close()


def random_prompt(seed: int, n: int, vocab_hi: int) -> list[int]:
    # ordinary tokens only (no mask / EOS / other specials, which sit at the top of the vocab)
    return np.random.default_rng(seed).integers(0, vocab_hi, n).tolist()


@pytest.fixture(scope="module")
def vocab_hi(artifacts):
    cfg = artifacts["cfg"]
    return min(cfg["eos_token_id"], cfg["mask_token_id"])


def relative_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))


class ParityReport:
    """Worst relative differences per key (``record``) and the explained mismatches (``notes``),
    printed at the end of a test module (pytest -s) by ``print``."""

    def __init__(self, notes_heading: str) -> None:
        self.measured: dict[str, float] = {}
        self.notes: list[str] = []
        self.notes_heading = notes_heading

    def record(self, key: str, value: float) -> None:
        self.measured[key] = max(self.measured.get(key, 0.0), float(value))

    def print(self) -> None:
        if self.measured:
            print("\nmeasured max |native - reference| / max(1, max|logit|):")
            for k in sorted(self.measured):
                print(f"  {k:40s} {self.measured[k]:.3e}")
        if self.notes:
            print(self.notes_heading)
            for t in self.notes:
                print("  " + t)
