"""``attncheck rope``'s report: one line per grid point for people, and the JSON document."""

from __future__ import annotations

from dataclasses import asdict

from attncheck.results.rope import RopeAudit

ROPE_SCHEMA = 1


def _theta(theta: float) -> str:
    return f"{int(theta):,}" if float(theta).is_integer() else f"{theta:g}"


def dtypes_text(audit: RopeAudit) -> str:
    """'bf16 table', 'fp32 table cast to bf16', '... rotated in fp16'."""
    text = f"{audit.compute} table" + ("" if audit.table == audit.compute else f" cast to {audit.table}")
    return text + ("" if audit.rotation is None else f", rotated in {audit.rotation}")


def rope_line(audit: RopeAudit) -> str:
    """'theta 500,000, d 128, bf16 table: positions stop being distinct at 257 (...); angle error up to 131,071:
    3.14 rad (...)': positions 0 .. context - 1, named by the last."""
    last = audit.context - 1
    head = f"theta {_theta(audit.theta)}, d {audit.head_dim}, {dtypes_text(audit)}: "
    if audit.first_indistinct is not None:
        distinct = (
            f"positions stop being distinct at {audit.first_indistinct:,} "
            f"({audit.indistinct_positions:,} of {audit.context:,} repeat the row before)"
        )
    else:
        distinct = (
            f"positions stay distinct up to {last:,} (the first repeat is at {audit.predicted_first_indistinct:,})"
        )
    if audit.first_nonfinite is not None:
        return (
            head
            + distinct
            + (
                f"; cos/sin not finite at {audit.nonfinite_positions:,} of {audit.context:,} positions from "
                f"{audit.first_nonfinite:,} (no angle there: the angle error is undefined)"
            )
        )
    rms = "n/a" if audit.rms_angle_error is None else f"{audit.rms_angle_error:.3g}"
    error = (
        f"; angle error up to {last:,}: {audit.max_angle_error:.3g} rad "
        f"(position {audit.max_error_position:,}, frequency {audit.max_error_frequency}; RMS {rms})"
    )
    return head + distinct + error


def rope_text(audits: list[RopeAudit]) -> str:
    return "".join(rope_line(a) + "\n" for a in audits)


def rope_json(audits: list[RopeAudit]) -> dict:
    return {"schema": ROPE_SCHEMA, "command": "rope", "points": [asdict(a) for a in audits]}
