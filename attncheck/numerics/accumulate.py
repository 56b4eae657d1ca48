"""Accumulators: the per-row facts of each chunk -> the census, the distribution and
one ``Cell`` per method x dtype, aggregated so that any chunking gives the same result."""

from __future__ import annotations

import math
from collections import Counter

import torch

from attncheck.numerics.backends import AlgoReference, ChunkFacts, RowMetrics
from attncheck.numerics.precision import (
    MASK_SENTINEL_LIMIT,
    dtype_from_name,
    exp_overflow_threshold,
    exp_underflow_threshold,
)
from attncheck.numerics.reduce import Examples, ExactSum, Max, attribute, count_values, most_common, unravel
from attncheck.numerics.rowmath import jacobian_from_moments
from attncheck.numerics.softmax import event_rows
from attncheck.registry import EVENTS
from attncheck.results import Cell, Census, Distribution, DtypeHeadroom

NEG_INF = float("-inf")


class CensusAcc:
    def __init__(self, dtypes: tuple[str, ...]) -> None:
        self.dtypes = dtypes
        self.n_finite = 0
        self.shift = 0.0  # set from the first finite value before the first chunk is counted
        self.sum1 = ExactSum()
        self.sum2 = ExactSum()
        self.max, self.min = Max(), Max()  # min kept as max of -x
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

    def update(self, c: ChunkFacts) -> None:
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
        count_values(self.sentinel_rows, c.min_finite[(c.min_finite <= MASK_SENTINEL_LIMIT) & torch.isfinite(c.min_finite)])
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
        count_values(self.cast_values[dtype], torch.cat([lowest[torch.isfinite(lowest)], highest[torch.isfinite(highest)]]))

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
                    cast_overflow_examples=[v for v, _ in most_common(self.cast_values[d])],
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
            sentinels=most_common(self.sentinel_rows),
            fully_masked_rows=self.fully_masked_rows,
            neginf_rows=self.neginf_rows,
            nan_input_rows=self.nan_rows,
            posinf_input_rows=self.posinf_rows,
            headroom=headroom,
        )


class DistAcc:
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.rows = 0
        self.h_sum, self.hn_sum, self.pmax_sum, self.jac_sum = ExactSum(), ExactSum(), ExactSum(), ExactSum()
        self.h_max, self.h_neg_min = Max(), Max()
        self.hn_rows = 0
        self.collapsed = 0

    def update(self, c: ChunkFacts) -> None:
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
        self.jac_sum.add(jacobian_from_moments(s2, s3))

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


class CellAcc:
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
        self.sq, self.sq_algo, self.kl = ExactSum(), ExactSum(), ExactSum()
        self.max_abs, self.max_abs_algo, self.max_sum_err, self.kl_max = Max(), Max(), Max(), Max()
        self.ref_nonzero = 0
        self.flushed = 0
        self.flips = 0
        self.examples = Examples(max_examples)

    def update(
        self,
        c: ChunkFacts,
        probs: torch.Tensor,
        events: dict[str, torch.Tensor],
        algo: AlgoReference,
        causes: list[tuple[str, torch.Tensor]],
        metrics: RowMetrics,
    ) -> None:
        """Add one chunk of this cell: ``probs`` (r, T) with the method's row events,
        the pipeline ``causes`` before them, and the cell's row ``metrics``."""
        keys = probs.shape[-1]
        self.rows += probs.shape[0]
        m = metrics
        nan_row = ~torch.isfinite(m.pmax)
        zero_row = m.pmax == 0
        row_causes = causes + [(name, events[name]) for name in EVENTS if name in events]  # pipeline order
        overflow = event_rows(events, "overflow", nan_row.shape, nan_row.device)
        underflow = event_rows(events, "underflow", nan_row.shape, nan_row.device)
        for target, counter, prefix in ((nan_row, self.nan_causes, "nan"), (zero_row, self.zero_causes, "zero")):
            if not bool(target.any()):
                continue
            for cause, hit in attribute(target, row_causes).items():
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
        self.max_sum_err.add((m.psum - 1).abs()[ok])
        self.sq.add(m.sq_err[ok])
        self.max_abs.add(m.max_err[ok])
        if not algo.same:
            both = ok & algo.ok
            self.sq_algo.add(m.sq_err_algo[both])
            self.max_abs_algo.add(m.max_err_algo[both])
            self.elems_algo += int(both.sum()) * keys
        else:
            self.sq_algo, self.max_abs_algo, self.elems_algo = self.sq, self.max_abs, self.elems
        kl = m.kl[ok]
        self.kl.add(kl)
        self.kl_max.add(kl)
        self.ref_nonzero += int(c.ref_positive_count[ok].sum())
        self.flushed += int(m.flushed[ok].sum())
        # A flip: the reference's top key is strictly below the cell's maximum (ties are not flips).
        flip = (m.p_at_top < m.pmax) & ok
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
            nan_rows_per_head=self._per_head(),
        )

    def _per_head(self) -> list[int]:
        """NaN rows per index of the last leading axis (the heads), summed over the axes before it."""
        if not self.heads:
            return []
        return self.nan_by_head.reshape(-1, self.heads[-1]).sum(dim=0).tolist()

    def _top_heads(self, k: int = 5) -> list[tuple[tuple[int, ...], int]]:
        if not self.heads or not bool(self.nan_by_head.any()):
            return []
        counts, idx = torch.sort(self.nan_by_head, descending=True, stable=True)
        return [(unravel(int(i), self.heads), int(n)) for n, i in zip(counts[:k].tolist(), idx[:k].tolist()) if n]

