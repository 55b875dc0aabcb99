"""The reference's decoding loop (block diffusion over the model of clover_testkit.reference.model).

Decoding (``generate``, spec "Decoding"):

* The prompt must not be empty (ValueError). It is committed whole; L_last = the
  logits row of its last token. (max_tokens <= 0: nothing runs, all counters 0.)
* Decode block k has size B_k = ``block_schedule[k]`` (the last entry repeats) or
  ``block_size``, and starts at p = n_committed (right after the committed text). Its
  canvas is B_k mask tokens; n_cand = min(B_k, max_tokens - generated); the candidate
  positions are 0..n_cand-1 (positions past the budget are never candidates and stay
  masked).
* Each step: if some masked position i > 0 exists, ONE block pass over the whole canvas
  (all B_k tokens) gives the pass logits (n_steps += 1); otherwise no pass runs. The
  candidate logits of masked position i are L_last for i = 0 (fixed for the block), else
  pass row i-1.
* The mask token is never a candidate: its logit is set to -inf first.
  temperature 0: candidate = argmax (ties: lowest id), confidence = softmax prob.
  temperature > 0: logits / T, top-k (0 = off; ties keep lower ids), top-p (1.0 = off;
  smallest prefix of the prob-sorted tokens whose cumulative prob >= top_p, at least
  one), renormalise, sample. One ``np.random.default_rng(seed)`` for the whole
  generation; every step, the masked positions (position 0 included) are sampled in
  increasing position order, each with one ``rng.random()`` draw u, token = first index
  whose cumulative prob > u. Confidence = the sampled token's prob in that distribution.
* Unmask every masked position with confidence >= threshold; if none, the single most
  confident (ties: lowest position). With max_steps S > 0, at step s (0-based within
  the block, steps without a pass included) at least ceil(masked / (S - s)) of the most
  confident are unmasked (ties: lowest position), so a block never takes more than S steps.
* ``step_callback(block_start, canvas_tokens_list, n_masked)`` is called after every step
  (also steps without a pass); if it returns True, generation stops: the output holds
  the completed blocks only (the current block counts as completed if it has no
  candidate masked any more), finish_reason "cancelled".
* A finished block appends canvas[:n_cand] to the output. Stop when it holds EOS (any of
  ``config.eos_token_ids``, when stop_at_eos; finish_reason "eos") or the budget is
  reached ("max_tokens"); otherwise commit the block's B_k tokens (L_last = the last row
  of that commit). The final block is not committed. The output ends before the first
  EOS and is cut to max_tokens.
* Counters (as the native engine counts them): ``n_steps`` = block passes;
  ``n_commits`` = decode blocks committed (the prompt's commit not counted);
  ``n_forward`` = prompt forwards ceil(len(prompt) / ubatch_tokens(B_0)) + n_steps + the
  block commits that cannot ride on a pass (a block commit rides on the next block's
  first step iff that step runs a pass, i.e. iff the next block's n_cand > 1; else it is
  a forward of its own); ``tokens_per_forward`` = len(tokens) / (n_forward - prompt
  forwards), 0.0 when that is 0. B = 1 is plain autoregressive decoding: one 1-token
  commit per generated token after the first, no block pass ever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from clover_testkit.reference.primitives import softmax

class CloverReference(Protocol):
    """What the loop asks of the model (clover_testkit.reference.model.CloverReference): its
    config, a fresh memory, causal commits and block passes."""

    cfg: Any

    def new_memory(self) -> Any: ...
    def commit(self, mem: Any, tokens: Sequence[int]) -> np.ndarray: ...
    def block_pass(self, mem: Any, tokens: Sequence[int], block_size: int, **kw: Any) -> np.ndarray: ...


@dataclass
class GenerateResult:
    tokens: list[int]
    n_forward: int            # prompt forwards + block passes + block commits that ride on no pass
    n_steps: int              # block passes
    tokens_per_forward: float # len(tokens) / (n_forward - prompt forwards), 0.0 when that is 0
    n_commits: int = 0        # decode blocks committed (the prompt's commit not counted)
    finish_reason: str = ""   # "eos", "max_tokens" or "cancelled"


def candidates(logits: np.ndarray, mask_id: int | None, temperature: float, top_k: int,
                top_p: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per row of logits [m, V]: candidate token and its confidence."""
    l = logits.astype(np.float64).copy()
    if mask_id is not None:  # (None: a config without one, B = 1 only)
        l[:, mask_id] = -np.inf
    toks, conf = np.zeros(len(l), np.int64), np.zeros(len(l))
    for row in range(len(l)):
        if temperature == 0.0:
            p = softmax(l[row])
            toks[row] = int(np.argmax(p))
        else:
            z = l[row] / temperature
            order = np.argsort(-z, kind="stable")
            if top_k > 0:
                z[order[top_k:]] = -np.inf
            p = softmax(z)
            if top_p < 1.0:
                order = np.argsort(-p, kind="stable")
                cum = np.cumsum(p[order])
                keep = int(np.searchsorted(cum, top_p, side="left")) + 1   # first cum >= top_p
                p[order[min(keep, len(p)):]] = 0.0
                p = p / p.sum()
            cdf = np.cumsum(p)
            idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
            toks[row] = min(idx, len(p) - 1)
        conf[row] = p[toks[row]]
    return toks, conf


