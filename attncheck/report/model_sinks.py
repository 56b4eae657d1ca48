"""The model report's learned sinks (gpt-oss): per call, each head's share of the denominator, whether the sink
changes the output in the call's dtype, and (``--what-if nosinks`` or ``kernels``) what a kernel that drops the sinks
would compute instead. A module's decode steps (``ModelReport.decode``) are folded into one line, as in the calls
table. Formatting only."""

from __future__ import annotations

import math
import statistics

from rich.text import Text

from attncheck.format import plain, visible
from attncheck.report.diagnostics import Block
from attncheck.results import CallReport, DecodeRun
from attncheck.results.sinks import SinkHead

HEADS_LISTED = 16  # a call with more heads shows the range of their shares (each head's is in the JSON)
CALLS_LISTED = 12


def _worst(values: list[float]) -> float:
    """The largest, NaN where any is (Python's max would keep or drop a NaN by its place)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _heads(reports: list[CallReport]) -> list[list[SinkHead]]:
    """Each head's facts over the reports (one call, or a module's decode steps)."""
    return [list(group) for group in zip(*(c.sinks.heads for c in reports))]


def _share(per: list[SinkHead]) -> str:
    if any(math.isnan(h.sink) for h in per):
        return "NaN sink"
    return plain(_worst([h.share_max for h in per]))


def _shares(heads: list[list[SinkHead]]) -> str:
    if len(heads) <= HEADS_LISTED:
        return "  ".join(f"h{per[0].head} {_share(per)}" for per in heads)
    top = [_worst([h.share_max for h in per]) for per in heads]
    return f"{len(heads)} heads: min {plain(min(top))}, median {plain(statistics.median(top))}, max {plain(max(top))}"


def _masked(reports: list[CallReport]) -> str:
    rows = max(h.masked_rows for c in reports for h in c.sinks.heads)
    if not rows:
        return ""
    return (
        f"; {rows} row(s) per head see no key (padding): there the sink takes the whole denominator (share 1, "
        "output 0), left out of the shares"
    )


def _nan(x: float) -> str:
    return "NaN (NaN in the call's scores or sinks)" if math.isnan(x) else plain(x)


def _line(label: str, reports: list[CallReport]) -> tuple[str, str]:
    """One call's line, or one module's decode steps', and its style."""
    heads = _heads(reports)
    f = reports[0].sinks
    changed = sum(any(h.changed for h in c.sinks.heads) for c in reports)
    steps = "" if len(reports) == 1 else f" (in {changed} of {len(reports)} steps)"
    nan = [per[0].head for per in heads if any(math.isnan(h.sink) for h in per)]
    moved = sum(1 for per in heads if any(h.changed for h in per))
    effect = (
        "changes nothing in any head" if not moved else f"changes the output in {moved} of {len(heads)} heads{steps}"
    )
    head = f"{label} ({f.dtype}): {_shares(heads)}{_masked(reports)}; "
    if nan:
        return (
            head + f"the sink is NaN in head(s) {', '.join(map(str, nan))}: the cell's output is NaN there, its "
            "share and error have no value",
            "red",
        )
    blank = [per[0].head for per in heads if any(math.isnan(h.share_max) for h in per)]
    if blank:
        return (
            head + f"the scores hold NaN in head(s) {', '.join(map(str, blank))}: no share or error there (the "
            "call's input_nan finding)",
            "red",
        )
    every = [h for per in heads for h in per]
    if any(c.sinks.ignored for c in reports):  # the call computed the cell without them: what they would change
        return (
            head
            + f"DROPPED by its SDPA call: the sink {effect} (up to {_nan(_worst([h.diff_nosinks for h in every]))})"
            f"; the call's err against float64 with them {_nan(_worst([h.err_nosinks for h in every]))}",
            "red" if moved else "",
        )
    return head + f"the sink {effect}; output err {_nan(_worst([h.err_model for h in every]))}", ""


def _entries(sunk: list[CallReport], decode: list[DecodeRun], prefix: str) -> list[tuple[str, list[CallReport]]]:
    """(label, reports) in call order: each call alone, a module's decode steps together."""
    step_run = {i: n for n, run in enumerate(decode) for i in run.steps}
    runs: dict[int, list[CallReport]] = {}
    out: list[tuple[str, list[CallReport]]] = []
    for c in sunk:
        name = visible(c.call.module.removeprefix(prefix) or c.call.name)
        n = step_run.get(c.call.index)
        if n is None:
            out.append((f"#{c.call.index} {name}", [c]))
        elif n in runs:
            runs[n].append(c)
        else:
            runs[n] = [c]
            out.append((name, runs[n]))
    return [(_run_label(label, reports), reports) for label, reports in out]


def _run_label(name: str, reports: list[CallReport]) -> str:
    """A single call's label as it is; a module's steps as the calls table labels them."""
    if name.startswith("#"):
        return name
    first, last = reports[0].call.index, reports[-1].call.index
    return f"#{first}-#{last} {name} decode x{len(reports)}"


def sinks_block(calls: list[CallReport], prefix: str = "", decode: list[DecodeRun] | None = None) -> Block | None:
    """The calls with learned sinks, one line each (a module's decode steps in one, and one for the what-if where
    asked); None without any."""
    sunk = [c for c in calls if c.sinks is not None and c.sinks.heads]
    if not sunk:
        return None
    first = sunk[0].sinks
    head = Text(
        "Learned sinks: each head's share of the float64 denominator, exp(sink - m) / (sum exp(s - m) + exp(sink - "
        f"m)), max over rows (over a module's decode steps where folded; {first.dtype} rounding: "
        f"{plain(first.rounding)}); output error of the model's cell against float64:"
    )
    lines: list[tuple[int, Text]] = []
    entries = _entries(sunk, decode or [], prefix)
    for label, reports in entries[:CALLS_LISTED]:
        line, style = _line(label, reports)
        lines.append((2, Text(line, style=style)))
        f = reports[0].sinks
        if f.nosinks and not f.ignored:
            every = [h for c in reports for h in c.sinks.heads]
            changed = sum(h.changed for h in every)
            said = (
                f"what if a kernel drops them (nosinks): err {_nan(_worst([h.err_nosinks for h in every]))} "
                f"against float64, {_nan(_worst([h.diff_nosinks for h in every]))} from the model's cell "
                f"({changed} of {sum(c.sinks.elements * len(c.sinks.heads) for c in reports)} outputs differ)"
            )
            lines.append((4, Text(said, style="yellow" if changed else "")))
    left = sum(1 for c in sunk if c.sinks.grads_left_out)
    if left:
        said = (
            f"the gradients of {left} call(s) with sinks were recorded; their backward with the sinks is not "
            "computed yet (not judged)"
        )
        lines.append((2, Text(said, style="yellow")))
    if len(entries) > CALLS_LISTED:
        lines.append((2, Text(f"... {len(entries) - CALLS_LISTED} more in the JSON report")))
    return Block(head, lines)
