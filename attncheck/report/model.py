"""The model report: many calls on one screen, and its JSON section. Formatting only."""

from __future__ import annotations

from typing import Any, Sequence

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck import __version__
from attncheck.codes import REGISTRY, SEVERITY, doc_link
from attncheck.findings import counted_rows
from attncheck.format import fmt, plain, to_jsonable, visible
from attncheck.model import findings_in_order
from attncheck.report.diagnostics import EXPLAIN_HINT, Hanging, diagnostic
from attncheck.report.fit import Fitted, fitted, narrow_table, natural_width
from attncheck.report.run import JSON_SCHEMA, diagnosis_json, settings_section
from attncheck.report.text import shown
from attncheck.results import CallReport, ModelLine, ModelReport, TensorDiagnosis

VERDICT_STYLE = {
    "nan": "bold red",
    "overflow": "bold red",
    "zero": "red",
    "error": "bold red",
    "flip": "yellow",
    "ok": "green",
    "skipped": "yellow",
    "n/a": "dim",
}
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
MAX_HEAD_COLUMNS = 32
WHAT_IF_NARROWEST = 4  # the what-if table's last layout: its findings listed under it
MATRIX_HEADS_FIRST = 8  # heads the layer x head table keeps beside the calls' names before it shortens them


def call_label(line: ModelLine, prefix: str = "") -> str:
    """The module path when the call has one (less the ``prefix`` every call shares), else
    the file (and key) it came from."""
    on = "" if line.rank is None else f"r{line.rank} "  # a capture of several processes: the rank first
    if line.module:
        return on + (line.module[len(prefix) :] if prefix and line.module.startswith(prefix) else line.module)
    return on + ("global" if line.kind in ("sdpa", "softmax", "flash_attn") else line.name)


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


def lines_table(report: ModelReport, prefix: str = "", labels: list[str] | None = None, narrow: int = 0) -> Table:
    """One row per call; a shape or cell every call shares is said once, above the table. ``labels``:
    the calls' names as shown (default: their module paths less ``prefix``); ``narrow`` (for narrow
    terminals): 1 puts two-word headers on two lines, 2 also leaves one space between columns, 3 also
    leaves the heads out of a cause and the codes out of a verdict (the findings below name them)."""
    labels = [call_label(line, prefix) for line in report.lines] if labels is None else labels
    shapes = {line.shape for line in report.lines}
    cells = {line.cell for line in report.lines}
    columns = [("#", "right"), ("call", "left")]
    columns += [("shape", "left")] if len(shapes) > 1 else []
    columns += [("cell", "left")] if len(cells) > 1 else []
    columns += [
        ("logit", "right"),
        ("room", "right"),
        ("NaN", "right"),
        ("first cause", "left"),
        ("err", "right"),
        ("verdict", "left"),
    ]
    backward = any(line.grad_verdict is not None for line in report.lines)
    columns += [("grad", "left")] if backward else []
    t = narrow_table(narrow)
    for name, justify in columns:  # nothing wraps: ``fitted`` chooses the layout that fits
        t.add_column(name.replace(" ", "\n") if narrow else name, justify=justify, no_wrap=True)
    for i, (line, label) in enumerate(zip(report.lines, labels)):
        first = i == report.first_bad
        mark = Text(f"{line.index}" + (" >" if first else ""), style="bold red" if first else "")
        headroom = Text(plain(line.headroom), style="red" if line.headroom is not None and line.headroom < 0 else "")
        cause = line.first_cause or "-"
        if line.first_cause and line.heads and narrow < 3:
            cause += " h" + ",".join(map(str, line.heads[:2])) + (",…" if len(line.heads) > 2 else "")
        # the error codes beside the verdict, but those of the backward, which the grad column shows
        codes = [code for code in line.errors if not (backward and code.startswith("grad_"))]
        verdict = line.verdict + (
            f" ({', '.join(codes[:2])})" if line.verdict == "error" and codes and narrow < 3 else ""
        )
        row = [mark, shown(label)]
        row += [_shape(line.shape)] if len(shapes) > 1 else []
        row += [line.cell or "-"] if len(cells) > 1 else []
        row += [
            plain(line.max_logit),
            headroom,
            Text(str(line.nan_rows), style="bold red" if line.nan_rows else ""),
            cause,
            fmt(line.worst_err, ".0e"),
            Text(verdict, style=VERDICT_STYLE.get(line.verdict, "")),
        ]
        row += [_grad_cell(line)] if backward else []
        t.add_row(*row)
    return t


