"""What ``attncheck rope`` returns: a RoPE table computed in a dtype over a context, against float64."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    first_nonfinite: int | None  # the first position whose cos or sin is not finite (no angle at all)
    max_angle_error: float | None  # radians, over positions < context; None (undefined) where any is not finite
    max_error_position: int | None
    max_error_frequency: int | None  # index j of inv_freq_j
    rms_angle_error: float | None  # None: undefined (an entry not finite)
    nonfinite_positions: int = 0  # positions < context whose cos or sin is not finite


@dataclass(frozen=True)
class RopeWhatIf:
    """A recorded table recomputed from its positions and theta with everything held in ``dtype`` (positions,
    inverse frequencies, product, cos and sin), cast to the table's dtype: --what-if rope:DTYPE."""

    dtype: str
    first_indistinct: int | None
    first_affected: int | None
    affected_positions: int
    max_angle_error: float | None  # radians; None where cos/sin are not finite


@dataclass(frozen=True)
class RopeVectorCheck:
    """The rotated q (or k) of the calls under a recorded table against float64: each vector unrotated with the
    table as recorded, rotated again by the exact angles (positions x theta^(-2j/d)), and compared per position."""

    role: str  # 'q' or 'k'
    dtype: str  # the recorded vectors' dtype
    calls: int  # the calls whose vectors were judged
    vectors: int  # vectors (batch x heads x positions) judged over those calls
    nonfinite: int  # vectors left out: not finite as recorded, their table row finite (the diagnosis reports them)
    first_affected: int | None  # the first position whose relative error implies an angle past the tolerance
    affected_positions: int
    max_relative_error: float | None  # |x_rec - x_ref| / |x_ref| over the head dim, max over batch and heads
    max_error_position: int | None
    max_error_call: int | None
    max_angle: float | None  # radians: the rotation angle that alone gives max_relative_error, 2 asin(e / 2)
    rounding: float  # the dtype's unit roundoff: its own rounding of each entry, which cancels in the comparison


@dataclass(frozen=True)
class RopeQKCheck:
    """The rotated q and k of the calls under a table, and what their error does to the scores."""

    calls: int  # calls under the table whose q was judged
    tolerance_relative: float  # 2 sin(tolerance / 2): the relative error of a vector turned by the tolerance
    q: RopeVectorCheck | None
    k: RopeVectorCheck | None
    score_error: float | None  # max |q_i.k_j - q_ref_i.k_ref_j| / (|q_ref_i| |k_ref_j|) over the sampled pairs
    score_positions: tuple[int, int] | None  # (query position, key position) of score_error
    score_call: int | None
    score_pairs: int  # (query, key) vector pairs sampled over all calls, heads and batch rows
    score_bound: float | None  # e_q + e_k + e_q e_k: the analytic bound over every pair, max over the calls
    note: str | None = None  # the calls (or k) not judged, and why


@dataclass(frozen=True)
class RopeTableCheck:
    """A rotary table a capture recorded, against float64 cos and sin of its positions and inverse frequencies (of its
    RoPE type: default, linear, llama3, yarn, longrope; any other type is not judged, ``note`` says so by name)."""

    index: int  # the table's number in the capture
    shape: tuple[int, ...]
    dtype: str
    calls: tuple[int, ...]  # the calls that ran under it
    modules: tuple[str, ...]
    rope_type: str
    theta: float | None
    theta_from: str  # 'config' (recorded from the model's config), 'fitted' (least squares over the table), ''
    positions_from: str  # 'recorded' (position_ids), 'assumed' (0 .. T-1 of the first sequence)
    judged: bool
    note: str | None = None  # why not judged, or what was assumed
    first_position: int | None = None
    last_position: int | None = None
    tolerance: float | None = None  # radians: the angle error from which a position counts as affected
    first_affected: int | None = None  # the first position whose angle error passes ``tolerance``
    affected_positions: int = 0
    first_indistinct: int | None = None  # the first position whose row repeats position - 1's
    indistinct_positions: int = 0
    max_angle_error: float | None = None  # radians
    max_error_position: int | None = None
    max_error_frequency: int | None = None
    fp32_recipe_error: float | None = None  # the same positions computed in fp32 and cast to the table's dtype
    what_if: tuple[RopeWhatIf, ...] = ()  # --what-if rope:DTYPE: reported apart, never the model's finding
    qk: RopeQKCheck | None = None  # the rotated q and k of its calls; None where no call's q was judged
    # the config's rope parameters recorded with the table (factor, low_freq_factor, original_max_position_embeddings,
    # attention_factor, ...: numbers and flags), which the non-default types' frequencies are computed from
    parameters: dict[str, float | bool] = field(default_factory=dict)
    rank: int | None = None  # the process of a torchrun capture that recorded it; None: a single process
    attention_factor: float | None = None  # the radius cos and sin are judged against: yarn's, longrope's, else 1
    max_magnitude_error: float | None = None  # the largest |sqrt(cos^2 + sin^2) / attention_factor - 1|
    # a fitted theta: the largest angle residual of the table against it (radians) over positions 0 .. theta_fit_last
    theta_fit_error: float | None = None
    theta_fit_last: int | None = None
    first_nonfinite: int | None = None  # the first position whose cos or sin is not finite (no angle at all)
    nonfinite_positions: int = 0
