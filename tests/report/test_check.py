"""`attncheck check`'s summary: at 80 columns every budget's number is shown whole, the
budgets going to a second table when they do not fit side by side."""

from __future__ import annotations

import io

from rich.console import Console

from attncheck.config.check import parse_table
from attncheck.format import num, row_text, rows_text
from attncheck.pipelines.check import run_check
from attncheck.report.check import print_summary


def test_every_budget_fits_80_columns():
    cfg = parse_table(
        {
            "synthetic": [{"d_k": 16, "seq": 32, "rows": 32, "scale": "none", "std": 3.0}],
            "methods": ["naive", "stable", "tiled", "torch"],
            "budget": {
                "nan": 0,
                "overflow": 0,
                "zero_rows": 0,
                "argmax_flips": 0,
                "max_abs_err": 0.01,
                "max_abs_err_algo": 0.01,
                "rmse": 0.001,
                "kl_max": 0.001,
                "relative_to_torch": 2.0,
            },
        }
    )
    result = run_check(cfg)
    buf = io.StringIO()
    print_summary(Console(width=80, file=buf, color_system=None), result)
    text = buf.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for name in ("max_abs_err_algo", "argmax_flips", "kl_max", "rmse"):
        assert name in text.split()
    words = text.split()
    for case in result.cases:  # every measured error, whole
        for c in case.checks:
            if c.measured is not None and c.budget in ("max_abs_err", "max_abs_err_algo", "rmse", "kl_max"):
                assert num(c.measured) in words, (case.name, c.budget)


def test_rows_are_written_the_same_way_everywhere():
    assert row_text((0, 5, 1)) == "(0,5,1)" and row_text((5,)) == "5"
    assert rows_text([(0, 5, 1), (0, 5, 2)]) == "(0,5,1), (0,5,2)"
