"""``Clover.sample``: llama-cpp-python's ``Llama.sample`` chain (penalties, then greedy, mirostat
or top-k / typical / top-p / min-p / temperature / dist), built from llama.cpp's own samplers
through llama-cpp-python's bindings on our libllama and applied to the last committed logits."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SampleArgs", "sample_token"]


@dataclass(frozen=True)
class SampleArgs:
    """``Llama.sample``'s knobs (its defaults)."""

    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    temp: float = 0.80
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    mirostat_mode: int = 0
    mirostat_eta: float = 0.1
    mirostat_tau: float = 5.0
    last_n: int = 64


def _chain(lc: Any, a: SampleArgs, n_vocab: int, seed: int) -> Any:
    """The chain of Llama._init_sampler, with the same samplers in the same order."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    add = lambda s: lc.llama_sampler_chain_add(chain, s)  # noqa: E731
    add(lc.llama_sampler_init_penalties(n_vocab, a.last_n, a.repeat_penalty, a.frequency_penalty, a.presence_penalty))
    if a.temp < 0.0:
        add(lc.llama_sampler_init_dist(seed))
    elif a.temp == 0.0:
        add(lc.llama_sampler_init_greedy())
    elif a.mirostat_mode == 1:
        add(lc.llama_sampler_init_mirostat(n_vocab, seed, a.mirostat_tau, a.mirostat_eta, 100))
    elif a.mirostat_mode == 2:
        add(lc.llama_sampler_init_mirostat_v2(seed, a.mirostat_tau, a.mirostat_eta))
    else:
        add(lc.llama_sampler_init_top_k(a.top_k))
        add(lc.llama_sampler_init_typical(a.typical_p, 1))
        add(lc.llama_sampler_init_top_p(a.top_p, 1))
        add(lc.llama_sampler_init_min_p(a.min_p, 1))
        add(lc.llama_sampler_init_temp(a.temp))
        add(lc.llama_sampler_init_dist(seed))
    return chain


def sample_token(lc: Any, logits: np.ndarray, history: list[int], a: SampleArgs, seed: int) -> int:
    """One token drawn from ``logits`` (mask token already excluded) by the chain; ``history``:
    the tokens the penalties count (the last ``a.last_n`` committed ones)."""
    n = len(logits)
    data = (lc.llama_token_data * n)()
    view = np.ctypeslib.as_array(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint8)), shape=(ctypes.sizeof(data),))
    rec = view.view(np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)]))
    rec["id"], rec["logit"], rec["p"] = np.arange(n), logits, 0.0
    arr = lc.llama_token_data_array(data, n, -1, False)
    chain = _chain(lc, a, n, seed)
    try:
        for t in history[-a.last_n:] if a.last_n > 0 else ():
            lc.llama_sampler_accept(chain, t)
        lc.llama_sampler_apply(chain, ctypes.byref(arr))
        return int(data[arr.selected].id)
    finally:
        lc.llama_sampler_free(chain)
