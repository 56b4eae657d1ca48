"""Results -> findings: every problem in a ``TensorDiagnosis`` gets a stable code, a severity and a one-line fix,
from each group's detector in pipeline order. Pure logic over the numbers; no tensors, no torch, no printing."""

from __future__ import annotations

from attncheck.findings.accuracy import accuracy_findings, flush_findings, output_findings, output_nan_findings
from attncheck.findings.base import SEVERITIES
from attncheck.findings.distribution import collapse_findings
from attncheck.findings.fp8 import fp8_findings
from attncheck.findings.inputs import input_findings
from attncheck.findings.masking import attention_findings
from attncheck.findings.overflow import cast_findings, softmax_findings
from attncheck.findings.registry import FIX, SEVERITY
from attncheck.findings.scale import scale_findings
from attncheck.results import Cell, Finding, TensorDiagnosis


def findings_for(diag: TensorDiagnosis) -> list[Finding]:
    out: list[Finding] = []
    cells = diag.cells

    def add(
        code: str, message: str, cells_hit: list[Cell] = (), rows: int = 0, examples=(), severity: str | None = None
    ) -> None:
        out.append(
            Finding(code, severity or SEVERITY[code], message, FIX[code], _names(list(cells_hit)), rows, list(examples))
        )

    def cells_with(kind: str, cause: str) -> list[Cell]:
        return [c for c in cells if getattr(c, f"{kind}_causes").get(cause, 0)]

    input_findings(diag, add, cells_with)
    if diag.attention is not None:
        attention_findings(diag, add, cells_with)
        scale_findings(diag.attention, add)
    cast_findings(diag, add)
    softmax_findings(diag, add)
    accuracy_findings(diag, add)
    output_nan_findings(diag, add)
    output_findings(diag, add)
    fp8_findings(diag, add)
    flush_findings(diag, add)
    collapse_findings(diag, add)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    out.sort(key=lambda f: order[f.severity])
    return out


def _names(cells: list[Cell]) -> list[str]:
    return [c.name for c in cells]
