"""`attncheck explain`: a code's page on stdout, every code without one, and a mistyped code one
line on stderr with the closest codes, exit 2; it never imports torch."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.report.reference import codes_list, codes_table, explain_page, explain_text

runner = CliRunner()


def render(renderable, width=80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_explain_prints_the_codes_page():
    r = runner.invoke(app, ["explain", "sentinel_overflow_on_add"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and r.stdout == render(explain_page("sentinel_overflow_on_add"))
    lines = [line.rstrip() for line in r.stdout.splitlines()]
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    assert "Adding the mask value to a negative score overflows to -inf." in lines
    assert (
        " $ attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value min --dtype fp16" in lines
    )  # the example, wrapped
    assert lines[-1] == "Reference: docs/reference/findings.md#sentinel_overflow_on_add"
    wide = runner.invoke(app, ["explain", "sentinel_overflow_on_add"], env={"COLUMNS": "120"}).stdout
    assert max(len(line) for line in wide.splitlines()) == 120  # wrapped to the terminal's width
    assert runner.invoke(app, ["explain", "EXP_OVERFLOW"], env={"COLUMNS": "80"}).stdout == render(
        explain_page("exp_overflow")
    )


def test_explain_markdown_prints_the_page_source():
    r = runner.invoke(app, ["explain", "sentinel_overflow_on_add", "--markdown"])
    assert r.exit_code == 0 and r.stdout == explain_text("sentinel_overflow_on_add")
    assert r.stdout.startswith(
        "# sentinel_overflow_on_add\n\nAdding the mask value to a negative score overflows to -inf.\n"
    )
    assert "$ attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value min" in r.stdout
    assert r.stdout.endswith("\nReference: docs/reference/findings.md#sentinel_overflow_on_add\n")
    assert runner.invoke(app, ["explain", "--markdown"]).stdout == codes_list()


def test_explain_without_a_code_lists_them_in_80_columns():
    r = runner.invoke(app, ["explain"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and r.stdout == render(codes_table())
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


@pytest.mark.parametrize(
    "typed, line",
    [
        (
            "exp_overflw",
            "attncheck: error: unknown finding code 'exp_overflw': did you mean exp_overflow, fp8_overflow, "
            "qk_overflow?",
        ),
        ("fully_masked", "attncheck: error: unknown finding code 'fully_masked': did you mean fully_masked_rows?"),
        ("bogus", "attncheck: error: unknown finding code 'bogus': 'attncheck explain' lists every code"),
    ],
)
def test_an_unknown_code_is_one_line_with_the_closest_codes(typed, line):
    r = runner.invoke(app, ["explain", typed])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == line + "\n"


def test_explain_imports_no_torch():
    code = (
        "import sys\n"
        "sys.argv = ['attncheck', 'explain', 'exp_overflow', '--markdown']\n"
        "from attncheck.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "sys.exit(3 if 'torch' in sys.modules or 'numpy' in sys.modules else rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == explain_text("exp_overflow")
