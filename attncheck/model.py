"""Calls -> the model report: one line per call, the first call that goes wrong, outlier heads.

Pure logic over the numbers in ``CallReport``s (no torch, no printing). A call is judged by
the cell the model actually ran (``CallReport.cell``: for a softmax call torch.softmax in its
dtype, for an SDPA call the flash path, as PyTorch's fused kernels compute, in the call's dtype); the other cells stay in the
per-tensor report.
"""

from __future__ import annotations

import statistics

from attncheck.findings import SEVERITY, counted_rows, counted_verdict, ignored_causes
from attncheck.results import UNEXPLAINED, CallReport, Finding, ModelLine, ModelReport, Outlier

# NaN causes in pipeline order (numerics.cells.diagnose attributes each row to its first).
PIPELINE = ("input_nan", "inf_input", "qk_overflow", "mask_sentinel", "fully_masked", "cast_overflow",
            "exp_overflow", "sum_overflow", "underflow", UNEXPLAINED)
BAD_VERDICTS = ("nan", "overflow", "zero", "error")
OUTLIER_RATIO = 10.0  # a head's max|q| (or |k|) this many times the median over the call's heads


def used_cell(report: CallReport):
    if report.diagnosis is None or report.cell is None:
        return None
    try:
        return report.diagnosis.cell(*report.cell)
    except KeyError:
        return None


def relevant_errors(report: CallReport, ignore=()) -> list[str]:
    """Codes of error findings that concern the cell the model ran, or the input itself."""
    if report.diagnosis is None:
        return []
    name = f"{report.cell[0]}/{report.cell[1]}" if report.cell else None
    out = []
    for f in report.diagnosis.findings:
        if f.severity == "error" and f.code not in ignore and (not f.cells or name in f.cells):
            out.append(f.code)
    return list(dict.fromkeys(out))


def call_line(report: CallReport, ignore=()) -> ModelLine:
    info, d = report.call, report.diagnosis
    if d is None:
        return ModelLine(info.index, info.name, info.module, info.kind, info.shape, None, None, None, 0, None, None, "skipped")
    cell = used_cell(report)
    dtype = report.cell[1] if report.cell else None
    head = next((h for h in d.census.headroom if h.dtype == dtype), None)
    max_logit = d.census.max
    nan_rows, first, worst, heads = 0, None, None, []
    if cell is not None:
        verdict = counted_verdict(cell, ignore)
        nan_rows = counted_rows(cell.nan_rows, cell.nan_causes, ignore)
        skip = ignored_causes(ignore)
        causes = [c for c in PIPELINE if cell.nan_causes.get(c) and c not in skip]
        causes += [c for c in cell.nan_causes if c not in PIPELINE and c not in skip and cell.nan_causes[c]]
        first = causes[0] if causes and nan_rows else None
        worst = cell.max_abs_err
        heads = [h.head for h in report.heads if h.nan_rows]
    else:
        verdict = "n/a"
    overflow_heads = [h.head for h in report.heads if h.qk_overflow]
    if first == "inf_input" and overflow_heads and "qk_overflow" not in ignore:
        first, heads = "qk_overflow", overflow_heads  # the +inf the softmax saw came from Q@K^T
    errors = relevant_errors(report, ignore)
    if verdict in ("ok", "flip", "n/a") and errors:
        verdict = "error"
    return ModelLine(info.index, info.name, info.module, info.kind, tuple(d.shape), report.cell and f"{report.cell[0]}/{report.cell[1]}",
                     max_logit, None if head is None else head.headroom, nan_rows, first, worst, verdict, heads, errors)


def outliers(report: CallReport, ratio: float = OUTLIER_RATIO) -> list[Outlier]:
    """Heads whose max|q| or max|k| is at least ``ratio`` times the median over the call's heads."""
    out = []
    for tensor in ("q", "k"):
        values = [getattr(h, f"{tensor}_max_abs") for h in report.heads]
        if len(values) < 3 or any(v is None for v in values):
            continue
        median = statistics.median(values)
        for h, v in zip(report.heads, values):
            if median > 0 and v >= ratio * median:
                out.append(Outlier(report.call.index, report.call.module, h.head, tensor, v, median, v / median))
    return out


def model_report(calls: list[CallReport], ignore=(), skipped=(), capture: dict | None = None) -> ModelReport:
    lines = [call_line(c, ignore) for c in calls]
    first = next((i for i, line in enumerate(lines) if line.verdict in BAD_VERDICTS), None)
    found = [o for c in calls for o in outliers(c)]
    return ModelReport(lines, first, found, tuple(ignore), list(skipped), capture)


def head_findings(report: CallReport, diag_findings: list[Finding]) -> list[Finding]:
    """A ``qk_overflow`` finding naming the heads whose Q@K^T overflows the call's dtype, when
    the diagnosis has none of its own (scores recorded at a softmax carry the +inf it made)."""
    over = [h for h in report.heads if h.qk_overflow]
    if not over or any(f.code == "qk_overflow" for f in diag_findings):
        return []
    from attncheck.findings import FIX
    from attncheck.format import plain

    dtype = report.call.dtype or "its dtype"
    cell = used_cell(report)
    hit = [cell.name] if cell is not None and cell.nan_causes.get("inf_input") else []
    rows = cell.nan_causes.get("inf_input", 0) if hit else 0
    where = ", ".join(f"head {h.head} ({h.qk_overflow})" for h in over[:6]) + (", ..." if len(over) > 6 else "")
    qk = "; ".join(f"head {h.head}: max|q| {plain(h.q_max_abs)}, max|k| {plain(h.k_max_abs)}" for h in over[:3])
    message = (f"Q@K^T overflows {dtype} as the model computes it, in {where} score(s); {qk}"
               + (f"; the softmax saw +inf there -> {rows} NaN row(s) in {hit[0]}" if hit else ""))
    return [Finding("qk_overflow", SEVERITY["qk_overflow"], message, FIX["qk_overflow"], hit, rows)]
