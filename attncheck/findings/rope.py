"""Rotary position embeddings: a recorded cos/sin table whose angles are not its positions' (a table computed in
bf16/fp16, inverse frequencies kept in bf16 after ``model.to(torch.bfloat16)``), and what it did to the calls' rotated
q and k and their scores."""

from __future__ import annotations

import math

from attncheck.findings.base import Code, Example
from attncheck.results import Finding
from attncheck.results.rope import RopeTableCheck, RopeVectorCheck

# Radians. A correctly computed table is far inside it: fp32 angles cast to bf16 are off by at most about 0.004 rad
# (cos and sin rounded to bf16) plus fp32's own rounding of p * inv_freq (about 0.01 rad at 128k positions, 0.06 at
# 1M); positions or inverse frequencies held in bf16 put whole radians between a position and its angle.
ROPE_ANGLE_TOLERANCE = 0.05
# Relative. cos and sin rounded to bf16 put a row at most about 2^-8 off its circle; a table whose rows are off by
# more than this was scaled by another factor than its type's (yarn's attention factor, 1 for the others).
ROPE_MAGNITUDE_TOLERANCE = 0.01

CODES: tuple[Code, ...] = (
    Code(
        "rope_precision",
        "warning",
        "rope",
        "the rotary table's angles, or the rotated q and k, are not their positions' (positions or frequencies "
        "rounded)",
        "RoPE rotates each pair of q and k entries at position p by p x theta^(-2j/d). When the positions, the "
        "inverse frequencies or their product are held in bf16 or fp16 (a table computed in the activations' dtype, "
        "or inv_freq cast by model.to(bfloat16)), the angle is that of a rounded position: bf16 holds integers "
        "exactly only up to 256 (position 15,962 becomes 15,936: huggingface/candle PR 3520), fp16 up to 2,048 and "
        "none beyond 65,504. The model then sees far positions as near ones and answers worse at long range. The "
        "finding names the first position affected, the first position whose table row repeats the one before "
        "(the dtype no longer tells them apart), the largest angle error and what the same table computed in fp32 "
        "and cast to its dtype would be off by. It then says what the table did to the calls' rotated q and k: "
        "each recorded vector is unrotated in float64 with the table as recorded and turned by the exact angles; "
        "the difference is the table's error as that vector meets it (the dtype's own rounding of q and k cancels "
        "in it), reported as the first position from which q (and k) go wrong, the largest relative error with "
        "the angle that alone would cause it, and the error of the scores q_i.k_j relative to |q_i||k_j| over a "
        "sample of pairs (keys at or before their query) beside the bound e_q + e_k + e_q e_k for every pair. A "
        "vector mixes all frequencies, so it goes wrong later than the table's worst frequency.",
        f"An angle error above ROPE_ANGLE_TOLERANCE = {ROPE_ANGLE_TOLERANCE} rad against float64 cos and sin of the "
        "recorded positions (position_ids) and the inverse frequencies of the table's RoPE type (default: "
        "theta^(-2j/d), theta from the model's config, else fitted to the table by least squares; linear, llama3, "
        "yarn and longrope from their definitions and the config's rope parameters), or a rotated q or k off by more "
        "than a turn by that angle would put it (relative error 2 sin(ROPE_ANGLE_TOLERANCE / 2), about 0.05, over the "
        "head dim, max over batch and heads; judged for default tables); an error where a position's row repeats its "
        "predecessor's; rows off their circle by more than ROPE_MAGNITUDE_TOLERANCE = "
        f"{ROPE_MAGNITUDE_TOLERANCE} (relative to yarn's and longrope's attention factor, 1 for the others). Tables "
        "of other types (dynamic, proportional, axial) are not judged, and the report says so by name.",
        "compute the inverse frequencies, the positions and their product in fp32 (transformers: position_ids.float() "
        "@ inv_freq with autocast off), cast only cos and sin to the activations' dtype; keep inv_freq in fp32 after "
        "model.to(bfloat16) (or load with dtype=torch.bfloat16); at long context rotate q and k in fp32",
        Example(
            """\
import torch
import torch.nn.functional as F

import attncheck


class Attention(torch.nn.Module):
    def forward(self, q, k, v, position_embeddings):
        cos, sin = position_embeddings  # (1, T, d), as transformers passes them

        def rotate(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin

        return F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, q, k, v, table):
        return self.attn(q, k, v, position_embeddings=table)


inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32)
freqs = torch.arange(1024).bfloat16()[:, None] * inv_freq.bfloat16()  # the table computed in bf16
emb = torch.cat((freqs, freqs), dim=-1)
table = (emb.cos()[None], emb.sin()[None])
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 1024, 32, generator=g).bfloat16() for _ in range(3))
with attncheck.capture("cap"):
    Model()(q, k, v, table)
""",
            "attncheck run cap --brief --fail-on rope_precision",
        ),
        severity_note="an error where positions share one table row",
        also="error",
    ),
)

SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}


def table_name(check: RopeTableCheck) -> str:
    """'rope table 0', 'rank 1 rope table 0' (a torchrun capture's: each rank numbers its own tables)."""
    return ("" if check.rank is None else f"rank {check.rank} ") + f"rope table {check.index}"


