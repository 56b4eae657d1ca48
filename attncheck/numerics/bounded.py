"""Long calls in bounded time: diagnose exactly the rows that can fail, and a uniform sample of the rest.

A score row i of one head is ``s_ij = scale q_i . k_j + m_ij``. By Cauchy-Schwarz, ``|q_i . k_j| <= |q_i| |k_j|``,
and however q and k are rounded to a cell's dtype (at most 2^-7 relative at and above bf16) and their products
summed in fp32 (at most d 2^-23 of sum |q_l k_l| <= |q_i| |k_j|), ``|q.k|`` as any cell computes it stays below
``|q_i| max_j |k_j| (1 + 2^-7)^2 (1 + d 2^-23) 1.01`` (``AttentionInputs.qk_bound``'s factor, per row instead of
per tensor; the watch certifies its max logits the same way, ``watcher.stats``). The max runs over the keys the row
can see: all keys of its kv head, or under the kernels' own causal mask the keys up to its position (a prefix
max). Plus the mask's largest value in the row, that bounds every logit, and a row is certified when the bound
stays below each cell's limit (``cell_limit``'s quantities): S = Q@K^T's rounding limit in the dtype the path
holds S in, exp's overflow for the naive softmax, a kernel's own limit on |S scale| (fa2-fma).

Rows with a nonfinite q, in a head whose k holds a nonfinite value, fully masked, or whose bound does not
certify them are computed in full. The unit is a query position (every head of it is computed), so that
the rows computed are a rectangular Q again and every path computes them as it would in the whole call.
The positions left are sampled uniformly without replacement (a seeded generator) and split at random into
``GROUPS`` equal groups; each group's figures accumulate on their own (``cells.groups``: in the one diagnosis
of the exact rows and the sample, so that a sampled row is computed once) and a figure that is a mean over rows is
estimated by the mean of the groups' figures with the interval mean +- t(0.975, GROUPS - 1) s / sqrt(GROUPS)
(the random group method: Wolter, Introduction to Variance Estimation, ch. 2); rmse-like figures go through their
squares.
A max over rows from a sample is a lower bound of the call's; for n sampled positions, the probability that
more than a fraction p of the positions exceed it is (1 - p)^n, so at 95% at most 1 - 0.05^(1/n) (about 3/n) do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from attncheck.numerics.cells.groups import GroupFigures, GroupTaps
from attncheck.numerics.inputs.index_mask import IndexMask
from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.precision import dtype_from_name, exp_overflow_threshold, rounding_limit
from attncheck.options import Bounded
from attncheck.params import MASK_SENTINEL_LIMIT
from attncheck.registry import PATHS, fp8_names, resolve
from attncheck.results.bounded import SampledFigure, Sampling

if TYPE_CHECKING:
    from attncheck.numerics.cells.plan import CellKey
    from attncheck.numerics.inputs.prepare import AttentionInputs
    from attncheck.results import TensorDiagnosis

GROUPS = 8
# t(0.975, df) for df = 1..7: the two-sided 95% interval of a mean over df + 1 groups (a group with no row compared
# leaves a figure to fewer groups)
T975 = (12.7062047, 4.30265273, 3.18244631, 2.77644511, 2.57058184, 2.44691185, 2.36462425)
CONFIDENCE = 0.95
PILOT_POSITIONS = 2 * GROUPS  # query positions timed to extrapolate the whole call under --budget
ROUNDING = (1 + 2**-7) ** 2 * 1.01  # q and k rounded to a 16-bit dtype, and margin (AttentionInputs.qk_bound)
# why a position is computed in full, in order: a nonfinite q or k (or mask), every key masked, q or k past a cell's
# dtype (its cast is inf), an output that could be nonfinite (V nonfinite or too large), the bound on the logits
REASONS = ("nonfinite", "fully_masked", "cast", "output", "bound")
MEAN_FIGURES = ("rmse", "rmse_algo", "kl_mean", "out_rmse", "out_rel_l1", "out_cos_mean")
SQUARED = ("rmse", "rmse_algo", "out_rmse")  # estimated through their squares (means over elements)
MAX_FIGURES = ("max_abs_err", "max_abs_err_algo", "kl_max", "out_max_abs_err")
DIST_FIGURES = ("entropy_mean", "entropy_norm_mean", "max_prob_mean", "jacobian_norm_mean")
EXACT_FIGURES = (
    "nan_rows",
    "overflow_rows",
    "out_nan_rows",
    "fully_masked_rows",
    "qk_overflow",
    "cast_overflow",
    "exp_overflow",
)
HEAD_MIN = 64  # a causal call's first certified positions computed in full, at least (causal_head)
ESTIMATOR = (
    f"uniform sample of query positions without replacement, split at random into {GROUPS} equal groups; "
    f"means: mean of the groups' figures +- t(0.975, {GROUPS - 1}) s/sqrt({GROUPS}) (rmse through its square); "
    "maxima: the sampled max, a lower bound (at 95%, at most 1 - 0.05^(1/n) of the other positions above it)"
)

CAUSAL_HEAD = (
    "; causal call: its first certified positions (as many as the sample, at least 64) are computed in full and "
    "weighted by their share, the sample is drawn from the positions after them"
)


@dataclass
class Certificate:
    """Per query position: must it be computed in full, and why; the largest certified bound."""

    must: torch.Tensor  # (Tq,) bool
    why: dict[str, int]  # reason -> score rows
    bound_max: float | None


def row_local(inp: "AttentionInputs", cells: list["CellKey"]) -> str | None:
    """Why these cells cannot be computed from a subset of the queries (None: they can)."""
    if inp.logits64 is not None:
        return "a score_mod's logits are computed whole"
    causal = inp.call is not None and inp.call.mask == "causal"
    for c in cells:
        if c.dtype in fp8_names():
            return f"{c.name}: FP8 quantisation scales read every row of a head"
        local = True if c.path is None else PATHS.get(c.path).row_local  # the spec says: no path name compared
        if local is False or (local == "noncausal" and causal):
            return f"{c.name}: the kernel's rows depend on their neighbours"
    return None


def _key_max(inp: "AttentionInputs") -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hq, Tq) float64: the largest |k_j| a query row can see; (B, Hq) bool: its head's k is finite."""
    b, hq, tq, _ = inp.q.shape
    k_norm = torch.linalg.vector_norm(inp.k.to(torch.float64), dim=-1)  # (B, Hk, Tk)
    finite = torch.isfinite(k_norm).all(dim=-1)  # (B, Hk)
    k_norm = torch.nan_to_num(k_norm, nan=0.0, posinf=0.0)
    causal = inp.call is not None and inp.call.mask == "causal" and tq <= k_norm.shape[-1]
    if causal:  # is_causal aligns at the top left (PyTorch's ones(L, S).tril(0)): query i sees keys 0..i
        k_max = torch.cummax(k_norm, dim=-1).values[..., :tq]
    else:
        k_max = k_norm.amax(dim=-1, keepdim=True).expand(b, k_norm.shape[1], tq)
    group = hq // k_norm.shape[1]
    return k_max.repeat_interleave(group, dim=1), finite.repeat_interleave(group, dim=1)