def ubatch_tokens(block_size: int) -> int:
    """Tokens per llama_decode in libclover for block size B (room for a commit of B fused with
    the next pass of B; at least 512): the prompt's commit takes ceil(n / this) forwards."""
    return max(512, 2 * block_size)


def generate(model: CloverReference, prompt_tokens: Sequence[int], *, max_tokens: int,
             block_size: int, threshold: float = 0.9, max_steps: int = 0,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_at_eos: bool = True,
             step_callback: Callable[[int, list[int], int], Any] | None = None,
             block_schedule: Sequence[int] | None = None,
             coreset: int | None = None) -> GenerateResult:
    """Block-diffusion decoding (module docstring, "Decoding"). block_schedule: the B of
    each decode block in turn (the last one repeats), as chosen by block_size="auto";
    overrides block_size. coreset: the block expert coreset of every block pass (None = off)."""
    schedule = [int(b) for b in block_schedule] if block_schedule else [block_size]
    cfg = model.cfg
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in schedule):
        raise ValueError(f"block sizes must be positive integers, got {schedule!r}")
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise ValueError("the prompt must not be empty")
    if cfg.mask_token_id is None and any(b > 1 for b in schedule):  # (B = 1 needs none: causal decoding)
        raise ValueError("config has no mask_token_id (a block size > 1 needs one)")
    if temperature < 0 or not 0.0 < top_p <= 1.0 or top_k < 0 or max_steps < 0:
        raise ValueError("bad sampling parameters")
    mask, eos = cfg.mask_token_id, set(cfg.eos_token_ids) if stop_at_eos else set()
    block_of = lambda k: schedule[min(k, len(schedule) - 1)]  # noqa: E731
    rng = np.random.default_rng(seed)
    out: list[int] = []
    n_steps = n_commits = n_solo_commits = n_prompt_forwards = 0
    reason = "max_tokens"
    if max_tokens > 0:
        mem = model.new_memory()
        L_last = model.commit(mem, prompt)[-1]
        n_prompt_forwards = -(-len(prompt) // ubatch_tokens(schedule[0]))
        k = 0
        while True:
            B, start = block_of(k), mem.n_committed
            canvas = [mask] * B
            # positions at or past the token budget are never candidates: they stay masked
            n_cand = min(B, max_tokens - len(out))
            masked = list(range(n_cand))
            step, cancelled, pass_logits = 0, False, None
            while masked:
                if any(i > 0 for i in masked):
                    pass_logits = (model.block_pass(mem, canvas, B, coreset=coreset) if coreset
                                   else model.block_pass(mem, canvas, B))
                    n_steps += 1
                rows = np.stack([L_last if i == 0 else pass_logits[i - 1] for i in masked])
                cand, conf = candidates(rows, mask, temperature, top_k, top_p, rng)
                if np.any(cand == mask):             # would never terminate
                    raise RuntimeError("the mask token was chosen as a candidate")
                ranked = sorted(range(len(masked)), key=lambda j: (-conf[j], masked[j]))
                n_unmask = max(1, int(np.sum(conf >= threshold)))
                if max_steps > 0:
                    left = max_steps - step
                    n_unmask = max(n_unmask, len(masked) if left <= 0 else -(-len(masked) // left))
                for j in ranked[:n_unmask]:
                    canvas[masked[j]] = int(cand[j])
                masked = [i for i in masked if canvas[i] == mask]
                step += 1
                if step_callback is not None and step_callback(start, list(canvas), len(masked)):
                    cancelled = True
                    break
            if not masked:
                out.extend(canvas[:n_cand])
            if cancelled:
                reason = "cancelled"
                break
            if any(t in eos for t in canvas[:n_cand]):
                reason = "eos"
                break
            if len(out) >= max_tokens:
                break
            L_last = model.commit(mem, canvas)[-1]
            n_commits += 1
            k += 1
            # the commit rides on the next block's first step iff that step runs a pass
            if min(block_of(k), max_tokens - len(out)) <= 1:
                n_solo_commits += 1
    for idx, t in enumerate(out):
        if t in eos:
            out = out[:idx]
            break
    out = out[:max(max_tokens, 0)]
    n_decode_forwards = n_steps + n_solo_commits
    return GenerateResult(tokens=out, n_forward=n_prompt_forwards + n_decode_forwards,
                          n_steps=n_steps,
                          tokens_per_forward=len(out) / n_decode_forwards if n_decode_forwards else 0.0,
                          n_commits=n_commits, finish_reason=reason)
