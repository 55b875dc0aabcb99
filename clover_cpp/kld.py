"""``clover kld``: how far a quantized file is from its base, on the paths Clover decodes by.

llama-perplexity's ``--kl-divergence`` compares the causal next-token distributions of a
quantized model with those of its f16 base. Clover also decodes by block passes over masked
canvases, so both are measured:

* **causal**: the text in chunks of n_ctx tokens (as llama-perplexity: each on an empty memory,
  the first token BOS when the model has one, the second half of every chunk scored); at each
  scored position, KL(base || quant) of the next-token distributions, whether the two argmaxes
  agree, and each model's negative log-likelihood of the true next token (-> perplexity);
* **block passes**: in the second half of every chunk, for each decode block (B positions
  after the committed text, as decoding lays them out), the canvas is the true block with a
  fraction r of its positions replaced by the mask token, for each r of ``mask_ratios``
  (decoding starts a block fully masked and unmasks it step by step); the block pass's row
  q-1 predicts masked position q (q > the block start, as decoding reads it), and those rows
  are compared as above. The masks are seeded, the same for both models.

Everything is float64 over the whole vocabulary.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["KLDStats", "KLDResult", "kl_divergence", "main"]

DEFAULT_MASK_RATIOS = (1.0, 0.75, 0.5, 0.25)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass
class KLDStats:
    """Accumulated comparison of rows of logits (base vs quant)."""

    kld: list[np.ndarray] = field(default_factory=list)
    agree: int = 0
    n: int = 0
    nll_base: float = 0.0
    nll_quant: float = 0.0

    def add(self, base: np.ndarray, quant: np.ndarray, targets: np.ndarray) -> None:
        if len(targets) == 0:
            return
        lp, lq = _log_softmax(base), _log_softmax(quant)
        p = np.exp(lp)
        self.kld.append((p * (lp - lq)).sum(axis=-1))
        self.agree += int((base.argmax(axis=-1) == quant.argmax(axis=-1)).sum())
        idx = np.arange(len(targets))
        self.nll_base -= float(lp[idx, targets].sum())
        self.nll_quant -= float(lq[idx, targets].sum())
        self.n += len(targets)

    @property
    def values(self) -> np.ndarray:
        return np.concatenate(self.kld) if self.kld else np.zeros(0)

    def summary(self) -> dict[str, float]:
        v = self.values
        if self.n == 0:
            return {"n": 0}
        ppl_b, ppl_q = math.exp(self.nll_base / self.n), math.exp(self.nll_quant / self.n)
        return {
            "n": self.n,
            "mean_kld": float(v.mean()),
            "kld_stderr": float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0,
            "median_kld": float(np.median(v)),
            "p99_kld": float(np.percentile(v, 99)),
            "max_kld": float(v.max()),
            "top1_agree": self.agree / self.n,
            "ppl_base": ppl_b,
            "ppl_quant": ppl_q,
            "ppl_ratio": ppl_q / ppl_b,
        }


@dataclass
class KLDResult:
    causal: dict[str, float]
    blocks: dict[float, dict[str, float]]   # mask ratio -> summary
    n_ctx: int
    n_chunks: int
    block_size: int

    def format(self) -> str:
        def row(label: str, s: dict[str, float]) -> str:
            if not s.get("n"):
                return f"{label:<22} (no positions)"
            return (f"{label:<22} {s['n']:>7} {s['mean_kld']:>10.6f} +- {s['kld_stderr']:<9.6f} "
                    f"{s['p99_kld']:>9.5f} {100 * s['top1_agree']:>7.2f}% {s['ppl_base']:>10.4f} "
                    f"{s['ppl_quant']:>10.4f} {s['ppl_ratio']:>8.5f}")

        lines = [f"{'path':<22} {'pos':>7} {'mean KLD':>10}    {'stderr':<9} {'p99 KLD':>9} {'top-1':>8} "
                 f"{'PPL base':>10} {'PPL quant':>10} {'ratio':>8}",
                 row("causal", self.causal)]
        for r, s in self.blocks.items():
            lines.append(row(f"block B={self.block_size} mask={r:g}", s))
        lines.append(f"({self.n_chunks} chunks of {self.n_ctx} tokens, the second half of each scored"
                     + ("; block rows: the predictions of masked positions)" if self.blocks else ")"))
        return "\n".join(lines)


def kl_divergence(base: Any, quant: Any, text: str | Sequence[int], n_ctx: int = 512, block_size: int | None = None,
                  mask_ratios: Sequence[float] = DEFAULT_MASK_RATIOS, seed: int = 0, max_chunks: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> KLDResult:
    """Compare the quantized Clover ``quant`` with its base ``base`` (both loaded, same vocabulary)
    on text; see the module doc. ``block_size`` defaults to the model's training block size;
    no mask ratios = causal only. Leaves both memories empty."""
    from .model import CloverValueError

    if base.n_vocab() != quant.n_vocab():
        raise CloverValueError(f"the models have different vocabularies ({base.n_vocab()} vs {quant.n_vocab()} tokens)")
    toks = base.tokenize(text, add_bos=True, special=True) if isinstance(text, str) else [int(t) for t in text]
    if isinstance(text, str) and toks != quant.tokenize(text, add_bos=True, special=True):
        raise CloverValueError("the models tokenize the text differently: not a quantization of the same model")
    n_ctx = int(n_ctx)
    if n_ctx < 4 or n_ctx > min(base.n_ctx(), quant.n_ctx()):
        raise CloverValueError(f"n_ctx must be 4 to {min(base.n_ctx(), quant.n_ctx())} (the contexts' size), got {n_ctx}")
    n_chunk = len(toks) // n_ctx
    if max_chunks is not None:
        n_chunk = min(n_chunk, int(max_chunks))
    if n_chunk < 1:
        raise CloverValueError(f"the text has {len(toks)} tokens, fewer than one chunk of n_ctx={n_ctx}")
    B = int(block_size or base.train_block_size)
    ratios = [float(r) for r in mask_ratios]
    if any(not 0.0 < r <= 1.0 for r in ratios):
        raise CloverValueError(f"mask ratios must be in (0, 1], got {ratios}")
    if ratios and B < 2:
        raise CloverValueError("block passes need a block size of 2 or more")
    mask = base.mask_token
    bos = base.bos_token
    rng = np.random.default_rng(seed)
    causal = KLDStats()
    blocks = {r: KLDStats() for r in ratios}
    first = n_ctx // 2
    for i in range(n_chunk):
        chunk = list(toks[i * n_ctx:(i + 1) * n_ctx])
        if bos >= 0 and isinstance(text, str):
            chunk[0] = bos
        base.reset()
        quant.reset()
        lb = base.commit(chunk[:first], logits=True)
        lq = quant.commit(chunk[:first], logits=True)
        # causal: positions first.. n_ctx - 2 predict first + 1 .. (the second half, as llama-perplexity)
        cb = [lb[-1:]]
        cq = [lq[-1:]]
        p = first
        while p < n_ctx:
            blk = chunk[p:min(p + B, n_ctx)]
            if ratios and len(blk) >= 2:
                for r in ratios:
                    # position p is predicted by the committed text (L_last), never by the pass:
                    # mask among p+1.. (at least one), as decoding sees them
                    n_mask = max(1, round(r * (len(blk) - 1)))
                    masked = np.sort(rng.choice(np.arange(1, len(blk)), size=n_mask, replace=False))
                    canvas = list(blk)
                    canvas[0] = mask if r == 1.0 else canvas[0]
                    for q in masked:
                        canvas[q] = mask
                    ob = base.block_logits(canvas)[masked - 1]
                    oq = quant.block_logits(canvas)[masked - 1]
                    blocks[r].add(ob, oq, np.asarray(blk, dtype=np.int64)[masked])
            cb.append(base.commit(blk, logits=True))
            cq.append(quant.commit(blk, logits=True))
            p += len(blk)
        rows_b, rows_q = np.concatenate(cb)[:-1], np.concatenate(cq)[:-1]  # the last one predicts past the chunk
        causal.add(rows_b, rows_q, np.asarray(chunk[first:], dtype=np.int64))
        if progress is not None:
            progress(i + 1, n_chunk)
    base.reset()
    quant.reset()
    return KLDResult(causal=causal.summary(), blocks={r: s.summary() for r, s in blocks.items()},
                     n_ctx=n_ctx, n_chunks=n_chunk, block_size=B)


# ----------------------------------------------------------------------------- command

def _command() -> Any:
    import click

    from .cli import CONTEXT_SETTINGS, UserError, open_model

    @click.command(name="kld", context_settings=CONTEXT_SETTINGS)
    @click.argument("base", metavar="BASE_GGUF")
    @click.argument("quant", metavar="QUANT_GGUF")
    @click.argument("file", metavar="TEXT_FILE")
    @click.option("-c", "--ctx-size", "chunk", type=click.IntRange(min=4), default=512, show_default=True,
                  help="Tokens per chunk (as llama-perplexity's -c): each chunk is scored on its second half.")
    @click.option("-b", "--block-size", type=click.IntRange(min=2), default=None,
                  help="Block size of the block passes (default: the model's training block size).")
    @click.option("--mask-ratios", default=",".join(f"{r:g}" for r in DEFAULT_MASK_RATIOS), show_default=True,
                  help="Fractions of each canvas masked for the block passes ('' = causal only).")
    @click.option("--chunks", type=click.IntRange(min=1), default=None, help="At most this many chunks.")
    @click.option("--seed", type=int, default=0, show_default=True, help="Seed of the canvases' masks.")
    @click.option("-t", "--threads", type=click.IntRange(1, 512), default=None, help="CPU threads.")
    @click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
    def main(base: str, quant: str, file: str, chunk: int, block_size: int | None, mask_ratios: str,
             chunks: int | None, seed: int, threads: int | None, as_json: bool) -> None:
        """KL divergence of QUANT_GGUF from BASE_GGUF (its f16/bf16 original) over a text file:
        mean KLD, top-1 agreement and perplexity ratio on the causal path and on block passes
        over masked canvases."""
        try:
            ratios = [float(x) for x in mask_ratios.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--mask-ratios: not a list of numbers: {mask_ratios!r}") from None
        path = Path(file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: cannot read the text ({e.__class__.__name__}: {e})") from None
        from .model import CloverError

        with open_model(base, threads, chunk, 0, None, False) as mb, open_model(quant, threads, chunk, 0, None,
                                                                                     False) as mq:
            try:
                r = kl_divergence(mb, mq, text, n_ctx=chunk, block_size=block_size, mask_ratios=ratios, seed=seed,
                                  max_chunks=chunks,
                                  progress=(lambda i, n: print(f"\rchunk {i}/{n}", end="", file=sys.stderr, flush=True))
                                  if sys.stderr.isatty() else None)
            except CloverError as e:
                raise UserError(e.message) from None
        if sys.stderr.isatty():
            print(file=sys.stderr)
        if as_json:
            import json

            click.echo(json.dumps({"causal": r.causal, "blocks": {f"{k:g}": v for k, v in r.blocks.items()},
                                   "n_ctx": r.n_ctx, "n_chunks": r.n_chunks, "block_size": r.block_size}, indent=1))
        else:
            click.echo(f"{Path(quant).name} vs {Path(base).name}")
            click.echo(r.format())

    return main


def __getattr__(name: str) -> Any:  # `main` is built on first use (click and the cli module are imported then)
    if name == "main":
        cmd = _command()
        globals()["main"] = cmd
        return cmd
    raise AttributeError(name)
