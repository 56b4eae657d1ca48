"""The model report's layer x head matrix: one mark per head of each call (the heads a finding names), fitted to
the terminal's width. Formatting only."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from attncheck.findings import counted_rows
from attncheck.findings.activations import SINK_EPSILON
from attncheck.report.fit import Fitted, fitted, natural_width
from attncheck.report.model_calls import call_label
from attncheck.report.text import shown
from attncheck.results import CallReport, ModelLine, ModelReport

MAX_HEAD_COLUMNS = 32


MATRIX_HEADS_FIRST = 8  # heads the layer x head table keeps beside the calls' names before it shortens them


HEAD_LEGEND = (
    "Layer x head: the largest logit (k = thousands); Nn = n NaN rows in the model's cell; ovf = Q@K^T overflows "
    "the call's dtype; * = outlier q/k; s = attention sink; c = outlier channel of q, k or v"
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
    activity: dict[tuple[int, int], str] = {}
    for m in report.head_marks:
        tag = "s" if m.what == "sink" else "c"
        key = (m.position, m.head)
        activity[key] = "".join(sorted(set(activity.get(key, "") + tag), reverse=True))  # 'sc'
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
            star = activity.get((at, h.head), "") + ("*" if (at, h.head) in marked else "")  # 33sc*
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


def flagged_heads(calls: list[CallReport], report: ModelReport) -> list[int]:
    """Heads with NaN rows, a Q@K^T overflow, an outlier q/k, a sink or an outlier channel in some call: a narrow
    table shows them."""
    marked = {h for o in report.outliers for h in (o.query_heads or [o.head])} | {m.head for m in report.head_marks}
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


MARKS_SHOWN = 12  # sink and outlier-channel heads listed; the JSON has every one


def activity_block(report: ModelReport, prefix: str = "") -> Text | None:
    """The model's sink rate (sail-sg/Attention-Sink's definition) and the heads marked s and c, listed."""
    if not report.sink_pairs and not report.head_marks:
        return None
    text = Text()
    if report.sink_pairs:
        text.append(
            f"Sink rate {report.sink_rate:.0%}: {report.sink_hits} of {report.sink_pairs} (batch, call, head) "
            f"triples give the first token an importance > {SINK_EPSILON:g} (its attention averaged over the queries "
            "that see it; sail-sg/Attention-Sink's definition)\n"
        )
    if report.head_marks:
        text.append(
            "Attention sinks (s) and outlier channels (c) (info; share of the queries that see the key, uniform: what "
            "attention spread over each query's visible keys would give; channel: max |x| against its head's median "
            "channel):\n"
        )
        for m in report.head_marks[:MARKS_SHOWN]:
            where = ("" if m.rank is None else f"r{m.rank} ") + shown(m.module.removeprefix(prefix)).plain
            text.append(f"  #{m.index} {where} ({m.what}) {m.message}\n")
        if len(report.head_marks) > MARKS_SHOWN:
            text.append(f"  ... {len(report.head_marks) - MARKS_SHOWN} more in the JSON report (model.head_marks)\n")
    text.rstrip()
    return text
