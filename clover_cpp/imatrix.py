"""``clover imatrix``: an importance matrix collected on Clover's own decoding paths.

llama-imatrix decodes causally only. Clover decodes by causal commits *and* block passes over
canvases with mask tokens, and the inputs of a matrix multiplication differ between the two,
so both are collected: the calibration text in chunks of n_ctx tokens (each on an empty
memory); the first half of a chunk is committed (a prompt), then for each decode block of the
second half (B positions, as decoding lays them out) a block pass over the true block with a
fraction r of it masked, for each r of ``mask_ratios`` (decoding starts a block fully masked
and unmasks it step by step; the masks are seeded), then the block is committed.

The inputs are read as llama-imatrix reads them: llama.cpp's eval callback (here the process's
default one, patch 0008: libclover's contexts set none) sees every MUL_MAT / MUL_MAT_ID whose
weight is a tensor of the model, and adds the squares of each input column: per weight (per
expert for stacked experts) the sums and the number of rows summed. The file is llama.cpp's
GGUF imatrix format (NAME.in_sum2 [experts, columns], NAME.counts [experts, 1], general.type
= imatrix, imatrix.datasets / chunk_count / chunk_size), sorted by name as llama-imatrix writes
it: ``clover quantize --imatrix``, ``clover convert --outtype iq4_xs --imatrix`` and
``llama-quantize --imatrix`` read it. Unlike llama-imatrix, batches of fewer than 16 rows are
not skipped (a block pass has B rows; the causal commits of a chunk are batched anyway).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ._ggml import GGML_TYPE_F32, ggml_backend_sched_eval_callback, set_default_eval_callback, tensor_array
from ._ggml import lib as ggml_lib

__all__ = ["ImatrixCollector", "collect_imatrix", "write_imatrix", "main"]

DEFAULT_MASK_RATIOS = (1.0, 0.75, 0.5, 0.25)


def _filter_name(name: str) -> str:
    """llama-imatrix's filter_tensor_name: the part between '#'s when there are any."""
    if "#" in name:
        return name.split("#", 2)[1]
    return name


@dataclass
class _Entry:
    values: np.ndarray   # float64 [n_mat, ne0]
    counts: np.ndarray   # float64 [n_mat]


@dataclass
class ImatrixCollector:
    """Sums of squared matmul inputs per weight, from llama.cpp's eval callback (install() /
    uninstall(); contexts created in between report to it)."""

    weights: set[str]                     # the model's weight names (only these are collected)
    process_output: bool = False          # also output.weight (llama-imatrix's --process-output)
    stats: dict[str, _Entry] = field(default_factory=dict)
    error: BaseException | None = None
    active: bool = True                   # off: the callback asks for nothing

    def install(self) -> None:
        self._op_names: dict[int, bytes] = {}
        self._cb = ggml_backend_sched_eval_callback(self._callback)
        set_default_eval_callback(self._cb)

    def uninstall(self) -> None:
        set_default_eval_callback(None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    def _op(self, op: int) -> bytes:
        n = self._op_names.get(op)
        if n is None:
            n = self._op_names[op] = ggml_lib().ggml_op_name(op) or b""
        return n

    def _callback(self, tp: Any, ask: bool, _ud: Any) -> bool:
        if not self.active:
            return False if ask else True
        try:
            t = tp.contents
            op = self._op(t.op)
            if op not in (b"MUL_MAT", b"MUL_MAT_ID"):
                return False if ask else True
            src0 = t.src[0].contents
            name = _filter_name(src0.name.decode("utf-8", "replace"))
            if name not in self.weights or (name == "output.weight" and not self.process_output):
                return False if ask else True
            src1 = t.src[1].contents
            if src1.type != GGML_TYPE_F32:
                return False if ask else True
            if ask:
                return True
            x = tensor_array(src1).astype(np.float64)  # [ne3, ne2, ne1, ne0]
            ne0 = int(src1.ne[0])
            if op == b"MUL_MAT_ID":
                n_as = int(src0.ne[2])
                ids = tensor_array(t.src[2].contents)[0, 0]  # [n_tokens, n_ids]
                e = self.stats.get(name)
                if e is None:
                    e = self.stats[name] = _Entry(np.zeros((n_as, ne0)), np.zeros(n_as))
                xs = x[0]  # [n_tokens, ne1, ne0]
                ne1 = xs.shape[1]
                for idx in range(ids.shape[1]):
                    ex = ids[:, idx]
                    if ((ex < 0) | (ex >= n_as)).any():
                        raise RuntimeError(f"{name}: expert id out of range")
                    np.add.at(e.values, ex, xs[:, idx % ne1, :] ** 2)
                    e.counts += np.bincount(ex, minlength=n_as)
            else:
                n_mat = int(src0.ne[2] * src0.ne[3])
                e = self.stats.get(name)
                if e is None:
                    e = self.stats[name] = _Entry(np.zeros((n_mat, ne0)), np.zeros(1))
                sq = (x ** 2).sum(axis=2)  # [ne3, ne2, ne0]
                for i3 in range(sq.shape[0]):
                    for i2 in range(sq.shape[1]):
                        e.values[(i3 % int(src0.ne[3])) * int(src0.ne[2]) + (i2 % int(src0.ne[2]))] += sq[i3, i2]
                e.counts += x.shape[0] * x.shape[1] * x.shape[2] / n_mat
            if not np.isfinite(e.values).all():
                raise RuntimeError(f"{name}: non-finite activations")
            return True
        except BaseException as ex:  # noqa: BLE001 - kept, raised by the caller after the pass
            if self.error is None:
                self.error = ex
            return True if not ask else False


def _weight_names(path: Path) -> set[str]:
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name for t in r.tensors if len(t.shape) >= 2 and t.name.endswith(".weight")}


