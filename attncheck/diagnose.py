"""Tensors -> diagnosis: census of the input, one result per (method, dtype) cell,
the distribution of the reference, and findings with a fix.

The score tensor is viewed as (rows, keys) and processed in row chunks; every
statistic is aggregated across chunks, so no float64 copy of the whole input
is ever made. No printing, no paths, no typer or rich here.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import torch

from attncheck import kernels
from attncheck.errors import AttncheckError
from attncheck.names import DTYPE_NAMES, METHOD_NAMES
from attncheck.precision import (
    MASK_SENTINEL_LIMIT,
    dtype_from_name,
    dtype_label,
    exp_overflow_threshold,
    exp_underflow_threshold,
    smallest_subnormal,
)
from attncheck.softmax import ACCUMULATIONS, canonical_method, run_method

if TYPE_CHECKING:
    from attncheck.scores import AttentionAudit, AttentionInputs

NAN_CAUSES = ("input_nan", "inf_input", "fully_masked", "cast_overflow", "exp_overflow", "underflow")
UNEXPLAINED = "unexplained"


@dataclass(frozen=True)
class Options:
    dtypes: tuple[str, ...] = DTYPE_NAMES
    methods: tuple[str, ...] = METHOD_NAMES
    block: int = 128
    reverse: bool = False
    accum: str = "fp32"
    device: str = "cpu"
    chunk_elements: int = 1 << 22  # float64 working set per chunk: 32 MiB a tensor
    collapse_threshold: float = 0.99
    max_examples: int = 8
    kernels: str = "auto"  # "fused" (numba, CPU), "torch", or "auto": fused from FUSED_MIN_ELEMENTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtypes", tuple(dtype_label(dtype_from_name(d)) for d in self.dtypes))
        object.__setattr__(self, "methods", tuple(canonical_method(m) for m in self.methods))
        if not self.dtypes:
            raise AttncheckError("no dtype selected")
        if not self.methods:
            raise AttncheckError("no method selected")
        if self.block < 1:
            raise AttncheckError(f"--block must be >= 1, got {self.block}")
        if self.accum not in ACCUMULATIONS:
            raise AttncheckError(f"unknown accumulation {self.accum!r} (choose from {', '.join(ACCUMULATIONS)})")
        if self.kernels not in ("auto", "fused", "torch"):
            raise AttncheckError(f"unknown kernels {self.kernels!r} (choose from auto, fused, torch)")
        if self.chunk_elements < 1:
            raise AttncheckError(f"chunk size must be >= 1 element, got {self.chunk_elements}")


# --------------------------------------------------------------------------- results


@dataclass
class DtypeHeadroom:
    """How the input sits against one dtype's limits (computed on the scores as given)."""

    dtype: str
    max_finite: float
    exp_overflow_threshold: float
    exp_underflow_threshold: float
    headroom: float | None  # threshold - largest finite score; negative means naive exp overflows
    rows_over_exp_threshold: int  # row max above the threshold: naive softmax overflows there
    rows_all_underflow: int  # row max below the underflow threshold: naive gives 0/0
    rows_spread_beyond_underflow: int  # some unmasked key sits further than |underflow| below the row max
    cast_posinf_values: int  # finite scores that become +inf when cast
    cast_neginf_values: int  # finite scores that become -inf when cast
    cast_overflow_rows: int
    cast_overflow_examples: list[float]  # values that overflow, by the rows they are the extreme of


@dataclass
class Census:
    shape: tuple[int, ...]
    dtype: str
    rows: int
    keys: int
    finite: int
    min: float | None  # of finite values
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    posinf: int
    neginf: int
    masked: int  # -inf or <= MASK_SENTINEL_LIMIT
    sentinels: list[tuple[float, int]]  # finite mask-like values (<= -1e4) that are a row's minimum, with how many rows
    fully_masked_rows: int  # every key masked (-inf or sentinel): the query may attend to nothing
    neginf_rows: int  # every key -inf: softmax undefined, the reference is NaN
    nan_input_rows: int
    posinf_input_rows: int
    headroom: list[DtypeHeadroom]


@dataclass
class Distribution:
    """Shape of the float64 reference over rows where it is defined."""

    rows: int
    entropy_mean: float | None
    entropy_min: float | None
    entropy_max: float | None
    entropy_norm_mean: float | None  # entropy / log(unmasked keys), rows with >= 2 unmasked keys
    max_prob_mean: float | None
    collapsed_rows: int  # max probability >= collapse threshold
    collapsed_frac: float | None
    collapse_threshold: float
    jacobian_norm_mean: float | None  # ||diag(p) - p p^T||_F: softmax gradient health


