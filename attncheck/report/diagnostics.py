"""Findings as compiler diagnostics read (rustc, ruff): a headline with the severity and the code,
where it holds, then indented ``= fix:`` lines, each wrapped at the full width of the terminal with
its later lines indented under it. Tables stay for numbers. Formatting only."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.text import Text

from attncheck.format import rows_text, visible
from attncheck.results.common import Finding

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
HEADLINE_INDENT = 4  # a headline's later lines
WHERE = "  --> "
FIX = "   = fix: "


class Hanging:
    """``prefix`` then ``body``, wrapped to the width: the first line after the prefix, the later ones
    after ``indent`` spaces. A word longer than its line is folded, never cut. With ``max_lines``,
    a body that needs more lines ends its last one with '…' (the one-screen summary)."""

    def __init__(self, prefix: Text, body: Text, indent: int | None = None, max_lines: int | None = None) -> None:
        self.prefix, self.body = prefix, body
        self.indent = prefix.cell_len if indent is None else indent
        self.max_lines = max_lines

    def lines(self, console: Console, width: int) -> list[Text]:
        """The lines the prefix and body take at ``width``, before any ``max_lines`` cut."""
        room = max(width - self.prefix.cell_len, 8)
        body = self.body.copy()
        body.overflow = "fold"
        first = body.wrap(console, room)[0] if body.plain else Text("")
        first.rstrip()
        out = [Text.assemble(self.prefix, first)]
        consumed = len(first.plain)
        rest = body[consumed:]
        skip = len(rest.plain) - len(rest.plain.lstrip(" "))
        rest = rest[skip:]
        if rest.plain:
            for line in rest.wrap(console, max(width - self.indent, 8)):
                line.rstrip()
                out.append(Text.assemble(" " * self.indent, line))
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        out = self.lines(console, width)
        if self.max_lines is not None and len(out) > self.max_lines:
            out = out[: self.max_lines]
            last = out[-1]
            if last.cell_len >= width:  # room for the ellipsis
                last = last[: len(last.plain) - 1]
                last.rstrip()
            out[-1] = Text.assemble(last, "…")
        for line in out:
            line.end = "\n"
            yield line


class Block:
    """A report block: its head wrapped as usual, then one entry per line, each wrapped with its later lines indented
    two spaces under its own (a call's line of the learned sinks or decode steps block). ``plain``: the text, one
    line per entry (as the tests read it)."""

    def __init__(self, head: Text, lines: list[tuple[int, Text]]) -> None:
        self.head, self.lines = head, lines  # (indent, body) per entry

    @property
    def plain(self) -> str:
        return "\n".join([self.head.plain.rstrip("\n")] + [" " * n + body.plain for n, body in self.lines])

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.head
        for n, body in self.lines:
            yield Hanging(Text(" " * n), body, indent=n + 2)


def diagnostic(
    severity: str,
    code: str,
    message: str,
    where: str | None = None,
    fix: str | None = None,
    max_lines: int | None = None,
) -> Group:
    """One finding: 'error[code]: message', then '  --> where' and '   = fix: ...' (names in
    ``message`` and ``where`` are printed as text, never as markup); with ``max_lines``, each part
    at most that many lines."""
    head = Text.assemble((f"{severity}[{code}]", SEVERITY_STYLE.get(severity, "")), ": ")
    parts = [Hanging(head, Text(visible(message)), indent=HEADLINE_INDENT, max_lines=max_lines)]
    if where:
        parts.append(Hanging(Text(WHERE, style="blue"), Text(visible(where)), max_lines=max_lines))
    if fix:
        parts.append(Hanging(Text(FIX, style="blue"), Text(visible(fix)), max_lines=max_lines))
    return Group(*parts)


def where_text(name: str, finding: Finding) -> str:
    """'scores.npy: rows (0,1,4), (0,1,5), ...': the tensor or call and the first rows the finding
    holds in (its message names the cells)."""
    return name + (": rows " + rows_text(finding.examples) if finding.examples else "")


EXPLAIN_HINT = "attncheck explain CODE prints each code's meaning, threshold, example and fix"


def findings_block(name: str, findings: Sequence[Finding]) -> Group:
    """A tensor's findings, one diagnostic each, a blank line between them, and the hint."""
    parts: list = [Text("Findings", style="bold")]
    for f in findings:
        parts += [diagnostic(f.severity, f.code, f.message, where_text(name, f), f.fix), Text("")]
    parts.append(Text(EXPLAIN_HINT, style="dim"))
    return Group(*parts)