def fitted_lines_table(report: ModelReport, prefix: str, legend: Text) -> Fitted:
    """The legend and the calls' table, built for the terminal's width: two-word headers on two lines
    and names shortened (the parts no name differs in left out, then the middle) only where the
    table would not fit otherwise."""
    labels = [call_label(line, prefix) for line in report.lines]

    def build(console: Console, width: int) -> list:
        table, dropped = fitted(
            console, width, labels, lambda names, narrow: lines_table(report, labels=names, narrow=narrow)
        )
        note = legend.copy()
        if dropped:
            note.append(f"; names without {', '.join(repr(p) for p in dropped)}")
        if any("…" in cell for cell in _column_texts(table, 1)):
            note.append("; … marks a shortened name (--json has each in full)")
        return [note, table]

    return Fitted(build)


def _column_texts(table: Table, index: int) -> list[str]:
    return [getattr(cell, "plain", str(cell)) for cell in table.columns[index].cells]


def _grad_cell(line: ModelLine) -> Text:
    """'ok', 'nan q,k,v', 'error' or '-' (no backward) for the grad column."""
    verdict = line.grad_verdict
    if verdict is None:
        return Text("-")
    if verdict == "nan":
        return Text("nan " + "".join(name[1:] for name in line.grad_which), style="bold red")
    return Text(verdict, style=VERDICT_STYLE.get(verdict, ""))


def backward_summary(report: ModelReport, prefix: str = "") -> Text | None:
    """The first call whose gradients go wrong, and the least loss-scale headroom over the calls."""
    with_grads = [line for line in report.lines if line.grad_verdict is not None]
    if not with_grads:
        return None
    text = Text(f"Backward of {len(with_grads)} call(s) (dO recorded): ")
    if report.first_grad_bad is None:
        text.append("gradients finite in every call", style="green")
    else:
        line = report.lines[report.first_grad_bad]
        what = (
            f"NaN/inf in {line.grad_nan_rows} row(s) of {', '.join(line.grad_which)}, first cause {line.grad_cause}"
            if line.grad_nan_rows
            else "error finding " + ", ".join(code for code in line.errors if code.startswith("grad_"))
        )
        text.append(
            f"first call whose gradients go wrong: #{line.index} {call_label(line, prefix)}: {what}", style="bold red"
        )
    rooms = [line for line in with_grads if line.grad_headroom is not None]
    if rooms:
        least = min(rooms, key=lambda line: line.grad_headroom)
        text.append(
            f"; least loss-scale headroom: dO may grow {plain(least.grad_headroom)}x before {least.grad_headroom_at} "
            f"overflows (#{least.index} {call_label(least, prefix)})",
            style="red" if least.grad_headroom < 1 else ("yellow" if least.grad_headroom < 2 else ""),
        )
    return text


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


HEAD_LEGEND = (
    "Layer x head: the largest logit (k = thousands); Nn = n NaN rows in the model's cell; ovf = Q@K^T overflows "
    "the call's dtype; * = outlier q/k"
)


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


def head_matrix(
    calls: list[CallReport],
    report: ModelReport,
    prefix: str = "",
    labels: dict[int, str] | None = None,
    heads: int | list[int] = MAX_HEAD_COLUMNS,
) -> Table | None:
    """Layer x head: NaN rows of the model's cell, Q@K^T overflow, else the head's largest logit; the
    first ``heads`` heads, or those listed; ``labels``: the calls' names as shown, by id of the CallReport
    (two captures read together share call indices)."""
    rows = [c for c in calls if c.heads]
    if not rows:
        return None
    which = list(range(min(max(len(c.heads) for c in rows), heads))) if isinstance(heads, int) else heads
    marked = {(o.position, h) for o in report.outliers for h in (o.query_heads or [o.head])}
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    t.add_column("call", no_wrap=True)
    for h in which:
        t.add_column(f"h{h}", justify="right", no_wrap=True)
    for at, c in enumerate(calls):  # ``at``: the call's place in the report, as an outlier names it
        if not c.heads:
            continue
        by_head = {h.head: h for h in c.heads}
        cells = []
        for index in which:
            h = by_head.get(index)
            if h is None:
                cells.append("")
                continue
            star = "*" if (at, h.head) in marked else ""
            nan = counted_rows(h.nan_rows, h.nan_causes, report.ignored)  # as the call table counts them
            if nan:
                cells.append(Text(f"N{nan}{star}", style="bold red"))
            elif h.qk_overflow:
                cells.append(Text(f"ovf{star}", style="bold red"))
            else:
                cells.append(Text(f"{compact(h.max_logit)}{star}", style="yellow" if star else ""))
        label = labels[id(c)] if labels is not None else _matrix_label(c, prefix)
        t.add_row(shown(label), *cells)
    return t


