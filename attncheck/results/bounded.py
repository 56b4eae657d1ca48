"""What a bounded diagnosis (``attncheck run --budget/--rows``) computed exactly and what it sampled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampledFigure:
    """One figure of a cell (or of the reference's distribution) estimated from the sample.

    ``kind`` 'mean': ``estimate`` with its two-sided 95% interval [``low``, ``high``] (random groups:
    mean of the groups' figures +- t(0.975, groups - 1) s / sqrt(groups)); 'max': the largest value
    over the sampled rows, a lower bound of the call's (``low`` = ``estimate``, ``high`` None), and
    ``exceed`` the fraction of the unsampled rows that may lie above it at 95% confidence."""

    owner: str  # a cell's name, or 'reference'
    figure: str  # the field of Cell / Distribution, e.g. 'rmse'
    kind: str  # 'mean' or 'max'
    estimate: float
    low: float | None
    high: float | None
    exceed: float | None = None


@dataclass
class Sampling:
    """How a call was diagnosed in bounded time.

    Rows are score rows (batch x head x query). A query position is certified when the bound
    scale |q_i| max_j |k_j| (times the dtypes' rounding factors), plus the mask's largest value, keeps every
    cell asked below its limit in every head; the others are computed in full (``exact_rows``, by
    ``exact_why``). The positions left are sampled uniformly (``sampled_rows``, ``seed``) and split at
    random into ``groups`` equal groups for the intervals. Counts of failing rows (NaN, overflow, fully
    masked, the cast and Q@K^T overflows) are exact: no certified row can have one; the error and
    distribution figures of the cells are over the rows computed (exact plus sampled), and ``figures``
    are the sampled estimates of the call's figures with their intervals."""

    rows: int  # score rows of the call
    positions: int  # query positions (the sampling unit: every head of a position is computed)
    certified_rows: int
    exact_rows: int  # rows computed in full because no bound certified their position
    exact_why: dict[str, int]  # 'bound', 'nonfinite', 'fully_masked' -> rows (a row counts under its first reason)
    sampled_rows: int
    groups: int
    seed: int
    bound_max: float | None  # the largest bound on |scale q.k| + mask over the certified rows
    estimator: str
    figures: list[SampledFigure] = field(default_factory=list)
    exact_figures: tuple[str, ...] = ()
    budget_s: float | None = None  # --budget
    estimated_exact_s: float | None = None  # the whole call's time, extrapolated from the pilot rows
    head_rows: int = 0  # a causal call's first certified positions' rows, computed in full for the estimates
