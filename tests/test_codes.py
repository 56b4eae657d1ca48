"""The registry of finding codes (attncheck/codes.py, attncheck/findings/): every code the findings make is in it with
each part of its reference page, and every code's example, run as written, makes attncheck report
that code."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attncheck.codes import (
    CAUSES_OF,
    CODES,
    FIX,
    GRAD_CAUSES_OF,
    GROUPS,
    REGISTRY,
    SEVERITIES,
    SEVERITY,
    closest_codes,
    doc_link,
)

PACKAGE = Path(__file__).resolve().parents[1] / "attncheck"
# Where codes are made: findings (add("code", ...)) and the watch's alerts (_alert("code", ...),
# WatchAlert("code", ...)).
MAKERS = {path: ("add",) for path in sorted((PACKAGE / "findings").glob("*.py"))}
MAKERS[PACKAGE / "watcher" / "trends.py"] = ("_alert", "WatchAlert")


def codes_the_findings_make() -> set[str]:
    """The first argument of every call that makes a finding or an alert."""
    found = set()
    for path, names in MAKERS.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in names and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.add(first.value)
    return found


def test_the_registry_holds_every_code_the_findings_make_and_no_other():
    assert codes_the_findings_make() == set(REGISTRY)
    assert len(CODES) == len(REGISTRY)  # no code registered twice


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.name)
def test_each_entry_has_every_part_of_its_page(code):
    assert code.severity in SEVERITIES and code.group in GROUPS
    assert code.also in ("", *SEVERITIES) and code.also != code.severity
    assert bool(code.also) == bool(code.severity_note)  # a second severity is said when it applies
    for text in (code.summary, code.meaning, code.threshold, code.fix):
        assert text.strip() and "\n" not in text and "|" not in code.summary
    assert not code.summary.endswith(".") and not code.fix.endswith(".")
    ex = code.example
    assert ex.python.endswith("\n") and ex.python.strip()
    if ex.command:
        words = shlex.split(ex.command)
        assert words[:2] in (["attncheck", "run"], ["attncheck", "watch"]) and words[-2:] == ["--fail-on", code.name]
    else:
        assert "result = " in ex.python
    assert doc_link(code.name) == f"docs/reference/findings.md#{code.name}"


def test_the_views_every_layer_reads():
    assert list(SEVERITY) == list(FIX) == [c.name for c in CODES]
    assert CAUSES_OF["fully_masked_rows"] == ("fully_masked",) and CAUSES_OF["unexplained_nan"] == ("unexplained",)
    assert set(CAUSES_OF) < set(REGISTRY) and set(GRAD_CAUSES_OF) == {
        "grad_nan_masked_row",
        "grad_nan_input",
        "grad_nan_forward",
        "grad_overflow",
    }


def test_closest_codes():
    assert closest_codes("exp_overflw") == ["exp_overflow", "fp8_overflow", "qk_overflow"]
    assert closest_codes("fully_masked") == ["fully_masked_rows"]
    assert closest_codes("zzz") == []


@pytest.mark.slow  # 34 small diagnoses, ~8 s: with the slow ones, in CI
@pytest.mark.parametrize("code", CODES, ids=lambda c: c.name)
def test_the_example_triggers_its_code(code, tmp_path, monkeypatch):
    """Run as the reference page shows it: the Python in an empty folder, then the command, which
    exits 1 because the code is reported (its --fail-on names the code alone)."""
    from attncheck import METHODS
    from attncheck.cli import app

    monkeypatch.chdir(tmp_path)
    methods = set(METHODS.names())
    namespace: dict = {"__name__": "__main__"}
    try:
        exec(compile(code.example.python, f"<example of {code.name}>", "exec"), namespace)
        if code.example.command:
            r = CliRunner().invoke(app, shlex.split(code.example.command)[1:])
            assert r.exit_code == 1, r.output[-3000:]
            assert f"attncheck: --fail-on {code.name}: " in r.output
        else:
            assert code.name in {f.code for f in namespace["result"].findings}
    finally:
        for name in set(METHODS.names()) - methods:
            METHODS.unregister(name)