def ranks_block(report: ModelReport) -> Text | None:
    """A capture of several processes (torchrun): each rank's own account, one line each."""
    if len(report.ranks) < 2:  # one rank's own report says so in its capture note
        return None
    world = (report.capture or {}).get("world")
    of = f" of {world}" if world else ""
    text = Text(f"Ranks ({len(report.ranks)}{of}; the calls above are every rank's, r0, r1, ...):\n")
    for r in report.ranks:
        head = f"  rank {r.rank}: {r.calls} call(s), {r.errors} error(s), {r.warnings} warning(s)"
        head += "" if r.complete else ", incomplete"
        if r.first_bad is None:
            text.append(head + "; no call goes wrong\n", style="yellow" if r.warnings or not r.complete else "green")
        else:
            line = report.lines[r.first_bad]
            cause = f", first cause {line.first_cause}" if line.first_cause else ""
            said = f"{head}; first call that goes wrong: #{line.index} {call_label(line)}: {line.verdict}{cause}"
            text.append(visible(said) + "\n", style="bold red")
    text.rstrip()
    return text


def capture_block(report: ModelReport) -> Group | None:
    """The capture's own findings (capture_incomplete), each a diagnostic."""
    if not report.findings:
        return None
    parts: list[Any] = [Text("Findings of the capture itself", style="bold")]
    for f in report.findings:
        parts += [diagnostic(f.severity, f.code, f.message, None, f.fix), Text("")]
    return Group(*parts)


def flagged_heads(calls: list[CallReport], report: ModelReport) -> list[int]:
    """Heads with NaN rows, a Q@K^T overflow or an outlier q/k in some call: a narrow table shows them."""
    marked = {h for o in report.outliers for h in (o.query_heads or [o.head])}
    return sorted({h.head for c in calls for h in c.heads if h.nan_rows or h.qk_overflow or h.head in marked})


def _matrix_label(c: CallReport, prefix: str) -> str:
    return call_label(
        ModelLine(
            c.call.index,
            c.call.name,
            c.call.module,
            c.call.kind,
            (),
            None,
            None,
            None,
            0,
            None,
            None,
            "",
            rank=c.call.rank,
        ),
        prefix,
    )


def fitted_head_matrix(calls: list[CallReport], report: ModelReport, prefix: str) -> Fitted | None:
    """The legend and the layer x head table, built for the terminal's width: names shortened as the
    calls' table does, then as many heads as fit, those with NaN rows, an overflow or an outlier
    always among them."""
    rows = [c for c in calls if c.heads]
    if not rows:
        return None
    most = max(len(c.heads) for c in rows)
    full = [_matrix_label(c, prefix) for c in rows]
    flagged = flagged_heads(rows, report)

    def choose(n: int) -> list[int]:
        """n heads: the flagged ones, and the first others."""
        keep = flagged[:n]
        return sorted(keep + [h for h in range(most) if h not in keep][: n - len(keep)])

    def build(console: Console, width: int) -> list:
        n = min(most, MAX_HEAD_COLUMNS)

        def table(names: list[str], which: list[int]) -> Table:
            return head_matrix(calls, report, labels={id(c): name for c, name in zip(rows, names)}, heads=which)

        # names are fitted beside a few heads (they say which call a row is), then as many heads as fit
        few = choose(min(n, MATRIX_HEADS_FIRST))
        t, dropped = fitted(console, width, full, lambda names, narrow: table(names, few))
        names = [getattr(cell, "plain", str(cell)) for cell in t.columns[0].cells]
        t = table(names, choose(n))
        while n > 1 and natural_width(console, t, width) > width:
            n -= 1
            t = table(names, choose(n))
        legend = Text(HEAD_LEGEND)
        if n < most:
            shown_flagged = " and those marked" if flagged and choose(n) != list(range(n)) else ""
            legend.append(f" ({n} of {most} heads: the first{shown_flagged}; --json has all)")
        if dropped:
            legend.append(f"; names without {', '.join(repr(p) for p in dropped)}")
        return [legend, t]

    return Fitted(build)


