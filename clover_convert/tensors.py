"""The plan's records of one output tensor (:class:`TensorPlan`, its source slabs :class:`Piece`):
made by :mod:`.plan`, read by the GGUF writer, the filler and the one-pass quantizer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as QT

from .mapping import Rule

__all__ = ["Piece", "TensorPlan"]


@dataclass
class Piece:
    """One source slab of an output tensor: the tensor hf, or in a fused expert tensor, the rows
    row0.. (as many as the output piece has) of expert ``expert``."""

    hf: str
    expert: int | None = None
    row0: int = 0


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]        # numpy order, final
    qtype: QT
    nbytes: int
    pieces: list[Piece]           # one per expert when stacked
    stacked: bool
    rule: Rule
    src_dtype: str
    row_perm: np.ndarray | None = field(default=None, repr=False)
    col_perm: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_params(self) -> int:
        return math.prod(self.shape)
