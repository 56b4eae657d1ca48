"""One tensor diagnosed (``attncheck run`` on scores, or on Q and K): the census of its scores, the distribution
of the float64 reference, a cell per method x dtype and its first limit, the mask/scale audit, and a kernel's
settings grid as judged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attncheck.results.activations import KeyShares
from attncheck.results.backward import CellBackward
from attncheck.results.bounded import Sampling
from attncheck.results.common import ASKED, DtypeLimits, Finding
from attncheck.results.lowsum import LowSumStats


@dataclass
class DtypeHeadroom:
    """How the input sits against one dtype's limits, counted on the scores as the dtype holds
    them (torch's cast of the scores as given, or the dtype pipeline's scores from Q and K):
    what the dtype's cells compute with. A score the dtype turns into +inf counts as given."""

    dtype: str
    max_finite: float
    exp_overflow_threshold: float
    exp_underflow_threshold: float
    headroom: float | None  # threshold - largest finite score in the dtype; negative means naive exp overflows
    rows_over_exp_threshold: int  # row max in the dtype above the threshold: naive softmax's exp overflows there
    rows_all_underflow: int  # row max in the dtype below the underflow threshold: naive gives 0/0
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
    sentinels: list[
        tuple[float, int]
    ]  # mask constants (<= -1e4) that are rows' minimum, with how many rows (see sentinel_spans)
    fully_masked_rows: int  # every key masked (-inf or sentinel): the query may attend to nothing
    neginf_rows: int  # every key -inf: softmax undefined, the reference is NaN
    nan_input_rows: int
    posinf_input_rows: int
    headroom: list[DtypeHeadroom]
    # per sentinel, the lowest and highest row minimum it stands for: a constant added to the
    # scores rounds to several values (finfo(fp16).min + scores: -65504 ... -65152), reported as one
    sentinel_spans: list[tuple[float, float]] = field(default_factory=list)
    unmasked_min: float | None = None  # smallest finite score above the sentinel limit (-1e4): the lowest real logit


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
class CellLimit:
    """The first failure a cell can have from finite inputs, and how far this input is from it.

    ``kind``: 'exp_overflow' (naive: exp of the largest logit is inf in the dtype), 'qk_overflow'
    (S = Q@K^T held in a dtype whose max it passes), 'cast_overflow' (scores cast to a narrower
    dtype), 'p_cast_flush' (an FP8 P cast flushes keys further than ``threshold`` below the
    running max). ``value`` is the quantity measured against ``threshold`` (largest logit, largest
    |q.k|, largest score, largest spread of a row); ``headroom`` = threshold - value.
    """

    kind: str
    threshold: float
    value: float | None
    what: str  # the limit in words: 'S = Q@K^T in fp16 overflows beyond 65504'

    @property
    def headroom(self) -> float | None:
        return None if self.value is None else self.threshold - self.value