def findings_summary(calls: list[CallReport], known: bool, first_bad: int | None = None, ignore=()) -> Group | None:
    """Each finding code once, as a diagnostic: its severity and what it means, in how many calls and
    the first of them, its fix (the model's cells' findings for a capture; every cell's for files of
    unknown implementation); causes before consequences (``model.findings_in_order``)."""
    seen = findings_in_order(calls, first_bad, ignore)
    if not seen:
        return None
    head = (
        "Findings of the cells the model runs (--detail NAME, --full: per-call reports)"
        if known
        else "Findings over all cells (--detail NAME, --full: per-call reports)"
    )
    parts: list[Any] = [Text(head, style="bold")]
    for code, severity, n, first, cause in seen:
        where = f"{n} call(s), first {first}"
        if cause:
            where += f"; after the first call that goes wrong ({cause}), whose NaN its input can carry"
        parts += [diagnostic(severity, code, REGISTRY[code].summary, where, REGISTRY[code].fix), Text("")]
    parts.append(Text(EXPLAIN_HINT, style="dim"))
    return Group(*parts)


def what_if_table(
    report: ModelReport, prefix: str = "", labels: list[str] | None = None, narrow: int = 0
) -> Table | None:
    """One row per what-if cell: calls computed, calls where it breaks, the first and why, its least
    headroom, its largest error and its findings. Never the model's verdict. ``labels``: the first
    calls' names as shown, one per what-if cell."""
    if not report.what_if:
        return None
    labels = [_first_label(a, prefix) for a in report.what_if] if labels is None else labels
    t = narrow_table(narrow)
    t.title, t.title_justify = (
        "What if the model ran these instead (not counted as the model's; --fail-on what-if:COND)",
        "left",
    )
    items = [_what_if_codes(a) for a in report.what_if]
    longest = max((len(item) for codes in items for item in codes), default=1)
    columns = [
        ("cell", "left"),
        ("breaks", "right"),
        ("first call", "left"),
        ("first cause", "left"),
        ("room", "right"),
        ("err", "right"),
    ]
    columns += [("findings", "left")] if narrow < WHAT_IF_NARROWEST else []  # narrowest: listed under the table
    for name, justify in columns:
        # findings wrap between codes, never inside one; a cause between its words
        t.add_column(
            name.replace(" ", "\n") if narrow else name,
            justify=justify,
            no_wrap=name not in ("first cause", "findings"),
            overflow="fold",
            min_width=longest if name == "findings" else None,
        )
    for a, label, codes in zip(report.what_if, labels, items):
        first = a.first
        where = "-" if first is None else shown(label)
        cause = "-"
        if first is not None:
            cause = first.first_cause or (", ".join(first.errors) if first.verdict == "error" else first.verdict)
            if first.first_cause and first.heads:
                cause += " h" + ",".join(map(str, first.heads[:2])) + (",…" if len(first.heads) > 2 else "")
        room = Text(plain(a.headroom), style="red" if a.headroom is not None and a.headroom < 0 else "")
        row = [
            Text(a.cell, style=VERDICT_STYLE["nan"] if a.bad_calls else "green"),
            f"{a.bad_calls}/{a.calls}",
            where,
            cause,
            room,
            fmt(a.worst_err, ".0e"),
        ]
        t.add_row(*row, *([", ".join(codes) or "-"] if narrow < WHAT_IF_NARROWEST else []))
    return t


def _first_label(answer, prefix: str) -> str:
    return "-" if answer.first is None else f"#{answer.first.index} {call_label(answer.first, prefix)}"


def _what_if_codes(answer) -> list[str]:
    """'grad_underflow (1)' per code, its space a no-break space: a code and its count stay on one line."""
    return [f"{code}\u00a0({n})" for code, n in answer.findings.items()]


def fitted_what_if_table(report: ModelReport, prefix: str) -> Fitted | None:
    """The what-if table, its first calls' names shortened where it would not fit the terminal."""
    if not report.what_if:
        return None
    labels = [_first_label(a, prefix) for a in report.what_if]

    def build(console: Console, width: int) -> list:
        named = [label for label in labels if label != "-"]
        heads = [label.split(" ", 1)[0] for label in named]  # '#3 name': the index stays whole, the name is shortened
        table, _ = fitted(
            console,
            width,
            [label.split(" ", 1)[1] for label in named],
            lambda names, narrow: what_if_table(
                report, labels=_merge(labels, [f"{h} {n}" for h, n in zip(heads, names)]), narrow=narrow
            ),
            WHAT_IF_NARROWEST,
        )
        if len(table.columns) == 7:
            return [table]
        # the findings column did not fit: each cell's codes in a line of their own, under the table
        lines = [
            Hanging(
                Text(f"  {a.cell}: "),
                Text(", ".join(code.replace("\u00a0", " ") for code in _what_if_codes(a))),
                indent=4,
            )
            for a in report.what_if
            if a.findings
        ]
        return [table, *([Text("Findings of the what-if cells:")] + lines if lines else [])]

    return Fitted(build)


