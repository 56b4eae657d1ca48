"""The findings reference, as Markdown, from the registry of codes (``attncheck.codes``): the page
``docs/reference/findings.md`` and what ``attncheck explain CODE`` prints, rendered for a terminal
by Rich (wrapped to its width) or as the Markdown itself. No torch: the page cannot drift from the
code because both come from here, and a test checks that the committed page is what this module
writes."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from attncheck.codes import CODES, GROUPS, REFERENCE_PAGE, REGISTRY, Code

GENERATOR = "scripts/gen_docs.py"

INTRO = """\
Every finding attncheck reports has a stable code, a severity and a fix. A report prints each as
a compiler prints a diagnostic: a headline with the severity and the code (`error[exp_overflow]:
...`), where it holds (`-->`: the tensor or call and its first rows), and an indented `= fix:`. The
JSON report gives `code`, `severity`, `message`, `fix`, `cells`, `rows`, `examples` and `doc`, a
link to the code's section below. `attncheck explain CODE` prints that section in a terminal, and
`attncheck explain` lists every code.

A code is also a word of `--fail-on` (exit 1 when the finding is reported) and of `--ignore`
(left out of the report; the NaN and all-zero rows whose first cause it names no longer count).
**error** means rows are broken (NaN, zeros, overflow); **warning**, a number is wrong or about to
be; **info**, a fact worth knowing that breaks nothing in the cell the model runs.

Each example is small and runs as shown (the tests run every one): the Python writes the input
files into the current directory, and the command reports the code, exiting 1 because of its
`--fail-on`. Examples without a command run attncheck as a library and print the codes found.
"""


def _example(code: Code) -> list[str]:
    ex = code.example
    out = ["**Example:**", "", "```python", ex.python.rstrip("\n"), "```", ""]
    if ex.command:
        out += ["```console", f"$ {ex.command}   # exit 1", "```", ""]
    else:
        out += [f"It prints the codes found, `{code.name}` among them.", ""]
    return out


def code_section(code: Code, level: int = 3) -> str:
    """One code's section: its heading, severity and summary, meaning, threshold, example and fix."""
    severity = f"{code.severity_note}" if code.severity_note else code.severity
    lines = [
        f"{'#' * level} {code.name}",
        "",
        code.summary[0].upper() + code.summary[1:] + ".",
        "",
        f"**Severity:** {severity}",
        "",
        code.meaning,
        "",
        f"**Threshold:** {code.threshold}",
        "",
    ]
    lines += _example(code)
    lines += [f"**Fix:** {code.fix}.", ""]
    return "\n".join(lines)


def findings_reference() -> str:
    """The whole page: an index table, then one section per code, grouped."""
    lines = [
        "# Findings reference",
        "",
        f"<!-- Generated from attncheck/codes.py by {GENERATOR}: edit the registry, not this page. -->",
        "",
        INTRO,
        "| code | severity | what it means |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| [`{c.name}`](#{c.name}) | {c.severities} | {c.summary} |"
        for group in GROUPS
        for c in CODES
        if c.group == group
    ]
    lines.append("")
    for group, title in GROUPS.items():
        lines += [f"## {title}", ""]
        lines += [code_section(c) for c in CODES if c.group == group]
    return "\n".join(lines).rstrip("\n") + "\n"


def explain_text(name: str) -> str:
    """What ``attncheck explain CODE`` prints: the code's section as a page of its own."""
    code = REGISTRY[name]
    return code_section(code, level=1) + f"\nReference: {code.doc}\n"


def codes_list() -> str:
    """What ``attncheck explain --markdown`` prints without a code: every code, its severity and
    summary, as a Markdown table (``codes_table`` renders them for a terminal)."""
    lines = ["| code | severity | what it means |", "| --- | --- | --- |"]
    lines += [f"| `{c.name}` | {c.severities} | {c.summary} |" for group in GROUPS for c in CODES if c.group == group]
    return "\n".join(lines) + f"\n\n`attncheck explain CODE` prints a code's page; all of them: {REFERENCE_PAGE}\n"


def explain_page(name: str):
    """``explain_text`` rendered for a terminal: Rich Markdown, wrapped to the console's width."""
    # rich.markdown (~99 ms): only for 'attncheck explain CODE', not for --help
    from rich.markdown import Markdown

    return Markdown(explain_text(name), code_theme="ansi_dark")


def codes_table():
    """``codes_list`` for a terminal: each group's codes, severity and summary in aligned columns,
    the summary wrapped to the console's width (the code and each severity word never broken)."""
    # rich.table (~12 ms): only for 'attncheck explain', not for --help
    from rich.table import Table

    code_width = max(len(c.name) for c in CODES)
    severity_width = max(len(c.severities) for c in CODES)  # every group's columns line up
    parts: list = []
    for group, title in GROUPS.items():
        t = Table.grid(padding=(0, 2))
        t.add_column(no_wrap=True, min_width=code_width)
        t.add_column(min_width=severity_width)
        t.add_column()
        for c in CODES:
            if c.group == group:
                t.add_row(c.name, c.severities, c.summary)
        parts += [Text(title, style="bold"), t, Text("")]
    parts.append(Text(f"attncheck explain CODE prints a code's page; all of them: {REFERENCE_PAGE}"))
    return Group(*parts)
