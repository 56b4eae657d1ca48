"""The model report's what-if table (each call under each dtype, method or setting asked for) and its kernel
replays block (each kernel path run on the calls, and what each outcome means). Formatting only."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck.format import fmt, plain, visible
from attncheck.report.diagnostics import Hanging
from attncheck.report.fit import Fitted, fitted, narrow_table
from attncheck.report.model_calls import VERDICT_STYLE, call_label
from attncheck.report.text import shown
from attncheck.results import CallReport, ModelReport

WHAT_IF_NARROWEST = 4  # the what-if table's last layout: its findings listed under it


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
