"""`attncheck explain`: a code's page on stdout, every code without one, and a mistyped code one
line on stderr with the closest codes, exit 2; it never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.report.reference import codes_list, explain_text

runner = CliRunner()


def test_explain_prints_the_codes_page():
    r = runner.invoke(app, ["explain", "sentinel_overflow_on_add"])
    assert r.exit_code == 0 and r.stdout == explain_text("sentinel_overflow_on_add")
    assert r.stdout.startswith("# sentinel_overflow_on_add\n\nAdding the mask value to a negative score overflows to -inf.\n")
    assert "$ attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value min" in r.stdout
    assert r.stdout.endswith("\nReference: docs/reference/findings.md#sentinel_overflow_on_add\n")
    assert runner.invoke(app, ["explain", "EXP_OVERFLOW"]).stdout == explain_text("exp_overflow")


def test_explain_without_a_code_lists_them():
    r = runner.invoke(app, ["explain"])
    assert r.exit_code == 0 and r.stdout == codes_list()


@pytest.mark.parametrize("typed, line", [
    ("exp_overflw", "attncheck: error: unknown finding code 'exp_overflw': did you mean exp_overflow, fp8_overflow, qk_overflow?"),
    ("fully_masked", "attncheck: error: unknown finding code 'fully_masked': did you mean fully_masked_rows?"),
    ("bogus", "attncheck: error: unknown finding code 'bogus': 'attncheck explain' lists every code"),
])
def test_an_unknown_code_is_one_line_with_the_closest_codes(typed, line):
    r = runner.invoke(app, ["explain", typed])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == line + "\n"


def test_explain_imports_no_torch():
    code = (
        "import sys\n"
        "sys.argv = ['attncheck', 'explain', 'exp_overflow']\n"
        "from attncheck.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "sys.exit(3 if 'torch' in sys.modules or 'numpy' in sys.modules else rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == explain_text("exp_overflow")