def _mask_rows(inp: "AttentionInputs", step: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hq, Tq): the largest value the float mask adds to a row (0 without one) and whether every key of
    the row is masked (a boolean mask, or float values at or below the sentinel limit), read in query blocks;
    causal and padding alone (``IndexMask``) say which rows they mask whole from their rules."""
    b, hq, tq, _ = inp.q.shape
    top = torch.zeros(b, hq, tq, dtype=torch.float64)
    full = torch.zeros(b, hq, tq, dtype=torch.bool)
    if isinstance(inp.masked, IndexMask) and inp.mask_float is None:
        return top, inp.masked.fully_masked().expand(b, hq, tq).clone()
    for q0 in range(0, tq, step):
        qs = slice(q0, min(q0 + step, tq))
        masked = None if inp.masked is None else _rows_of(inp.masked, qs)
        if inp.mask_float is not None:
            mf = _rows_of(inp.mask_float, qs)
            top[:, :, qs] = torch.nan_to_num(mf.amax(dim=-1), nan=math.inf).expand(b, hq, -1)
            by_float = mf <= MASK_SENTINEL_LIMIT
            masked = by_float if masked is None else masked | by_float
        if masked is not None:
            full[:, :, qs] = masked.all(dim=-1).expand(b, hq, -1)
    return top, full


def _rows_of(t: torch.Tensor | IndexMask, qs) -> torch.Tensor:
    """Rows ``qs`` of a (B|1, H|1, Tq|1, Tk) mask; a mask broadcast over the queries keeps its one row; causal and
    padding alone (``IndexMask``) make those rows' part, (B|1, 1, n|1, Tk)."""
    if isinstance(t, IndexMask):
        return t.plane(None, qs)
    return t if t.shape[-2] == 1 else t[..., qs, :]


