"""What ``attncheck sweep`` returns: each grid point's cells and outputs, and the presets that reproduce published
figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attncheck.results.common import DtypeLimits


@dataclass
class SweepCell:
    """One method x dtype at one grid point; rates are shares of rows."""

    method: str
    dtype: str
    rows: int
    nan_rate: float
    overflow_rate: float  # rows where an exp or the row sum hit inf from finite logits (as `run` counts them)
    exp_overflow_rate: float | None  # naive only: rows where exp of a finite logit is inf in the dtype
    exp_overflow_rate_theory: float | None  # naive only: its Gaussian-tail prediction (0.0 below 2.2e-308)
    max_abs_err: float | None  # max |p - p_float64(x)| over rows without NaN/inf; None if there are none
    max_abs_err_algo: float | None  # against float64 softmax of x after the cast to the dtype
    # naive only: log10 of the prediction, exact also where it is below float64's range
    exp_overflow_rate_theory_log10: float | None = None


@dataclass
class SweepOutput:
    """One attention path x dtype at one grid point: its output O = P@V against float64."""

    path: str
    dtype: str
    rows: int
    nan_rate: float  # rows of O holding NaN
    max_abs_err: float | None  # over rows where O is finite
    rmse: float | None
    rel_l1: float | None  # sum |O - O_ref| / sum |O_ref|


@dataclass
class SweepPoint:
    dk: int
    scale: str  # as given: 'none', 'sqrt', 'dk', 'dk2' or the number as typed
    scale_value: float
    std: float
    seq: int
    rows: int
    dist: str
    var_qk: float  # sample variance of the unscaled logits q . k
    var_qk_theory: float
    var_qk_stderr: float  # standard error of var_qk under this layout (rows of a head share keys)
    var_scaled: float  # sample variance of scale * q . k
    var_scaled_theory: float
    max_prob_mean: float | None
    entropy_mean: float | None  # nats
    entropy_norm_mean: float | None  # entropy / log(seq): 1 is uniform, 0 one-hot
    jacobian_norm_mean: float | None  # ||diag(p) - p p^T||_F: 0 when collapsed, gradient dies
    collapsed_rate: float | None  # rows with max probability >= the collapse threshold
    jacobian_norm_collapsed_mean: float | None  # |J| over the collapsed rows only; None if there are none
    cells: list[SweepCell]
    outputs: list[SweepOutput] = field(default_factory=list)  # per path x dtype, with V drawn like q and k


@dataclass
class PresetRow:
    """One published figure beside attncheck's measurement of the same thing."""

    label: str  # e.g. 'baseline attention, FP16'
    cell: str  # the attncheck cell that stands for it, e.g. 'eager:stable/fp16'
    paper: float
    measured: float | None


@dataclass
class PresetCheck:
    """A claim the preset must reproduce (a ratio in a range, a figure within a factor)."""

    claim: str
    value: float | None
    low: float
    high: float

    @property
    def holds(self) -> bool:
        return self.value is not None and self.low <= self.value <= self.high


@dataclass
class PresetGrid:
    """Measurements over a grid, beside a closed form: one row per grid point."""

    title: str
    columns: list[str]
    rows: list[list[float | str | None]]


@dataclass
class PresetResult:
    name: str
    source: str  # the publication
    setup: str  # what attncheck ran: distribution, shapes, seed
    metric: str
    rows: list[PresetRow]
    checks: list[PresetCheck]
    notes: list[str] = field(default_factory=list)
    grids: list[PresetGrid] = field(default_factory=list)
    seconds: float = 0.0  # not in the JSON report


@dataclass
class SweepResult:
    config: Any  # the sweep's settings (a config.sweep.SweepConfig: the grid axes, rows, dist, seed, block)
    device: str
    points: list[SweepPoint]
    # Not in the JSON report: the limits of the dtypes, and the time the sweep took.
    limits: dict[str, DtypeLimits] = field(default_factory=dict)
    seconds: float = 0.0
