"""``attncheck explain [CODE]``: print a finding code's reference page, generated from the registry of
codes (``attncheck.codes``), or list every code. Text only: nothing numeric is imported."""

from __future__ import annotations

from typing import Optional

import typer

from attncheck.cli.common import EXIT_OK, fail, write_stdout


def explain(
    code: Optional[str] = typer.Argument(None, metavar="CODE", help="A finding code, e.g. exp_overflow; without it, every code with its severity and what it means.", show_default=False),
) -> None:
    """Print what a finding code means: the threshold behind it, a minimal example that triggers it, and the fix.

    The same page as the findings reference (docs/reference/findings.md), which the JSON report links from each finding's doc field.

    Exit codes: 0 printed, 2 unknown code.
    """
    from attncheck.codes import REGISTRY, closest_codes
    from attncheck.report.reference import codes_list, explain_text

    if code is None:
        write_stdout(codes_list())
        raise typer.Exit(EXIT_OK)
    name = code.strip()
    name = name.lower() if name.lower() in REGISTRY else name
    if name not in REGISTRY:
        near = closest_codes(name.lower())
        hint = f"did you mean {', '.join(near)}?" if near else "'attncheck explain' lists every code"
        raise fail(f"unknown finding code '{name}': {hint}")
    write_stdout(explain_text(name))
    raise typer.Exit(EXIT_OK)
