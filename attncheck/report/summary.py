"""The one-screen answer (``attncheck run --summary``): the verdict, the first call (or tensor) that
goes wrong, its cause as a diagnostic with the fix, and what else to look at, in about ten lines at
80 columns; a healthy model in one to three. Formatting only: every fact comes from the model report
(``attncheck.model``) and the diagnoses, as the full report shows them."""

from __future__ import annotations

import glob
import shlex
from typing import Any, Sequence

from rich.console import Group
from rich.text import Text

from attncheck.codes import CAUSES_OF
from attncheck.format import visible
from attncheck.model import BAD_VERDICTS
from attncheck.report.diagnostics import SEVERITY_STYLE, Hanging, diagnostic
from attncheck.report.model import SEVERITY_ORDER
from attncheck.report.model_calls import rope_not_judged_lines
from attncheck.results.common import Finding
from attncheck.results.model import CallReport, ModelLine, ModelReport
from attncheck.results.run import TensorDiagnosis

PART_LINES = 3  # a diagnostic's headline and its fix: at most this many lines each
VERDICT_WORD = {"error": "ERROR", "warning": "WARNING", "ok": "OK"}
VERDICT_STYLE = {"error": "bold red", "warning": "yellow", "ok": "green"}
NAMED = 3  # codes or cells named on a line before '...'


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _counts(findings: Sequence[Finding]) -> tuple[int, int]:
    return sum(f.severity == "error" for f in findings), sum(f.severity == "warning" for f in findings)


def _verdict(what: str, device: str, errors: int, warnings: int, tail: str = "") -> Hanging:
    """'ERROR: 4 calls on cpu, 3 errors, 0 warnings; ...' (the word is the worst severity found)."""
    level = "error" if errors else ("warning" if warnings else "ok")
    counts = f"{what} on {device}, {_plural(errors, 'error')}, {_plural(warnings, 'warning')}{tail}"
    return Hanging(Text(f"{VERDICT_WORD[level]}: ", style=VERDICT_STYLE[level]), Text(visible(counts)), indent=4)


def _line(label: str, body: str, style: str = "") -> Hanging:
    """'label: body', later lines indented by four (names in ``body`` printed as text)."""
    return Hanging(Text(f"{label}: ", style=style), Text(visible(body)), indent=4)


def root_finding(findings: Sequence[Finding], cause: str | None, errors: Sequence[str] = ()) -> Finding | None:
    """The finding that explains a call: the one whose code stands for its first NaN cause, else its
    first error that counts, else its most severe finding (findings are listed most severe first)."""
    if cause is not None:
        hit = next((f for f in findings if f.code == cause or cause in CAUSES_OF.get(f.code, ())), None)
        if hit is not None:
            return hit
    hit = next((f for f in findings if f.code in errors), None)
    if hit is not None:
        return hit
    return min(findings, key=lambda f: SEVERITY_ORDER[f.severity], default=None)


def _cause_text(line: ModelLine) -> str:
    """'NaN in 32 rows, head 5' (the diagnostic below names the cause), or the error codes."""
    if line.verdict == "error":
        return "error finding " + ", ".join(line.errors)
    what = f"NaN in {_plural(line.nan_rows, 'row')}" if line.nan_rows else line.verdict
    if line.heads:
        heads = ",".join(map(str, line.heads[:6])) + (",…" if len(line.heads) > 6 else "")
        what += f", head{'s' if len(line.heads) > 1 else ''} {heads}"
    return what


def _name(line: ModelLine) -> str:
    """The call's module (or file), behind its rank in a capture of several processes."""
    return ("" if line.rank is None else f"rank {line.rank} ") + (line.module or line.name)


def _codes_line(codes: dict[str, str]) -> str:
    """'inf_input, input_nan (error); double_scale (warning)': codes grouped by severity."""
    parts = []
    for severity in ("error", "warning", "info"):
        names = [code for code, s in codes.items() if s == severity]
        if names:
            parts.append(", ".join(names[:NAMED]) + (", ..." if len(names) > NAMED else "") + f" ({severity})")
    return "; ".join(parts)


def _hint(code: str | None, detail: str | None) -> Hanging | None:
    tips = ([f"--detail {detail}"] if detail else []) + ([f"attncheck explain {code}"] if code else [])
    return Hanging(Text("more: ", style="dim"), Text(visible("; ".join(tips)), style="dim"), indent=4) if tips else None