def _merge(labels: list[str], named: list[str]) -> list[str]:
    """``labels`` with each entry that is not '-' replaced, in order, by the next of ``named``."""
    it = iter(named)
    return [label if label == "-" else next(it) for label in labels]


KERNEL_TABLES = 5  # per-call kernel tables shown (the calls where the kernels disagree first); the rest in the JSON


def kernel_outcome(k) -> str:
    """'NaN (fused_max, 1 row)', 'backward NaN predicted (padded_tile, LSE -121)', 'finite', 'not run: why'."""
    if k.refused is not None:
        return f"not run: {k.refused}"
    parts = []
    if k.verdict in ("nan", "overflow", "zero"):
        parts.append(
            f"{'NaN' if k.verdict == 'nan' else k.verdict} ({k.cause or k.verdict}, {k.nan_rows} row(s))"
            if k.verdict == "nan"
            else k.verdict
        )
    elif k.verdict == "error":
        parts.append("error finding")
    if k.backward_rows:
        lse = f", LSE {k.lse:.4g}" if k.lse is not None else ""
        parts.append(f"backward NaN predicted ({k.backward_cause}, {k.backward_rows} row(s){lse})")
    return "; ".join(parts) or "finite"


def kernel_sentence(call) -> str:
    """One line per replayed call: 'NaN under cudnn (...); finite under fa2, mem-efficient; not run by fa2 (...)'."""
    broken = [f"{_kernel_name(k)} {kernel_outcome(k)}" for k in call.kernels if k.refused is None and k.breaks]
    fine = [_kernel_name(k) for k in call.kernels if k.refused is None and not k.breaks]
    parts = ["; ".join(broken)] if broken else []
    if fine:
        parts.append(("finite under " if broken else "finite under every kernel that could run it: ") + ", ".join(fine))
    refused = [k.path for k in call.kernels if k.refused is not None]
    if refused:
        parts.append("not run by " + ", ".join(refused))
    return "; ".join(parts)


def _kernel_name(k) -> str:
    return k.path + (" (ran)" if k.ran else "")


def kernels_block(report: ModelReport, prefix: str = "") -> Group | None:
    """--what-if kernels: one table per call where the kernels disagree (the first ``KERNEL_TABLES``), and a
    line per replayed call: which kernel breaks it and which do not."""
    if not report.kernels:
        return None
    parts: list[Any] = [
        Text(
            "Which kernel breaks each call (--what-if kernels: every kernel that could have run it, in "
            "its dtype; not counted as the model's)",
            style="bold",
        )
    ]
    shown_tables = [c for c in report.kernels if any(k.breaks for k in c.kernels)][:KERNEL_TABLES]
    for call in shown_tables:
        line = report.lines[call.position]
        t = Table(
            box=None,
            pad_edge=False,
            title=f"#{line.index} {call_label(line, prefix)} ({call.kernels[0].dtype})",
            title_justify="left",
            title_style="",
        )
        t.add_column("kernel", no_wrap=True)
        t.add_column("result", overflow="fold")
        t.add_column("out err", justify="right", no_wrap=True)
        for k in call.kernels:
            style = "dim" if k.refused is not None else (VERDICT_STYLE["nan"] if k.breaks else "green")
            name = _kernel_name(k) + (" *" if k.assumed else "")
            t.add_row(Text(name, style=style), shown(kernel_outcome(k)), fmt(k.out_err, ".0e"))
        parts.append(t)
    text = Text()
    for call in report.kernels:
        line = report.lines[call.position]
        text.append(f"  #{line.index} {visible(call_label(line, prefix))}: ", style="bold")
        text.append(visible(kernel_sentence(call)) + "\n")
    text.rstrip()
    parts.append(text)
    if any(k.assumed for c in report.kernels for k in c.kernels):
        parts.append(
            Text(
                "  * closed source or hardware approximations: its rounding points are assumed "
                "(docs/reference/numerics.md)",
                style="dim",
            )
        )
    return Group(*parts)