@dataclass
class Cell:
    """One method x dtype. Errors are over rows where the cell and the reference are both
    finite: against the float64 softmax of the scores as given (total), and against the
    float64 softmax of the scores after the cast to the cell's dtype (``_algo``)."""

    method: str
    dtype: str
    rows: int
    nan_rows: int
    nan_causes: dict[str, int]
    # rows where an exp or the row sum overflowed from finite scores (rows holding NaN or
    # +inf are not counted: their cause is the input); per event in ``events``
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
    kl_mean: float | None  # generalised KL(ref || p), see numerics.rowmath.kl_divergence
    kl_max: float | None
    flushed_frac: float | None  # reference-nonzero probabilities that became exactly 0
    argmax_flips: int
    examples: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    # overflow_rows by what overflowed (the overflow entries of ``events``): 'exp_overflow' (an exp of a finite score is
    # inf) or 'sum_overflow' (every exp finite, the row sum inf); the two are disjoint
    overflow_events: dict[str, int] = field(default_factory=dict)
    # NaN rows per index of the leading axes but the query axis, e.g. per (batch, head); most first
    nan_rows_by_head: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    # Rows per event the method reported (registry.EVENTS: exp_overflow, sum_overflow, underflow)
    events: dict[str, int] = field(default_factory=dict)
    # Per event, the least value a kernel reported over its rows ('padded_tile': the lowest log-sum-exp)
    event_values: dict[str, float] = field(default_factory=dict)
    # Per event, the values it hit over its rows ('p_saturation': probabilities above the FP8 format's max)
    event_counts: dict[str, int] = field(default_factory=dict)
    # With Q and K: the attention path the cell computes (registry.PATHS); None for given scores.
    path: str | None = None
    tied_rows: int = 0  # rows whose largest score is held by two or more keys (each gets exp(0) = 1)
    # With V: the output O = P@V against float64 (P64 @ V64), over rows where both are finite.
    out_rows: int | None = None  # rows compared
    out_nan_rows: int | None = None  # rows of O holding NaN or inf
    # those rows by their first cause (OUT_CAUSES: 'softmax' where P itself is NaN, else V's or P@V's)
    out_nan_causes: dict[str, int] = field(default_factory=dict)
    out_pv_max: float | None = None  # largest float64 |P @ V| (P and V as the cell holds them) of 'pv_overflow' rows
    out_max_abs_err: float | None = None
    out_rmse: float | None = None
    out_rel_l1: float | None = None  # sum |O - O_ref| / sum |O_ref|
    out_cos_min: float | None = None  # cosine similarity of a row of O with the reference's
    out_cos_mean: float | None = None
    # Bias of the path's own rounding: mean signed error of O against float64 softmax of the
    # path's scores times V as the dtype holds it (the V cast, shared by rows, left out).
    out_bias: float | None = None  # over all rows
    out_bias_tied: float | None = None  # over rows whose maximum score is shared by several keys
    out_bias_tied_z: float | None = None  # that mean in standard errors, the rows as samples (|z| > 4: biased)
    # FP8 cells: share of the probabilities the reference (of the cell's own scores) says are non-zero
    # that the P cast flushed to 0, overall and by the key block's position against the block of the
    # row max in visiting order (before_max, max_block, after_max); rows where it flushed any.
    pcast_flushed_frac: float | None = None
    pcast_flushed_by_position: dict[str, float | None] | None = None
    pcast_rows: int = 0
    pcast_mass_max: float | None = None  # largest reference probability mass a row lost to the P cast
    pcast_mass_rows: int = 0  # rows that lost at least 1e-3 of it (accumulate.PCAST_MASS)
    p_scale: float | None = None  # S, the factor on P before the FP8 cast
    # FP8 cells: how the tensor cores accumulate P@V ('fp32', '13 bits', '13 bits, flush every 4 blocks'), the key
    # length, and the output RMSE of the same kernel under other accumulators ('fp32': fp32 throughout; 'flush N':
    # the reduced accumulator added to fp32 every N key blocks), where the cell's is reduced
    fp8_accum: str | None = None
    fp8_accum_keys: int | None = None
    fp8_accum_rmse: dict[str, float | None] | None = None
    # NaN rows per head (the axis before the queries), summed over the axes before it; empty for 2-D input
    nan_rows_per_head: list[int] = field(default_factory=list)
    nan_causes_per_head: dict[str, list[int]] = field(default_factory=dict)  # the same, per first cause
    role: str = ASKED  # MODEL, WHAT_IF or ASKED (see ROLES)
    # rows whose top key differs from float64's, but only by a near-tie that the cell's own rounding
    # explains (see numerics.cells.accumulate.real_flips); not in argmax_flips
    argmax_flips_near_tie: int = 0
    limit: CellLimit | None = None  # None: nothing in this cell fails from finite scores
    backward: CellBackward | None = None  # dQ, dK, dV of this cell, where the output gradient dO is known
    # One point of a kernel's settings grid (--what-if fa4): its label ('t4,o8') and its numbers
    # ({'rescale_threshold': 4.0, 'max_offset': 8.0, 'default': False, 'refused': None or why the kernel asserts)
    variant: str | None = None
    setting: dict | None = None

    @property
    def name(self) -> str:
        """'stable/fp16'; with Q and K: 'eager:stable/fp16', 'flash/fp16'; a setting: 'fa4(t4,o8)/e4m3'."""
        variant = f"({self.variant})" if self.variant else ""
        if self.path and self.path != self.method:
            return f"{self.path}:{self.method}{variant}/{self.dtype}"
        return f"{self.method}{variant}/{self.dtype}"

    @property
    def label(self) -> str:
        """The cell without its dtype: 'stable', 'eager:stable', 'flash'."""
        return self.name.rsplit("/", 1)[0]

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
class DtypeAudit:
    """What computing the scores from Q and K in one dtype did, counted over all rows."""

    dtype: str
    qk_overflow_values: int = 0  # Q@K^T (or its scaling) beyond the dtype's range
    qk_overflow_rows: int = 0
    qk_max_abs: float = 0.0  # largest |score| the dtype pipeline produced before masking (finite part)
    mask_not_representable: int = 0  # finite float-mask values that become -inf in the dtype
    sentinel_not_representable: bool = False  # the boolean-mask sentinel itself is not representable
    sentinel_value: float = (
        0.0  # what a masked key is set to in this dtype: the boolean planes' sentinel, else the float mask's
    )
    mask_values: list[float] = field(
        default_factory=list
    )  # every sentinel the mask adds in this dtype (planes, then float mask)
    overflow_on_add: int = 0  # finite score + finite mask -> -inf
    summed_planes_overflow: int = 0  # finite float-mask value + finite sentinel -> -inf
    mask_sentinel_rows: int = 0  # rows the mask turned into all -inf or NaN
    # FP8 dtypes (the flash-fp8 path): how Q, K, V were quantised to the format, per tensor name.
    fp8_scaling: str | None = None  # none, tensor, head or block (numerics.fp8_attention)
    fp8_clipped: dict[str, int] = field(
        default_factory=dict
    )  # values beyond the format's max: the satfinite cast clips them
    fp8_flushed: dict[str, int] = field(default_factory=dict)  # non-zero values that became 0
    fp8_subnormal: dict[str, int] = field(
        default_factory=dict
    )  # non-zero values left below the smallest normal (fewer bits)
    fp8_values: dict[str, int] = field(default_factory=dict)  # non-zero values per tensor
    fp8_amax: dict[str, float] = field(default_factory=dict)  # largest |x| before quantisation (after the rotation)