def model_summary(report: ModelReport, calls: list[CallReport], device: str) -> Group:
    """A capture (calls whose implementation is known): the verdict over the cells the model runs, the
    first call that goes wrong, its cause and fix, the later calls and other codes in a line each, the
    what-ifs in one."""
    diags = [c.diagnosis for c in calls if c.diagnosis is not None]
    findings = [f for d in diags for f in d.findings] + list(report.findings)  # the capture's own too
    errors, warnings = _counts(findings)
    tail = f" (ignored: {', '.join(report.ignored)})" if report.ignored else ""
    if report.first_bad is None and not errors and not warnings:
        tail += "; no call goes wrong"
    parts: list[Any] = [_verdict(_plural(len(report.lines), "call"), device, errors, warnings, tail)]
    note = (report.capture or {}).get("note")
    stopped = (report.capture or {}).get("stopped")
    if note and stopped and any(stopped in f.message for f in report.findings):
        note = None  # capture_incomplete below says why recording stopped
    if note:
        parts.append(_line("capture", str(note), style="yellow"))
    unjudged = rope_not_judged_lines(report.capture)  # rotary tables of a type not modelled: said by name
    if unjudged:
        more = f" (and {len(unjudged) - 1} more)" if len(unjudged) > 1 else ""
        parts.append(_line("not judged", unjudged[0] + more, style="yellow"))
    for name, why in report.skipped[:1]:
        more = f" (and {len(report.skipped) - 1} more)" if len(report.skipped) > 1 else ""
        parts.append(_line("skipped", f"{name}: {why}{more}", style="yellow"))
    root, first = _first_bad(report, calls, diags, errors, warnings, parts)
    if root is not None:
        parts.append(diagnostic(root.severity, root.code, root.message, None, root.fix, max_lines=PART_LINES))
    named = {root.code} if root is not None else set()
    after = len(report.lines) if report.first_bad is None else report.first_bad + 1
    later = [line for line in report.lines[after:] if line.verdict in BAD_VERDICTS]
    if later:
        nxt = later[0]
        why = nxt.first_cause or ", ".join(nxt.errors) or nxt.verdict
        named |= {code for code, causes in CAUSES_OF.items() if nxt.first_cause in causes} | set(nxt.errors)
        parts.append(
            _line(
                "later",
                f"{_plural(len(later), 'more call')} {'goes' if len(later) == 1 else 'go'} wrong, "
                f"first #{nxt.index} {_name(nxt)} ({why})",
            )
        )
    grad = report.first_grad_bad
    if grad is not None and (grad != report.first_bad or (root is not None and not root.code.startswith("grad_"))):
        g = report.lines[grad]
        codes = [code for code in g.errors if code.startswith("grad_")]
        what = (
            f"NaN/inf in {g.grad_nan_rows} row(s) of {', '.join(g.grad_which)}, first cause {g.grad_cause}"
            if g.grad_nan_rows
            else "error finding " + ", ".join(codes)
        )
        named |= set(codes)
        said = f"first call whose gradients go wrong: #{g.index} {_name(g)}: {what}"
        parts.append(_line("backward", said, style="bold red"))
    others = _others(report, calls, named, first)
    if others:
        parts.append(_line("also", _codes_line(others)))
    if root is None:
        infos: dict[str, int] = {}
        for d in diags:
            for code in dict.fromkeys(f.code for f in d.findings if f.severity == "info"):
                infos[code] = infos.get(code, 0) + 1
        if infos:
            said = ", ".join(f"{code} ({_plural(n, 'call')})" for code, n in list(infos.items())[:NAMED])
            parts.append(_line("info", said + (", ..." if len(infos) > NAMED else "")))
    _what_if_line(report, parts)
    if root is not None:
        glob = _detail_glob(report.lines[first]) if first is not None and len(report.lines) > 1 else None
        hint = _hint(root.code, glob)
        if hint is not None:
            parts.append(hint)
    return Group(*parts)


def _first_bad(report: ModelReport, calls: list[CallReport], diags, errors: int, warnings: int, parts: list) -> tuple:
    """The finding at the root of what goes wrong and the call it is in: (root or None, the call's position or
    None); the first bad call's line (or the first holding the worst finding) added to ``parts``."""
    root, first = None, None
    if report.first_bad is not None:
        first = report.first_bad
        line = report.lines[first]
        said = f"#{line.index} {_name(line)} ({line.cell or line.kind}): {_cause_text(line)}"
        parts.append(_line("first bad call", said, style="bold red"))
        diag = calls[first].diagnosis
        root = root_finding(diag.findings if diag is not None else [], line.first_cause, line.errors)
    elif report.findings and not any(f.severity in ("error", "warning") for d in diags for f in d.findings):
        root = report.findings[0]  # the capture's own (capture_incomplete): no call says more
    elif errors or warnings:  # findings without a broken row: the first call holding the worst of them
        worst = "error" if errors else "warning"
        first = next(
            i
            for i, c in enumerate(calls)
            if c.diagnosis is not None and any(f.severity == worst for f in c.diagnosis.findings)
        )
        line = report.lines[first]
        root = next(f for f in calls[first].diagnosis.findings if f.severity == worst)
        parts.append(
            _line(
                f"first {worst}", f"#{line.index} {_name(line)} ({line.cell or line.kind})", style=SEVERITY_STYLE[worst]
            )
        )
    return root, first


