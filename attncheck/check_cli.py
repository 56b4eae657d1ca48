"""``attncheck check``: read the [tool.attncheck] config, check every input against its
budgets, write the reports CI understands, exit 0 / 1 / 2.

The config is found, parsed and checked (inputs globbed, output folders checked)
before torch is imported, so a bad config fails in milliseconds with one line.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Optional

import typer

from attncheck.check_config import find_config, load_config
from attncheck.cliutil import EXIT_FAILED, EXIT_OK, check_output_path, fail, write_json
from attncheck.errors import AttncheckError
from attncheck.names import DEVICES
from attncheck.sweep_config import parse_name

STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


def _write_text(text: str, path: str, option: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        raise AttncheckError(f"cannot write {option} {path}: {e.strerror or e}") from None


def _append_step_summary(text: str) -> None:
    """Add the Markdown to the job summary of GitHub Actions; a failure here only warns."""
    target = os.environ.get(STEP_SUMMARY)
    if not target:
        return
    try:
        with open(target, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
    except OSError as e:
        typer.echo(f"attncheck: warning: cannot append to ${STEP_SUMMARY} ({target}): {e.strerror or e}", err=True)


def check(
    config: Optional[str] = typer.Option(
        None, "--config", "-c", metavar="FILE",
        help="pyproject.toml with \\[tool.attncheck], or an attncheck.toml whose top level is that table. "
        "Default: the first attncheck.toml, or pyproject.toml with \\[tool.attncheck], from the current directory up.",
    ),
    junit: Optional[str] = typer.Option(None, "--junit", metavar="FILE", help="Write JUnit XML: one testcase per input x cell, failures carry the numbers."),
    markdown: Optional[str] = typer.Option(None, "--markdown", metavar="FILE", help=f"Write a Markdown summary (also appended to ${STEP_SUMMARY} when it is set)."),
    json_out: Optional[str] = typer.Option(None, "--json", metavar="FILE", help="Write the results as JSON to FILE ('-' for stdout: the summary is then not printed)."),
    device: Optional[str] = typer.Option(None, "--device", metavar="NAME", help="Where to compute: cpu, auto (cuda if available), cuda. Default: the config's device (cpu)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the broken budgets and the verdict line, not the table."),
) -> None:
    """Check attention inputs against error budgets, for CI.

    Reads \\[tool.attncheck] (inputs, synthetic configs, dtypes, methods, budget),
    diagnoses every input and checks every method x dtype cell against the budget:
    NaN and overflow rows, errors against float64, and FlashAttention's rule
    relative_to_torch (error at most N x torch.softmax's in the same dtype).
    Exit codes: 0 every budget holds, 1 a budget broke, 2 configuration or input error
    (or an internal error, so that 1 always means a budget).
    """
    try:
        if device is not None:
            device = parse_name(device, DEVICES, "--device")
        cfg = load_config(config) if config is not None else load_config(find_config())
        check_output_path(junit, "--junit", dash_ok=False)
        check_output_path(markdown, "--markdown", dash_ok=False)
        check_output_path(json_out, "--json", dash_ok=True)
        from attncheck.checks import run_check  # torch comes in here, once the config is known to be good

        result = run_check(cfg, device)
    except AttncheckError as e:
        raise fail(str(e)) from None
    except Exception as e:  # a bug, not a broken budget: exit 1 must keep meaning "a budget broke"
        traceback.print_exc()
        raise fail(f"internal error: {type(e).__name__}: {e} (a bug in attncheck; please report it with the traceback above)") from None

    from attncheck.check_report import check_json, junit_xml, markdown as to_markdown, print_summary

    md = to_markdown(result)
    try:
        if junit is not None:
            _write_text(junit_xml(result), junit, "--junit")
        if markdown is not None:
            _write_text(md, markdown, "--markdown")
        if json_out is not None:
            write_json(json.dumps(check_json(result), indent=2, allow_nan=False), json_out)
    except AttncheckError as e:
        raise fail(str(e)) from None
    _append_step_summary(md)

    if json_out != "-":
        from rich.console import Console

        print_summary(Console(), result, quiet=quiet)
    for case in result.failures:
        for c in case.failures:
            typer.echo(f"attncheck: budget broken: {case.input} {case.name}: {c.describe()}", err=True)
    raise typer.Exit(EXIT_FAILED if result.failures else EXIT_OK)