@dataclass
class Cell:
    method: str
    dtype: str
    rows: int
    nan_rows: int
    nan_causes: dict[str, int]
    overflow_rows: int
    underflow_rows: int
    zero_rows: int
    zero_causes: dict[str, int]
    compared_rows: int  # rows where both the cell and the reference are finite
    max_abs_err: float | None
    rmse: float | None
    max_abs_err_algo: float | None  # against float64 softmax of the dtype-cast scores
    rmse_algo: float | None
    max_row_sum_err: float | None
    kl_mean: float | None  # generalised KL(ref || p), see kl_divergence
    kl_max: float | None
    flushed_frac: float | None  # reference-nonzero probabilities that became exactly 0
    argmax_flips: int
    examples: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    # NaN rows per index of the leading axes but the query axis, e.g. per (batch, head); most first
    nan_rows_by_head: list[tuple[tuple[int, ...], int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.method}/{self.dtype}"

    @property
    def verdict(self) -> str:
        """'nan', 'overflow', 'zero', 'flip' or 'ok' - the worst thing that happened."""
        if self.nan_rows:
            return "nan"
        if self.overflow_rows:
            return "overflow"
        if self.zero_rows - self.zero_causes.get("fully_masked", 0) > 0:
            return "zero"
        if self.argmax_flips:
            return "flip"
        return "ok"


@dataclass
class Finding:
    code: str
    severity: str  # "error", "warning" or "info"
    message: str
    fix: str
    cells: list[str] = field(default_factory=list)
    rows: int = 0
    examples: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class TensorDiagnosis:
    name: str
    shape: tuple[int, ...]
    dtype: str
    census: Census
    distribution: Distribution
    cells: list[Cell]
    findings: list[Finding]
    options: Options
    attention: "AttentionAudit | None" = None  # mask and scale facts when scores came from Q and K

    def cell(self, method: str, dtype: str) -> Cell:
        for c in self.cells:
            if c.method == method and c.dtype == dtype:
                return c
        raise KeyError(f"{method}/{dtype}")


# --------------------------------------------------------------------------- helpers

NEG_INF = float("-inf")
ROW_BLOCK = 64  # rows per exact-sum block; chunk sizes do not change any result


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    return (-torch.special.xlogy(p, p).sum(dim=-1)).clamp_min(0) + 0.0  # no -0.0


def kl_divergence(ref: torch.Tensor, p: torch.Tensor, floor: float) -> torch.Tensor:
    """KL(ref || p) per row, in the generalised form sum(r log(r/q) - r + q), q = max(p, floor).

    It equals KL when both sum to 1 and stays >= 0 when rounding leaves p off
    sum 1. log(r/q) is taken as log1p(delta) with delta = (r - q) / q, so the
    second-order quantity survives float64 rounding even when p is within 1e-7 of r
    (fp32 cells), where r log r - r log q would cancel to noise; but as log r - log q
    where q > 2r, since delta rounds to -1 when r is far below q (a key the reference
    all but excludes, against a flushed p held at the floor).
    ``floor`` (the smallest subnormal of p's dtype) keeps a flushed key finite;
    flushes are counted on their own in ``flushed_frac``.
    """
    q = p.to(torch.float64).clamp_min(floor)
    delta = torch.sub(ref, q).div_(q)
    terms = torch.special.xlog1py(ref, delta)  # r log1p(delta); 0 where r = 0
    far = delta < -0.5  # q > 2r: log1p(delta) would lose r/q to the rounding of delta
    if bool(far.any()):
        r, qf = ref[far], q[far]
        terms[far] = torch.where(r > 0, r * (torch.log(r) - torch.log(qf)), 0.0)
    return (terms.sum(dim=-1) + torch.sub(q, ref).sum(dim=-1)).clamp_min(0)


def jacobian_frobenius(p: torch.Tensor) -> torch.Tensor:
    """||diag(p) - p p^T||_F per row without forming the T x T matrix.

    ||J||_F^2 = sum p_i^2 - 2 sum p_i^3 + (sum p_i^2)^2.
    """
    p = p.reshape(-1, p.shape[-1])
    s2 = row_dot(p, p)
    s3 = row_dot(p * p, p)
    return torch.sqrt((s2 - 2 * s3 + s2 * s2).clamp_min(0))


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(r, T) x (r, T) -> (r,) sum(a * b) per row, through BLAS (about twice linalg.vecdot's speed on CPU)."""
    return torch.einsum("ij,ij->i", a, b)


def _row_abs_max(d: torch.Tensor) -> torch.Tensor:
    """max |d| per row without allocating |d|."""
    return torch.maximum(d.amax(dim=-1), d.amin(dim=-1).neg_())


def _row_finite(x: torch.Tensor) -> torch.Tensor:
    """(rows,) True where every entry is finite, in one reduction: a float64 sum of
    fp16/bf16/fp32 values cannot overflow, so it is non-finite only through inf or NaN."""
    if x.dtype == torch.float64:
        return torch.isfinite(x).all(dim=-1)
    return torch.isfinite(x.sum(dim=-1, dtype=torch.float64))


class _ExactSum:
    """Sum of per-row values that does not depend on how rows are chunked.

    Rows are summed by torch in fixed global blocks of ROW_BLOCK, and the block
    sums with math.fsum (correctly rounded), so any chunking gives the same bits.
    """

    def __init__(self) -> None:
        self.blocks: list[float] = []
        self.carry = torch.zeros(0, dtype=torch.float64)

    def add(self, values: torch.Tensor) -> None:
        v = torch.cat([self.carry, values.detach().to("cpu", torch.float64)])
        full = v.numel() - v.numel() % ROW_BLOCK
        if full:
            self.blocks.extend(v[:full].reshape(-1, ROW_BLOCK).sum(dim=-1).tolist())
        self.carry = v[full:]

    def total(self) -> float:
        tail = [float(self.carry.sum())] if self.carry.numel() else []
        return math.fsum(self.blocks + tail)


class _Max:
    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, values: torch.Tensor) -> None:
        if values.numel():
            v = float(values.max())
            self.value = v if self.value is None else max(self.value, v)


class _Examples:
    """First few flat row indices per label."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rows: dict[str, list[int]] = {}

    def add(self, label: str, mask: torch.Tensor, offset: int) -> None:
        have = self.rows.setdefault(label, [])
        if len(have) >= self.limit or not bool(mask.any()):
            return
        idx = torch.nonzero(mask).flatten()[: self.limit - len(have)]
        have.extend(int(i) + offset for i in idx.tolist())

    def unravel(self, lead: tuple[int, ...]) -> dict[str, list[tuple[int, ...]]]:
        return {k: [_unravel(i, lead) for i in v] for k, v in self.rows.items() if v}


def _unravel(flat: int, lead: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for dim in reversed(lead):
        out.append(flat % dim)
        flat //= dim
    return tuple(reversed(out))


def _attribute(target: torch.Tensor, causes: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Give each target row the first cause (pipeline order) that holds for it."""
    left = target.clone()
    out = {}
    for name, cond in causes:
        hit = left & cond
        out[name] = hit
        left &= ~hit
    out[UNEXPLAINED] = left
    return out


def _most_common(counter: Counter, k: int = 3) -> list[tuple[float, int]]:
    """Most frequent first, ties by value: the same order whatever the chunking."""
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def _count_values(counter: Counter, values: torch.Tensor) -> None:
    """Add how often each value occurs in a 1-D tensor (one entry per row) to ``counter``."""
    if values.numel():
        uniq, counts = torch.unique(values.to(torch.float64), return_counts=True)
        counter.update(dict(zip(uniq.tolist(), counts.tolist())))


# --------------------------------------------------------------------------- one chunk of rows


@dataclass
class _Chunk:
    """Facts about a block of rows of the scores as given, shared by every cell.

    Built by the fused CPU kernel (``kernels.reference_rows``) or by torch ops
    (CUDA, or without numba); both give the same per-row vectors.
    """

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
    ref_p2: torch.Tensor  # (r,) sum p^2
    ref_p3: torch.Tensor  # (r,) sum p^3
    ref_positive_count: torch.Tensor  # (r,) keys with p > 0
    ref_top: torch.Tensor  # (r, 1) index of the reference's most likely key
    fused: bool = False
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

    @property
    def ref_ok(self) -> torch.Tensor:
        return torch.isfinite(self.ref_sum)

    @property
    def all_masked(self) -> torch.Tensor:
        if self.masked_rows is not None:
            return self.masked_rows
        return self.masked == self.x.shape[-1]

    @classmethod
    def of(cls, x: torch.Tensor, offset: int, shift: float = 0.0, fused: bool = False, workspace: "_Workspace | None" = None) -> "_Chunk":
        """Census facts relative to ``shift`` (sums of x - shift keep the std accurate)."""
        return cls._fused(x, offset, shift, workspace or _Workspace()) if fused else cls._torch(x, offset, shift)

    @classmethod
    def _fused(cls, x: torch.Tensor, offset: int, shift: float, workspace: "_Workspace") -> "_Chunk":
        # fp16/bf16 scores widen exactly to fp32: one compiled kernel fewer per dtype
        xn = kernels.as_rows(x if x.dtype in (torch.float32, torch.float64) else x.float())
        ref = workspace.take("ref", xn.shape)
        out = kernels.compiled()["reference_rows"](xn, shift, MASK_SENTINEL_LIMIT, ref)
        t = [torch.from_numpy(a) for a in out]
        nan, posinf, neginf, masked, finite, fmax, fmin, umin, s1, s2, ssum, ent, p2, p3, pos, top = t
        return cls(x, offset, nan, posinf, neginf, masked, finite, fmax, fmin, umin, s1, s2,
                   torch.from_numpy(ref), ssum, ent, p2, p3, pos, top.unsqueeze(-1), fused=True)

    @classmethod
    def _torch(cls, x: torch.Tensor, offset: int, shift: float) -> "_Chunk":
        keys = x.shape[-1]
        bad = ~_row_finite(x)
        x64 = x.to(torch.float64, copy=True)  # (r, T): this chunk's own float64 copy, reused in place
        zero = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        nan, posinf, neginf = zero.clone(), zero.clone(), zero.clone()
        n_finite = torch.full_like(zero, keys)
        max_f = x64.amax(dim=-1)
        min_f = x64.amin(dim=-1)
        xs = x64 - shift  # (r, T)
        if bool(bad.any()):
            idx = torch.nonzero(bad).flatten()
            xb = x64[idx]
            fin = torch.isfinite(xb)
            nan[idx] = torch.isnan(xb).sum(dim=-1)
            posinf[idx] = torch.isposinf(xb).sum(dim=-1)
            neginf[idx] = torch.isneginf(xb).sum(dim=-1)
            n_finite[idx] = fin.sum(dim=-1)
            max_f[idx] = torch.where(fin, xb, NEG_INF).amax(dim=-1)
            min_f[idx] = torch.where(fin, xb, float("inf")).amin(dim=-1)
            xs[idx] = torch.where(fin, xs[idx], 0.0)
        s1 = xs.sum(dim=-1)
        s2 = row_dot(xs, xs)
        del xs
        masked = (x64 <= MASK_SENTINEL_LIMIT).sum(dim=-1)
        unmasked_min = torch.where(torch.isfinite(x64) & (x64 > MASK_SENTINEL_LIMIT), x64, float("inf")).amin(dim=-1) if bool((masked > 0).any()) else min_f.clone()
        top = x.argmax(dim=-1, keepdim=True)  # the reference's most likely key (softmax is monotonic)
        ref, ssum, ent = _reference_in_place(x64, bad)
        ref_ok = torch.isfinite(ssum)
        p2 = torch.where(ref_ok, row_dot(ref, ref), 0.0)
        p3 = torch.where(ref_ok, row_dot(ref * ref, ref), 0.0)
        pos = torch.where(ref_ok, torch.count_nonzero(ref > 0, dim=-1), 0)
        return cls(x, offset, nan, posinf, neginf, masked, n_finite, max_f, min_f, unmasked_min, s1, s2,
                   ref, ssum, ent, p2, p3, pos, top)


class _Workspace:
    """float64 buffers the fused kernels write into, reused from chunk to chunk. A fresh
    buffer of 32 MiB or more is a new mapping whose pages fault in again on every chunk;
    reuse makes that once per diagnosis. A buffer taken under a name is valid until the
    name is taken again."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.size < n:
            buf = self._buffers[name] = np.empty(n, dtype=np.float64)
        return buf[:n].reshape(shape)


FUSED_MIN_ELEMENTS = 1 << 22  # below this, numba's import and compile cost more than they save


def _use_fused(options: Options, device: torch.device, elements: int) -> bool:
    if device.type != "cpu" or options.kernels == "torch" or not kernels.available():
        return False
    return options.kernels == "fused" or elements >= FUSED_MIN_ELEMENTS


def _first_finite(x: torch.Tensor) -> float | None:
    fin = torch.isfinite(x).reshape(-1)
    idx = torch.nonzero(fin)
    return float(x.reshape(-1)[idx[0, 0]]) if idx.numel() else None


def _reference_in_place(x64: torch.Tensor, bad: torch.Tensor):
    """float64 max-subtracted softmax, overwriting ``x64`` with z = x - max.

    Returns the reference, S = sum(exp(z)) (NaN where the softmax is undefined)
    and the entropy log S - sum(p z) (no log per entry).
    """
    z = x64.sub_(x64.amax(dim=-1, keepdim=True))  # (r, T); NaN rows: NaN, -inf keys: -inf
    p = torch.exp(z)
    s = p.sum(dim=-1, keepdim=True)
    p.div_(s)
    s = s.squeeze(-1)
    if bool(bad.any()):
        z.clamp_(min=torch.finfo(torch.float64).min)  # -inf keys have p = 0; keep 0 * z finite
    h = (torch.log(s) - row_dot(p, z)).clamp_min(0) + 0.0
    return p, s, h


# --------------------------------------------------------------------------- accumulators


class _CensusAcc:
    def __init__(self, dtypes: tuple[str, ...]) -> None:
        self.dtypes = dtypes
        self.n_finite = 0
        self.shift = 0.0  # set from the first finite value before the first chunk is counted
        self.sum1 = _ExactSum()
        self.sum2 = _ExactSum()
        self.max, self.min = _Max(), _Max()  # min kept as max of -x
        self.nan = self.posinf = self.neginf = self.masked = 0
        self.sentinel_rows: Counter[float] = Counter()  # mask-like row minimum -> rows
        self.fully_masked_rows = self.neginf_rows = self.nan_rows = self.posinf_rows = 0
        self.rows_over = Counter()
        self.rows_under = Counter()
        self.rows_spread = Counter()
        self.cast_pos = Counter()
        self.cast_neg = Counter()
        self.cast_rows = Counter()
        self.cast_values: dict[str, Counter[float]] = {d: Counter() for d in dtypes}

    def update(self, c: _Chunk) -> None:
        keys = c.x.shape[-1]
        fin_rows = c.n_finite > 0
        self.max.add(c.max_finite[fin_rows])
        self.min.add(-c.min_finite[fin_rows])
        self.n_finite += int(c.n_finite.sum())
        self.sum1.add(c.sum1)
        self.sum2.add(c.sum2)
        self.nan += int(c.nan_count.sum())
        self.posinf += int(c.posinf_count.sum())
        self.neginf += int(c.neginf_count.sum())
        self.masked += int(c.masked.sum())
        self.fully_masked_rows += int(c.all_masked.sum())
        self.neginf_rows += int(c.all_neginf.sum())
        self.nan_rows += int(c.nan.sum())
        self.posinf_rows += int(c.posinf.sum())
        # A mask constant is the minimum of every row it masks: count rows per value.
        _count_values(self.sentinel_rows, c.min_finite[(c.min_finite <= MASK_SENTINEL_LIMIT) & torch.isfinite(c.min_finite)])
        spread = c.max_finite - c.unmasked_min
        has_keys = (keys - c.masked) >= 2
        for d in self.dtypes:
            dt = dtype_from_name(d)
            self.rows_over[d] += int((c.max_finite > exp_overflow_threshold(dt)).sum())
            self.rows_under[d] += int(((c.max_finite < exp_underflow_threshold(dt)) & fin_rows).sum())
            self.rows_spread[d] += int((has_keys & (spread > -exp_underflow_threshold(dt))).sum())

    def update_cast(self, dtype: str, x: torch.Tensor, xc: torch.Tensor, rows: torch.Tensor) -> None:
        """Count finite scores that the cast to ``dtype`` turned into +-inf (only ``rows`` can hold any)."""
        xb, xcb = x[rows], xc[rows]
        over = torch.isinf(xcb) & torch.isfinite(xb)
        if not bool(over.any()):
            return
        self.cast_pos[dtype] += int((over & (xcb > 0)).sum())
        self.cast_neg[dtype] += int((over & (xcb < 0)).sum())
        self.cast_rows[dtype] += int(over.any(dim=-1).sum())
        xb64 = xb.to(torch.float64)
        lowest = torch.where(over & (xb64 < 0), xb64, float("inf")).amin(dim=-1)
        highest = torch.where(over & (xb64 > 0), xb64, NEG_INF).amax(dim=-1)
        _count_values(self.cast_values[dtype], torch.cat([lowest[torch.isfinite(lowest)], highest[torch.isfinite(highest)]]))

    def finish(self, shape: tuple[int, ...], dtype: str, rows: int) -> Census:
        headroom = []
        top = self.max.value
        for d in self.dtypes:
            dt = dtype_from_name(d)
            thr = exp_overflow_threshold(dt)
            headroom.append(
                DtypeHeadroom(
                    dtype=d,
                    max_finite=torch.finfo(dt).max,
                    exp_overflow_threshold=thr,
                    exp_underflow_threshold=exp_underflow_threshold(dt),
                    headroom=None if top is None else thr - top,
                    rows_over_exp_threshold=self.rows_over[d],
                    rows_all_underflow=self.rows_under[d],
                    rows_spread_beyond_underflow=self.rows_spread[d],
                    cast_posinf_values=self.cast_pos[d],
                    cast_neginf_values=self.cast_neg[d],
                    cast_overflow_rows=self.cast_rows[d],
                    cast_overflow_examples=[v for v, _ in _most_common(self.cast_values[d])],
                )
            )
        n = self.n_finite
        mean = std = None
        if n:  # sums are of x - shift, so the std does not cancel when |mean| >> std
            m1 = self.sum1.total() / n
            mean = self.shift + m1
            std = math.sqrt(max(self.sum2.total() / n - m1 * m1, 0.0))
        return Census(
            shape=shape,
            dtype=dtype,
            rows=rows,
            keys=shape[-1],
            finite=n,
            min=None if self.min.value is None else -self.min.value,
            max=top,
            mean=mean,
            std=std,
            nan=self.nan,
            posinf=self.posinf,
            neginf=self.neginf,
            masked=self.masked,
            sentinels=_most_common(self.sentinel_rows),
            fully_masked_rows=self.fully_masked_rows,
            neginf_rows=self.neginf_rows,
            nan_input_rows=self.nan_rows,
            posinf_input_rows=self.posinf_rows,
            headroom=headroom,
        )


class _DistAcc:
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.rows = 0
        self.h_sum, self.hn_sum, self.pmax_sum, self.jac_sum = _ExactSum(), _ExactSum(), _ExactSum(), _ExactSum()
        self.h_max, self.h_neg_min = _Max(), _Max()
        self.hn_rows = 0
        self.collapsed = 0

    def update(self, c: _Chunk) -> None:
        ok = c.ref_ok
        h = c.ref_entropy[ok]
        self.rows += int(ok.sum())
        self.h_sum.add(h)
        self.h_max.add(h)
        self.h_neg_min.add(-h)
        n_keys = (c.x.shape[-1] - c.masked)[ok]
        norm_ok = n_keys >= 2
        self.hn_sum.add(h[norm_ok] / torch.log(n_keys[norm_ok].to(torch.float64)))
        self.hn_rows += int(norm_ok.sum())
        pmax = 1.0 / c.ref_sum[ok]  # the max key has exp(0) = 1
        self.pmax_sum.add(pmax)
        self.collapsed += int((pmax >= self.threshold).sum())
        s2, s3 = c.ref_p2[ok], c.ref_p3[ok]
        self.jac_sum.add(torch.sqrt((s2 - 2 * s3 + s2 * s2).clamp_min(0)))  # see jacobian_frobenius

    def finish(self) -> Distribution:
        r = self.rows
        return Distribution(
            rows=r,
            entropy_mean=self.h_sum.total() / r if r else None,
            entropy_min=None if self.h_neg_min.value is None else -self.h_neg_min.value + 0.0,
            entropy_max=self.h_max.value,
            entropy_norm_mean=self.hn_sum.total() / self.hn_rows if self.hn_rows else None,
            max_prob_mean=self.pmax_sum.total() / r if r else None,
            collapsed_rows=self.collapsed,
            collapsed_frac=self.collapsed / r if r else None,
            collapse_threshold=self.threshold,
            jacobian_norm_mean=self.jac_sum.total() / r if r else None,
        )


class _CellAcc:
    def __init__(self, method: str, dtype: str, max_examples: int, heads: tuple[int, ...] = (), queries: int = 1) -> None:
        self.method, self.dtype = method, dtype
        # Rows of a (..., heads..., queries, keys) tensor are grouped by their leading index.
        self.heads, self.queries = heads, queries
        self.nan_by_head = torch.zeros(math.prod(heads) if heads else 0, dtype=torch.int64)
        self.rows = 0
        self.nan_causes: Counter[str] = Counter()
        self.zero_causes: Counter[str] = Counter()
        self.nan_rows = self.zero_rows = self.overflow_rows = self.underflow_rows = 0
        self.compared = 0
        self.elems = 0
        self.elems_algo = 0
        self.sq, self.sq_algo, self.kl = _ExactSum(), _ExactSum(), _ExactSum()
        self.max_abs, self.max_abs_algo, self.max_sum_err, self.kl_max = _Max(), _Max(), _Max(), _Max()
        self.ref_nonzero = 0
        self.flushed = 0
        self.flips = 0
        self.examples = _Examples(max_examples)

    def update(
        self,
        c: _Chunk,
        probs: torch.Tensor,
        overflow: torch.Tensor,
        underflow: torch.Tensor,
        own: "_OwnReference",
        causes: list[tuple[str, torch.Tensor]],
        rows: tuple | None = None,
    ) -> None:
        """Add one chunk of this cell: ``probs`` (r, T) with the method's overflow and
        underflow rows, and ``rows``, the per-row metrics of ``cell_rows`` (computed
        here when not given)."""
        keys = probs.shape[-1]
        self.rows += probs.shape[0]
        if rows is None:
            rows = cell_rows(c, [probs], own)[0]
        pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop = rows  # pmax: NaN if any entry is NaN; 0 only for all-zero rows
        nan_row = ~torch.isfinite(pmax)
        zero_row = pmax == 0
        row_causes = causes + [("exp_overflow", overflow), ("underflow", underflow)]
        for target, counter, prefix in ((nan_row, self.nan_causes, "nan"), (zero_row, self.zero_causes, "zero")):
            if not bool(target.any()):
                continue
            for cause, hit in _attribute(target, row_causes).items():
                k = int(hit.sum())
                if k:
                    counter[cause] += k
                    self.examples.add(f"{prefix}:{cause}", hit, c.offset)
        self.nan_rows += int(nan_row.sum())
        if self.heads and bool(nan_row.any()):
            head = (torch.nonzero(nan_row).flatten().cpu() + c.offset) // self.queries
            self.nan_by_head += torch.bincount(head, minlength=self.nan_by_head.numel())
        self.zero_rows += int(zero_row.sum())
        self.overflow_rows += int(overflow.sum())
        self.underflow_rows += int(underflow.sum())
        self.examples.add("overflow", overflow, c.offset)

        ok = ~nan_row & c.ref_ok  # (r,) rows where both are defined
        n_ok = int(ok.sum())
        if not n_ok:
            return
        self.compared += n_ok
        self.elems += n_ok * keys
        self.max_sum_err.add((psum - 1).abs()[ok])
        self.sq.add(sq[ok])
        self.max_abs.add(mx[ok])
        if not own.same:
            both = ok & own.ok
            self.sq_algo.add(sqa[both])
            self.max_abs_algo.add(mxa[both])
            self.elems_algo += int(both.sum()) * keys
        else:
            self.sq_algo, self.max_abs_algo, self.elems_algo = self.sq, self.max_abs, self.elems
        kl = kl[ok]
        self.kl.add(kl)
        self.kl_max.add(kl)
        self.ref_nonzero += int(c.ref_positive_count[ok].sum())
        self.flushed += int(flushed[ok].sum())
        # A flip: the reference's top key is strictly below the cell's maximum (ties are not flips).
        flip = (attop < pmax) & ok
        self.flips += int(flip.sum())
        self.examples.add("flip", flip, c.offset)

    def finish(self, lead: tuple[int, ...]) -> Cell:
        return Cell(
            method=self.method,
            dtype=self.dtype,
            rows=self.rows,
            nan_rows=self.nan_rows,
            nan_causes=dict(self.nan_causes),
            overflow_rows=self.overflow_rows,
            underflow_rows=self.underflow_rows,
            zero_rows=self.zero_rows,
            zero_causes=dict(self.zero_causes),
            compared_rows=self.compared,
            max_abs_err=self.max_abs.value,
            rmse=math.sqrt(self.sq.total() / self.elems) if self.elems else None,
            max_abs_err_algo=self.max_abs_algo.value,
            rmse_algo=math.sqrt(self.sq_algo.total() / self.elems_algo) if self.elems_algo else None,
            max_row_sum_err=self.max_sum_err.value,
            kl_mean=self.kl.total() / self.compared if self.compared else None,
            kl_max=self.kl_max.value,
            flushed_frac=self.flushed / self.ref_nonzero if self.ref_nonzero else None,
            argmax_flips=self.flips,
            examples=self.examples.unravel(lead),
            nan_rows_by_head=self._top_heads(),
        )

    def _top_heads(self, k: int = 5) -> list[tuple[tuple[int, ...], int]]:
        if not self.heads or not bool(self.nan_by_head.any()):
            return []
        counts, idx = torch.sort(self.nan_by_head, descending=True, stable=True)
        return [(_unravel(int(i), self.heads), int(n)) for n, i in zip(counts[:k].tolist(), idx[:k].tolist()) if n]


@dataclass
class _OwnReference:
    """The scores of one dtype's cells and the float64 softmax of those scores (the
    yardstick of algorithmic error, apart from the cast). ``same``: the scores are the
    chunk's own, so this reference is the chunk's."""

    xc: torch.Tensor  # (r, T) in the cell's dtype
    ok: torch.Tensor  # (r,) rows where the softmax of xc is defined
    ref: torch.Tensor  # (r, T) float64; only rows where ``ok`` are meaningful
    same: bool


def cell_rows(c: _Chunk, probs: list[torch.Tensor], own: _OwnReference) -> list[tuple]:
    """Per-row metrics of each of a dtype's cells, in the order of ``probs``: max p, sum p,
    sum of squared and max absolute error against the chunk's reference and against
    ``own`` (not meaningful when ``own.same``), generalised KL, flushed count, p at the top key."""
    if not c.fused:
        return [_cell_rows_torch(c, p, own, smallest_subnormal(p.dtype)) for p in probs]
    return _cell_rows_fused(c, probs, own)


def _cell_rows_fused(c: _Chunk, probs: list[torch.Tensor], own: _OwnReference) -> list[tuple]:
    """One kernel call for up to four cells: outputs in the scores' dtype take the first
    free slot, a float32 output of fp16/bf16 scores (tiled's) slot 3, so that each
    dtype always compiles to the same kernel."""
    xdt = own.xc.dtype
    slots: list = [None] * 4
    where = []
    for p in probs:
        k = next(i for i in ((0, 1, 2, 3) if p.dtype == xdt else (3,)) if slots[i] is None)
        slots[k] = p
        where.append(k)
    dummies = (kernels.as_rows(own.xc[:1, :1]), kernels.as_rows(torch.zeros(1, 1)))
    arrays = [kernels.as_rows(p) if p is not None else dummies[k == 3] for k, p in enumerate(slots)]
    used = np.array([p is not None for p in slots])
    floors = np.array([smallest_subnormal(p.dtype if p is not None else xdt) for p in slots])
    out = kernels.compiled()["cell_rows"](*arrays, used, floors, own.ref.numpy(), not own.same, own.ok.numpy(),
                                          c.ref.numpy(), c.ref_ok.numpy(), c.ref_top.squeeze(-1).numpy())
    out = [torch.from_numpy(a) for a in out]
    return [tuple(a[k] for a in out) for k in where]


def _cell_rows_torch(c: _Chunk, probs: torch.Tensor, own: _OwnReference, floor: float):
    """The per-row metrics of ``kernels_numba.cell_rows`` with torch ops (any device)."""
    pmax = probs.amax(dim=-1).to(torch.float64)
    p64 = probs.to(torch.float64)  # (r, T): one conversion, then float64 throughout
    psum = p64.sum(dim=-1)
    sqa = mxa = None
    if not own.same:
        da = p64 - own.ref
        sqa, mxa = row_dot(da, da), _row_abs_max(da)
        del da
    d = p64 - c.ref
    sq, mx = row_dot(d, d), _row_abs_max(d)
    del d
    kl = kl_divergence(c.ref, p64, floor)
    del p64
    flushed = torch.count_nonzero((probs == 0) & (c.ref > 0), dim=-1)
    attop = probs.gather(-1, c.ref_top).squeeze(-1).to(torch.float64)
    return pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop


# --------------------------------------------------------------------------- entry point


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cuda' without CUDA is an input error."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise AttncheckError("--device cuda requested but CUDA is not available (torch.cuda.is_available() is False); use --device cpu")
        return torch.device(name)
    raise AttncheckError(f"unknown device {name!r} (choose from auto, cpu, cuda)")


def check_scores(name: str, x: torch.Tensor) -> None:
    """Refuse tensors the diagnosis cannot take, naming what was found."""
    if not (x.is_floating_point() and x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
        raise AttncheckError(f"{name}: dtype {str(x.dtype).removeprefix('torch.')} is not supported; attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)")
    if x.dim() == 0:
        raise AttncheckError(f"{name}: is a scalar; scores need at least one axis (the last axis holds the keys)")
    if x.numel() == 0:
        raise AttncheckError(f"{name}: is empty (shape {tuple(x.shape)})")


def _cast(c: _Chunk, dt: torch.dtype, census: _CensusAcc, name: str, workspace: _Workspace | None = None):
    """Cast the chunk to ``dt``; return the rows the cast broke and the cast scores with
    their own reference."""
    x = c.x
    if dt == x.dtype:
        return torch.zeros_like(c.bad), _OwnReference(x, c.ref_ok, c.ref, same=True)
    xc = x.to(dt)
    own = _reference_of(xc, c.fused, workspace)
    # Rounding is monotonic, so only a finite value beyond dt's largest can round to inf:
    # the rows to check are known from the census, whatever -inf masks the rows carry.
    top = torch.finfo(dt).max
    suspect = (c.max_finite > top) | (c.min_finite < -top)
    cast_made = torch.zeros_like(c.bad)
    if bool(suspect.any()):
        idx = torch.nonzero(suspect).flatten()
        census.update_cast(name, x, xc, idx)
        xcb = xc[idx]
        cast_made[idx] = (torch.isposinf(xcb).any(dim=-1) & ~c.posinf[idx]) | (torch.isneginf(xcb).all(dim=-1) & ~c.all_neginf[idx])
    return cast_made, own


def _reference_of(xc: torch.Tensor, fused: bool, workspace: _Workspace | None = None) -> _OwnReference:
    """Scores already in a cell's dtype with their float64 softmax."""
    if fused:
        ref = (workspace or _Workspace()).take("own_ref", tuple(xc.shape))
        ok = kernels.compiled()["own_reference_rows"](kernels.as_rows(xc), ref)
        return _OwnReference(xc, torch.from_numpy(ok), torch.from_numpy(ref), same=False)
    ref = torch.softmax(xc.to(torch.float64), dim=-1)
    return _OwnReference(xc, torch.isfinite(ref.sum(dim=-1)), ref, same=False)


def _in_dtype(block, c: _Chunk, dt: torch.dtype, census: _CensusAcc, name: str, workspace: _Workspace):
    """Scores of one block in ``dt`` with their own reference, and the pipeline causes
    before and after 'fully_masked'."""
    if isinstance(block, torch.Tensor):
        cast_made, own = _cast(c, dt, census, name, workspace)
        return own, [], [("cast_overflow", cast_made)]
    xc, before, after = block.in_dtype(dt)  # scores the model computes in dt (Q@K^T, scale, mask)
    return _reference_of(xc, c.fused, workspace), before, after


def diagnose(name: str, scores: torch.Tensor, options: Options | None = None, progress: Callable[[int], None] | None = None) -> TensorDiagnosis:
    """Diagnose one score tensor; the softmax runs over its last axis."""
    options = options or Options()
    check_scores(name, scores)
    keys = scores.shape[-1]
    rows = scores.numel() // keys
    flat = scores.reshape(rows, keys)  # (R, T); a view when contiguous
    step = rows_per_chunk(keys, options)
    chunks = (flat[start : start + step] for start in range(0, rows, step))
    return diagnose_chunks(name, tuple(scores.shape), scores.dtype, chunks, options, progress)


# Bytes of working memory per score element of a chunk: the float64 reference and the
# reference of the cast scores, the cast scores, one cell's probabilities and its
# float64 temporaries (torch path; the fused kernels need about half).
WORKING_BYTES_PER_ELEMENT = 96


def chunk_elements_for(max_memory: int) -> int:
    """Elements per chunk that keep the diagnosis working set within ``max_memory`` bytes."""
    return max(1, max_memory // WORKING_BYTES_PER_ELEMENT)


def rows_per_chunk(keys: int, options: Options) -> int:
    """Rows per chunk so that one float64 working tensor stays near options.chunk_elements."""
    return max(1, options.chunk_elements // keys)


def diagnose_chunks(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    chunks: Iterable,
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    attention=None,
) -> TensorDiagnosis:
    """Diagnose a score tensor that arrives as consecutive (rows, keys) blocks, in row order.

    A block is a (rows, keys) tensor of scores (cast to each dtype), or a
    ``scores.QKBlock`` that computes its scores per dtype from Q and K. Results do
    not depend on how the rows are split. ``progress`` is called with the number of
    rows finished after each block. ``attention`` is the Q/K audit to attach.
    """
    options = options or Options()
    device = torch.device(options.device)
    lead = shape[:-1]
    rows = math.prod(lead) if lead else 1
    census = _CensusAcc(options.dtypes)
    dist = _DistAcc(options.collapse_threshold)
    heads = tuple(shape[:-2]) if len(shape) >= 3 else ()  # (batch, heads, ...) of (..., queries, keys)
    cells = {(m, d): _CellAcc(m, d, options.max_examples, heads, shape[-2] if heads else 1) for d in options.dtypes for m in options.methods}
    start = 0
    shift = None
    fused = _use_fused(options, device, math.prod(shape))
    workspace = _Workspace()
    for block in chunks:  # loop over row chunks, never over rows
        raw = isinstance(block, torch.Tensor)
        x = (block if raw else block.given).to(device)
        if shift is None:  # the first finite value in row-major order, whatever the chunking
            shift = _first_finite(x)
            census.shift = shift or 0.0
        c = _Chunk.of(x, start, census.shift if shift is not None else 0.0, fused, workspace)
        if not raw:
            c.masked_rows = block.all_masked
            block.audit_reference(c.ref, c.ref_ok)
        start += c.x.shape[0]
        census.update(c)
        dist.update(c)
        for d in options.dtypes:
            own, before, after = _in_dtype(block, c, dtype_from_name(d), census, d, workspace)
            causes = [("input_nan", c.nan), ("inf_input", c.posinf), *before, ("fully_masked", c.all_masked), *after]
            outs = [run_method(m, own.xc, block=options.block, reverse=options.reverse, accum=options.accum) for m in options.methods]
            metrics = cell_rows(c, [o.probs for o in outs], own)  # one pass over the chunk for all of the dtype's cells
            for m, out, per_row in zip(options.methods, outs, metrics):
                cells[(m, d)].update(c, out.probs, out.overflow_rows, out.underflow_rows, own, causes, per_row)
            del own, outs, metrics
        if progress is not None:
            progress(c.x.shape[0])
        del c, x, block  # free this chunk before the next one is read
    if start != rows:
        raise AttncheckError(f"{name}: got {start} rows, expected {rows} for shape {shape}")

    result = TensorDiagnosis(
        name=name,
        shape=shape,
        dtype=dtype_label(dtype),
        census=census.finish(shape, dtype_label(dtype), rows),
        distribution=dist.finish(),
        cells=[cells[(m, d)].finish(lead) for m in options.methods for d in options.dtypes],
        findings=[],
        options=options,
        attention=attention,
    )
    from attncheck.findings import findings_for  # advice text lives apart from the math

    result.findings = findings_for(result)
    return result


def diagnose_attention(
    name: str,
    inputs: "AttentionInputs",
    options: Options | None = None,
    progress: Callable[[int], None] | None = None,
    scores: torch.Tensor | None = None,
) -> TensorDiagnosis:
    """Diagnose the scores that Q, K and a mask produce in each dtype.

    With ``scores`` (what the model actually produced) also given, those are
    diagnosed instead, and the scale that maps q.k onto them is fitted.
    """
    from attncheck.scores import fit_scale, score_blocks, start_audit

    options = options or Options()
    audit = start_audit(inputs)
    if scores is not None:
        check_scores(name, scores)
        audit.fitted_scale = fit_scale(scores, inputs)
        keys = scores.shape[-1]
        flat = scores.reshape(-1, keys)
        step = rows_per_chunk(keys, options)
        chunks = (flat[i : i + step] for i in range(0, flat.shape[0], step))
        return diagnose_chunks(name, tuple(scores.shape), scores.dtype, chunks, options, progress, attention=audit)
    step = rows_per_chunk(inputs.k.shape[2], options)
    blocks = score_blocks(inputs, step, torch.device(options.device), audit)
    return diagnose_chunks(name, inputs.score_shape, inputs.q.dtype, blocks, options, progress, attention=audit)