def _others(report: ModelReport, calls: list[CallReport], named: set, first) -> dict[str, str]:
    """Codes not named above, each with its worst severity."""
    # Other codes worth a look: the errors of the first bad call are its own breakage, which its first
    # cause explains (an inf_input beside qk_overflow is the same +inf); warnings anywhere, and errors
    # of calls the lines above do not name.
    others: dict[str, str] = {}
    for i, c in enumerate(calls):
        for f in c.diagnosis.findings if c.diagnosis is not None else []:
            if f.code in named or f.severity == "info" or (i == first and f.severity == "error"):
                continue
            if SEVERITY_ORDER[f.severity] < SEVERITY_ORDER[others.get(f.code, "info")]:
                others[f.code] = f.severity
    for f in report.findings:  # the capture's own (capture_incomplete)
        if f.code not in named and SEVERITY_ORDER[f.severity] < SEVERITY_ORDER[others.get(f.code, "info")]:
            others[f.code] = f.severity
    return others


def _what_if_line(report: ModelReport, parts: list) -> None:
    """The what-if cells asked in one line (not counted), added to ``parts``."""
    if report.what_if:
        broken = [a for a in report.what_if if a.bad_calls]
        if broken:
            cells = ", ".join(f"{a.cell} (#{a.first.index})" if a.first is not None else a.cell for a in broken[:NAMED])
            text = f"{len(broken)} of {len(report.what_if)} cells asked would break: {cells}" + (
                ", ..." if len(broken) > NAMED else ""
            )
        else:
            text = f"none of the {_plural(len(report.what_if), 'cell')} asked would break"
        parts.append(_line("what-if", text + " (not counted)"))


def _detail_glob(line: ModelLine) -> str:
    """What --detail takes to pick that call alone: its module path (or name) as a glob that matches
    it literally, quoted for the shell where it would read it otherwise."""
    return shlex.quote(glob.escape(line.module or line.name))


def _bad_cells(d: TensorDiagnosis) -> str:
    """'6 of 12 cells break: naive/fp16, naive/bf16, naive/fp32, ...' (NaN, overflow or all-zero rows)."""
    hit = [c.name for c in d.cells if c.verdict in ("nan", "overflow", "zero")]
    if not hit:
        return "no cell has a broken row"
    named = ", ".join(hit[:NAMED]) + (", ..." if len(hit) > NAMED else "")
    return f"{len(hit)} of {len(d.cells)} cells break: {named}"


def tensors_summary(diags: Sequence[TensorDiagnosis], device: str, what_ifs: Sequence[TensorDiagnosis] = ()) -> Group:
    """Saved tensors (scores, or Q/K/V: every cell asked): the verdict, the first tensor with the worst
    finding, that finding and its fix, the other codes."""
    findings = [f for d in diags for f in d.findings]
    errors, warnings = _counts(findings)
    tail = "" if errors or warnings else "; nothing breaks"
    parts: list[Any] = [_verdict(_plural(len(diags), "tensor"), device, errors, warnings, tail)]
    worst = "error" if errors else ("warning" if warnings else None)
    root = None
    if worst is not None:
        d = next(d for d in diags if any(f.severity == worst for f in d.findings))
        root = next(f for f in d.findings if f.severity == worst)
        parts.append(
            _line(
                f"first {worst}",
                f"{d.name} ({'x'.join(map(str, d.shape))}, {d.dtype}): {_bad_cells(d)}",
                style=SEVERITY_STYLE[worst],
            )
        )
        parts.append(diagnostic(root.severity, root.code, root.message, None, root.fix, max_lines=PART_LINES))
    seen: dict[str, str] = {}
    for f in sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity]):
        seen.setdefault(f.code, f.severity)
    others = {code: s for code, s in seen.items() if root is None or (code != root.code and s != "info")}
    if others:
        parts.append(_line("also", _codes_line(others)) if root is not None else _line("info", ", ".join(others)))
    broken = [c.name for d in what_ifs for c in d.cells if c.verdict in ("nan", "overflow", "zero")]
    if what_ifs:
        said = (
            ("would break: " + ", ".join(broken[:NAMED]) + (", ..." if len(broken) > NAMED else ""))
            if broken
            else "no cell asked would break"
        )
        parts.append(_line("what-if", said + " (not counted)"))
    if root is not None:
        parts.append(Text(f"more: attncheck explain {root.code}; without --summary: the full report", style="dim"))
    return Group(*parts)