def collect_imatrix(model_path: str | os.PathLike, text: str, n_ctx: int = 512, block_size: int | None = None,
                    mask_ratios: Sequence[float] = DEFAULT_MASK_RATIOS, causal: bool = True, seed: int = 0,
                    max_chunks: int | None = None, n_threads: int | None = None, process_output: bool = False,
                    progress: Callable[[int, int], None] | None = None) -> tuple[ImatrixCollector, int]:
    """Run the calibration text through the model (see the module doc); returns the collector
    and the number of chunks. ``causal=False`` collects the block passes only (the commits are
    run with the collector off)."""
    from .model import Clover, CloverValueError

    coll = ImatrixCollector(_weight_names(Path(model_path)), process_output=process_output)
    # installed for the whole run: a context llama.cpp makes again later reports too
    with coll.installed(), Clover(model_path, n_ctx=n_ctx, n_threads=n_threads, block_size=block_size) as m:
        toks = m.tokenize(text, add_bos=True, special=True)
        n_chunk = len(toks) // n_ctx
        if max_chunks is not None:
            n_chunk = min(n_chunk, int(max_chunks))
        if n_chunk < 1:
            raise CloverValueError(f"the calibration text has {len(toks)} tokens, fewer than one chunk of n_ctx={n_ctx}")
        ratios = [float(r) for r in mask_ratios]
        if any(not 0.0 < r <= 1.0 for r in ratios):
            raise CloverValueError(f"mask ratios must be in (0, 1], got {ratios}")
        B = m.block_size
        rng = np.random.default_rng(seed)
        bos, mask = m.bos_token, m.mask_token
        first = n_ctx // 2
        for i in range(n_chunk):
            chunk = list(toks[i * n_ctx:(i + 1) * n_ctx])
            if bos >= 0:
                chunk[0] = bos
            m.reset()
            coll.active = causal
            m.commit(chunk[:first], logits=True)  # with logits: every row reaches the last layer
            p = first
            while p < n_ctx:
                blk = chunk[p:min(p + B, n_ctx)]
                if ratios and len(blk) >= 2:
                    coll.active = True
                    for r in ratios:
                        n_mask = max(1, round(r * (len(blk) - 1)))
                        masked = rng.choice(np.arange(1, len(blk)), size=n_mask, replace=False)
                        canvas = list(blk)
                        if r == 1.0:
                            canvas[0] = mask
                        for q in masked:
                            canvas[int(q)] = mask
                        m.block_logits(canvas)
                coll.active = causal
                m.commit(blk, logits=True)
                p += len(blk)
            if coll.error is not None:
                raise coll.error
            if progress is not None:
                progress(i + 1, n_chunk)
        m.reset()
    return coll, n_chunk


