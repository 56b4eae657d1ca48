"""The backward pass of a cell (dQ, dK, dV against float64 autograd): the causes of NaN gradient rows in backward
order, each gradient's errors, and the tolerance on a recorded gradient's agreement."""

from __future__ import annotations

from dataclasses import dataclass, field

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
