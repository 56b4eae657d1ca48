"""What attncheck returns: plain dataclasses of numbers and names, free of torch.

``numerics`` fills them, ``findings`` reads them, ``report`` formats them. The
JSON reports are these dataclasses as they are (fields starting with ``_`` and
the few marked below are left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attncheck.format import plain

UNEXPLAINED = "unexplained"  # the cause of a NaN or zero row that no known cause explains

# What a cell is asked for. A captured call names the implementation and dtype it ran: that is its
# MODEL cell, which alone decides the call's verdict, findings and exit code; any other cell is a
# WHAT_IF ('what would break if the model ran this instead'), reported apart and never counted as
# the model's. For bare scores (or Q/K files) the implementation is unknown: every cell is ASKED.
MODEL, WHAT_IF, ASKED = "model", "what-if", "asked"
ROLES = (MODEL, WHAT_IF, ASKED)

# FlashAttention's test rule: a kernel's error is at most this many times the error of a
# plain PyTorch implementation in the same dtype, both against a float64 reference.
FLASH_RULE_FACTOR = 2.0


def flash_rule_bound(reference_err: float, factor: float = FLASH_RULE_FACTOR, atol: float = 0.0) -> float:
    """The error an implementation may have when the same-dtype reference has ``reference_err``."""
    return factor * reference_err + atol


@dataclass(frozen=True)
class DtypeLimits:
    """What a dtype can hold (``numerics.precision`` derives each from torch.finfo)."""

    name: str
    max: float
    tiny: float
    smallest_subnormal: float
    eps: float
    rounding_limit: float  # |x| at or beyond this does not round to a finite value below max
    overflow: str  # what a cast beyond the range gives: 'inf', 'nan' or 'saturate'
    exp_overflow: float  # exp(x) is inf in the dtype for x above this
    exp_underflow: float  # exp(x) is 0 in the dtype for x below this


# --------------------------------------------------------------------------- run


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


# A recorded gradient beyond the rounding bound of the model's cell by at most this factor is an info, not
# an error (grad_emulation_mismatch): the bound is first order and its exp constants are measured on x86
# vector units; measured ratios stay below 0.7 (docs/reference/numerics.md), a wrong emulation is far beyond.
REAL_BOUND_TOLERANCE = 4.0

# The causes of NaN/inf gradient rows, in backward order: what reaches a row first is its cause.
GRAD_CAUSES = (
    "grad_out_nan",
    "grad_out_inf",
    "grad_out_overflow",
    "input_nan",
    "inf_input",
    "qk_overflow",
    "fully_masked",
    "forward_nan",
    "dp_overflow",
    "ds_nan",
    "ds_overflow",
    "grad_overflow",
)


@dataclass
class GradStats:
    """One gradient (dq, dk or dv) of one cell against float64 autograd of the intended attention.
    Rows are (batch, head, token) of the gradient: queries for dq, keys for dk and dv (kv heads)."""

    rows: int
    nan_rows: int  # rows holding NaN or inf
    first_cause: str | None  # the earliest of those rows' causes in backward order (GRAD_CAUSES); counts: ``causes``
    causes: dict[str, int]  # NaN/inf rows per first cause
    compared: int  # entries where the cell and the reference are both finite
    max_abs_err: float | None
    rel_err: float | None  # ||g - g64|| / ||g64|| over the compared entries
    max_abs_ref: float | None  # largest |g64|
    flushed_frac: float | None  # entries non-zero in float64 that are exactly 0 in the cell
    nan_rows_per_head: list[int] = field(default_factory=list)  # summed over the batch
    examples: list[tuple[int, ...]] = field(default_factory=list)  # first NaN/inf rows (batch, head, token)
    # FlashAttention's rule: max_abs_err <= 2 x that of plain attention in the same dtype (eager, softmax in the
    # dtype, no upcast) + two ulps of the largest gradient (2 x the dtype's spacing at max|g_float64|);
    # None where the cell is that baseline itself, and in fp32
    # (FlashAttention's tests apply it in fp16 and bf16; in fp32 both errors are rounding noise)
    baseline_err: float | None = None
    rule_bound: float | None = None
    # The gradients the model's kernel really produced (recorded by the capture) against this cell:
    # largest |real - cell|, and its largest ratio to the rounding bound of the cell's path (> 1: they disagree)
    real_max_diff: float | None = None
    real_bound_ratio: float | None = None
    real_nan_mismatch: int = 0  # entries finite in one and NaN/inf in the other

    @property
    def rule_holds(self) -> bool | None:
        if self.rule_bound is None or self.max_abs_err is None:
            return None
        return self.max_abs_err <= self.rule_bound

    @property
    def real_agrees(self) -> bool | None:
        if self.real_bound_ratio is None and not self.real_nan_mismatch:
            return None
        return not self.real_nan_mismatch and (self.real_bound_ratio is None or self.real_bound_ratio <= 1.0)

    @property
    def real_near(self) -> bool:
        """Beyond the bound, yet within REAL_BOUND_TOLERANCE of it, every entry finite in both: an info,
        not an error (the bound is first order; see grad_emulation_mismatch)."""
        return (
            self.real_agrees is False
            and not self.real_nan_mismatch
            and self.real_bound_ratio is not None
            and self.real_bound_ratio <= REAL_BOUND_TOLERANCE
        )


@dataclass
class CellBackward:
    """The backward of one cell from q, k, v, the mask and the output gradient dO."""

    dq: GradStats | None
    dk: GradStats | None
    dv: GradStats | None
    dout_nan_rows: int  # rows of dO holding NaN or inf
    # dO could be multiplied by at most this before an intermediate the path holds overflows its dtype
    # (every backward quantity is linear in dO): the headroom of the loss scale; at: which one sets it
    scale_headroom: float | None
    headroom_at: str | None  # e.g. 'dP in fp16'
    # the rounding points that differ by call: 'mask added', 'masked_fill', 'softmax in fp32', 'sums per block in bf16'
    how: str = ""
    real_compared: bool = False  # the model's recorded gradients were compared with this cell
    dtype: str = (
        ""  # the dtype the gradients are computed in (an eager cell under autocast: its matmuls', not its softmax's)
    )

    def grads(self) -> list[tuple[str, GradStats]]:
        return [(n, g) for n, g in (("dq", self.dq), ("dk", self.dk), ("dv", self.dv)) if g is not None]

    @property
    def nan_rows(self) -> int:
        return sum(g.nan_rows for _, g in self.grads())


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
    # With Q and K: the attention path the cell computes (registry.PATHS); None for given scores.
    path: str | None = None
    tied_rows: int = 0  # rows whose largest score is held by two or more keys (each gets exp(0) = 1)
    # With V: the output O = P@V against float64 (P64 @ V64), over rows where both are finite.
    out_rows: int | None = None  # rows compared
    out_nan_rows: int | None = None  # rows of O holding NaN
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
class Finding:
    code: str
    severity: str  # "error", "warning" or "info"
    message: str
    fix: str
    cells: list[str] = field(default_factory=list)
    rows: int = 0
    examples: list[tuple[int, ...]] = field(default_factory=list)


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


@dataclass
class HeadStat:
    """One attention head of a call: its q/k magnitudes, its largest logit, and what went wrong in it."""

    head: int
    q_max_abs: float | None  # max |q| over batch, tokens and d; None without q
    k_max_abs: float | None  # of the kv head this query head reads (GQA)
    max_logit: float | None  # largest finite unmasked score (scaled, as the softmax sees it)
    qk_overflow: int = 0  # scores of Q@K^T beyond the call's dtype, computed as the model rounds them
    nan_rows: int = 0  # NaN rows of the cell the model uses, over all batch elements
    kv_head: int | None = None  # the kv head it reads (GQA: shared by a group of query heads); None: its own
    nan_causes: dict[str, int] = field(default_factory=dict)  # its NaN rows by first cause (--ignore leaves some out)


@dataclass
class CallInfo:
    """What was recorded about one attention call (from a capture, or read from a file).

    ``kind``: 'sdpa' (scaled_dot_product_attention: q, k, v, mask), 'softmax' (the scores a
    softmax saw, with q/k/v where the matmuls around it were found), 'qk' (a file of q/k/mask
    tensors) or 'scores' (a plain score tensor).
    """

    index: int  # position in call order
    name: str  # how reports name it: the file, or file:key group
    kind: str
    module: str = ""  # module path in the model ('' outside any module or unknown)
    file: str | None = None
    dtype: str | None = None  # the dtype the call computed in ('fp16', ...; autocast's when it was on)
    softmax_dtype: str | None = None  # a softmax's dtype= argument
    shape: tuple[int, ...] = ()  # of the scores (batch..., heads, queries, keys)
    is_causal: bool = False
    scale: float | None = None  # None: SDPA's default 1/sqrt(d), or unknown for a softmax
    enable_gqa: bool = False
    dropout_p: float = 0.0
    has_qk: bool = False
    forward: int | None = None  # which forward pass of the top module (1-based); None: outside one
    meta: dict[str, str] = field(default_factory=dict)  # everything else the capture wrote
    rank: int | None = None  # the process that made the call, in a capture of several (torchrun); None: one process


@dataclass
class CallReport:
    """One call diagnosed: the diagnosis of the cell the model ran, its heads, and the what-if cells.

    For a call whose implementation is known (a capture's sdpa and softmax calls), ``diagnosis``
    holds the model's cell alone and its findings are the call's; ``what_if`` holds the cells asked
    as what-ifs with their own findings, never counted as the model's. For a call of unknown
    implementation (q/k files, plain scores) ``diagnosis`` holds every cell asked."""

    call: CallInfo
    diagnosis: TensorDiagnosis | None
    heads: list[HeadStat] = field(default_factory=list)
    cell: tuple[str, str] | None = None  # (method or path, dtype) of the computation the model ran
    error: str | None = None  # why the call could not be diagnosed (partial results)
    what_if: TensorDiagnosis | None = None
    # --what-if kernels: the kernel paths that could not have run the call, each with why (its support)
    kernels_refused: dict[str, str] = field(default_factory=dict)
    kernel_dtype: str | None = None  # the dtype the kernels were replayed in (q, k and v's); None: no replay
    # Where the path judging the call is not the kernel the capture names (an unknown backend or device, a kernel
    # that would not run the call): which path judged it instead, and why
    path_note: str | None = None
    # --what-if fa4: each kernel grid and dtype the kernel would not run the call in ('fa4/e4m3'), with why
    settings_refused: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelLine:
    """One row of the model report."""

    index: int
    name: str
    module: str
    kind: str
    shape: tuple[int, ...]
    cell: str | None  # 'torch/fp16': the cell the model ran
    max_logit: float | None
    headroom: float | None  # the model cell's distance to its first failure (CellLimit.headroom)
    nan_rows: int  # of the cell the model ran, less those with an ignored cause
    first_cause: str | None  # first cause of those NaN rows in pipeline order
    worst_err: float | None  # max |p - p_float64| of that cell
    verdict: str  # 'nan', 'overflow', 'zero', 'flip', 'ok', 'error' (error finding), 'skipped'
    heads: list[int] = field(default_factory=list)  # heads the cause sits in
    errors: list[str] = field(default_factory=list)  # codes of error findings of the model's cell, not ignored
    limit: CellLimit | None = None  # what ``headroom`` is measured to
    # The backward of that cell, where the call's output gradient is known (None: no backward)
    grad_nan_rows: int | None = None  # NaN/inf rows of dq, dk and dv together, less those with an ignored cause
    grad_cause: str | None = None  # their first cause in backward order (results.GRAD_CAUSES)
    grad_which: list[str] = field(default_factory=list)  # the gradients holding them: 'dq', 'dk', 'dv'
    grad_headroom: float | None = None  # dO may grow this many times before an intermediate overflows
    grad_headroom_at: str | None = None
    # A flex call with a score_mod: its name and the largest unmasked logit before it (max_logit is after it)
    score_mod: str | None = None
    logit_before_mod: float | None = None
    rank: int | None = None  # the process that made the call (a capture of several, under torchrun)

    @property
    def grad_verdict(self) -> str | None:
        """'nan', 'error' (a backward error finding), 'ok', or None without a backward."""
        if self.grad_nan_rows is None:
            return None
        if self.grad_nan_rows:
            return "nan"
        return "error" if any(code.startswith("grad_") for code in self.errors) else "ok"


@dataclass
class Outlier:
    """A head whose q or k is far larger than the other heads' of the same call."""

    index: int
    module: str
    head: int
    tensor: str  # 'q' or 'k'
    value: float
    median: float
    ratio: float
    kv_head: int | None = None  # k under GQA: the kv head (``head`` is the first query head reading it)
    query_heads: list[int] = field(default_factory=list)  # ... and every query head that reads it
    rank: int | None = None  # the process that made the call (a capture of several ranks)
    position: int | None = None  # the call's place among the report's calls (unique where indices repeat)

    @property
    def message(self) -> str:
        where = ("" if self.rank is None else f"rank {self.rank} ") + (self.module or f"call {self.index}")
        if self.kv_head is not None:
            reads = ", ".join(map(str, self.query_heads))
            return (
                f"{where} kv head {self.kv_head} (query heads {reads}): max|{self.tensor}| {plain(self.value)} "
                f"vs median {plain(self.median)} over the other kv heads"
            )
        return (
            f"{where} head {self.head}: max|{self.tensor}| {plain(self.value)} vs median {plain(self.median)} "
            "over the other heads"
        )


@dataclass
class WhatIfAnswer:
    """One what-if cell over every call it was computed for: does it break, and where first."""

    cell: str  # 'flash/fp16', 'eager:torch/fp16'
    calls: int  # calls it was computed for
    bad_calls: int  # calls where it goes wrong (NaN, overflow, zero rows or an error finding)
    first: ModelLine | None  # the first call where it goes wrong, as a model line judged by this cell
    nan_rows: int  # over all calls
    worst_err: float | None  # largest max |p - p_float64| over the calls
    headroom: float | None  # the least headroom over the calls (to ``limit``)
    limit: CellLimit | None = None
    findings: dict[str, int] = field(default_factory=dict)  # finding code -> calls where this cell's findings hold it

    @property
    def verdict(self) -> str:
        return "ok" if not self.bad_calls else (self.first.verdict if self.first is not None else "error")


@dataclass
class KernelVerdict:
    """One kernel path on one call (``--what-if kernels``): what it gives, or why it could not run it."""

    path: str
    dtype: str
    ran: bool = False  # the kernel the capture says ran the call (the model's cell)
    verdict: str = "ok"  # a model line's verdict ('nan', 'overflow', 'zero', 'error', 'flip', 'ok'), or 'refused'
    nan_rows: int = 0
    cause: str | None = None  # the first cause of the NaN rows
    backward_rows: int = 0  # rows whose backward the kernel breaks although its forward is finite (padded_tile)
    backward_cause: str | None = None  # that hazard's event ('padded_tile')
    lse: float | None = None  # the lowest log-sum-exp of those rows
    refused: str | None = None  # why the kernel could not have run the call
    out_err: float | None = None  # max |O - O_float64| where both are finite
    assumed: bool = False  # the path's rounding points are assumed (closed source)

    @property
    def breaks(self) -> bool:
        return self.verdict in ("nan", "overflow", "zero", "error") or self.backward_rows > 0


@dataclass
class KernelCall:
    """A call replayed under every kernel that could have run it."""

    position: int  # in the model report's calls
    name: str  # the call as the report names it (its module)
    kernels: list[KernelVerdict] = field(default_factory=list)

    @property
    def disagree(self) -> bool:
        """Some kernel breaks the call and another does not."""
        run = [k for k in self.kernels if k.refused is None]
        return any(k.breaks for k in run) and not all(k.breaks for k in run)


@dataclass
class RankSummary:
    """One rank of a capture of several processes: its calls and findings, and its first call that goes wrong."""

    rank: int
    calls: int
    errors: int
    warnings: int
    first_bad: int | None  # position in the model report's ``lines``
    complete: bool = True


@dataclass
class ModelReport:
    """Many calls in one view: a line per call, the first one that goes wrong, outlier heads, and
    the answers to what-if questions."""

    lines: list[ModelLine]
    first_bad: int | None  # position in ``lines`` of the first call that goes wrong
    outliers: list[Outlier]
    ignored: tuple[str, ...] = ()
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (call, why) not diagnosed
    capture: dict | None = None  # the manifest's facts: stopped, script error, calls recorded
    what_if: list[WhatIfAnswer] = field(default_factory=list)
    known: bool = False  # the calls name their implementation (a capture): the model's cells alone decide
    first_grad_bad: int | None = None  # position in ``lines`` of the first call whose gradients go wrong
    findings: list[Finding] = field(default_factory=list)  # of the capture itself, not of a call (capture_incomplete)
    ranks: list[RankSummary] = field(default_factory=list)  # a capture of several processes: each rank's own account
    kernels: list[KernelCall] = field(
        default_factory=list
    )  # --what-if kernels: each call under every kernel that could run it
    recorded_on: str | None = (
        None  # the GPU every call was recorded on ('cuda:0, NVIDIA H100, sm 9.0'); None: a CPU or mixed
    )
    settings: list[SettingChoice] = field(default_factory=list)  # --what-if fa4: each grid over the calls, its best
    # --what-if fa4: each call's own grids (position in ``lines``, its choices): the best may differ call by call
    call_settings: list[tuple[int, list[SettingChoice]]] = field(default_factory=list)
    # grids not computed: ('fa4/e4m3', calls the kernel would not run in that dtype, the first call's why)
    settings_refused: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class RunResult:
    """What ``attncheck run`` returns: a diagnosis per tensor, and where it ran; for files, the
    calls they hold and the model report over them."""

    tensors: list[TensorDiagnosis]
    device: str
    calls: list[CallReport] = field(default_factory=list)
    model: ModelReport | None = None


# --------------------------------------------------------------------------- sweep


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


# --------------------------------------------------------------------------- check

PROB_COUNT_BUDGETS = ("nan", "overflow", "zero_rows", "argmax_flips")
COUNT_BUDGETS = (*PROB_COUNT_BUDGETS, "out_nan")
ERROR_BUDGETS = ("max_abs_err", "max_abs_err_algo", "rmse", "kl_max")
RELATIVE_BUDGET = "relative_to_torch"
# On O = P@V (cells that have V): NaN rows, errors against float64 P64 @ V64, the
# smallest cosine similarity of a row (a lower bound: measured >= limit), and
# FlashAttention's rule on O's max error against the eager torch.softmax cell.
OUTPUT_BUDGETS = ("out_nan", "out_max_abs_err", "out_rmse", "out_rel_l1", "out_cos_min", "out_relative_to_torch")
# FlashAttention's rule: budget -> the Cell field compared with the torch cell's in the same dtype.
RELATIVE_BUDGETS = {RELATIVE_BUDGET: "max_abs_err_algo", "out_relative_to_torch": "out_max_abs_err"}
LOWER_BUDGETS = ("out_cos_min",)
BUDGET_NAMES = (*PROB_COUNT_BUDGETS, *ERROR_BUDGETS, RELATIVE_BUDGET, *OUTPUT_BUDGETS)


@dataclass(frozen=True)
class Budget:
    """Limits one method x dtype cell must stay within; None means not checked.

    Counts are rows of the cell; errors are measured against float64 by
    ``diagnose`` (``max_abs_err``, ``rmse``: against the scores as given;
    ``max_abs_err_algo``: against the scores after the cast to the dtype).
    ``relative_to_torch`` is FlashAttention's rule: the cell's ``max_abs_err_algo``
    at most N x torch.softmax's in the same dtype, plus ``relative_to_torch_atol``.
    The ``out_*`` budgets judge O = P@V against float64 P64 @ V64 in cells that have V
    (synthetic entries with ``paths``); ``out_cos_min`` is a lower bound.
    """

    def output_budgets(self) -> list[str]:
        return [name for name in OUTPUT_BUDGETS if getattr(self, name) is not None]

    nan: int | None = 0
    overflow: int | None = 0
    zero_rows: int | None = None
    argmax_flips: int | None = None
    max_abs_err: float | None = None
    max_abs_err_algo: float | None = None
    rmse: float | None = None
    kl_max: float | None = None
    relative_to_torch: float | None = None
    relative_to_torch_atol: float = 0.0
    out_nan: int | None = None
    out_max_abs_err: float | None = None
    out_rmse: float | None = None
    out_rel_l1: float | None = None
    out_cos_min: float | None = None
    out_relative_to_torch: float | None = None

    def active(self) -> list[tuple[str, float]]:
        """(name, limit) of every budget that is checked, in report order."""
        return [(name, getattr(self, name)) for name in BUDGET_NAMES if getattr(self, name) is not None]


@dataclass
class BudgetCheck:
    """One budget applied to one cell."""

    budget: str  # 'nan', 'max_abs_err', 'relative_to_torch', ...
    limit: float | int  # as configured (for relative_to_torch: the factor N)
    measured: float | int | None  # the cell's value; None: nothing to measure (see note)
    bound: float | None  # what measured is compared to: limit, or N x torch + atol
    passed: bool
    reference: float | None = (
        None  # relative budgets: torch's value in the same dtype (max_abs_err_algo, out_max_abs_err)
    )
    atol: float = 0.0  # relative_to_torch_atol
    rows: list[tuple[int, ...]] = field(default_factory=list)  # where it happened (first rows), or the worst row
    note: str = ""  # why measured is None

    @property
    def is_count(self) -> bool:
        return self.budget in COUNT_BUDGETS

    @property
    def op(self) -> str:
        """How measured compares to the bound in words: '<=' when it holds ('>=' for a lower bound), else '>' ('<')."""
        lower = self.budget in LOWER_BUDGETS
        if self.passed:
            return ">=" if lower else "<="
        return "<" if lower else ">"

    @property
    def worst_row(self) -> tuple[int, ...] | None:
        return self.rows[0] if self.rows else None

    @property
    def is_relative(self) -> bool:
        return self.budget in RELATIVE_BUDGETS

    @property
    def ratio(self) -> float | None:
        """relative budgets: measured / torch's error (None when torch's is 0 or missing)."""
        if self.reference and self.measured is not None:
            return self.measured / self.reference
        return None


@dataclass
class CaseResult:
    """One input x method x dtype cell and every budget checked on it."""

    input: str
    method: str
    dtype: str
    rows: int
    compared_rows: int  # rows where the cell and the float64 reference are both finite
    checks: list[BudgetCheck]
    shape: tuple[int, ...] = ()
    seconds: float = 0.0  # this case's share of the time spent on its input

    @property
    def name(self) -> str:
        return f"{self.method}/{self.dtype}"

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[BudgetCheck]:
        return [c for c in self.checks if not c.passed]


@dataclass
class CheckResult:
    config: str  # the config file as messages name it
    config_path: str | None
    device: str
    cases: list[CaseResult]
    inputs: list[str]
    budget: Budget
    dtype_budgets: dict[str, Budget] = field(default_factory=dict)
    seconds: float = 0.0
    ignore: tuple[str, ...] = ()  # finding codes whose rows the count budgets left out

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]


# --------------------------------------------------------------------------- watch


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
