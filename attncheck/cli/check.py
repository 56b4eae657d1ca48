"""``attncheck check``: read the [tool.attncheck] config, check every input against its
budgets, write the reports CI understands, exit 0 / 1 / 2.

The config is found, parsed and checked (inputs globbed, output folders checked)
before torch is imported, so a bad config fails in milliseconds with one line.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Annotated, Optional

import typer

from attncheck import params
from attncheck.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    check_output_path,
    fail,
    one_stdout,
    open_output,
    out_of_memory,
    report_console,
    require_stdout,
    say,
    write_json,
    write_text,
)
from attncheck.cli.options import DeviceOpt, JsonOpt, QuietOpt, notices, progress_shown
from attncheck.config.check import find_config, load_config
from attncheck.errors import AttncheckError
from attncheck.report.progress import Progress

STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


def _append_step_summary(text: str) -> None:
    """Add the Markdown to the job summary of GitHub Actions; a failure here only warns."""
    target = os.environ.get(STEP_SUMMARY)
    if not target:
        return
    try:
        with open_output(target, "a") as fh:  # a FIFO nobody reads is refused, not waited on
            fh.write(text + "\n")
    except OSError as e:
        say(f"attncheck: warning: cannot append to ${STEP_SUMMARY} ({target}): {e.strerror or e}")


def check(
    config: Optional[str] = typer.Option(
        None,
        "--config",
        "-c",
        metavar="FILE",
        help="pyproject.toml with \\[tool.attncheck], or an attncheck.toml whose top level is that table. "
        "Default: the first attncheck.toml, or pyproject.toml with \\[tool.attncheck], from the current directory up.",
    ),
    junit: Optional[str] = typer.Option(
        None,
        "--junit",
        metavar="FILE",
        help=(
            "Write JUnit XML: one testcase per input x cell, failures carry the numbers ('-' for stdout: the "
            "summary is then not printed)."
        ),
    ),
    markdown: Optional[str] = typer.Option(
        None,
        "--markdown",
        metavar="FILE",
        help=f"Write a Markdown summary (also appended to ${STEP_SUMMARY} when it is set; '-' for stdout).",
    ),
    json_out: JsonOpt = None,
    device: Annotated[Optional[str], DeviceOpt.__metadata__[0]] = None,
    quiet: QuietOpt = False,
) -> None:
    """Check attention inputs against error budgets, for CI.

    Reads \\[tool.attncheck] (inputs, synthetic configs, dtypes, methods, budget), diagnoses every input and checks every method x dtype cell against the budget: NaN and overflow rows, errors against float64, and FlashAttention's rule relative_to_torch (error at most N x torch.softmax's in the same dtype).

    Exit codes: 0 every budget holds, 1 a budget broke, 2 configuration or input error (or an internal error, so that 1 always means a budget).
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        require_stdout()  # every report ends on standard output: refuse a closed one before any work
        if device is not None:
            device = params.device(device)
        cfg = load_config(config) if config is not None else load_config(find_config())
        one_stdout(junit=junit, markdown=markdown, json=json_out)
        check_output_path(junit, "--junit")
        check_output_path(markdown, "--markdown")
        check_output_path(json_out, "--json")
        from attncheck.pipelines.check import run_check  # torch comes in here, once the config is known to be good

        show, forced = progress_shown(quiet)
        with Progress(show, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
            result = run_check(cfg, device, progress.track, notices(quiet))
    except AttncheckError as e:
        raise fail(e) from None
    except Exception as e:  # a bug, not a broken budget: exit 1 must keep meaning "a budget broke"
        if out_of_memory(e) is not None:
            raise fail(out_of_memory(e)) from None
        traceback.print_exc()
        raise fail(
            f"internal error: {type(e).__name__}: {e} (a bug in attncheck; please report it with the traceback above)"
        ) from None

    # the report modules (~15 ms of rich tables): not for --help or a bad argument
    from attncheck.report.check import check_json, describe_check, junit_xml, print_summary
    from attncheck.report.check import markdown as to_markdown

    md = to_markdown(result)
    try:
        if junit is not None:
            write_text(junit_xml(result), junit, "--junit")
        if markdown is not None:
            write_text(md, markdown, "--markdown")
        if json_out is not None:
            write_json(json.dumps(check_json(result), indent=2, allow_nan=False), json_out)
    except AttncheckError as e:
        raise fail(e) from None
    _append_step_summary(md)

    if "-" not in (json_out, junit, markdown):
        print_summary(report_console(), result, quiet=quiet)
    for case in result.failures:
        for c in case.failures:
            say(f"attncheck: budget broken: {case.input} {case.name}: {describe_check(c)}")
    raise typer.Exit(EXIT_FAILED if result.failures else EXIT_OK)
