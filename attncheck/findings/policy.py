"""--ignore and --fail-on: the rows and findings a user judged expected left out, and the conditions that hold."""

from __future__ import annotations

from attncheck.findings.base import SEVERITIES, out_nan_rows
from attncheck.findings.registry import CAUSES_OF, GRAD_CAUSES_OF
from attncheck.results import Cell, Finding, TensorDiagnosis

# Overflow codes: ignoring one of them judges a cell's overflow rows expected (its verdict, --fail-on overflow)
OVERFLOW_CODES = frozenset({"exp_overflow", "sum_overflow", "fused_max"})


def ignored_causes(ignore) -> set[str]:
    return {cause for code in ignore for cause in CAUSES_OF.get(code, ())}


def counted_rows(total: int, causes: dict[str, int], ignore=()) -> int:
    """Rows of a cell (NaN or zero) less those whose first cause belongs to an ignored code."""
    skip = ignored_causes(ignore)
    return total - sum(n for cause, n in causes.items() if cause in skip)


def counted_grad_rows(b, ignore=()) -> int:
    """NaN/inf gradient rows of a cell's backward, less those whose first cause belongs to an ignored code."""
    skip = {cause for code in ignore for cause in GRAD_CAUSES_OF.get(code, ())}
    return sum(n for _, g in b.grads() for cause, n in g.causes.items() if cause not in skip)


def counted_verdict(c: Cell, ignore=()) -> str:
    """The cell's verdict once rows with an ignored cause are left out."""
    if not ignore:
        return c.verdict
    if counted_rows(c.nan_rows, c.nan_causes, ignore):
        return "nan"
    if c.overflow_rows and not (OVERFLOW_CODES & set(ignore)):
        return "overflow"
    if counted_rows(c.zero_rows, c.zero_causes, (*ignore, "fully_masked_rows")) > 0:
        return "zero"
    if c.argmax_flips and "argmax_flip" not in ignore:
        return "flip"
    return "ok"


def apply_ignore(diag: TensorDiagnosis, ignore) -> None:
    """Drop the findings whose code the user has judged expected."""
    if ignore:
        diag.findings = [f for f in diag.findings if f.code not in ignore]


def failed_conditions(diags: list[TensorDiagnosis], conditions: list[str], ignore=()) -> list[str]:
    """The --fail-on conditions that hold, each with a short reason.

    Conditions: nan, overflow, zero, flip, error (any error finding), warning (any
    error or warning finding), or a finding code. Rows whose cause belongs to an
    ``ignore``d code do not count.
    """
    held = []
    for cond in conditions:
        for d in diags:
            if cond == "nan":
                bad = [c.name for c in d.cells if counted_rows(c.nan_rows, c.nan_causes, ignore)]
                bad += [f"{c.name} output" for c in d.cells if out_nan_rows(c, ignore)]
                bad += [
                    f"{c.name} backward"
                    for c in d.cells
                    if c.backward is not None and counted_grad_rows(c.backward, ignore)
                ]
            elif cond == "overflow":
                bad = [c.name for c in d.cells if c.overflow_rows and not (OVERFLOW_CODES & set(ignore))] + [
                    f"cast to {h.dtype}"
                    for h in d.census.headroom
                    if (h.cast_posinf_values or h.cast_neginf_values) and "cast_overflow" not in ignore
                ]
            elif cond == "zero":
                bad = [c.name for c in d.cells if counted_rows(c.zero_rows, c.zero_causes, ignore)]
            elif cond == "flip":
                bad = [c.name for c in d.cells if c.argmax_flips]
            elif cond in ("error", "warning"):
                allowed = SEVERITIES.index(cond)
                bad = [f.code for f in d.findings if SEVERITIES.index(f.severity) <= allowed and f.code not in ignore]
            else:
                bad = [f.code for f in d.findings if f.code == cond]
            if bad:
                held.append(f"{cond}: {d.name}: {', '.join(dict.fromkeys(bad))}")
    return held


def failed_by_findings(findings: list[Finding], conditions: list[str], ignore=(), where: str = "capture") -> list[str]:
    """The --fail-on conditions that findings outside any call's diagnosis (the capture's) meet."""
    held = []
    for cond in conditions:
        if cond in ("error", "warning"):
            allowed = SEVERITIES.index(cond)
            bad = [f.code for f in findings if SEVERITIES.index(f.severity) <= allowed and f.code not in ignore]
        else:
            bad = [f.code for f in findings if f.code == cond and f.code not in ignore]
        if bad:
            held.append(f"{cond}: {where}: {', '.join(dict.fromkeys(bad))}")
    return held
