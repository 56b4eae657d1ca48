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
from typing import Iterable

import torch

from attncheck.errors import AttncheckError
from attncheck.names import DTYPE_NAMES, METHOD_NAMES
from attncheck.precision import (
    dtype_from_name,
    dtype_label,
    exp_overflow_threshold,
    exp_underflow_threshold,
    rounding_limit,
    smallest_subnormal,
)
from attncheck.softmax import ACCUMULATIONS, canonical_method, reference_softmax, run_method

# Finite scores at or below this look like an additive mask sentinel (-1e4, -1e9, finfo.min).
MASK_SENTINEL_LIMIT = -1e4
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
    cast_overflow_examples: list[float]  # distinct values that overflow, most frequent first


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
    sentinels: list[tuple[float, int]]  # most frequent finite mask-like values with counts
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

    def cell(self, method: str, dtype: str) -> Cell:
        for c in self.cells:
            if c.method == method and c.dtype == dtype:
                return c
        raise KeyError(f"{method}/{dtype}")


# --------------------------------------------------------------------------- helpers


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    return (-torch.special.xlogy(p, p).sum(dim=-1)).clamp_min(0) + 0.0  # no -0.0


def kl_divergence(ref: torch.Tensor, p: torch.Tensor, floor: float) -> torch.Tensor:
    """KL(ref || p) per row, in the generalised form sum(r log(r/p) - r + p).

    It equals KL when both sum to 1 and stays >= 0 when rounding leaves p off
    sum 1. p is floored at ``floor`` (the dtype's smallest subnormal) so a key
    flushed to 0 counts as the smallest value the dtype could have held instead
    of making KL infinite; flushes are counted on their own in ``flushed_frac``.
    """
    q = p.clamp_min(floor)
    terms = torch.special.xlogy(ref, ref) - torch.special.xlogy(ref, q) - ref + q
    return terms.sum(dim=-1).clamp_min(0)


def jacobian_frobenius(p: torch.Tensor) -> torch.Tensor:
    """||diag(p) - p p^T||_F per row without forming the T x T matrix.

    ||J||_F^2 = sum p_i^2 - 2 sum p_i^3 + (sum p_i^2)^2.
    """
    s2 = (p * p).sum(dim=-1)
    s3 = (p * p * p).sum(dim=-1)
    return torch.sqrt((s2 - 2 * s3 + s2 * s2).clamp_min(0))


def _max(a: float | None, b: torch.Tensor) -> float | None:
    if b.numel() == 0:
        return a
    v = float(b.max())
    return v if a is None else max(a, v)


def _min(a: float | None, b: torch.Tensor) -> float | None:
    if b.numel() == 0:
        return a
    v = float(b.min())
    return v if a is None else min(a, v)


