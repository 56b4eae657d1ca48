"""What every command's results share: the roles of a cell, the causes no known cause explains, FlashAttention's
error rule, a dtype's limits and a finding."""

from __future__ import annotations

from dataclasses import dataclass, field

UNEXPLAINED = "unexplained"  # the cause of a NaN or zero row that no known cause explains

# First causes of a row of the output O = P@V that is NaN or inf, in pipeline order: the row's P is itself NaN
# (its softmax causes say why), V holds NaN/inf at a key of the row's head (0 x NaN is NaN, so a masked key counts
# too where the path multiplies it), V is finite but its cast to the dtype overflows, or P and V are finite in the
# dtype and the product P@V passes its max; else UNEXPLAINED.
OUT_CAUSES = ("softmax", "v_nonfinite", "v_cast_overflow", "pv_overflow")

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


@dataclass
class Finding:
    code: str
    severity: str  # "error", "warning" or "info"
    message: str
    fix: str
    cells: list[str] = field(default_factory=list)
    rows: int = 0
    examples: list[tuple[int, ...]] = field(default_factory=list)
