"""``attncheck explain [CODE]``: print a finding code's reference page, generated from the registry of
codes (``attncheck.codes``), or list every code: rendered for the terminal (Rich, wrapped to its
width), or as Markdown with --markdown. Nothing numeric is imported."""

from __future__ import annotations

from typing import Optional

import typer

from attncheck.cli.common import EXIT_OK, fail, report_console, write_stdout
from attncheck.codes import REGISTRY, closest_codes
from attncheck.report.reference import codes_list, codes_table, explain_page, explain_text


def explain(
    code: Optional[str] = typer.Argument(
        None,
        metavar="CODE",
        help="A finding code, e.g. exp_overflow; without it, every code with its severity and what it means.",
        show_default=False,
    ),
    markdown: bool = typer.Option(
        False,
        "--markdown",
        help=(
            "Print the page's Markdown source (as docs/reference/findings.md holds it) instead of rendering it for "
            "the terminal."
        ),
    ),
) -> None:
    """Print what a finding code means: the threshold behind it, a minimal example that triggers it, and the fix.

    The same page as the findings reference (docs/reference/findings.md), which the JSON report links from each finding's doc field.

    Exit codes: 0 printed, 2 unknown code.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    if code is None:
        if markdown:
            write_stdout(codes_list())
        else:
            report_console().print(codes_table())
        raise typer.Exit(EXIT_OK)
    name = code.strip()
    name = name.lower() if name.lower() in REGISTRY else name
    if name not in REGISTRY:
        near = closest_codes(name.lower())
        hint = f"did you mean {', '.join(near)}?" if near else "'attncheck explain' lists every code"
        raise fail(f"unknown finding code '{name}': {hint}")
    if markdown:
        write_stdout(explain_text(name))
    else:
        report_console().print(explain_page(name))
    raise typer.Exit(EXIT_OK)