@dataclass
class SoftCap:
    """A soft-capped call, ``cap * tanh(S * scale / cap)`` (Gemma-2's eager attention): S = Q@K^T is held
    in ``dtype`` before the cap, so it can round to inf there while the capped logits stay finite."""

    cap: float
    scale: float
    dtype: str  # where S = Q@K^T is held before the cap (the scores' dtype)
    limit: float  # its rounding limit: |S| at or past it becomes inf
    max_qk: float  # max |q.k| in float64, unscaled
    overflow: int  # scores of S that round to inf in ``dtype`` (q and k finite)
    # tanh(limit * scale / cap) rounds to 1 in ``dtype``: an S that became inf gives the logit and the gradient
    # (1 - tanh^2 = 0) that its finite value gives in this dtype, so the overflow changes nothing
    saturated: bool
    grad_finite: bool  # torch's autograd of the cap at inf S: finite (0), not NaN
    not_judged: list[str] = field(default_factory=list)  # what was asked but has no cap to judge by


@dataclass
class AttentionAudit:
    """Mask and scale facts of scores computed from Q and K (plain numbers)."""

    d: int
    heads: int
    kv_heads: int
    scale: float
    scale_name: str
    scale_order: str
    mask_value: str  # what masked keys hold: --mask-value for boolean planes, else the float mask's sentinel (repr)
    q_std: float  # robust std (1.4826 MAD) of the entries of q
    k_std: float
    q_max_abs: float
    k_max_abs: float
    float_mask_looks_boolean: bool
    raw_max_abs: float = 0.0  # max |q.k| in float64, unscaled
    scores_std: float | None = None  # robust std (1.4826 MAD) of the scaled, unmasked float64 scores
    masked_keys: int = 0
    leak_rows: int = 0  # rows whose float64 mass on masked keys exceeds the leak tolerance
    leak_max: float = 0.0
    dtypes: dict[str, DtypeAudit] = field(default_factory=dict)
    fitted_scale: float | None = None  # least-squares scale of given scores against q.k
    float_mask_value: float | None = (
        None  # a float mask's sentinel as the mask holds it (its most common value <= -1e4)
    )
    mask_summed_neginf: int = 0  # -inf values of a float mask next to sentinels beyond half its range (summed planes)
    mask_deep_sentinel: float | None = None
    # where the scale came from: 'argument' (SDPA's scale=) or 'traced' (the model's own code, as the
    # capture followed it) are the model's choice, a fact rather than a finding; None: --scale or the default
    scale_source: str | None = None
    softcap: SoftCap | None = None  # a soft cap between Q@K^T and the softmax (a captured eager call)
    # V as given: its non-finite entries (count, the first few as (batch, kv head, key, dim) with their value), its
    # largest finite |v|, and per dtype the finite entries its cast turns into +-inf (count, first few)
    v_nonfinite: int = 0
    v_nonfinite_at: list[tuple[tuple[int, ...], float]] = field(default_factory=list)
    v_max_abs: float | None = None
    v_cast_overflow: dict[str, int] = field(default_factory=dict)
    v_cast_overflow_at: dict[str, list[tuple[tuple[int, ...], float]]] = field(default_factory=dict)


