"""Accumulators: the per-row facts of each chunk -> the census, the distribution and
one ``Cell`` per method x dtype, aggregated so that any chunking gives the same result."""

from __future__ import annotations

import math
from collections import Counter

import torch

from attncheck.numerics.backends import AlgoReference, ChunkFacts, RowMetrics
from attncheck.numerics.cells.outnan import OutNanAcc
from attncheck.numerics.methods.fp8 import POSITIONS
from attncheck.numerics.methods.softmax import event_rows
from attncheck.numerics.precision import (
    MASK_SENTINEL_LIMIT,
    dtype_from_name,
    exp_overflow_threshold,
    exp_underflow_threshold,
    known_sentinels,
)
from attncheck.numerics.reduce import (
    ExactSum,
    Examples,
    Max,
    any_true,
    attribute,
    count,
    count_values,
    finite,
    group_mask_values,
    take_rows,
    unravel,
)
from attncheck.numerics.rowmath import row_finite
from attncheck.registry import EVENTS
from attncheck.results import ASKED, Cell, Census, Distribution, DtypeHeadroom

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
        self.top_in: dict[str, Max] = {d: Max() for d in dtypes}  # largest finite score as each dtype holds it
        self.spread = Max()  # largest (row max - smallest unmasked score) over rows with two or more unmasked keys
        self.neg_unmasked_min = Max()  # minus the smallest finite score above the sentinel limit
        self.cast_pos = Counter()
        self.cast_neg = Counter()
        self.cast_rows = Counter()
        self.cast_values: dict[str, Counter[float]] = {d: Counter() for d in dtypes}

    def update(self, c: ChunkFacts) -> None:
        fin_rows = c.n_finite > 0
        self.max.add(take_rows(c.max_finite, fin_rows))
        self.min.add(-take_rows(c.min_finite, fin_rows))
        self.n_finite += int(c.n_finite.sum())
        self.sum1.add(c.sum1)
        self.sum2.add(c.sum2)
        self.nan += int(c.nan_count.sum())
        self.posinf += int(c.posinf_count.sum())
        self.neginf += int(c.neginf_count.sum())
        self.masked += int(c.masked.sum())
        self.fully_masked_rows += count(c.all_masked)
        self.neginf_rows += count(c.all_neginf)
        self.nan_rows += count(c.nan)
        self.posinf_rows += count(c.posinf)
        # A mask constant is the minimum of every row it masks: count rows per value.
        count_values(self.sentinel_rows, c.min_finite[(c.min_finite <= MASK_SENTINEL_LIMIT) & finite(c.min_finite)])
        self.neg_unmasked_min.add(-take_rows(c.unmasked_min, finite(c.unmasked_min)))
        spread = c.max_finite - c.unmasked_min  # NaN or -inf where a row has no unmasked key
        self.spread.add(take_rows(spread, ((c.x.shape[-1] - c.masked) >= 2) & finite(spread)))

    def update_headroom(self, dtype: str, c: ChunkFacts, top: torch.Tensor, low: torch.Tensor) -> None:
        """Count the chunk's rows against ``dtype``'s exp thresholds, from the scores the
        dtype's cells compute with: ``top`` (r,) float64 the largest finite score of each row
        and ``low`` the smallest unmasked one, both as held in ``dtype`` (a score the dtype
        cannot hold as a finite number is taken as given, +-inf otherwise)."""
        dt = dtype_from_name(dtype)
        fin_rows = c.n_finite > 0
        self.top_in[dtype].add(take_rows(top, fin_rows))
        self.rows_over[dtype] += count(top > exp_overflow_threshold(dt))
        self.rows_under[dtype] += count((top < exp_underflow_threshold(dt)) & fin_rows)
        has_keys = (c.x.shape[-1] - c.masked) >= 2
        self.rows_spread[dtype] += count(has_keys & (top - low > -exp_underflow_threshold(dt)))

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
        count_values(
            self.cast_values[dtype], torch.cat([lowest[torch.isfinite(lowest)], highest[torch.isfinite(highest)]])
        )

    def finish(self, shape: tuple[int, ...], dtype: str, rows: int) -> Census:
        headroom = []
        top = self.max.value
        for d in self.dtypes:
            dt = dtype_from_name(d)
            thr = exp_overflow_threshold(dt)
            top_d = self.top_in[d].value
            headroom.append(
                DtypeHeadroom(
                    dtype=d,
                    max_finite=torch.finfo(dt).max,
                    exp_overflow_threshold=thr,
                    exp_underflow_threshold=exp_underflow_threshold(dt),
                    headroom=None if top_d is None else thr - top_d,
                    rows_over_exp_threshold=self.rows_over[d],
                    rows_all_underflow=self.rows_under[d],
                    rows_spread_beyond_underflow=self.rows_spread[d],
                    cast_posinf_values=self.cast_pos[d],
                    cast_neginf_values=self.cast_neg[d],
                    cast_overflow_rows=self.cast_rows[d],
                    cast_overflow_examples=[v for v, *_ in group_mask_values(self.cast_values[d], known_sentinels())],
                )
            )
        sentinels = group_mask_values(self.sentinel_rows, known_sentinels())
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
            unmasked_min=None if self.neg_unmasked_min.value is None else -self.neg_unmasked_min.value,
            mean=mean,
            std=std,
            nan=self.nan,
            posinf=self.posinf,
            neginf=self.neginf,
            masked=self.masked,
            sentinels=[(v, rows) for v, rows, _, _ in sentinels],
            sentinel_spans=[(lo, hi) for _, _, lo, hi in sentinels],
            fully_masked_rows=self.fully_masked_rows,
            neginf_rows=self.neginf_rows,
            nan_input_rows=self.nan_rows,
            posinf_input_rows=self.posinf_rows,
            headroom=headroom,
        )


