"""What ``attncheck rope`` returns: a RoPE table computed in a dtype over a context, against float64."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeAudit:
    """Positions 0 .. context - 1 of the default RoPE table (inverse frequencies theta^(-2j/d)) in a dtype."""

    theta: float
    head_dim: int
    compute: str  # the dtype holding the positions, inverse frequencies, their product and cos/sin
    table: str  # the dtype of the cos/sin the attention receives
    rotation: str | None  # the dtype the rotation runs in, where narrower than the table
    context: int
    predicted_first_indistinct: int  # closed form: 2^bits + 1 of the dtype holding the positions
    first_indistinct: int | None  # first position whose row repeats position - 1's (or is not finite); None: none
    indistinct_positions: int  # positions < context whose row repeats their predecessor's
    first_nonfinite: int | None
    max_angle_error: float  # radians, over finite entries of positions < context
    max_error_position: int
    max_error_frequency: int  # index j of inv_freq_j
    rms_angle_error: float | None  # None: no finite entry
