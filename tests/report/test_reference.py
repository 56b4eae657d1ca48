"""The findings reference is generated from the registry of codes: the committed page is what the
generator writes, each code has its section, and `attncheck explain CODE` prints that section."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from attncheck.codes import CODES, GROUPS, REFERENCE_PAGE
from attncheck.report.reference import (
    code_section,
    codes_list,
    codes_table,
    explain_page,
    explain_text,
    findings_reference,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_up_to_date():
    assert (ROOT / REFERENCE_PAGE).read_text() == findings_reference(), "run: python scripts/gen_docs.py"


def test_every_code_has_one_section_under_its_group_and_a_row_in_the_index():
    page = findings_reference()
    headings = re.findall(r"^(#{2,3}) (.+)$", page, flags=re.M)
    assert [t for level, t in headings if level == "##"] == list(GROUPS.values())
    assert [t for level, t in headings if level == "###"] == [c.name for g in GROUPS for c in CODES if c.group == g]
    for c in CODES:
        assert f"| [`{c.name}`](#{c.name}) | {c.severities} | {c.summary} |" in page
        assert code_section(c) in page


def test_a_section_reads_in_order():
    exp = next(c for c in CODES if c.name == "exp_overflow")
    text = code_section(exp)
    assert text.startswith("### exp_overflow\n\nExp of a finite score overflows to inf.\n\n**Severity:** error\n\n")
    order = [
        text.index(part)
        for part in (
            exp.meaning,
            "**Threshold:** " + exp.threshold,
            "```python\n",
            "```console\n$ " + exp.example.command + "   # exit 1\n```",
            "**Fix:** " + exp.fix + ".",
        )
    ]
    assert order == sorted(order)
    masked = code_section(next(c for c in CODES if c.name == "fully_masked_rows"))
    assert "**Severity:** warning where a cell turns the rows into NaN, else info" in masked


def test_explain_text_is_the_section_as_a_page():
    for c in CODES:
        text = explain_text(c.name)
        assert text == "#" + code_section(c)[3:] + f"\nReference: docs/reference/findings.md#{c.name}\n"


def test_codes_list_names_each_code_once():
    lines = codes_list().splitlines()
    for c in CODES:
        (line,) = [ln for ln in lines if ln.startswith(f"| `{c.name}` |")]
        assert line == f"| `{c.name}` | {c.severities} | {c.summary} |"


def render(renderable, width=80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_the_codes_table_fits_80_columns_with_every_code_whole():
    text = render(codes_table())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[:4] == [
        "The scores as given",
        "input_nan                   error             a row of the scores holds NaN     ",
        "                                              before any softmax runs           ",
        "inf_input                   error             a row of the scores holds +inf    ",
    ]
    for c in CODES:  # each on a line of its own, its severity beside it, its summary's words in order
        (line,) = [ln for ln in lines if ln.split()[:1] == [c.name]]
        start = lines.index(line)
        assert line.split()[1] == c.severities.split()[0]
        words = " ".join(ln[46:].strip() for ln in lines[start : start + 4]).split()
        assert words[: len(c.summary.split())] == c.summary.split()
    assert [ln for ln in lines if ln and not ln.startswith(" ")][0] == "The scores as given"
    assert all(title in lines for title in GROUPS.values())


def test_a_codes_page_is_wrapped_markdown_at_80_columns():
    text = render(explain_page("sentinel_overflow_on_add"))
    lines = [line.rstrip() for line in text.splitlines()]
    assert max(len(line) for line in text.splitlines()) <= 80
    assert lines[0].strip() == "sentinel_overflow_on_add"  # the heading, without its '#'
    assert "Adding the mask value to a negative score overflows to -inf." in lines
    assert "**" not in text and "```" not in text  # Markdown rendered, not shown
    assert lines[-1] == "Reference: docs/reference/findings.md#sentinel_overflow_on_add"