class HeadMax:
    """The largest unmasked score (above the sentinel limit) per head, the axis before the queries;
    rows are (leading..., head, query) in row-major order."""

    def __init__(self, heads: int, queries: int) -> None:
        self.heads, self.queries = heads, queries
        self.top = torch.full((heads,), NEG_INF, dtype=torch.float64)

    def update(self, c: ChunkFacts) -> None:
        if not self.heads:
            return
        r = c.max_finite.shape[0]
        head = (torch.arange(c.offset, c.offset + r) // self.queries) % self.heads
        top = torch.where(c.max_finite > MASK_SENTINEL_LIMIT, c.max_finite, NEG_INF).to("cpu", torch.float64)
        self.top = self.top.scatter_reduce(0, head, top, reduce="amax")

    def values(self) -> list[float | None]:
        return [None if v == NEG_INF else v for v in self.top.tolist()]


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
        h = take_rows(c.ref_entropy, ok)
        self.rows += count(ok)
        self.h_sum.add(h)
        self.h_max.add(h)
        self.h_neg_min.add(-h)
        n_keys = take_rows(c.x.shape[-1] - c.masked, ok)
        norm_ok = n_keys >= 2
        self.hn_sum.add(take_rows(h, norm_ok) / torch.log(take_rows(n_keys, norm_ok).to(torch.float64)))
        self.hn_rows += count(norm_ok)
        pmax = 1.0 / take_rows(c.ref_sum, ok)  # the max key has exp(0) = 1
        self.pmax_sum.add(pmax)
        self.collapsed += count(pmax >= self.threshold)
        self.jac_sum.add(take_rows(c.ref_jacobian, ok))

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


class OutAcc:
    """Errors of a cell's output O = P@V against float64 (P64 @ V64), aggregated over chunks,
    and the bias of the path's own rounding: the mean signed error of O against float64
    softmax of the path's scores times V as the dtype holds it, per row, over all rows
    and over rows whose row maximum is tied."""

    def __init__(self, causes: OutNanAcc) -> None:
        self.causes = causes  # the NaN/inf rows by first cause (OutNanAcc.update, called by the path stage)
        self.rows = self.nan_rows = self.elems = self.cos_rows = self.bias_rows = self.tied_bias_rows = 0
        self.sq, self.abs_err, self.abs_ref, self.cos, self.bias, self.tied_bias, self.tied_bias_sq = (
            ExactSum() for _ in range(7)
        )
        self.max_abs, self.neg_cos_min = Max(), Max()

    def update(self, out: torch.Tensor, ref: torch.Tensor, tied: torch.Tensor, ref_algo: torch.Tensor) -> None:
        """``out`` (r, dv) in the cell's dtype; ``ref`` (r, dv) float64 P64 @ V64 and
        ``ref_algo`` (r, dv) float64 of the path's scores and V in the dtype (NaN rows where
        the reference softmax is undefined); ``tied`` (r,) rows whose maximum score is shared."""
        o = out.to(torch.float64)
        finite = row_finite(out)  # one float64 sum per row: values of a float format cannot overflow it
        self.nan_rows += count(~finite)
        ok = finite & torch.isfinite(ref.sum(dim=-1))  # P64 @ V64: probabilities times finite values
        self._bias(o, ref_algo, finite, tied)
        o, r = take_rows(o, ok), take_rows(ref, ok)  # (k, dv); the tensors themselves when every row is kept
        self.rows += o.shape[0]
        if not o.shape[0]:
            return
        d = o - r
        self.elems += d.numel()
        self.max_abs.add(d.abs().amax(dim=-1))
        self.sq.add((d * d).sum(dim=-1))
        self.abs_err.add(d.abs().sum(dim=-1))
        self.abs_ref.add(r.abs().sum(dim=-1))
        norms = o.norm(dim=-1) * r.norm(dim=-1)
        has = norms > 0  # a zero row of O against a zero reference has no direction to compare
        cos = (o * r).sum(dim=-1)[has] / norms[has]
        self.cos.add(cos)
        self.neg_cos_min.add(-cos)
        self.cos_rows += int(has.sum())

    def _bias(self, o: torch.Tensor, ref_algo: torch.Tensor, finite: torch.Tensor, tied: torch.Tensor) -> None:
        ok = finite & torch.isfinite(ref_algo.sum(dim=-1))  # NaN rows where the reference softmax is undefined
        e = (take_rows(o, ok) - take_rows(ref_algo, ok)).mean(dim=-1)  # (k,) each row's mean signed error
        self.bias.add(e)
        self.bias_rows += e.shape[0]
        et = take_rows(e, take_rows(tied, ok))
        self.tied_bias.add(et)
        self.tied_bias_sq.add(et * et)
        self.tied_bias_rows += et.shape[0]

    def fields(self) -> dict:
        e = self.elems
        ref_l1 = self.abs_ref.total()
        n = self.tied_bias_rows
        return dict(
            out_rows=self.rows,
            out_nan_rows=self.nan_rows,
            out_max_abs_err=self.max_abs.value,
            out_rmse=math.sqrt(self.sq.total() / e) if e else None,
            out_rel_l1=self.abs_err.total() / ref_l1 if ref_l1 else None,
            out_cos_min=None if self.neg_cos_min.value is None else -self.neg_cos_min.value,
            out_cos_mean=self.cos.total() / self.cos_rows if self.cos_rows else None,
            out_bias=self.bias.total() / self.bias_rows if self.bias_rows else None,
            out_bias_tied=self.tied_bias.total() / n if n else None,
            out_bias_tied_z=self._tied_z(),
        )

    def _tied_z(self) -> float | None:
        """The mean signed error of tied rows in standard errors of that mean, the rows taken
        as the samples (0 for unbiased rounding; None with fewer than 2 such rows)."""
        n = self.tied_bias_rows
        if n < 2:
            return None
        mean = self.tied_bias.total() / n
        var = max(self.tied_bias_sq.total() - n * mean * mean, 0.0) / (n - 1)
        if var == 0:
            return 0.0 if mean == 0 else math.copysign(math.inf, mean)
        return mean / math.sqrt(var / n)


PCAST_MASS = 1e-3  # a row that loses this much of its probability to the P cast has lost something visible

# A top-1 flip counts only where rounding cannot explain it: the reference's top key a and the cell's
# top key b (first of ties) are further apart in float64 score, s_a - s_b, than the cell's own score
# errors at the two keys, |s'_a - s_a| + |s'_b - s_b| (s' the scores as the cell computed them: cast,
# or Q@K^T in the path's dtype), plus FLIP_UNITS unit roundoffs of the cell's dtype (exp and the
# division round each probability once more; a tiled cell rescales P blocks by different factors).
# For first-order rounding, p_b > p_a needs s'_b - s'_a > -(that rounding), so a flip inside the
# bound is a near-tie that the dtype cannot resolve; one beyond it is the cell's own error.
FLIP_UNITS = 4


def real_flips(
    x: torch.Tensor, xc: torch.Tensor, probs: torch.Tensor, top: torch.Tensor, rows: torch.Tensor, unit: float
) -> torch.Tensor:
    """(k,) bool: which of the flipped ``rows`` (k,) count under the flip rule above. ``x`` (r, T) the scores as
    given (float64 from Q and K), ``xc`` the cell's scores, ``probs`` its probabilities, ``top`` (r, 1)
    the reference's top key."""
    s = x[rows].to(torch.float64)  # (k, T)
    sc = xc[rows].to(torch.float64)
    a = top[rows]
    b = probs[rows].argmax(dim=-1, keepdim=True)
    gap = (s.gather(-1, a) - s.gather(-1, b)).squeeze(-1)
    err = ((sc.gather(-1, a) - s.gather(-1, a)).abs() + (sc.gather(-1, b) - s.gather(-1, b)).abs()).squeeze(-1)
    return gap > torch.nan_to_num(err, nan=math.inf) + FLIP_UNITS * unit


class CellAcc:
    def __init__(
        self,
        method: str,
        dtype: str,
        max_examples: int,
        heads: tuple[int, ...] = (),
        queries: int = 1,
        path: str | None = None,
        role: str = ASKED,
    ) -> None:
        self.method, self.dtype, self.path, self.role = method, dtype, path, role
        self.unit = torch.finfo(dtype_from_name(dtype)).eps / 2  # unit roundoff of the cell's dtype (real_flips)
        self.near_ties = 0
        self.out: OutAcc | None = None  # created with the first output
        self.tied_rows = 0
        # Rows of a (..., heads..., queries, keys) tensor are grouped by their leading index.
        self.heads, self.queries = heads, queries
        self.nan_by_head = torch.zeros(math.prod(heads) if heads else 0, dtype=torch.int64)
        self.nan_by_head_cause: dict[str, torch.Tensor] = {}  # cause -> NaN rows per leading index (as nan_by_head)
        self.rows = 0
        self.nan_causes: Counter[str] = Counter()
        self.zero_causes: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.event_values: dict[str, float] = {}
        self.event_counts: dict[str, int] = {}
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
        # FP8 cells: probabilities the reference says are non-zero, and those the P cast flushed to 0,
        # by the key block's position against the row max's block in visiting order (fp8.POSITIONS).
        self.pcast_live: torch.Tensor | None = None
        # FP8 cells: how P@V accumulates, the key length, and the output error of the same kernel under other
        # accumulators (name -> sum of squared errors, elements)
        self.accum: str | None = None
        self.accum_keys: int | None = None
        self.companions: dict[str, list] = {}
        self.pcast_flushed = torch.zeros(3, dtype=torch.int64)
        self.pcast_rows = 0  # rows where the P cast flushed a probability the reference has
        self.pcast_mass_rows = 0  # rows where it flushed at least PCAST_MASS of the reference's probability
        self.pcast_mass_max = Max()
        self.p_scale: float | None = None

    def update(
        self,
        c: ChunkFacts,
        probs: torch.Tensor,
        events: dict[str, torch.Tensor],
        algo: AlgoReference,
        causes: list[tuple[str, torch.Tensor]],
        metrics: RowMetrics,
        pcast=None,
        extremes: dict[str, torch.Tensor] | None = None,
        counts: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add one chunk of this cell: ``probs`` (r, T) with the method's row events,
        the pipeline ``causes`` before them, and the cell's row ``metrics``; for an FP8
        cell, ``pcast`` (fp8.PCastSoftmax) says which probabilities the P cast flushed."""
        keys = probs.shape[-1]
        self.rows += probs.shape[0]
        m = metrics
        nan_row = ~finite(m.pmax)
        zero_row = m.pmax == 0
        self._count_broken(c, events, causes, nan_row, zero_row, extremes, counts)
        if pcast is not None:
            self._count_pcast(pcast, algo, ~nan_row)
        ok = ~nan_row & c.ref_ok  # (r,) rows where both are defined
        n_ok = count(ok)
        if not n_ok:
            return
        self._add_errors(c, probs, algo, m, ok, n_ok, keys)

    def _count_broken(self, c: ChunkFacts, events, causes, nan_row, zero_row, extremes, counts) -> None:
        """The chunk's NaN and all-zero rows by their first cause (per head too), and the method's row events."""
        # pipeline order; a backward hazard breaks no forward row
        row_causes = causes + [(name, events[name]) for name in EVENTS if name in events and EVENTS[name] != "backward"]
        overflow = event_rows(events, "overflow", nan_row.shape, nan_row.device)
        underflow = event_rows(events, "underflow", nan_row.shape, nan_row.device)
        for target, counter, prefix in ((nan_row, self.nan_causes, "nan"), (zero_row, self.zero_causes, "zero")):
            if not any_true(target):
                continue
            for cause, hit in attribute(target, row_causes).items():
                k = count(hit)
                if k:
                    counter[cause] += k
                    self.examples.add(f"{prefix}:{cause}", hit, c.offset)
                    if prefix == "nan" and self.heads:  # per head too: --ignore leaves them out of the head grid
                        head = (torch.nonzero(hit).flatten().cpu() + c.offset) // self.queries
                        per = self.nan_by_head_cause.setdefault(cause, torch.zeros_like(self.nan_by_head))
                        per += torch.bincount(head, minlength=per.numel())
        self.nan_rows += count(nan_row)
        if self.heads and any_true(nan_row):
            head = (torch.nonzero(nan_row).flatten().cpu() + c.offset) // self.queries
            self.nan_by_head += torch.bincount(head, minlength=self.nan_by_head.numel())
        self.zero_rows += count(zero_row)
        self.overflow_rows += count(overflow)
        self.underflow_rows += count(underflow)
        self.examples.add("overflow", overflow, c.offset)
        for name in EVENTS:
            if name in events and any_true(events[name]):
                self.events[name] += count(events[name])
                self.examples.add(f"event:{name}", events[name], c.offset)
                if extremes and name in extremes:  # the least value over the event's rows (a log-sum-exp)
                    low = float(extremes[name][events[name]].double().min())
                    self.event_values[name] = min(self.event_values.get(name, low), low)
                if counts and name in counts:  # the values hit, over the event's rows
                    self.event_counts[name] = self.event_counts.get(name, 0) + int(counts[name].sum())

    def _add_errors(self, c: ChunkFacts, probs, algo: AlgoReference, m: RowMetrics, ok, n_ok: int, keys: int) -> None:
        """The error statistics of the rows both sides define (``ok``): squared and largest errors, KL, flushed
        probabilities and the flips of the top key."""
        self.compared += n_ok
        self.elems += n_ok * keys
        every = n_ok == ok.numel()  # the common case: no row to leave out, no boolean indexing (a copy each)

        def sel(t: torch.Tensor) -> torch.Tensor:
            return t if every else take_rows(t, ok)

        self.max_sum_err.add((m.psum - 1).abs_() if every else take_rows((m.psum - 1).abs(), ok))
        self.sq.add(sel(m.sq_err))
        self.max_abs.add(sel(m.max_err))
        if not algo.same:
            both = ok & algo.ok
            n_both = count(both)
            self.sq_algo.add(take_rows(m.sq_err_algo, both))
            self.max_abs_algo.add(take_rows(m.max_err_algo, both))
            self.elems_algo += n_both * keys
        else:
            self.sq_algo, self.max_abs_algo, self.elems_algo = self.sq, self.max_abs, self.elems
        kl = sel(m.kl)
        self.kl.add(kl)
        self.kl_max.add(kl)
        self.ref_nonzero += int(sel(c.ref_positive_count).sum())
        self.flushed += int(sel(m.flushed).sum())
        # A flip: the reference's top key is strictly below the cell's maximum (ties are not flips),
        # and further from it than the cell's rounding explains (real_flips; flips are rare: a gather).
        flip = (m.p_at_top < m.pmax) & ok
        if any_true(flip):
            rows = torch.nonzero(flip).flatten()
            real = real_flips(c.x, algo.xc, probs, c.ref_top, rows, self.unit)
            self.near_ties += count(~real)
            flip = torch.zeros_like(flip).index_fill_(0, rows[real], True)
            self.flips += count(real)
            self.examples.add("flip", flip, c.offset)

    def _count_pcast(self, pcast, algo: AlgoReference, rows: torch.Tensor) -> None:
        t = pcast.tally(algo.ref, rows & algo.ok)  # the reference of the cell's own scores is non-zero there
        if self.pcast_live is None:
            self.pcast_live = torch.zeros(3, dtype=torch.int64)
        self.pcast_live += t.live
        self.pcast_flushed += t.flushed
        self.pcast_rows += t.mass.numel()
        self.pcast_mass_max.add(t.mass)
        self.pcast_mass_rows += int((t.mass >= PCAST_MASS).sum())
        self.p_scale = pcast.p_scale

    def update_out(self, out: torch.Tensor, ref: torch.Tensor, tied: torch.Tensor, ref_algo: torch.Tensor) -> None:
        """Add one chunk of this cell's output O (see OutAcc.update)."""
        if self.out is None:
            self.out = OutAcc(OutNanAcc(self.examples))
        self.out.update(out, ref, tied, ref_algo)

    def update_companion(self, name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        """Add one chunk of the output of this cell's kernel under another accumulator: its squared error
        against ``ref`` (float64 P64 @ V64) over the rows where both are finite, as out_rmse counts them."""
        o = out.to(torch.float64)
        ok = row_finite(out) & torch.isfinite(ref.sum(dim=-1))
        d = take_rows(o, ok) - take_rows(ref, ok)
        sq, n = self.companions.setdefault(name, [ExactSum(), 0])
        sq.add((d * d).sum(dim=-1))
        self.companions[name][1] = n + d.numel()

    def finish(self, lead: tuple[int, ...]) -> Cell:
        return Cell(
            method=self.method,
            dtype=self.dtype,
            rows=self.rows,
            nan_rows=self.nan_rows,
            nan_causes=dict(self.nan_causes),
            overflow_rows=self.overflow_rows,
            overflow_events={
                name: self.events[name] for name in EVENTS if EVENTS[name] == "overflow" and self.events[name]
            },
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
            events=dict(self.events),
            event_values=dict(self.event_values),
            event_counts=dict(self.event_counts),
            path=self.path,
            tied_rows=self.tied_rows,
            nan_rows_per_head=self._per_head(),
            nan_causes_per_head={cause: self._per_head(t) for cause, t in self.nan_by_head_cause.items()},
            role=self.role,
            argmax_flips_near_tie=self.near_ties,
            **({} if self.out is None else {**self.out.fields(), **self.out.causes.fields()}),
            **self._pcast_fields(),
            fp8_accum=self.accum,
            fp8_accum_keys=self.accum_keys,
            fp8_accum_rmse={name: math.sqrt(sq.total() / n) if n else None for name, (sq, n) in self.companions.items()}
            or None,
        )

    def _pcast_fields(self) -> dict:
        if self.pcast_live is None:
            return {}
        live, flushed = self.pcast_live.tolist(), self.pcast_flushed.tolist()
        return dict(
            pcast_flushed_frac=sum(flushed) / sum(live) if sum(live) else None,
            pcast_flushed_by_position={name: (f / n if n else None) for name, f, n in zip(POSITIONS, flushed, live)},
            pcast_rows=self.pcast_rows,
            pcast_mass_max=self.pcast_mass_max.value,
            pcast_mass_rows=self.pcast_mass_rows,
            p_scale=self.p_scale,
        )

    def _per_head(self, counts: torch.Tensor | None = None) -> list[int]:
        """NaN rows (``counts``: of one cause) per index of the last leading axis (the heads), summed over the
        axes before it."""
        if not self.heads:
            return []
        return (self.nan_by_head if counts is None else counts).reshape(-1, self.heads[-1]).sum(dim=0).tolist()

    def _top_heads(self) -> list[tuple[tuple[int, ...], int]]:
        """Every leading index with NaN rows, most first (ties by index)."""
        if not self.heads or not bool(self.nan_by_head.any()):
            return []
        counts, idx = torch.sort(self.nan_by_head, descending=True, stable=True)
        hit = int((counts > 0).sum())
        return [(unravel(int(i), self.heads), int(n)) for n, i in zip(counts[:hit].tolist(), idx[:hit].tolist())]
