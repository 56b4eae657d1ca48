"""What ``attncheck.watch`` logs and its report reads back: each head's series over the steps, the alerts, and
the report over every rank's log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WatchSeries:
    """One attention head over a training run, as a watch log holds it (one point per recorded step)."""

    rank: int
    module: str  # the module path; '#2' after it for a module's second call in a step
    head: int
    kind: str  # 'sdpa' or 'softmax'
    dtype: str
    path: str  # the path the call runs: flash, sdpa-math, eager
    steps: list[int]
    max_logit: list[float | None]
    entropy_mean: list[float | None]
    collapsed: list[float | None]
    nonfinite: list[int]  # rows of the call's output holding NaN or inf (the call's, not the head's), per step
    limit_logit: float | None  # the largest logit before the call's first failure in its dtype
    limit_what: str
    scale: float | None
    growth: (
        float | None
    )  # the largest logit's growth factor per 100 steps, fitted over the last window (None: no real trend)
    steps_to_limit: float | None  # at that growth, steps until the limit (None: not growing)
    limits: list[float | None] = field(default_factory=list)  # each step's limit (a call's dtype may change mid-run)
    limit_whats: list[str | None] = field(default_factory=list)  # ... and what it is the limit of
    first_share: list[float | None] = field(default_factory=list)  # key 0's share of the sampled rows, per step

    @property
    def label(self) -> str:
        return f"{self.module} h{self.head}"


@dataclass
class WatchAlert:
    """A condition that held, at the first step it held (per head where it is a head's)."""

    code: str  # logit_growth, entropy_collapse, headroom_low, nonfinite, rank_divergence, no_attention
    severity: str
    rank: int
    module: str
    head: int | None
    step: int
    message: str
    what_if: str | None = None  # the dtype asked with --what-if (headroom_low), else None: the run's own
    other_rank: int | None = None  # rank_divergence: the rank it differs from (``rank`` holds the larger logit)


@dataclass
class WatchReport:
    logs: list[str]
    ranks: list[int]
    records: int  # recorded steps over all ranks
    first_step: int
    last_step: int
    series: list[WatchSeries]
    alerts: list[WatchAlert]  # in step order
    losses: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # rank -> (step, loss)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def first(self) -> WatchAlert | None:
        own = [a for a in self.alerts if a.what_if is None]
        return own[0] if own else None