def row_bounds(inp: "AttentionInputs") -> tuple[torch.Tensor, ...]:
    """(B, Hq, Tq) each: the bound on |q.k| as any cell computes it, the bound on every finite logit (times the
    scale, plus the mask's largest value), rows whose q, k or mask is not finite, and fully masked rows."""
    d = inp.q.shape[-1]
    q_norm = torch.linalg.vector_norm(inp.q.to(torch.float64), dim=-1)  # (B, Hq, Tq)
    k_max, k_finite = _key_max(inp)
    raw = q_norm * k_max * ROUNDING * (1 + d * 2**-23)
    mask_top, full = _mask_rows(inp)
    logit = raw * abs(inp.scale) + mask_top
    nonfinite = ~torch.isfinite(q_norm) | ~k_finite[..., None] | torch.isnan(mask_top) | torch.isposinf(mask_top)
    return raw, logit, nonfinite, full


def _head_max(inp: "AttentionInputs", per_key: torch.Tensor) -> torch.Tensor:
    """(B, Hq, Tq) float64: the largest of a (B, Hk, Tk) per-key figure over every key of the row's kv head, NaN
    as inf. Every key, masked or not: eager computes P@V as a whole product, where a masked key's 0 times a
    nonfinite v is NaN, and an inf score of a masked key plus an additive -inf mask is NaN."""
    b, hq, tq, _ = inp.q.shape
    per_key = torch.nan_to_num(per_key.to(torch.float64), nan=math.inf)
    top = per_key.amax(dim=-1, keepdim=True).expand(b, per_key.shape[1], tq)
    return top.repeat_interleave(hq // per_key.shape[1], dim=1)


def cast_bounds(inp: "AttentionInputs") -> tuple[torch.Tensor, ...]:
    """(B, Hq, Tq) each, float64: max |q| of the row (times the scale when it is applied to q), max |k| and max |v|
    of its kv head (NaN as inf; max |v| 0 without V). A cell casts q, k and v to its dtype: an entry at
    or past the dtype's rounding limit becomes inf there, which the Cauchy-Schwarz bound on the float64 norms does
    not see; and the output is a convex combination of the rows of V, so |O| <= max |v|."""
    q_abs = torch.nan_to_num(inp.q.to(torch.float64).abs().amax(dim=-1), nan=math.inf)
    if inp.scale_order == "q":
        q_abs = q_abs * max(1.0, abs(inp.scale))
    k_abs = _head_max(inp, inp.k.abs().amax(dim=-1))
    v_abs = torch.zeros_like(q_abs) if inp.v is None else _head_max(inp, inp.v.abs().amax(dim=-1))
    return q_abs, k_abs, v_abs


def _cast_ok(inp: "AttentionInputs", cells: list["CellKey"]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hq, Tq) bool each: q and k stay finite when cast to every cell's dtype; the output stays finite (V
    finite and within the dtype after its cast, P@V below the dtype's largest value, and the unnormalised fp32
    accumulator of the online softmax, at most Tk max |v|, below fp32's)."""
    q_abs, k_abs, v_abs = cast_bounds(inp)
    qk_ok, v_ok = torch.ones_like(q_abs, dtype=torch.bool), torch.ones_like(q_abs, dtype=torch.bool)
    tk = inp.k.shape[-2]
    for dt in {dtype_from_name(c.dtype) for c in cells}:
        top = float(torch.finfo(dt).max)
        qk_ok &= (q_abs < top) & (k_abs < top)
        v_ok &= (v_abs * ROUNDING < top) & (v_abs * tk < float(torch.finfo(torch.float32).max) / 2)
        v_ok &= v_abs < rounding_limit(dt)
    return qk_ok, v_ok


def certify(inp: "AttentionInputs", cells: list["CellKey"]) -> Certificate:
    """Which query positions every cell asked is certified free of overflow and NaN at, from the bound."""
    raw, logit, nonfinite, full = row_bounds(inp)
    ok = torch.ones_like(full)
    s32 = rounding_limit(torch.float32)
    for c in cells:
        dt = dtype_from_name(c.dtype)
        spec = PATHS.get(c.path) if c.path is not None else None
        # S held in the dtype (eager) or in fp32; the scale, applied before or after, taken as at least 1
        held = rounding_limit(dt) if spec is None or spec.scores == "dtype" else s32
        ok &= (raw * max(1.0, abs(inp.scale)) < held) & (logit < held)  # S, then S plus the mask, in that dtype
        if c.method == "naive":  # exp(x) of the unshifted logits
            ok &= logit < exp_overflow_threshold(dt)
        own = None if spec is None or spec.limit is None else resolve(spec.limit)(dt, MethodParams())
        if own is not None:
            _, threshold, _, *other = own
            ok &= (logit < threshold) if not other else torch.zeros_like(ok)  # another quantity: not bounded here
    cast_ok, out_ok = _cast_ok(inp, cells)
    row_must = nonfinite | full | ~ok | ~cast_ok | ~out_ok
    must = row_must.reshape(-1, row_must.shape[-1]).any(dim=0)  # (Tq,): a position is computed in every head
    why = _why(must, row_must.shape[0] * row_must.shape[1], nonfinite, full, ~cast_ok, ~out_ok, ~ok)
    certified = logit.reshape(-1, logit.shape[-1])[:, ~must]
    return Certificate(must, why, float(certified.max()) if certified.numel() else None)


def _why(must: torch.Tensor, planes: int, *hits: torch.Tensor) -> dict[str, int]:
    """Score rows computed in full by reason: each position computed counts its every head (``planes`` rows)
    under the first reason any of its rows has, so that the reasons add up to the rows computed in full."""
    left = must.clone()
    why = {}
    for name, hit in zip(REASONS, hits):
        at = hit.reshape(-1, hit.shape[-1]).any(dim=0) & left
        if bool(at.any()):
            why[name] = int(at.sum()) * planes
        left &= ~at
    return why


def _query_rows(t: torch.Tensor | IndexMask, positions: torch.Tensor) -> torch.Tensor | IndexMask:
    """The rows of the query ``positions`` of a mask: a plane's rows, or the rule of those positions."""
    return t.at(positions) if isinstance(t, IndexMask) else _rows_of(t, positions)


def subset(inp: "AttentionInputs", positions: torch.Tensor) -> "AttentionInputs":
    """The inputs of the query ``positions`` alone (their mask rows with them)."""
    return replace(
        inp,
        q=inp.q[:, :, positions],
        masked=None if inp.masked is None else _query_rows(inp.masked, positions),
        mask_float=None if inp.mask_float is None else _rows_of(inp.mask_float, positions),
        cache={},
    )


def diagnose_bounded(
    name: str,
    inp: "AttentionInputs",
    options,
    cells: list["CellKey"],
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
    scale_source: str | None = None,
    diagnose_attention: Callable | None = None,
) -> "TensorDiagnosis":
    """The diagnosis of a long call in bounded time (module docstring), or of every row where sampling would
    save nothing. ``diagnose_attention``: the exact diagnosis (``cells.diagnose``'s, passed in: it calls this)."""
    found = _sampled(name, inp, options, cells, progress, notice, scale_source, diagnose_attention)
    if found is not None:
        return found
    exact = replace(options, bounded=None)
    return diagnose_attention(name, inp, exact, progress, notice=notice, cells=cells, scale_source=scale_source)


def _sampled(
    name: str,
    inp: "AttentionInputs",
    options,
    cells: list["CellKey"],
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
    scale_source: str | None = None,
    diagnose_attention: Callable | None = None,
) -> "TensorDiagnosis | None":
    """The diagnosis of a long call in bounded time (module docstring); None where it would compute every row
    anyway (too few rows, a sample as large as what is left, a call within the budget, or cells whose rows
    depend on their neighbours: then ``notice`` hears why). ``diagnose_attention``: the exact diagnosis
    (``cells.diagnose``'s, passed in: it calls this module)."""
    started = time.perf_counter()
    bounded: Bounded = options.bounded
    exact = replace(options, bounded=None)
    tq, planes = inp.q.shape[2], inp.q.shape[0] * inp.q.shape[1]
    if inp.rows < max(bounded.min_rows, 2 * PILOT_POSITIONS * planes):
        return None
    why_not = row_local(inp, cells)
    if why_not is not None:
        if notice is not None:
            notice(f"{name}: computed in full ({why_not})")
        return None
    cert = certify(inp, cells)
    free = torch.nonzero(~cert.must).flatten()
    if free.numel() <= 4 * PILOT_POSITIONS:  # nearly every position can fail: each is computed
        if notice is not None and free.numel() < tq:
            notice(f"{name}: computed in full ({tq - free.numel():,} of {tq:,} query positions can fail)")
        return None
    causal = inp.call is not None and inp.call.mask == "causal"
    gen = torch.Generator().manual_seed(bounded.seed)

    def run(pos: torch.Tensor, cuts: list[int] | None = None, taps: GroupTaps | None = None) -> "TensorDiagnosis":
        return diagnose_attention(
            name,
            subset(inp, pos),
            exact,
            None,
            notice=notice,
            cells=cells,
            fit=False,
            scale_source=scale_source,
            cuts=cuts,
            taps=taps,
        )

    # the pilots' positions from a generator of their own: the sample is the seed's first draw, with or without them
    order = free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(bounded.seed + 1))]
    n, estimated = _sample_size(bounded, run, order, int(cert.must.sum()), planes, tq, started, 2 if causal else 1)
    if n is None:
        return None
    head, rest = causal_head(free, n) if causal else (free[:0], free)
    if n >= rest.numel():
        return None
    sample = rest[torch.randperm(rest.numel(), generator=gen)[:n]]
    # the exact rows, a causal call's head, then each group's sampled positions (each in order): no block of rows
    # across two of them; the head and the groups accumulate beside the whole diagnosis, in its one pass
    heads = [head] if head.numel() else []
    parts = [torch.nonzero(cert.must).flatten(), *heads, *(torch.sort(g).values for g in sample.chunk(GROUPS))]
    positions = torch.cat(parts)
    taps = GroupTaps(len(heads) + GROUPS, first=1)
    main = run(positions, [0, *torch.tensor([p.numel() for p in parts]).cumsum(0).tolist()], taps)
    _restore(main, inp, positions)
    main.sampling = _sampling(inp, bounded, cert, taps, n, head.numel(), free.numel(), estimated)
    if progress is not None:
        progress(inp.rows)
    return main


