"""Sums kept in 16 bits (``attncheck run --accumulate``): per accumulation asked, the softmax denominator's and
the output's error against float64 and the first overflow of each accumulator. Plain numbers, free of torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SumOverflow:
    """The first row (in row order) whose accumulator became inf or NaN, and where."""

    row: int  # flat row index (batch x heads x queries)
    key: int  # 0-based index of the last key added when the accumulator first left the finite range
    partial: float  # the accumulator's last finite value before it (0 for a pairwise tree's first node)
    value: float  # what it became: inf, -inf or nan
    dim: int | None = None  # P@V: the head dim of V whose accumulator went first


@dataclass
class LowSumStats:
    """One accumulation (``params.SumSpec``) over every row of a tensor or call."""

    label: str  # 'fp16-seq', 'bf16-pairwise', 'fp16-block:64'
    rows: int = 0
    keys: int = 0  # keys per row
    dtype_max: float = 0.0  # the accumulator dtype's largest finite value (torch.finfo)
    denom_err_max: float = 0.0  # relative error of the denominator against float64, largest over finite rows
    denom_err_mean: float = 0.0
    denom_overflow_rows: int = 0
    denom_first: SumOverflow | None = None
    out_rows: int = 0  # rows with an output (V given)
    out_err_max: float | None = None  # max |O - O64| / max |O64| per row, largest over finite rows (None: none)
    out_overflow_rows: int = 0  # rows whose P@V accumulator (unnormalised, before the division) left the range
    out_nonfinite_rows: int = 0  # rows whose output O holds inf or NaN (out_err_max is over the others)
    out_first: SumOverflow | None = None
    out_peak: float = 0.0  # largest |sum_j exp(s_j - m) v_jd| in float64 over rows and dims: what the accumulator holds


@dataclass
class CallSums:
    """``--accumulate`` on one captured call: each sum asked over every row of the call."""

    index: int  # the call's position in the capture
    name: str
    module: str  # the attention module ('' outside any module)
    rank: int | None  # the process that made it, in a capture of several (torchrun)
    sums: list[LowSumStats]


@dataclass
class LayerSums:
    """One sum over every call of one layer (attention module): the worst of its calls, and which call that was."""

    module: str
    rank: int | None
    label: str  # the sum, 'fp16-seq'
    calls: list[int]  # the calls' positions in the capture, in call order
    keys: int  # the most keys per row over the calls
    stats: LowSumStats  # rows and overflowed rows summed over the calls, errors their largest (mean: over all rows)
    worst_call: int  # the call with the largest relative error (denominator or output)
    first_call: int | None = None  # the first call whose accumulator overflowed; None: none did


@dataclass
class CaptureSums:
    """``--accumulate`` on a capture: per call, per layer, and the findings (a what-if: on a capture never the
    model's verdict; only ``--fail-on what-if:COND`` fails on them)."""

    labels: list[str]
    calls: list[CallSums]
    layers: list[LayerSums]
    findings: list = field(default_factory=list)  # results.common.Finding, each naming its layer and call
