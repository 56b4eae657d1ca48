"""The types of the row backends: what a chunk's facts, a dtype's reference and a cell's row metrics are, and
the interface a backend implements (``attncheck.numerics.backends`` picks one)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from attncheck.numerics.methods.online import online_softmax
from attncheck.numerics.reduce import finite

FUSED_MIN_ELEMENTS = 1 << 22  # below this, numba's import and compile cost more than they save


@dataclass
class ChunkFacts:
    """Facts about a block of rows of the scores as given, shared by every cell."""

    x: torch.Tensor  # (r, T) as given
    offset: int  # global index of the first row
    nan_count: torch.Tensor  # (r,) int
    posinf_count: torch.Tensor
    neginf_count: torch.Tensor
    masked: torch.Tensor  # (r,) count of entries -inf or <= MASK_SENTINEL_LIMIT
    n_finite: torch.Tensor  # (r,)
    max_finite: torch.Tensor  # (r,) float64, -inf where no finite entry
    min_finite: torch.Tensor  # (r,) float64, +inf where no finite entry
    unmasked_min: torch.Tensor  # (r,) float64 min of finite entries > MASK_SENTINEL_LIMIT, +inf if none
    sum1: torch.Tensor  # (r,) float64 sum of finite (x - shift)
    sum2: torch.Tensor  # (r,) float64 sum of finite (x - shift)^2
    ref: torch.Tensor  # (r, T) float64 reference
    ref_sum: torch.Tensor  # (r,) S = sum(exp(x - max)), NaN where undefined; max prob = 1 / S
    ref_entropy: torch.Tensor  # (r,)
    ref_jacobian: torch.Tensor  # (r,) ||diag(p) - p p^T||_F of the reference, 0 where undefined
    ref_positive_count: torch.Tensor  # (r,) keys with p > 0
    ref_top: torch.Tensor  # (r, 1) index of the reference's most likely key
    masked_rows: torch.Tensor | None = None  # (r,) set when the mask is known exactly (Q/K inputs)

    @property
    def nan(self) -> torch.Tensor:
        return self.nan_count > 0

    @property
    def posinf(self) -> torch.Tensor:
        return self.posinf_count > 0

    @property
    def all_neginf(self) -> torch.Tensor:
        return self.neginf_count == self.x.shape[-1]

    @property
    def bad(self) -> torch.Tensor:
        return self.n_finite < self.x.shape[-1]

    @cached_property
    def ref_ok(self) -> torch.Tensor:
        """(r,) rows whose reference is defined; computed once (every cell reads it)."""
        return finite(self.ref_sum)

    @property
    def all_masked(self) -> torch.Tensor:
        if self.masked_rows is not None:
            return self.masked_rows
        return self.masked == self.x.shape[-1]


@dataclass
class AlgoReference:
    """The scores of one dtype's cells and the float64 softmax of those scores: the
    yardstick of the algorithmic error, apart from the cast. ``same``: the scores are
    the chunk's own (no cast), so this reference is the chunk's."""

    xc: torch.Tensor  # (r, T) in the cell's dtype
    ok: torch.Tensor  # (r,) rows where the softmax of xc is defined
    ref: torch.Tensor  # (r, T) float64; only rows where ``ok`` are meaningful
    same: bool


@dataclass
class RowMetrics:
    """One cell's numbers per row of a chunk; all (r,) float64 unless noted."""

    pmax: torch.Tensor  # max p; NaN if any entry is NaN; 0 only for all-zero rows
    psum: torch.Tensor  # sum p (0 where the reference is undefined)
    sq_err: torch.Tensor  # sum (p - ref)^2
    max_err: torch.Tensor  # max |p - ref|
    sq_err_algo: torch.Tensor | None  # the same two against the algo reference (None when it is the chunk's)
    max_err_algo: torch.Tensor | None
    kl: torch.Tensor  # generalised KL(ref || max(p, floor))
    flushed: torch.Tensor  # (r,) int: keys with p == 0 where ref > 0
    p_at_top: torch.Tensor  # p at the reference's most likely key


class RowBackend(abc.ABC):
    """Computes the row facts of a chunk; ``name`` says which backend ran."""

    name: str

    @abc.abstractmethod
    def chunk(self, x: torch.Tensor, offset: int, shift: float) -> ChunkFacts:
        """Census facts relative to ``shift`` (sums of x - shift keep the std accurate)
        and the float64 reference of the rows ``x`` (r, T) as given."""

    @abc.abstractmethod
    def algo_reference(self, xc: torch.Tensor) -> AlgoReference:
        """Scores already in a cell's dtype with their float64 softmax."""

    @abc.abstractmethod
    def cell_metrics(
        self, c: ChunkFacts, probs: Sequence[torch.Tensor], algo: AlgoReference, precise: bool = False
    ) -> list[RowMetrics]:
        """Row metrics of each of one dtype's cells, in the order of ``probs``. ``precise``:
        the cells computed in fp32 (their errors are ~1e-7 relative), a hint a backend may
        use for speed; the numbers do not depend on it."""

    def method(self, spec, algo: AlgoReference, params):
        """A method's output (softmax.MethodOutput) on ``algo.xc`` computed by this backend's own
        kernel (``spec.rows_kernel``), or None: then the method's torch implementation runs."""
        return None

    def online(self, x: torch.Tensor, p_dtype: torch.dtype, block: int, reverse: bool = False) -> torch.Tensor:
        """The online softmax of the rows ``x`` (r, T), P rounded to ``p_dtype``: effective
        probabilities (r, T) float32 with the rounding points of ``methods.online``."""
        return online_softmax(x, p_dtype, min(block, x.shape[-1]), reverse)

    def same_reference(self, c: ChunkFacts) -> AlgoReference:
        """The chunk's scores need no cast: its reference is the algo reference."""
        return AlgoReference(c.x, c.ref_ok, c.ref, same=True)
