"""Tables that fit the terminal they print at: a table is built for the width it is given (``Fitted``),
in the first of its layouts that fits (``fitted``): as it is, two-word headers on two lines, one
space between columns, then with its names shortened, first by the dotted parts no name differs in,
then in the middle of their words. Formatting only."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table

MIN_LABEL = 12  # a call's name is never shortened below this many characters


def constant_parts(labels: list[str]) -> list[str]:
    """Inner dotted parts of a name that every name of its depth holds at that place and that are not
    numbers ('block', 'layer' in T5's 'encoder.block.0.layer.0.SelfAttention'): they tell no call
    from another, so a table short of room leaves them out (and says so)."""
    by_depth: dict[int, list[list[str]]] = {}
    for label in labels:
        parts = label.split(".")
        by_depth.setdefault(len(parts), []).append(parts)
    out = []
    for depth, names in by_depth.items():
        for i in range(1, depth - 1):
            values = {parts[i] for parts in names}
            if len(values) == 1 and not names[0][i].isdigit() and names[0][i] not in out:
                out.append(names[0][i])
    return out


def without_parts(label: str, dropped: list[str]) -> str:
    parts = label.split(".")
    kept = [p for i, p in enumerate(parts) if i in (0, len(parts) - 1) or p not in dropped]
    return ".".join(kept)


def middle_ellipsis(label: str, width: int) -> str:
    """``label`` in at most ``width`` characters, shortened in the middle of its words: the longest
    dotted part that is not a number loses its end to '…' first, so that layer numbers and the start
    of every part stay ('encoder.0.0.SelfAttention' -> 'encoder.0.0.SelfAtt…'); a label with nothing
    left to trim keeps its start and its end around '…'."""
    if len(label) <= width:
        return label
    parts = label.split(".")
    keep = [len(p) for p in parts]  # characters of each part kept ('…' added where fewer than all)

    def length() -> int:
        return sum(k + (k < len(p)) for k, p in zip(keep, parts)) + len(parts) - 1

    while length() > width:
        trimmable = [i for i, p in enumerate(parts) if not p.isdigit() and keep[i] > 2]
        if not trimmable:
            tail = (width - 1) * 3 // 5
            return label[: width - 1 - tail] + "…" + label[len(label) - tail :]
        i = max(trimmable, key=lambda i: (keep[i], i))  # the longest; of equals, the later
        keep[i] -= 1 if keep[i] < len(parts[i]) else 2  # the first cut makes room for the '…' too
    return ".".join(p if k == len(p) else p[:k] + "…" for k, p in zip(keep, parts))


def natural_width(console: Console, table: Table, width: int) -> int:
    """The width ``table`` takes with no word broken: every cell of a no-wrap column on one line, the
    cells of the others at their longest word."""
    options = console.options.update_width(10 * width)
    whole = Measurement.get(console, options, table).maximum
    for column in table.columns:
        cells = [column.header, *column.cells]
        widest = max(Measurement.get(console, options, c).maximum for c in cells)
        if not column.no_wrap:  # wraps between words
            need = max(max(Measurement.get(console, options, c).minimum for c in cells), column.min_width or 0)
            whole -= widest - min(need, widest)
    return whole


class Fitted:
    """A renderable built for the width it is printed at (tables that fit the terminal)."""

    def __init__(self, build) -> None:
        self.build = build  # (console, width) -> list of renderables

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.build(console, options.max_width)


def narrow_table(narrow: int = 0) -> Table:
    """A report table: a line under the header, no side borders; two spaces between columns, or from
    ``narrow`` 2 on one, and no margin."""
    if narrow < 2:
        return Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    return Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, collapse_padding=True, show_edge=False)


NARROWEST = 3  # the last layout (``narrow``): 1 two-line headers, 2 one space between columns, 3 the table's own


def fitted(console: Console, width: int, labels: list[str], build, narrowest: int = NARROWEST) -> tuple[Any, list[str]]:
    """``build(labels, narrow)`` -> a table, in the first layout that fits ``width``: as it is, then
    narrower (``narrow`` 1 to ``narrowest``), then in the narrowest with the labels shortened as
    little as lets it fit: first the parts no name differs in left out, then the words in the middle
    of each name. Returns the table and the parts left out."""
    for narrow in range(narrowest + 1):
        table = build(labels, narrow)
        if natural_width(console, table, width) <= width:
            return table, []
    dropped = constant_parts(labels)
    short = [without_parts(label, dropped) for label in labels] if dropped else labels
    used = [p for p in dropped if any(p in label.split(".")[1:-1] for label in labels)]
    table = build(short, narrowest)
    longest = max((len(label) for label in short), default=0)
    if natural_width(console, table, width) <= width or longest <= MIN_LABEL:
        return table, used
    lo, hi = MIN_LABEL, longest
    while lo < hi:  # the widest label width at which the table fits
        mid = (lo + hi + 1) // 2
        if natural_width(console, build([middle_ellipsis(x, mid) for x in short], narrowest), width) <= width:
            lo = mid
        else:
            hi = mid - 1
    return build([middle_ellipsis(x, lo) for x in short], narrowest), used


def narrowed(table: Table, narrow: int) -> Table:
    """``table`` (a report table, built wide) in a narrower layout: from ``narrow`` 1 its headers'
    words on lines of their own, from 2 one space between columns and no margin."""
    if narrow >= 1:
        for column in table.columns:
            if isinstance(column.header, str):
                column.header = column.header.replace(" / ", "/\n").replace(" ", "\n")
    if narrow >= 2:
        table.padding = (0, 0)
        table.show_edge = False
    return table


def fit_table(build) -> Fitted:
    """``build()`` -> a table, printed in the first of ``narrowed``'s layouts that fits the terminal."""

    def layouts(console: Console, width: int) -> list:
        for narrow in range(3):
            table = narrowed(build(), narrow)
            if natural_width(console, table, width) <= width:
                break
        return [table]

    return Fitted(layouts)