def theta_source(check: RopeTableCheck) -> str:
    """'config', or 'fitted: the table within 0.0027 rad of it through position 2,047'."""
    if check.theta_from != "fitted" or check.theta_fit_error is None:
        return check.theta_from
    return f"fitted: the table within {check.theta_fit_error:.2g} rad of it through position {check.theta_fit_last:,}"


def _where(check: RopeTableCheck) -> str:
    shape = "x".join(map(str, check.shape))
    mods = ", ".join(check.modules[:2]) + (f" and {len(check.modules) - 2} more" if len(check.modules) > 2 else "")
    kind = "" if check.rope_type == "default" else f", {check.rope_type}"
    theta = "" if check.theta is None else f", theta {check.theta:g} ({theta_source(check)})"
    return f"{table_name(check)} ({check.dtype} {shape}{kind}{theta}; {len(check.calls)} call(s): {mods or 'global'})"


def _off_circle(check: RopeTableCheck) -> bool:
    return check.max_magnitude_error is not None and check.max_magnitude_error > ROPE_MAGNITUDE_TOLERANCE


def _vector_text(v: RopeVectorCheck) -> str:
    """'rotated q goes wrong from position 104 (relative error up to 0.711 at position 295 in call #0: a turn of
    0.726 rad; 101 positions past the tolerance)'."""
    if v.max_relative_error is None:
        return f"rotated {v.role}: no finite vector"
    size = f"{v.max_relative_error:.3g}" if math.isfinite(v.max_relative_error) else "not finite"
    worst = (
        f"relative error up to {size} at position {v.max_error_position:,} in call #{v.max_error_call}: a turn of "
        f"{v.max_angle:.3g} rad"
    )
    if v.first_affected is None:
        return f"rotated {v.role} stays within the tolerance ({worst})"
    return (
        f"rotated {v.role} goes wrong from position {v.first_affected:,} ({worst}; {v.affected_positions:,} positions "
        "past the tolerance)"
    )


def _qk_text(check: RopeTableCheck) -> str | None:
    """What the table did to its calls' rotated q and k and to their scores (each vector against itself turned by the
    exact angles, so the dtype's own rounding of q and k cancels)."""
    qk = check.qk
    if qk is None or (qk.q is None and qk.k is None):
        return None
    parts = [_vector_text(v) for v in (qk.q, qk.k) if v is not None]
    if qk.score_error is not None:
        i, j = qk.score_positions
        bound = "" if qk.score_bound is None else f"; at most {qk.score_bound:.3g} for any pair"
        parts.append(
            f"scores q_i.k_j off by up to {qk.score_error:.3g} of |q_i||k_j| (query position {i:,}, key position "
            f"{j:,}, over {qk.score_pairs:,} sampled pairs{bound})"
        )
    return "; ".join(parts)


def _qk_affected(check: RopeTableCheck) -> bool:
    qk = check.qk
    return qk is not None and any(v is not None and v.first_affected is not None for v in (qk.q, qk.k))


def rope_findings(checks: list[RopeTableCheck] | None) -> list[Finding]:
    """rope_precision per table whose angles, or whose calls' rotated q and k, pass ROPE_ANGLE_TOLERANCE (or whose
    rows pass ROPE_MAGNITUDE_TOLERANCE off their circle): an error where adjacent positions share a row, else a
    warning."""
    out: list[Finding] = []

    def add(code: str, message: str, severity: str) -> None:
        out.append(Finding(code, severity, message, FIX[code]))

    for check in checks or ():
        table_bad = check.first_affected is not None or check.first_indistinct is not None or _off_circle(check)
        if not check.judged or not (table_bad or _qk_affected(check)):
            continue
        parts = []
        if check.first_indistinct is not None:
            parts.append(
                f"positions stop being distinct at {check.first_indistinct:,} (its row repeats position "
                f"{check.first_indistinct - 1:,}'s; {check.indistinct_positions:,} positions repeat the one before)"
            )
        if check.first_affected is not None:
            parts.append(
                f"first position affected {check.first_affected:,} (angle error > {check.tolerance:g} rad; "
                f"{check.affected_positions:,} of {check.last_position - check.first_position + 1:,} positions)"
            )
        if check.first_nonfinite is not None:
            parts.append(
                f"cos/sin not finite at {check.nonfinite_positions:,} positions from position "
                f"{check.first_nonfinite:,} (no angle there: the angle error is undefined)"
            )
        elif check.max_angle_error is not None:
            parts.append(
                f"angle error up to {check.max_angle_error:.3g} rad (position {check.max_error_position:,}, frequency "
                f"{check.max_error_frequency})"
            )
        if _off_circle(check):
            parts.append(
                f"cos and sin off their circle by up to {check.max_magnitude_error:.3g} (relative to the attention "
                f"factor {check.attention_factor:g} of rope_type {check.rope_type})"
            )
        parts.append(_qk_text(check))
        if check.fp32_recipe_error is not None:
            parts.append(f"computed in fp32 and cast to {check.dtype} it is off by {check.fp32_recipe_error:.2g} rad")
        assumed = "; positions assumed 0 .. T-1" if check.positions_from == "assumed" else ""
        severity = "error" if check.first_indistinct is not None else SEVERITY["rope_precision"]
        add("rope_precision", f"{_where(check)}: " + "; ".join(p for p in parts if p) + assumed, severity)
    return out
