"""Hugging Face Clover checkpoint -> GGUF, streaming: the orchestrator.

``convert(src, out, ...)`` plans the whole conversion from the config and the safetensors
headers (no weights read: :mod:`.plan`, with :mod:`.source` for the folder or hub repo and
:mod:`.gguf_writer` for the header), writes the GGUF header, metadata and tensor infos, then
the tensor data (:mod:`.filler`): chunk by chunk on every core, read from the memory-mapped
source just before it is needed, the mappings released as it goes. A stacked expert tensor is
its experts' slabs one after the other, so peak memory is a few chunks per worker plus a few
tens of MB, not the model size.

Output is written to hidden temporary files next to the output and renamed into place
at the end; on any failure or interruption the temporaries are removed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from clover_gguf.files import check_output, clean_stale_temps, fmt_bytes, temp_path

from .config import ConversionError
from .filler import Filler
from .gguf_writer import Placement, WriteBack
from .plan import (
    NO_MASK_WARNING,
    OUTTYPES,
    ConversionPlan,
    parse_size,
    plan_conversion,
)
from .safetensors_io import CheckpointError, CheckpointReader
from .source import HUB_PATTERNS
from .tensors import TensorPlan

__all__ = [
    "convert",
    "plan_conversion",
    "ConversionPlan",
    "TensorPlan",
    "ConversionError",
    "CheckpointError",
    "parse_size",
    "OUTTYPES",
    "HUB_PATTERNS",
]


def _check_disk(plan: ConversionPlan) -> None:
    need = plan.total_bytes + len(plan.tensors) * 64 + sum(len(s) + 16 for s in plan.tokenizer.tokens) + \
        sum(len(s) + 16 for s in plan.tokenizer.merges) + (1 << 20)
    try:
        free = shutil.disk_usage(plan.out.parent).free
    except OSError as e:
        raise ConversionError(f"{plan.out.parent}: cannot check free space: {e}") from None
    if free < need:
        raise ConversionError(
            f"not enough free disk space in {plan.out.parent}: need {fmt_bytes(need)}, have {fmt_bytes(free)}"
        )


def _fill(plan: ConversionPlan, filler: Filler, where: dict[str, Placement], bar) -> None:  # noqa: ANN001 - a tqdm bar or None
    """Every tensor's data, the chunks of two tensors queued at a time (no worker waits between
    tensors); the written bytes go to disk as they come (WriteBack)."""
    write_back, queued = WriteBack(), deque()

    def finish(t: TensorPlan, jobs: list[Future]) -> None:
        filler.wait(t, jobs)
        place = where[t.name]
        write_back.written_up_to(place.fd, place.offset + t.nbytes)
        if bar is not None:
            bar.set_postfix_str(t.name, refresh=False)
            bar.update(t.nbytes)

    try:
        for t in plan.tensors:
            queued.append((t, filler.submit(t, *where[t.name])))
            if len(queued) == 2:
                finish(*queued.popleft())
        while queued:
            finish(*queued.popleft())
    except BaseException:
        for _, jobs in queued:
            for job in jobs:
                job.cancel()
        raise


def _warn_about_values(filler: Filler) -> None:
    for name, n in filler.nonfinite.items():  # converted as they are, but the user should know
        print(f"warning: {name}: {n} NaN/Inf value(s) in the checkpoint", file=sys.stderr)
    for name, n in filler.beyond_f16.items():
        print(f"warning: {name}: {n} value(s) past the f16 range (+-65504) written as +-inf "
              "(--outtype bf16 or f32 keeps them)", file=sys.stderr)


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike | None = None,
    outtype: str = "auto",
    split_max_size: int | str | None = None,
    dry_run: bool = False,
    force: bool = False,
    progress: bool = True,
) -> ConversionPlan:
    """Convert a Clover checkpoint (folder or hub id ``org/name``) to GGUF.

    Returns the :class:`ConversionPlan` (tensor list, shard paths, totals). With
    ``dry_run`` nothing is read beyond headers and nothing is written.
    Raises ConversionError / CheckpointError (one-line messages) on bad input.
    """
    t0 = time.monotonic()
    plan = plan_conversion(src, out, outtype, split_max_size, dry_run=dry_run)
    if plan.config.mask_token_id is None:
        print(NO_MASK_WARNING, file=sys.stderr)
    if dry_run:
        return plan

    inputs = plan.source.files()
    for p in plan.shard_paths:
        check_output(Path(p), inputs, force, ConversionError)
        clean_stale_temps(Path(p))
    _check_disk(plan)

    reader = CheckpointReader(plan.folder)
    w = plan.writer
    temps = {Path(p): temp_path(Path(p)) for p in plan.shard_paths}
    bar = None
    try:
        where = w.write_header(Path(plan.out), temps)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="Converting", leave=False)
        filler = Filler(reader)
        try:
            _fill(plan, filler, where, bar)
        finally:
            filler.close()
        w.finish()
        reader.close()
        for final, tp in temps.items():
            os.replace(tp, final)
        _warn_about_values(filler)
    except BaseException:
        try:
            w.close()
        except Exception:  # noqa: BLE001
            pass
        reader.close()
        for tp in temps.values():
            try:
                tp.unlink()
            except FileNotFoundError:
                pass
        raise
    finally:
        if bar is not None:
            bar.close()
    plan.elapsed_s = time.monotonic() - t0
    return plan