@dataclass
class TensorDiagnosis:
    name: str
    shape: tuple[int, ...]
    dtype: str
    census: Census
    distribution: Distribution
    cells: list[Cell]
    findings: list[Finding]
    settings: dict[str, Any]  # how the cells were computed (block, order, accumulation, kernels, ...) as plain values
    attention: AttentionAudit | None = None  # mask and scale facts when scores came from Q and K
    # Not in the JSON report: the limits of the cell dtypes, and the row backend that ran.
    limits: dict[str, DtypeLimits] = field(default_factory=dict)
    backend: str = ""
    head_max_logits: list[float | None] = field(
        default_factory=list
    )  # largest unmasked score per head (the axis before the queries)
    choices: list[SettingChoice] = field(default_factory=list)  # --what-if fa4: each settings grid and its best
    lowsum: list[LowSumStats] = field(default_factory=list)  # --accumulate: each sum kept in 16 bits
    sampling: Sampling | None = None  # --budget/--rows: what was computed exactly and what was sampled
    key_shares: KeyShares | None = None  # the attention each key receives (numerics.sinks)

    def cell(self, method: str, dtype: str, path: str | None = None, variant: str | None = None) -> Cell:
        """The cell of ``method`` (or of a path: 'flash') in ``dtype``; ``path`` narrows it down; ``variant``: a
        point of a settings grid ('t4,o8'), None the cell as configured."""
        for c in self.cells:
            if c.method == method and c.dtype == dtype and (path is None or c.path == path) and c.variant == variant:
                return c
        raise KeyError(f"{method}/{dtype}" if path is None else f"{path}:{method}/{dtype}")


@dataclass
class SettingPoint:
    """One point of a kernel's settings grid (``--what-if fa4``) as judged: its numbers and its errors."""

    label: str  # 't4,o8'
    cell: str  # the cell's name: 'fa4(t4,o8)/e4m3'
    values: dict[str, float]  # {'rescale_threshold': 4.0, 'max_offset': 8.0}
    default: bool  # the kernel's own setting for the dtype
    refused: str | None  # why the kernel refuses it at the commit the path follows (its assert)
    err: (
        float | None
    )  # the choice's metric: O's relative L1 error (with V), else P's RMSE, against float64; worst call's
    verdict: str  # the cell's (the worst call's): 'ok', 'flip', 'nan', ...
    findings: list[str] = field(default_factory=list)  # codes of the cell's findings (over the calls)
    events: dict[str, int] = field(
        default_factory=dict
    )  # rows per kernel event ('p_saturation': P clipped by its cast)
    headroom: float | None = None  # the cell's limit's headroom (the lazy rescale's: how far P may grow)
    calls_bad: int = 0  # calls where it went wrong or had an error finding


@dataclass
class SettingChoice:
    """A kernel's settings grid in one dtype, over one diagnosis or every call of a model: each point's error
    against float64 and the best (the least error among the points the kernel takes that break nothing; errors
    within ``tie`` of each other, relatively, tie, and a tie goes to the default)."""

    path: str
    dtype: str
    metric: str  # 'out_rel_l1' (sum |O - O_float64| / sum |O_float64|) or 'rmse' (of P)
    points: list[SettingPoint]
    best: str | None  # label of the best point; None: none could be chosen (every point broke or was refused)
    default: str | None  # label of the kernel's default point
    calls: int = 1  # calls whose grid is gathered here
    tie: float = 0.0

    def point(self, label: str | None) -> SettingPoint | None:
        return next((p for p in self.points if p.label == label), None)
