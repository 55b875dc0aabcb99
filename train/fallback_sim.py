"""Threshold decoding replayed in Python over native block passes, to see where a decode
leaves the model's own B = 1 output (train/RESULTS.md, the 2026-12-01 distillation round).

    python -m train.fallback_sim MODEL.gguf [--data train/runs/data]

Greedy, B = 32, threshold 0.9, on the held-out prompts of train.evaluate (64 tokens, 128 new).
Two fallbacks for a step where no position reaches the threshold: the spec's (the most
confident position; this replay reproduces the native decode's tokens and pass counts) and
the leftmost masked position (not the spec). Prints agreement with B = 1, tokens per pass,
and how many of the tokens unmasked at >= threshold while the decode still agreed were wrong.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from clover_cpp import Clover
from clover_testkit.reference import softmax
from train.evaluate import prompts

B, THRESHOLD, NEW = 32, 0.9, 128


def _probs(logits: np.ndarray, mask: int) -> np.ndarray:
    x = logits.astype(np.float64)
    x[:, mask] = -np.inf                      # the mask token is never a candidate
    return softmax(x, axis=-1)


def decode(m: Clover, prompt: list[int], base: list[int], leftmost: bool, tally: list[int]) -> tuple[list[int], int]:
    """(tokens, passes) of a decode of len(base) tokens; tally += [confident picks, wrong ones]
    counted while everything unmasked so far equals base. Spec v2: a block's position 0 is
    predicted by the committed text's last logits, position i > 0 by the pass's row i - 1."""
    mask, seq, passes = m.mask_token, list(prompt), 0
    while len(seq) < len(prompt) + len(base):
        b0 = len(seq) - len(prompt)
        n = min(B, len(base) - b0)            # positions past the budget are never candidates
        want, canvas = base[b0:b0 + n], [mask] * B
        m.reset()
        m.commit(seq)
        last = _probs(m.last_logits()[None], mask)[0]
        while mask in canvas[:n]:
            live = [i for i in range(n) if canvas[i] == mask]
            if any(i > 0 for i in live):      # a pass only when a position after the first needs one
                p = _probs(m.block_logits(canvas), mask)
                passes += 1
            dist = {i: last if i == 0 else p[i - 1] for i in live}
            conf = {i: dist[i].max() for i in live}
            pick = [i for i in live if conf[i] >= THRESHOLD]
            agreeing = seq[len(prompt):] == base[:b0] and all(canvas[i] in (mask, want[i]) for i in range(n))
            if not pick:
                pick = [live[0]] if leftmost else [max(live, key=lambda i: (conf[i], -i))]
            for i in pick:
                canvas[i] = int(dist[i].argmax())
                if agreeing and conf[i] >= THRESHOLD:
                    tally[0] += 1
                    tally[1] += int(canvas[i] != want[i])
        seq += canvas[:n]
    return seq[len(prompt):], passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--data", default="train/runs/data")
    a = ap.parse_args()
    ps = prompts(Path(a.data), 8, 64)
    with Clover(a.model, n_ctx=512, n_threads=1, block_size=1) as m1, \
            Clover(a.model, n_ctx=512, n_threads=1, block_size=B) as mb:
        base = [m1.generate(p, max_tokens=NEW, block_size=1, stop_at_eos=False).tokens for p in ps]
        for leftmost in (False, True):
            same = total = passes = 0
            tally = [0, 0]
            for p, b in zip(ps, base):
                out, n = decode(mb, p, b, leftmost, tally)
                same += sum(int(x == y) for x, y in zip(out, b))
                total, passes = total + len(b), passes + n
            print(f"{'leftmost' if leftmost else 'most confident (spec)'} fallback: agreement {same / total:.1%}, "
                  f"tokens per pass {total / passes:.2f}, confident picks wrong while agreeing {tally[1]}/{tally[0]}")


if __name__ == "__main__":
    main()
