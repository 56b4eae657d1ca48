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
ESTIMATOR = (
    f"uniform sample of query positions without replacement, split at random into {GROUPS} equal groups; "
    f"means: mean of the groups' figures +- t(0.975, {GROUPS - 1}) s/sqrt({GROUPS}) (rmse through its square); "
    "maxima: the sampled max, a lower bound (at 95%, at most 1 - 0.05^(1/n) of the other positions above it)"
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


def certify(inp: "AttentionInputs", cells: list["CellKey"]) -> Certificate:
    """Which query positions every cell asked is certified free of overflow and NaN at, from the bound."""
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.precision import dtype_from_name, exp_overflow_threshold, rounding_limit

    raw, logit, nonfinite, full = row_bounds(inp)
    ok = torch.ones_like(full)
    s32 = rounding_limit(torch.float32)
    for c in cells:
        dt = dtype_from_name(c.dtype)
        spec = PATHS.get(c.path) if c.path is not None else None
        # S held in the dtype (eager) or in fp32; the scale, applied before or after, taken as at least 1
        held = rounding_limit(dt) if spec is None or spec.scores == "dtype" else s32
        ok &= raw * max(1.0, abs(inp.scale)) < held
        if c.method == "naive":  # exp(x) of the unshifted logits
            ok &= logit < exp_overflow_threshold(dt)
        own = None if spec is None or spec.limit is None else resolve(spec.limit)(dt, MethodParams())
        if own is not None:
            _, threshold, _, *other = own
            ok &= (logit < threshold) if not other else torch.zeros_like(ok)  # another quantity: not bounded here
    reasons = (("nonfinite", nonfinite), ("fully_masked", full & ~nonfinite), ("bound", ~ok & ~nonfinite & ~full))
    why = {name: int(hit.sum()) for name, hit in reasons if bool(hit.any())}
    row_must = nonfinite | full | ~ok
    must = row_must.reshape(-1, row_must.shape[-1]).any(dim=0)  # (Tq,): a position is computed in every head
    certified = logit.reshape(-1, logit.shape[-1])[:, ~must]
    return Certificate(must, why, float(certified.max()) if certified.numel() else None)


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
        return None
    gen = torch.Generator().manual_seed(bounded.seed)
    order = free[torch.randperm(free.numel(), generator=gen)]

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

    n, estimated = _sample_size(bounded, run, order, int(cert.must.sum()), planes, tq, started)
    if n is None or n >= free.numel():
        return None
    # the exact rows, then each group's sampled positions (each in order): no block of rows across two of them
    parts = [torch.nonzero(cert.must).flatten(), *(torch.sort(g).values for g in order[:n].chunk(GROUPS))]
    positions = torch.cat(parts)
    taps = GroupTaps(GROUPS, first=1)
    main = run(positions, [0, *torch.tensor([p.numel() for p in parts]).cumsum(0).tolist()], taps)
    _restore(main, inp, positions)
    exact_rows = int(cert.must.sum()) * planes
    main.sampling = Sampling(
        rows=inp.rows,
        positions=tq,
        certified_rows=inp.rows - exact_rows,
        exact_rows=exact_rows,
        exact_why=cert.why,
        sampled_rows=n * planes,
        groups=GROUPS,
        seed=bounded.seed,
        bound_max=cert.bound_max,
        estimator=ESTIMATOR,
        figures=estimates(taps.figures, n),
        exact_figures=EXACT_FIGURES,
        budget_s=bounded.budget,
        estimated_exact_s=estimated,
    )
    if progress is not None:
        progress(inp.rows)
    return main


def _sample_size(bounded: Bounded, run: Callable, order: torch.Tensor, must: int, planes: int, tq: int, started: float):
    """(query positions to sample, rounded to whole groups, or None where the pilots time the whole call within the
    budget; the whole call's time estimated by the pilots, None under --rows)."""
    if bounded.rows is not None:
        n = -(-bounded.rows // planes)
        return max(PILOT_POSITIONS, -(-n // GROUPS) * GROUPS), None
    fixed, per = _pilot(run, order)
    estimated = fixed + per * tq
    if estimated <= bounded.budget:
        return None, estimated
    # one diagnosis of the exact rows and the sample (the groups accumulate beside it), in what the budget has left
    # after the bound and the pilots
    n = int((bounded.budget - (time.perf_counter() - started) - fixed - per * must) / per)
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


def estimates(groups: list[GroupFigures], n: int) -> list[SampledFigure]:
    """The sampled figures of each cell and of the reference's distribution, from the groups' diagnoses."""
    out: list[SampledFigure] = []
    exceed = 1 - (1 - CONFIDENCE) ** (1 / n)
    owners = [(c.name + (f" [{c.variant}]" if c.variant else ""), i) for i, c in enumerate(groups[0].cells)]
    for owner, i in owners:
        cells = [g.cells[i] for g in groups]
        for figure in MEAN_FIGURES:
            fig = mean_figure(owner, figure, [getattr(c, figure) for c in cells], figure in SQUARED)
            if fig is not None:
                out.append(fig)
        for figure in MAX_FIGURES:
            values = [v for v in (getattr(c, figure) for c in cells) if v is not None and math.isfinite(v)]
            if values:
                out.append(SampledFigure(owner, figure, "max", max(values), max(values), None, exceed))
    for figure in DIST_FIGURES:
        fig = mean_figure("reference", figure, [getattr(g.distribution, figure) for g in groups], False)
        if fig is not None:
            out.append(fig)
    return out


def mean_figure(owner: str, figure: str, values: list, squared: bool) -> SampledFigure | None:
    """A mean over rows from the groups' values: their mean and its t interval (rmse-like through squares)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if len(vals) < 2:
        return None
    xs = torch.tensor([v * v for v in vals] if squared else vals, dtype=torch.float64)
    mean, half = float(xs.mean()), T975[len(vals) - 2] * float(xs.std(correction=1)) / math.sqrt(xs.numel())
    if squared:
        return SampledFigure(
            owner, figure, "mean", math.sqrt(mean), math.sqrt(max(0.0, mean - half)), math.sqrt(mean + half)
        )
    return SampledFigure(owner, figure, "mean", mean, mean - half, mean + half)