def write_imatrix(coll: ImatrixCollector, path: str | os.PathLike, datasets: Sequence[str], chunk_count: int,
                  chunk_size: int) -> Path:
    """The GGUF imatrix file as llama-imatrix writes it (names sorted; in_sum2 [n_mat, ne0] and
    counts [n_mat, 1], float32), written to a temporary and renamed into place."""
    import gguf

    from clover_gguf.files import temp_path

    path = Path(path)
    tmp = temp_path(path)
    try:
        w = gguf.GGUFWriter(tmp, arch="imatrix")
        w.add_type(gguf.GGUFType.IMATRIX)
        w.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
        for name in sorted(coll.stats):
            e = coll.stats[name]
            w.add_tensor(f"{name}.in_sum2", e.values.astype(np.float32))
            w.add_tensor(f"{name}.counts", e.counts.astype(np.float32).reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ----------------------------------------------------------------------------- command

def _command() -> Any:
    import click

    from .cli import CONTEXT_SETTINGS, UserError

    @click.command(name="imatrix", context_settings=CONTEXT_SETTINGS)
    @click.option("-m", "--model", required=True, metavar="GGUF", help="The model (f16/bf16/f32 GGUF).")
    @click.option("-f", "--file", "file", required=True, metavar="TEXT_FILE", help="Calibration text.")
    @click.option("-o", "--output", required=True, metavar="OUT", help="The importance matrix to write (GGUF).")
    @click.option("-c", "--ctx-size", "chunk", type=click.IntRange(min=4), default=512, show_default=True,
                  help="Tokens per chunk: the first half committed, the second decoded block by block.")
    @click.option("-b", "--block-size", type=click.IntRange(min=1), default=None,
                  help="Block size of the block passes (default: the model's training block size).")
    @click.option("--mask-ratios", default=",".join(f"{r:g}" for r in DEFAULT_MASK_RATIOS), show_default=True,
                  help="Fractions of each canvas masked ('' = causal commits only).")
    @click.option("--no-causal", is_flag=True, help="Collect the block passes only.")
    @click.option("--chunks", type=click.IntRange(min=1), default=None, help="At most this many chunks.")
    @click.option("--process-output", is_flag=True, help="Also collect output.weight (as llama-imatrix).")
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("-t", "--threads", type=click.IntRange(1, 512), default=None, help="CPU threads.")
    @click.option("--force", is_flag=True, help="Overwrite OUT.")
    def main(model: str, file: str, output: str, chunk: int, block_size: int | None, mask_ratios: str,
             no_causal: bool, chunks: int | None, process_output: bool, seed: int, threads: int | None,
             force: bool) -> None:
        """Importance matrix for quantizing (IQ types, Q2_K, ...) from causal commits and block
        passes over masked canvases, in llama.cpp's GGUF imatrix format."""
        from .model import CloverError

        try:
            ratios = [float(x) for x in mask_ratios.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--mask-ratios: not a list of numbers: {mask_ratios!r}") from None
        if no_causal and not ratios:
            raise UserError("--no-causal with no mask ratios collects nothing")
        out = Path(output)
        if out.exists() and not force:
            raise UserError(f"{out} exists (--force overwrites it)")
        if out.exists() and out.resolve() in (Path(model).resolve(), Path(file).resolve()):
            raise UserError(f"{out} is one of the inputs")
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{file}: cannot read the text ({e.__class__.__name__}: {e})") from None
        if not Path(model).is_file():
            raise UserError(f"{model}: no such file")
        try:
            coll, n = collect_imatrix(model, text, n_ctx=chunk, block_size=block_size, mask_ratios=ratios,
                                      causal=not no_causal, seed=seed, max_chunks=chunks, n_threads=threads,
                                      process_output=process_output,
                                      progress=(lambda i, k: print(f"\rchunk {i}/{k}", end="", file=sys.stderr,
                                                                   flush=True)) if sys.stderr.isatty() else None)
        except CloverError as e:
            raise UserError(e.message) from None
        if sys.stderr.isatty():
            print(file=sys.stderr)
        write_imatrix(coll, out, [Path(file).name], n, chunk)
        click.echo(f"wrote {out}: {len(coll.stats)} weights, {n} chunks of {chunk} tokens", err=True)

    return main


def __getattr__(name: str) -> Any:
    if name == "main":
        cmd = _command()
        globals()["main"] = cmd
        return cmd
    raise AttributeError(name)