class _Examples:
    """First few flat row indices per label."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rows: dict[str, list[int]] = {}

    def add(self, label: str, mask: torch.Tensor, offset: int) -> None:
        have = self.rows.setdefault(label, [])
        if len(have) >= self.limit:
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


# --------------------------------------------------------------------------- accumulators


class _CensusAcc:
    def __init__(self, dtypes: tuple[str, ...]) -> None:
        self.n_finite = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min: float | None = None
        self.max: float | None = None
        self.nan = self.posinf = self.neginf = self.masked = 0
        self.sentinels: Counter[float] = Counter()
        self.fully_masked_rows = self.neginf_rows = self.nan_rows = self.posinf_rows = 0
        self.dtypes = dtypes
        self.rows_over = Counter()
        self.rows_under = Counter()
        self.rows_spread = Counter()
        self.cast_pos = Counter()
        self.cast_neg = Counter()
        self.cast_rows = Counter()
        self.cast_values: dict[str, Counter[float]] = {d: Counter() for d in dtypes}

    def update(self, x: torch.Tensor, flags: "_RowFlags") -> None:
        finite = torch.isfinite(x)
        vals = x[finite].to(torch.float64)
        n = vals.numel()
        if n:
            # Chan et al.: merge chunk mean and M2 without cancellation.
            m_b = float(vals.mean())
            m2_b = float(((vals - m_b) ** 2).sum())
            delta = m_b - self.mean
            tot = self.n_finite + n
            self.mean += delta * n / tot
            self.m2 += m2_b + delta * delta * self.n_finite * n / tot
            self.n_finite = tot
        self.min = _min(self.min, vals)
        self.max = _max(self.max, vals)
        self.nan += int(torch.isnan(x).sum())
        self.posinf += int(torch.isposinf(x).sum())
        self.neginf += int(torch.isneginf(x).sum())
        sentinel = finite & (x <= MASK_SENTINEL_LIMIT)
        masked = sentinel | torch.isneginf(x)
        self.masked += int(masked.sum())
        if bool(sentinel.any()):
            values, counts = torch.unique(x[sentinel].to(torch.float64), return_counts=True)
            top = torch.argsort(counts, descending=True)[:16]
            for v, c in zip(values[top].tolist(), counts[top].tolist()):
                self.sentinels[v] += c
        self.fully_masked_rows += int(flags.all_masked.sum())
        self.neginf_rows += int(flags.all_neginf.sum())
        self.nan_rows += int(flags.nan.sum())
        self.posinf_rows += int(flags.posinf.sum())

        x64_max = torch.where(finite, x, float("-inf")).amax(dim=-1).to(torch.float64)  # (rows,)
        unmasked = finite & ~sentinel
        x_min = torch.where(unmasked, x, float("inf")).amin(dim=-1).to(torch.float64)
        spread = x64_max - x_min  # inf where no unmasked keys: excluded below
        has_keys = unmasked.sum(dim=-1) >= 2
        for d in self.dtypes:
            dt = dtype_from_name(d)
            self.rows_over[d] += int((x64_max > exp_overflow_threshold(dt)).sum())
            self.rows_under[d] += int(((x64_max < exp_underflow_threshold(dt)) & (x64_max > float("-inf"))).sum())
            self.rows_spread[d] += int((has_keys & (spread > -exp_underflow_threshold(dt))).sum())

    def update_cast(self, dtype: str, x: torch.Tensor, xc: torch.Tensor) -> None:
        over = torch.isinf(xc) & torch.isfinite(x)
        if not bool(over.any()):
            return
        self.cast_pos[dtype] += int((over & (xc > 0)).sum())
        self.cast_neg[dtype] += int((over & (xc < 0)).sum())
        self.cast_rows[dtype] += int(over.any(dim=-1).sum())
        values, counts = torch.unique(x[over].to(torch.float64), return_counts=True)
        top = torch.argsort(counts, descending=True)[:16]
        for v, c in zip(values[top].tolist(), counts[top].tolist()):
            self.cast_values[dtype][v] += c

    def finish(self, shape: tuple[int, ...], dtype: str, rows: int) -> Census:
        headroom = []
        for d in self.dtypes:
            dt = dtype_from_name(d)
            thr = exp_overflow_threshold(dt)
            headroom.append(
                DtypeHeadroom(
                    dtype=d,
                    max_finite=torch.finfo(dt).max,
                    exp_overflow_threshold=thr,
                    exp_underflow_threshold=exp_underflow_threshold(dt),
                    headroom=None if self.max is None else thr - self.max,
                    rows_over_exp_threshold=self.rows_over[d],
                    rows_all_underflow=self.rows_under[d],
                    rows_spread_beyond_underflow=self.rows_spread[d],
                    cast_posinf_values=self.cast_pos[d],
                    cast_neginf_values=self.cast_neg[d],
                    cast_overflow_rows=self.cast_rows[d],
                    cast_overflow_examples=[v for v, _ in self.cast_values[d].most_common(3)],
                )
            )
        n = self.n_finite
        return Census(
            shape=shape,
            dtype=dtype,
            rows=rows,
            keys=shape[-1],
            finite=n,
            min=self.min,
            max=self.max,
            mean=self.mean if n else None,
            std=math.sqrt(self.m2 / n) if n else None,
            nan=self.nan,
            posinf=self.posinf,
            neginf=self.neginf,
            masked=self.masked,
            sentinels=self.sentinels.most_common(3),
            fully_masked_rows=self.fully_masked_rows,
            neginf_rows=self.neginf_rows,
            nan_input_rows=self.nan_rows,
            posinf_input_rows=self.posinf_rows,
            headroom=headroom,
        )


@dataclass
class _RowFlags:
    """Per-row facts about the scores as given, for one chunk."""

    nan: torch.Tensor
    posinf: torch.Tensor
    all_neginf: torch.Tensor
    all_masked: torch.Tensor  # every key -inf or a finite sentinel <= MASK_SENTINEL_LIMIT

    @classmethod
    def of(cls, x: torch.Tensor) -> "_RowFlags":
        neginf = torch.isneginf(x)
        return cls(
            nan=torch.isnan(x).any(dim=-1),
            posinf=torch.isposinf(x).any(dim=-1),
            all_neginf=neginf.all(dim=-1),
            all_masked=(neginf | (x <= MASK_SENTINEL_LIMIT)).all(dim=-1),
        )


class _DistAcc:
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.rows = 0
        self.h_sum = 0.0
        self.h_min: float | None = None
        self.h_max: float | None = None
        self.hn_sum = 0.0
        self.hn_rows = 0
        self.pmax_sum = 0.0
        self.collapsed = 0
        self.jac_sum = 0.0

    def update(self, x: torch.Tensor, ref: torch.Tensor, ref_ok: torch.Tensor) -> None:
        p = ref[ref_ok]  # (rows_ok, T) float64
        if p.numel() == 0:
            return
        h = entropy(p)
        self.rows += p.shape[0]
        self.h_sum += float(h.sum())
        self.h_min = _min(self.h_min, h)
        self.h_max = _max(self.h_max, h)
        xs = x[ref_ok]
        n_keys = (torch.isfinite(xs) & (xs > MASK_SENTINEL_LIMIT)).sum(dim=-1)
        norm_ok = n_keys >= 2
        if bool(norm_ok.any()):
            self.hn_sum += float((h[norm_ok] / torch.log(n_keys[norm_ok].to(torch.float64))).sum())
            self.hn_rows += int(norm_ok.sum())
        pmax = p.amax(dim=-1)
        self.pmax_sum += float(pmax.sum())
        self.collapsed += int((pmax >= self.threshold).sum())
        self.jac_sum += float(jacobian_frobenius(p).sum())

    def finish(self) -> Distribution:
        r = self.rows
        return Distribution(
            rows=r,
            entropy_mean=self.h_sum / r if r else None,
            entropy_min=self.h_min,
            entropy_max=self.h_max,
            entropy_norm_mean=self.hn_sum / self.hn_rows if self.hn_rows else None,
            max_prob_mean=self.pmax_sum / r if r else None,
            collapsed_rows=self.collapsed,
            collapsed_frac=self.collapsed / r if r else None,
            collapse_threshold=self.threshold,
            jacobian_norm_mean=self.jac_sum / r if r else None,
        )


class _CellAcc:
    def __init__(self, method: str, dtype: str, max_examples: int) -> None:
        self.method, self.dtype = method, dtype
        self.floor = smallest_subnormal(dtype_from_name(dtype))
        self.rows = 0
        self.nan_causes: Counter[str] = Counter()
        self.zero_causes: Counter[str] = Counter()
        self.nan_rows = self.zero_rows = self.overflow_rows = self.underflow_rows = 0
        self.compared = 0
        self.elems = 0
        self.max_abs: float | None = None
        self.sq = 0.0
        self.max_abs_algo: float | None = None
        self.sq_algo = 0.0
        self.elems_algo = 0
        self.max_sum_err: float | None = None
        self.kl_sum = 0.0
        self.kl_max: float | None = None
        self.ref_nonzero = 0
        self.flushed = 0
        self.flips = 0
        self.examples = _Examples(max_examples)

    def update(
        self,
        offset: int,
        probs: torch.Tensor,
        overflow: torch.Tensor,
        underflow: torch.Tensor,
        ref: torch.Tensor,
        ref_ok: torch.Tensor,
        ref_algo: torch.Tensor,
        causes: list[tuple[str, torch.Tensor]],
    ) -> None:
        self.rows += probs.shape[0]
        nan_row = torch.isnan(probs).any(dim=-1)
        zero_row = (probs == 0).all(dim=-1)
        row_causes = causes + [("exp_overflow", overflow), ("underflow", underflow)]
        for target, counter, prefix in ((nan_row, self.nan_causes, "nan"), (zero_row, self.zero_causes, "zero")):
            for cause, hit in _attribute(target, row_causes).items():
                k = int(hit.sum())
                if k:
                    counter[cause] += k
                    self.examples.add(f"{prefix}:{cause}", hit, offset)
        self.nan_rows += int(nan_row.sum())
        self.zero_rows += int(zero_row.sum())
        self.overflow_rows += int(overflow.sum())
        self.underflow_rows += int(underflow.sum())
        self.examples.add("overflow", overflow, offset)

        ok = torch.isfinite(probs).all(dim=-1) & ref_ok  # (rows,)
        if not bool(ok.any()):
            return
        all_ok = bool(ok.all())
        p = (probs if all_ok else probs[ok]).to(torch.float64)
        r = ref if all_ok else ref[ok]
        self.compared += p.shape[0]
        self.elems += p.numel()
        d = p - r
        self.max_abs = _max(self.max_abs, d.abs())
        self.sq += float((d * d).sum())
        ra = ref_algo if all_ok else ref_algo[ok]
        ra_ok = torch.isfinite(ra).all(dim=-1)
        if bool(ra_ok.any()):
            da = (p - ra)[ra_ok]
            self.max_abs_algo = _max(self.max_abs_algo, da.abs())
            self.sq_algo += float((da * da).sum())
            self.elems_algo += da.numel()
        self.max_sum_err = _max(self.max_sum_err, (p.sum(dim=-1) - 1).abs())
        kl = kl_divergence(r, p, self.floor)
        self.kl_sum += float(kl.sum())
        self.kl_max = _max(self.kl_max, kl)
        nz = r > 0
        self.ref_nonzero += int(nz.sum())
        self.flushed += int((nz & (p == 0)).sum())
        top = r.argmax(dim=-1, keepdim=True)
        flip = p.gather(-1, top).squeeze(-1) < p.amax(dim=-1)
        self.flips += int(flip.sum())
        if bool(flip.any()):
            rows_idx = torch.nonzero(ok).flatten()[flip]
            mask = torch.zeros_like(ok)
            mask[rows_idx] = True
            self.examples.add("flip", mask, offset)

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
            max_abs_err=self.max_abs,
            rmse=math.sqrt(self.sq / self.elems) if self.elems else None,
            max_abs_err_algo=self.max_abs_algo,
            rmse_algo=math.sqrt(self.sq_algo / self.elems_algo) if self.elems_algo else None,
            max_row_sum_err=self.max_sum_err,
            kl_mean=self.kl_sum / self.compared if self.compared else None,
            kl_max=self.kl_max,
            flushed_frac=self.flushed / self.ref_nonzero if self.ref_nonzero else None,
            argmax_flips=self.flips,
            examples=self.examples.unravel(lead),
        )


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


def diagnose(name: str, scores: torch.Tensor, options: Options | None = None) -> TensorDiagnosis:
    """Diagnose one score tensor; the softmax runs over its last axis."""
    options = options or Options()
    check_scores(name, scores)
    device = torch.device(options.device)
    shape = tuple(scores.shape)
    keys = shape[-1]
    lead = shape[:-1]
    rows = math.prod(lead) if lead else 1
    flat = scores.reshape(rows, keys)  # (R, T); a view when contiguous
    chunk = max(1, options.chunk_elements // keys)

    census = _CensusAcc(options.dtypes)
    dist = _DistAcc(options.collapse_threshold)
    cells = {(m, d): _CellAcc(m, d, options.max_examples) for d in options.dtypes for m in options.methods}
    given_dtype = scores.dtype
    for start in range(0, rows, chunk):  # loop over row chunks, never over rows
        x = flat[start : start + chunk].to(device)  # (r, T) as given
        flags = _RowFlags.of(x)
        census.update(x, flags)
        ref = reference_softmax(x)  # (r, T) float64
        ref_ok = torch.isfinite(ref).all(dim=-1)
        dist.update(x, ref, ref_ok)
        for d in options.dtypes:
            dt = dtype_from_name(d)
            xc = x.to(dt)
            census.update_cast(d, x, xc)
            ref_algo = ref if dt == given_dtype else reference_softmax(xc)
            cast_made = (torch.isposinf(xc).any(dim=-1) & ~flags.posinf) | (torch.isneginf(xc).all(dim=-1) & ~flags.all_neginf)
            causes = [
                ("input_nan", flags.nan),
                ("inf_input", flags.posinf),
                ("fully_masked", flags.all_masked),
                ("cast_overflow", cast_made),
            ]
            for m in options.methods:
                out = run_method(m, xc, block=options.block, reverse=options.reverse, accum=options.accum)
                cells[(m, d)].update(start, out.probs, out.overflow_rows, out.underflow_rows, ref, ref_ok, ref_algo, causes)

    result = TensorDiagnosis(
        name=name,
        shape=shape,
        dtype=dtype_label(given_dtype),
        census=census.finish(shape, dtype_label(given_dtype), rows),
        distribution=dist.finish(),
        cells=[cells[(m, d)].finish(lead) for m in options.methods for d in options.dtypes],
        findings=[],
        options=options,
    )
    from attncheck.findings import findings_for  # advice text lives apart from the math

    result.findings = findings_for(result)
    return result