def path_notes(report: ModelReport, calls: list[CallReport], prefix: str = "") -> Group | None:
    """A line per call judged by another path than the kernel its capture names (the first few)."""
    noted = [(line, c.path_note) for line, c in zip(report.lines, calls) if c.path_note]
    if not noted:
        return None
    parts: list[Any] = [
        shown(f"#{line.index} {call_label(line, prefix)}: {note}", style="yellow")
        for line, note in noted[:KERNEL_TABLES]
    ]
    if len(noted) > KERNEL_TABLES:
        parts.append(
            shown(
                f"... {len(noted) - KERNEL_TABLES} more calls judged by another path than the capture names "
                "(path_note in the JSON report)",
                style="yellow",
            )
        )
    return Group(*parts)


def closing_line(report: ModelReport, calls: list[CallReport], device: str) -> Text:
    diags = [c.diagnosis for c in calls if c.diagnosis is not None]
    severities = [f.severity for d in diags for f in d.findings] + [f.severity for f in report.findings]
    errors, warnings = severities.count("error"), severities.count("warning")
    of = f" of {len(report.ranks)} ranks" if len(report.ranks) > 1 else ""
    where = f"recorded on {report.recorded_on}, judged on {device}" if report.recorded_on else f"on {device}"
    head = f"{len(report.lines)} call(s){of} {where}: {errors} error(s), {warnings} warning(s)"
    incomplete = [f for f in report.findings if f.code == "capture_incomplete"]
    gap = "".join("; " + f.message for f in incomplete)  # what was not judged, on the line CI logs show
    judged = "in the cells the model runs" if report.known else "in any cell"
    if report.what_if:
        broken = [a.cell for a in report.what_if if a.bad_calls]
        tail = f"; what-if: {', '.join(broken)} would break" if broken else "; what-if: no cell asked would break"
        warned = [
            a.cell for a in report.what_if if not a.bad_calls and any(SEVERITY.get(c) == "warning" for c in a.findings)
        ]
        if warned:  # said beside 'would break': --fail-on what-if:warning fails on them
            tail += f" (warnings in {', '.join(warned)})"
    else:
        tail = ""
    if report.first_bad is None:
        return shown(head + f"; no call goes wrong {judged}" + tail + gap, style="yellow" if warnings else "green")
    line = report.lines[report.first_bad]
    what = f"NaN in {line.nan_rows} row(s)" if line.nan_rows else line.verdict
    if line.verdict == "error":
        what = "error finding " + ", ".join(line.errors)
    cause = ""
    if line.first_cause:
        cause = f", first cause {line.first_cause}" + (
            f" in head {','.join(map(str, line.heads[:6]))}" if line.heads else ""
        )
    on = "" if line.rank is None else f" on rank {line.rank}"
    where = f"#{line.index} {call_label(line)} ({line.kind}, {line.cell or 'no cell'})"
    return shown(f"{head}; first call that goes wrong{on}: {where}: {what}{cause}{tail}{gap}", style="bold red")


LINES_LEGEND = (
    "Calls in order, judged by the cell the model runs (softmax: torch.softmax in its dtype; sdpa: the path of the "
    "kernel PyTorch chose, in its dtype: on a GPU fa2 (fa3, fa4 where PyTorch ran FlashAttention-3, -4), "
    "mem-efficient or cudnn, on a CPU flash, sdpa-math for the math backend; flash_attn: fa2-fma, fa3, fa4). "
    "logit: largest unmasked score; room: the cell's distance to its first failure{limit}; NaN: NaN rows; "
    "err: max |p - p_float64|; >: the first call that goes wrong{grad}"
)
FILES_LEGEND = (
    "Tensors and calls in order; the implementation is not known, so every cell is the question and a line's verdict "
    "counts every cell's error findings (the cell shown: torch.softmax in the tensor's dtype). "
    "logit: largest unmasked score; room: that cell's distance to its first failure{limit}; NaN: NaN rows; "
    "err: max |p - p_float64|; >: the first call that goes wrong{grad}"
)
GRAD_LEGEND = "; grad: the backward of that cell from the recorded dO (nan qkv: NaN/inf rows in dQ, dK, dV)"


def _limit_text(report: ModelReport) -> str:
    """' (S = Q@K^T in fp32 rounds to inf at |S| >= 3.40282e+38)' when every line's cell shares one
    limit; else ' (each cell's own: see the JSON report's limit)'."""
    limits = {line.limit.what for line in report.lines if line.limit is not None}
    if not limits:
        return " (none: no cell here fails from finite scores)" if report.lines else ""
    if len(limits) == 1 and all(line.limit is not None for line in report.lines):
        return f" ({next(iter(limits))})"
    return " (each cell's own: " + "; ".join(sorted(limits)) + "; '-': none)"


SETTING_CALLS_SHOWN = 12  # calls whose best settings are listed; the JSON has every call's