def _sampling(inp, bounded: Bounded, cert: Certificate, taps: GroupTaps, n: int, head: int, free: int, estimated):
    """What the sample says of the whole call: the rows computed and why, and each figure's estimate from the groups
    (and a causal call's ``head`` positions, computed in full, weighted by their share of the ``free`` ones)."""
    planes = inp.q.shape[0] * inp.q.shape[1]
    head_figures, groups = (taps.figures[0], taps.figures[1:]) if head else (None, taps.figures)
    exact_rows = int(cert.must.sum()) * planes
    return Sampling(
        rows=inp.rows,
        positions=inp.q.shape[2],
        certified_rows=inp.rows - exact_rows,
        exact_rows=exact_rows,
        exact_why=cert.why,
        sampled_rows=n * planes,
        groups=GROUPS,
        seed=bounded.seed,
        bound_max=cert.bound_max,
        estimator=ESTIMATOR + (CAUSAL_HEAD if head else ""),
        figures=estimates(groups, n, head_figures, head / free),
        exact_figures=EXACT_FIGURES,
        budget_s=bounded.budget,
        estimated_exact_s=estimated,
        head_rows=head * planes,
    )


def causal_head(free: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, rest) of the certified positions of a causal call: the first max(n, HEAD_MIN) of them, computed in
    full, and those after, sampled. Early causal rows see few keys and hold the heavy tail of the row figures
    (row 0's max probability is 1): a uniform sample of them gives intervals that cover ~80% instead of 95%."""
    e = min(max(n, HEAD_MIN), free.numel())
    return free[:e], free[e:]


def _sample_size(
    bounded: Bounded, run: Callable, order: torch.Tensor, must: int, planes: int, tq: int, started: float, share: int
):
    """(query positions to sample, rounded to whole groups, or None where the pilots time the whole call within the
    budget; the whole call's time estimated by the pilots, None under --rows). ``share``: 2 for a causal call, whose
    head (as many positions as the sample) is computed beside the sample."""
    if bounded.rows is not None:
        n = -(-bounded.rows // planes)
        return max(PILOT_POSITIONS, -(-n // GROUPS) * GROUPS), None
    fixed, per = _pilot(run, order)
    estimated = fixed + per * tq
    if estimated <= bounded.budget:
        return None, estimated
    # one diagnosis of the exact rows and the sample (the groups accumulate beside it), in what the budget has left
    # after the bound and the pilots
    n = int((bounded.budget - (time.perf_counter() - started) - fixed - per * must) / (share * per))
    return max(PILOT_POSITIONS, -(-n // GROUPS) * GROUPS), estimated


def _pilot(run: Callable, order: torch.Tensor) -> tuple[float, float]:
    """(seconds a diagnosis costs whatever its size, seconds per query position) from two timed pilots of
    PILOT_POSITIONS and 3 PILOT_POSITIONS positions: the per-call work apart from the rows'. An untimed pilot of
    PILOT_POSITIONS runs first, so that what a process pays once (the kernels' compile, first imports) does not
    inflate the first timing and under-time the rows (a 64k call's sample once ran 3x past what its pilots timed)."""
    times = []
    for n in (PILOT_POSITIONS, PILOT_POSITIONS, 3 * PILOT_POSITIONS):
        t0 = time.perf_counter()
        run(torch.sort(order[:n]).values)
        times.append(time.perf_counter() - t0)
    times = times[1:]
    per = max((times[1] - times[0]) / (2 * PILOT_POSITIONS), times[1] / (3 * PILOT_POSITIONS) / 10)
    return max(0.0, times[0] - PILOT_POSITIONS * per), per


def _restore(diag: "TensorDiagnosis", inp: "AttentionInputs", positions: torch.Tensor) -> None:
    """The diagnosis of the rows computed, said of the whole call: its shape, and examples at their own query."""
    diag.shape = tuple(inp.score_shape)
    where = positions.tolist()
    for cell in diag.cells:
        cell.examples = {
            label: [(*row[:-1], where[row[-1]]) if row else row for row in rows]
            for label, rows in cell.examples.items()
        }


def estimates(
    groups: list[GroupFigures], n: int, head: GroupFigures | None = None, weight: float = 0.0
) -> list[SampledFigure]:
    """The sampled figures of each cell and of the reference's distribution, from the groups' figures; with a
    causal ``head`` computed in full, a mean is ``weight`` head + (1 - weight) the groups' mean (its interval
    scaled by 1 - weight) and a max is the larger of the head's and the sample's."""
    out: list[SampledFigure] = []
    exceed = 1 - (1 - CONFIDENCE) ** (1 / n)
    owners = [(c.name + (f" [{c.variant}]" if c.variant else ""), i) for i, c in enumerate(groups[0].cells)]
    for owner, i in owners:
        cells = [g.cells[i] for g in groups]
        h = None if head is None else head.cells[i]
        for figure in MEAN_FIGURES:
            at = None if h is None else getattr(h, figure)
            fig = mean_figure(owner, figure, [getattr(c, figure) for c in cells], figure in SQUARED, at, weight)
            if fig is not None:
                out.append(fig)
        for figure in MAX_FIGURES:
            got = [getattr(c, figure) for c in cells] + ([] if h is None else [getattr(h, figure)])
            values = [v for v in got if v is not None and math.isfinite(v)]
            if values:
                out.append(SampledFigure(owner, figure, "max", max(values), max(values), None, exceed))
    for figure in DIST_FIGURES:
        at = None if head is None else getattr(head.distribution, figure)
        fig = mean_figure("reference", figure, [getattr(g.distribution, figure) for g in groups], False, at, weight)
        if fig is not None:
            out.append(fig)
    return out


def mean_figure(
    owner: str, figure: str, values: list, squared: bool, head: float | None = None, weight: float = 0.0
) -> SampledFigure | None:
    """A mean over rows from the groups' values: their mean and its t interval (rmse-like through squares); with
    the ``head``'s exact value, weighted by its share of the rows (``weight``), added in."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if len(vals) < 2:
        return None
    xs = torch.tensor([v * v for v in vals] if squared else vals, dtype=torch.float64)
    mean, half = float(xs.mean()), T975[len(vals) - 2] * float(xs.std(correction=1)) / math.sqrt(xs.numel())
    if head is not None and math.isfinite(head):
        mean, half = weight * (head * head if squared else head) + (1 - weight) * mean, (1 - weight) * half
    if squared:
        return SampledFigure(
            owner, figure, "mean", math.sqrt(mean), math.sqrt(max(0.0, mean - half)), math.sqrt(mean + half)
        )
    return SampledFigure(owner, figure, "mean", mean, mean - half, mean + half)
