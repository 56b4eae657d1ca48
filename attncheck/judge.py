"""Judgement of the numbers: numerics returns them (``TensorDiagnosis``, ``CallReport``), and here they get what
they mean.

numerics (tensors -> numbers) imports no findings; this layer sits above it and below the pipelines and the
recorder's sinks. A diagnosis gets its findings (``findings.findings_for``) and its settings choices
(``model.setting_choices``); a call's report then its backward findings, its soft cap's and its heads'
(``model.head_findings``), in that order, each merged into the list by severity. ``diagnose``,
``diagnose_chunks``, ``diagnose_attention``, ``diagnose_call`` and ``attach_backward`` are numerics' own, judged:
what the library, the pipelines and the capture call.
"""

from __future__ import annotations

from attncheck.codes import FIX, SEVERITIES, SEVERITY
from attncheck.findings import backward_findings, findings_for, sink_findings, softcap_findings
from attncheck.findings.activations import activation_findings
from attncheck.findings.lowsum import capture_sums_findings, lowsum_findings
from attncheck.model import head_findings, setting_choices
from attncheck.numerics.cells import calls
from attncheck.numerics.cells import diagnose as cells
from attncheck.options import Options
from attncheck.results.common import Finding
from attncheck.results.model import CallReport
from attncheck.results.run import TensorDiagnosis

__all__ = [
    "Options",
    "attach_backward",
    "diagnose",
    "diagnose_attention",
    "diagnose_call",
    "diagnose_chunks",
    "judge_backward",
    "judge_call",
    "judge_diagnosis",
    "judge_capture_sums",
    "judge_lowsum",
]


def _merged(findings: list[Finding], extra: list[Finding]) -> list[Finding]:
    """``extra`` added to ``findings``, errors first (a stable sort: each keeps its own order within a severity)."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings + extra, key=lambda f: order[f.severity])


def judge_diagnosis(diag: TensorDiagnosis) -> TensorDiagnosis:
    """A diagnosis's findings and settings choices, from its numbers (replacing any it had)."""
    diag.findings = findings_for(diag)
    diag.choices = setting_choices(diag)
    return diag


def judge_backward(diag: TensorDiagnosis, what: TensorDiagnosis | None = None) -> None:
    """The backward findings of the cells that have a backward, added to the diagnosis holding them."""
    for d in (diag, what):
        if d is not None:
            found = backward_findings(d.cells)
            if found:
                d.findings = _merged(d.findings, found)


def judge_call(report: CallReport) -> CallReport:
    """A call's report as numerics returns it (``numerics.cells.calls.diagnose_call``), judged: its diagnosis and
    what-if diagnosis, their backward, the soft cap's overflow and the heads whose Q@K^T overflows."""
    diag, what = report.diagnosis, report.what_if
    judge_diagnosis(diag)
    if what is not None:
        judge_diagnosis(what)
    judge_backward(diag, what)
    found = softcap_findings(diag) + sink_findings(report.sinks)
    if found:
        diag.findings = _merged(diag.findings, found)
    extra = head_findings(report, diag.findings) + activation_findings(report)
    if extra:
        diag.findings = _merged(diag.findings, extra)
    return report


def _adder(found: list[Finding]):
    """The ``add`` a findings group calls, appending to ``found`` with each code's severity and fix."""

    def add(code: str, message: str, cells_hit=(), rows: int = 0, examples=(), severity: str | None = None) -> None:
        found.append(Finding(code, severity or SEVERITY[code], message, FIX[code], [], rows, list(examples)))

    return add


def judge_lowsum(diag: TensorDiagnosis) -> None:
    """The findings of the sums kept in 16 bits (``diag.lowsum``, --accumulate), added to the diagnosis."""
    found: list[Finding] = []
    lowsum_findings(diag, _adder(found))
    if found:
        diag.findings = _merged(diag.findings, found)


def judge_capture_sums(report) -> None:
    """The findings of --accumulate on a capture (results.lowsum.CaptureSums), per layer and sum: the report's own,
    apart from the calls' diagnoses (a what-if: never the model's verdict)."""
    found: list[Finding] = []
    capture_sums_findings(report, _adder(found))
    report.findings = _merged([], found)


def diagnose(*args, **kwargs) -> TensorDiagnosis:
    """``numerics.cells.diagnose.diagnose`` (same arguments), judged."""
    return judge_diagnosis(cells.diagnose(*args, **kwargs))


def diagnose_chunks(*args, **kwargs) -> TensorDiagnosis:
    """``numerics.cells.diagnose.diagnose_chunks`` (same arguments), judged."""
    return judge_diagnosis(cells.diagnose_chunks(*args, **kwargs))


def diagnose_attention(*args, **kwargs) -> TensorDiagnosis:
    """``numerics.cells.diagnose.diagnose_attention`` (same arguments), judged."""
    return judge_diagnosis(cells.diagnose_attention(*args, **kwargs))


def diagnose_call(*args, **kwargs) -> CallReport:
    """``numerics.cells.calls.diagnose_call`` (same arguments), judged."""
    return judge_call(calls.diagnose_call(*args, **kwargs))


def attach_backward(diag: TensorDiagnosis, what: TensorDiagnosis | None, *args, **kwargs) -> None:
    """``numerics.cells.calls.attach_backward`` (same arguments), and the backward findings it leads to."""
    calls.attach_backward(diag, what, *args, **kwargs)
    judge_backward(diag, what)