def call_settings_lines(report: ModelReport, prefix: str = "") -> Text | None:
    """--what-if fa4 over several calls: each call's best setting per dtype, beside its default's error."""
    if len(report.call_settings) < 2:
        return None
    text = Text("Best setting per call (its error; the default's where it is not the best):\n")
    for at, choices in report.call_settings[:SETTING_CALLS_SHOWN]:
        line = report.lines[at]
        parts = []
        for ch in choices:
            best, default = ch.point(ch.best), ch.point(ch.default)
            said = f"{ch.path}/{ch.dtype} " + ("none" if best is None else f"{best.label} {fmt(best.err, '.2g')}")
            if default is not None and default is not best:
                said += f" (default {default.label} {fmt(default.err, '.2g')})"
            parts.append(said)
        text.append(f"  #{line.index} {visible(call_label(line, prefix))}: ", style="bold")
        text.append("; ".join(parts) + "\n")
    if len(report.call_settings) > SETTING_CALLS_SHOWN:
        text.append(f"  ... {len(report.call_settings) - SETTING_CALLS_SHOWN} more in the JSON report\n")
    text.rstrip()
    return text


def render_model(report: ModelReport, calls: list[CallReport], device: str) -> Group:
    parts: list[Any] = []
    if report.capture:
        note = report.capture.get("note")
        if note:
            parts.append(shown(f"capture: {note}", style="yellow"))
    prefix = shared_prefix([line.module for line in report.lines])
    shared = shared_facts(report)
    backward = any(line.grad_verdict is not None for line in report.lines)
    legend = (LINES_LEGEND if report.known else FILES_LEGEND).format(
        limit=_limit_text(report), grad=GRAD_LEGEND if backward else ""
    )
    if any(line.kind == "flex" for line in report.lines):
        legend = legend.replace(
            "sdpa-math for the math backend)",
            "sdpa-math for the math backend; flex: FlexAttention's fused "
            "kernel where flex_attention is torch.compile'd, flex-math where it is not)",
        )
    legend += (f"; calls named below {prefix[:-1]}" if prefix else "") + (f"; {shared}" if shared else "")
    parts.append(fitted_lines_table(report, prefix, shown(legend)))
    modded = [line for line in report.lines if line.score_mod is not None]
    if modded:
        text = Text("Flex score_mod (judged on the logits after it; largest unmasked logit before -> after):\n")
        for line in modded[:12]:
            before = "-" if line.logit_before_mod is None else plain(line.logit_before_mod)
            text.append(
                f"  #{line.index} {visible(line.module)}: {visible(line.score_mod)} {before} -> "
                f"{plain(line.max_logit)}\n"
            )
        if len(modded) > 12:
            text.append(f"  ... {len(modded) - 12} more in the JSON report\n")
        text.rstrip()
        parts.append(text)
    matrix = fitted_head_matrix(calls, report, prefix)
    if matrix is not None:
        parts.append(matrix)
    if report.outliers:
        text = Text(
            "Outlier heads (max|q| or max|k| >= 10x the median over the call's other heads; k per kv head):\n",
            style="yellow",
        )
        for o in report.outliers[:12]:
            text.append(f"  {visible(o.message)}\n")
        if len(report.outliers) > 12:
            text.append(f"  ... {len(report.outliers) - 12} more in the JSON report\n")
        text.rstrip()
        parts.append(text)
    ranks = ranks_block(report)
    if ranks is not None:
        parts.append(ranks)
    own = capture_block(report)
    if own is not None:
        parts.append(own)
    summary = findings_summary(calls, report.known, report.first_bad, report.ignored)
    if summary is not None:
        parts.append(summary)
    grads = backward_summary(report, prefix)
    if grads is not None:
        parts.append(grads)
    table = fitted_what_if_table(report, prefix)
    if table is not None:
        parts.append(table)
    kernels = kernels_block(report, prefix)
    if kernels is not None:
        parts.append(kernels)
    settings = settings_section(report.settings)
    if settings is not None:
        parts.append(settings)
    for grid, n, why in report.settings_refused:
        parts.append(shown(f"{grid} (--what-if): not computed for {n} call(s): {why}", style="dim"))
        per_call = call_settings_lines(report, prefix)
        if per_call is not None:
            parts.append(per_call)
    notes = path_notes(report, calls, prefix)
    if notes is not None:
        parts.append(notes)
    for name, why in report.skipped:
        parts.append(shown(f"skipped {name}: {why}", style="yellow"))
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
        out_calls.append(
            {
                "index": line.index,
                "rank": line.rank,
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
                "score_mod": None
                if line.score_mod is None
                else {"name": line.score_mod, "max_logit_before": line.logit_before_mod},
                "headroom": line.headroom,
                "limit": _limit_json(line.limit),
                "nan_rows": line.nan_rows,
                "first_cause": line.first_cause,
                "cause_heads": line.heads,
                "max_abs_err": line.worst_err,
                "verdict": line.verdict,
                "errors": line.errors,
                "heads": to_jsonable(c.heads),
                "error": c.error,
                "device": info.meta.get("device"),  # where the call ran, as the capture recorded it
                "capability": info.meta.get("capability"),
                "sdpa_backend": info.meta.get("sdpa_backend"),
                "path_note": c.path_note,
                "what_if": None if c.what_if is None else diagnosis_json(c.what_if),
                "backward": None
                if line.grad_verdict is None
                else {
                    "verdict": line.grad_verdict,
                    "nan_rows": line.grad_nan_rows,
                    "first_cause": line.grad_cause,
                    "grads": line.grad_which,
                    "scale_headroom": line.grad_headroom,
                    "headroom_at": line.grad_headroom_at,
                },
            }
        )
    first = None if report.first_bad is None else _first_json(report.lines[report.first_bad])
    return to_jsonable(
        {
            "calls": out_calls,
            "first_bad": first,
            "outliers": [dict(to_jsonable(o), message=o.message) for o in report.outliers],
            "ignored": list(report.ignored),
            "skipped": [{"name": n, "error": why} for n, why in report.skipped],
            "capture": report.capture,
            "ranks": [
                {
                    "rank": r.rank,
                    "calls": r.calls,
                    "errors": r.errors,
                    "warnings": r.warnings,
                    "complete": r.complete,
                    "first_bad": None if r.first_bad is None else _first_json(report.lines[r.first_bad]),
                }
                for r in report.ranks
            ],
            "findings": [
                {"code": f.code, "severity": f.severity, "message": f.message, "fix": f.fix, "doc": doc_link(f.code)}
                for f in report.findings
            ],
            "known_implementation": report.known,
            "recorded_on": report.recorded_on,
            "first_grad_bad": None
            if report.first_grad_bad is None
            else _first_json(report.lines[report.first_grad_bad]),
            "what_if": [
                {
                    "cell": a.cell,
                    "calls": a.calls,
                    "bad_calls": a.bad_calls,
                    "verdict": a.verdict,
                    "nan_rows": a.nan_rows,
                    "max_abs_err": a.worst_err,
                    "headroom": a.headroom,
                    "limit": _limit_json(a.limit),
                    "findings": a.findings,
                    "first_bad": None if a.first is None else _first_json(a.first),
                }
                for a in report.what_if
            ],
            "kernels": [
                {
                    "index": report.lines[c.position].index,
                    "name": c.name,
                    "summary": kernel_sentence(c),
                    "kernels": [dict(to_jsonable(k), breaks=k.breaks, outcome=kernel_outcome(k)) for k in c.kernels],
                }
                for c in report.kernels
            ],
            "settings": [to_jsonable(c) for c in report.settings],  # --what-if fa4: each grid over the calls
            "settings_refused": [{"grid": g, "calls": n, "why": why} for g, n, why in report.settings_refused],
        }
    )


def _limit_json(limit) -> dict[str, Any] | None:
    """A CellLimit with its headroom (non-finite numbers become null)."""
    return None if limit is None else to_jsonable(dict(to_jsonable(limit), headroom=limit.headroom))


def _first_json(line: ModelLine) -> dict[str, Any]:
    return {
        "index": line.index,
        "rank": line.rank,
        "name": line.name,
        "module": line.module,
        "verdict": line.verdict,
        "first_cause": line.first_cause,
        "heads": line.heads,
        "nan_rows": line.nan_rows,
        "errors": line.errors,
    }


def run_json(
    diags: Sequence[TensorDiagnosis], device: str, failed: Sequence[str] = (), model=None, calls=()
) -> dict[str, Any]:
    """The run's JSON: every tensor's diagnosis and, for files, the ``model`` section (one entry
    per call, the first that goes wrong, outlier heads)."""
    opts = diags[0].settings if diags else None
    return {
        "schema": JSON_SCHEMA,
        "attncheck_version": __version__,
        "device": device,
        "options": None if opts is None else to_jsonable(opts),
        "tensors": [diagnosis_json(d) for d in diags],
        "failed": list(failed),
        "model": None if model is None else model_json(model, list(calls)),
    }
