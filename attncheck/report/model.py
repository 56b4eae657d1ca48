"""The model report: many calls on one screen, and its JSON section. Formatting only."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck.format import fmt, plain, to_jsonable
from attncheck.results import CallReport, ModelLine, ModelReport

VERDICT_STYLE = {"nan": "bold red", "overflow": "bold red", "zero": "red", "error": "bold red", "flip": "yellow",
                 "ok": "green", "skipped": "yellow", "n/a": "dim"}
MAX_HEAD_COLUMNS = 32


def call_label(line: ModelLine, prefix: str = "") -> str:
    """The module path when the call has one (less the ``prefix`` every call shares), else
    the file (and key) it came from."""
    if line.module:
        return line.module[len(prefix):] if prefix and line.module.startswith(prefix) else line.module
    return "global" if line.kind in ("sdpa", "softmax") else line.name


def shared_prefix(modules: list[str]) -> str:
    """The dotted prefix every module path shares ('transformer.h.'), '' for fewer than two paths."""
    if len(modules) < 2 or not all(modules):
        return ""
    parts = [m.split(".") for m in modules]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    common = common[: min(len(p) for p in parts) - 1]  # keep at least one part of each name
    return ".".join(common) + "." if common else ""


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "-"


def lines_table(report: ModelReport, prefix: str = "") -> Table:
    """One row per call; a shape or cell every call shares is said once, above the table."""
    shapes = {line.shape for line in report.lines}
    cells = {line.cell for line in report.lines}
    columns = [("#", "right"), ("call", "left")]
    columns += [("shape", "left")] if len(shapes) > 1 else []
    columns += [("cell", "left")] if len(cells) > 1 else []
    columns += [("logit", "right"), ("room", "right"), ("NaN", "right"), ("first cause", "left"), ("err", "right"), ("verdict", "left")]
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for name, justify in columns:
        t.add_column(name, justify=justify, no_wrap=name != "call", overflow="fold", min_width=8 if name == "call" else None)
    for i, line in enumerate(report.lines):
        first = i == report.first_bad
        mark = Text(f"{line.index}" + (" >" if first else ""), style="bold red" if first else "")
        headroom = Text(plain(line.headroom), style="red" if line.headroom is not None and line.headroom < 0 else "")
        cause = line.first_cause or "-"
        if line.first_cause and line.heads:
            cause += " h" + ",".join(map(str, line.heads[:2])) + (",…" if len(line.heads) > 2 else "")
        verdict = line.verdict + (f" ({', '.join(line.errors[:2])})" if line.verdict == "error" else "")
        row = [mark, call_label(line, prefix)]
        row += [_shape(line.shape)] if len(shapes) > 1 else []
        row += [line.cell or "-"] if len(cells) > 1 else []
        row += [plain(line.max_logit), headroom, Text(str(line.nan_rows), style="bold red" if line.nan_rows else ""), cause,
                fmt(line.worst_err, ".0e"), Text(verdict, style=VERDICT_STYLE.get(line.verdict, ""))]
        t.add_row(*row)
    return t


def shared_facts(report: ModelReport) -> str:
    """'every call: shape 2x8x16x16, cell torch/fp16' for what the table leaves out."""
    facts = []
    shapes = {line.shape for line in report.lines}
    cells = {line.cell for line in report.lines}
    if len(shapes) == 1:
        facts.append(f"shape {_shape(next(iter(shapes)))}")
    if len(cells) == 1:
        facts.append(f"cell {next(iter(cells)) or '-'}")
    return ("every call: " + ", ".join(facts)) if facts else ""


HEAD_LEGEND = "Layer x head: the largest logit (k = thousands); Nn = n NaN rows in the model's cell; ovf = Q@K^T overflows the call's dtype; * = outlier q/k"


def compact(x: float | None) -> str:
    """A logit in at most 4 characters: 3.4, 123, 22k, 3e+06."""
    if x is None:
        return "-"
    a = abs(x)
    if a < 9.95:
        return f"{x:.1f}"
    if a < 999.5:
        return f"{x:.0f}"
    if a < 999.5e3:
        return f"{x / 1e3:.0f}k"
    return f"{x:.0e}"


def head_matrix(calls: list[CallReport], report: ModelReport, prefix: str = "") -> Table | None:
    """Layer x head: NaN rows of the model's cell, Q@K^T overflow, else the head's largest logit."""
    rows = [c for c in calls if c.heads]
    if not rows:
        return None
    width = min(max(len(c.heads) for c in rows), MAX_HEAD_COLUMNS)
    marked = {(o.index, o.head) for o in report.outliers}
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    t.add_column("call", no_wrap=True)
    for h in range(width):
        t.add_column(f"h{h}", justify="right", no_wrap=True)
    for c in rows:
        cells = []
        for h in c.heads[:width]:
            star = "*" if (c.call.index, h.head) in marked else ""
            if h.nan_rows:
                cells.append(Text(f"N{h.nan_rows}{star}", style="bold red"))
            elif h.qk_overflow:
                cells.append(Text(f"ovf{star}", style="bold red"))
            else:
                cells.append(Text(f"{compact(h.max_logit)}{star}", style="yellow" if star else ""))
        cells += [""] * (width - len(cells))
        t.add_row(call_label(ModelLine(c.call.index, c.call.name, c.call.module, c.call.kind, (), None, None, None, 0, None, None, ""), prefix), *cells)
    return t


def findings_summary(calls: list[CallReport]) -> Text | None:
    """Each finding code once: its severity, in how many calls, the first of them."""
    seen: dict[str, list] = {}
    for c in calls:
        if c.diagnosis is None:
            continue
        for f in c.diagnosis.findings:
            entry = seen.setdefault(f.code, [f.severity, 0, c.call.module or c.call.name])
            entry[1] += 1
    if not seen:
        return None
    order = {"error": 0, "warning": 1, "info": 2}
    text = Text("Findings over all cells (--detail NAME or --full for the per-call tables):\n")
    for code, (severity, n, first) in sorted(seen.items(), key=lambda kv: order[kv[1][0]]):
        style = {"error": "bold red", "warning": "yellow", "info": "cyan"}[severity]
        text.append(f"  {severity:<7} ", style=style)
        text.append(f"{code}: {n} call(s), first {first}\n")
    text.rstrip()
    return text


def closing_line(report: ModelReport, calls: list[CallReport], device: str) -> Text:
    diags = [c.diagnosis for c in calls if c.diagnosis is not None]
    errors = sum(f.severity == "error" for d in diags for f in d.findings)
    warnings = sum(f.severity == "warning" for d in diags for f in d.findings)
    head = f"{len(report.lines)} call(s) on {device}: {errors} error(s), {warnings} warning(s)"
    if report.first_bad is None:
        return Text(head + "; no call goes wrong in the cells the model runs", style="yellow" if errors or warnings else "green")
    line = report.lines[report.first_bad]
    what = f"NaN in {line.nan_rows} row(s)" if line.nan_rows else line.verdict
    if line.verdict == "error":
        what = "error finding " + ", ".join(line.errors)
    cause = ""
    if line.first_cause:
        cause = f", first cause {line.first_cause}" + (f" in head {','.join(map(str, line.heads[:6]))}" if line.heads else "")
    return Text(f"{head}; first call that goes wrong: #{line.index} {call_label(line)} ({line.kind}, {line.cell or 'no cell'}): {what}{cause}", style="bold red")


LINES_LEGEND = ("Calls in order, judged by the cell the model runs (softmax: torch.softmax in its dtype; sdpa: the flash path in its "
                "dtype). logit: largest unmasked score; room: exp overflow threshold minus logit; NaN: NaN rows; "
                "err: max |p - p_float64|; >: the first call that goes wrong")


def render_model(report: ModelReport, calls: list[CallReport], device: str) -> Group:
    parts: list[Any] = []
    if report.capture:
        note = report.capture.get("note")
        if note:
            parts.append(Text(f"capture: {note}", style="yellow"))
    prefix = shared_prefix([line.module for line in report.lines])
    shared = shared_facts(report)
    legend = LINES_LEGEND + (f"; calls named below {prefix[:-1]}" if prefix else "") + (f"; {shared}" if shared else "")
    parts += [Text(legend), lines_table(report, prefix)]
    matrix = head_matrix(calls, report, prefix)
    if matrix is not None:
        wide = max(len(c.heads) for c in calls if c.heads) > MAX_HEAD_COLUMNS
        parts += [Text(HEAD_LEGEND + (f" (first {MAX_HEAD_COLUMNS} heads)" if wide else "")), matrix]
    if report.outliers:
        text = Text("Outlier heads (max|q| or max|k| >= 10x the median over the call's heads):\n", style="yellow")
        for o in report.outliers[:12]:
            text.append(f"  {o.message}\n")
        if len(report.outliers) > 12:
            text.append(f"  ... {len(report.outliers) - 12} more in the JSON report\n")
        text.rstrip()
        parts.append(text)
    summary = findings_summary(calls)
    if summary is not None:
        parts.append(summary)
    for name, why in report.skipped:
        parts.append(Text(f"skipped {name}: {why}", style="yellow"))
    if report.ignored:
        parts.append(Text(f"ignored finding codes: {', '.join(report.ignored)}", style="dim"))
    parts.append(closing_line(report, calls, device))
    return Group(*parts)


def print_model(console: Console, report: ModelReport, calls: list[CallReport], device: str) -> None:
    console.print(render_model(report, calls, device))


# --------------------------------------------------------------------------- JSON


def model_json(report: ModelReport, calls: list[CallReport]) -> dict[str, Any]:
    out_calls = []
    for line, c in zip(report.lines, calls):
        info = c.call
        out_calls.append({
            "index": line.index,
            "name": line.name,
            "module": line.module,
            "kind": line.kind,
            "file": info.file,
            "forward": info.forward,
            "shape": list(line.shape),
            "dtype": info.dtype,
            "softmax_dtype": info.softmax_dtype,
            "is_causal": info.is_causal,
            "scale": info.scale,
            "enable_gqa": info.enable_gqa,
            "has_qk": info.has_qk,
            "cell": line.cell,
            "max_logit": line.max_logit,
            "headroom": line.headroom,
            "nan_rows": line.nan_rows,
            "first_cause": line.first_cause,
            "cause_heads": line.heads,
            "max_abs_err": line.worst_err,
            "verdict": line.verdict,
            "errors": line.errors,
            "heads": to_jsonable(c.heads),
            "error": c.error,
        })
    first = None
    if report.first_bad is not None:
        line = report.lines[report.first_bad]
        first = {"index": line.index, "name": line.name, "module": line.module, "verdict": line.verdict,
                 "first_cause": line.first_cause, "heads": line.heads, "nan_rows": line.nan_rows}
    return to_jsonable({
        "calls": out_calls,
        "first_bad": first,
        "outliers": [dict(to_jsonable(o), message=o.message) for o in report.outliers],
        "ignored": list(report.ignored),
        "skipped": [{"name": n, "error": why} for n, why in report.skipped],
        "capture": report.capture,
    })

