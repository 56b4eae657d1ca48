"""Check results -> a Rich summary, JUnit XML, Markdown and JSON. Formatting only:
every number comes from ``numerics.budgets`` (which takes them from ``diagnose``)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck import __version__
from attncheck.format import cosine, num, row_text, to_jsonable, visible
from attncheck.report.text import shown
from attncheck.results.check import (
    BUDGET_NAMES,
    LOWER_BUDGETS,
    RELATIVE_BUDGET,
    RELATIVE_BUDGETS,
    BudgetCheck,
    CaseResult,
    CheckResult,
)

JSON_SCHEMA = "attncheck.check/1"
JUNIT_SUITE = "attncheck"

MEANING = {
    "nan": "rows that come out NaN",
    "overflow": "rows where exp or the row sum overflowed",
    "zero_rows": "rows that come out all zero",
    "argmax_flips": "rows whose top-1 key differs from float64",
    "max_abs_err": "max |p - p_float64| against the scores as given",
    "max_abs_err_algo": "max |p - p_float64| against the scores cast to the dtype",
    "rmse": "root mean square error against the scores as given",
    "kl_max": "largest KL(p_float64 || p) of a row",
    RELATIVE_BUDGET: "max_abs_err_algo as a multiple of torch.softmax's in the same dtype (FlashAttention's rule)",
    "out_nan": "rows of O = P@V that come out NaN",
    "out_max_abs_err": "max |O - O_float64| (O_float64 = P_float64 @ V in float64)",
    "out_rmse": "root mean square error of O",
    "out_rel_l1": "sum |O - O_float64| / sum |O_float64|",
    "out_cos_min": "smallest cosine similarity of a row of O with O_float64 (a lower bound)",
    "out_relative_to_torch": (
        "out_max_abs_err as a multiple of the eager torch.softmax path's in the same dtype (FlashAttention's rule on O)"
    ),
}


def describe_check(check: BudgetCheck) -> str:
    """'max_abs_err 0.0312 > budget 0.01 (worst row (0, 3, 17))' or 'nan 0 <= budget 0'."""
    op = check.op
    if check.measured is None:
        text = f"{check.budget} not measured: {check.note} (budget {num(check.limit)})"
    elif check.is_relative:
        atol = f" + {num(check.atol)}" if check.atol else ""
        ratio = f" ({ratio_text(check.ratio)} torch)" if check.ratio is not None else ""
        text = (
            f"{check.budget}: {RELATIVE_BUDGETS[check.budget]} {num(check.measured)} {op} "
            f"{num(check.limit)} x torch {num(check.reference)}{atol} = {num(check.bound)}{ratio}"
        )
    else:
        text = (
            f"{check.budget} {value_text(check.budget, check.measured)} {op} budget "
            f"{value_text(check.budget, check.limit)}"
        )
    if check.rows and not check.passed:
        if check.is_count:
            shown = ", ".join(row_text(r) for r in check.rows[:3])
            text += f" (row{'s' if len(check.rows) > 1 else ''} {shown}{', ...' if len(check.rows) > 3 else ''})"
        else:
            text += f" (worst row {row_text(check.rows[0])})"
    return text


def describe_case(case: CaseResult) -> str:
    """Failing budgets first, then the ones that hold."""
    parts = [describe_check(c) for c in case.failures]
    parts += [describe_check(c) + " ok" for c in case.checks if c.passed]
    return "; ".join(parts)


# --------------------------------------------------------------------------- shared pieces


def budget_columns(result: CheckResult) -> list[str]:
    """Budgets that some case checks, in report order."""
    used = {c.budget for case in result.cases for c in case.checks}
    return [name for name in BUDGET_NAMES if name in used]


def value_text(budget: str, value: float | int) -> str:
    """A measured value or limit as reports show it (cosines with six decimals)."""
    return cosine(value) if budget in LOWER_BUDGETS else num(value)


def limit_text(budget: str, limit: float | int | None) -> str:
    if limit is None:
        return "-"
    if budget in RELATIVE_BUDGETS:
        return f"<= {num(limit)}x torch"
    return f"{'>=' if budget in LOWER_BUDGETS else '<='} {value_text(budget, limit)}"


def ratio_text(ratio: float) -> str:
    """'2.13x', '0.13x', '0.00012x'."""
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.2g}x"


def measured_text(check: BudgetCheck) -> str:
    """What a table cell shows: the value, or for relative_to_torch the ratio to torch's error."""
    if check.measured is None:
        return "n/a"
    if check.is_relative:
        if check.ratio is not None:
            return ratio_text(check.ratio)
        return f"{num(check.measured)} (torch {num(check.reference)})"
    return value_text(check.budget, check.measured)


def _header_limit(result: CheckResult, budget: str) -> float | int | None:
    return getattr(result.budget, budget)


def _cell_text(check: BudgetCheck, header_limit: float | int | None) -> str:
    text = measured_text(check)
    if check.limit != header_limit:  # a [budget.<dtype>] override applies to this case
        text += f" ({limit_text(check.budget, check.limit)})"
    return text


def summary_line(result: CheckResult) -> str:
    n, bad = len(result.cases), len(result.failures)
    head = f"{bad} of {n} case(s) broke their budget" if bad else f"all {n} case(s) within budget"
    return (
        f"attncheck check: {head} ({len(result.inputs)} input(s), config {visible(result.config)}, device "
        f"{result.device})"
    )


def check_lines(case: CaseResult) -> list[str]:
    """One line per budget with every number at full precision (for JUnit and logs)."""
    lines = []
    for c in case.checks:
        status = "ok  " if c.passed else "FAIL"
        if c.measured is None:
            body = f"not measured: {c.note}; budget {c.limit!r}"
        elif c.is_relative:
            op = c.op
            ratio = f" (ratio {c.ratio!r})" if c.ratio is not None else ""
            body = (
                f"{RELATIVE_BUDGETS[c.budget]} {c.measured!r} {op} {c.limit!r} x torch {c.reference!r} + atol "
                f"{c.atol!r} = {c.bound!r}{ratio}"
            )
        else:
            body = f"{c.measured!r} {c.op} budget {c.limit!r}"
        if c.rows:
            label = "rows" if c.is_count else "worst row"
            body += f"; {label} " + ", ".join(row_text(r) for r in c.rows)
        lines.append(f"{status} {c.budget}: {body}")
    return lines


# --------------------------------------------------------------------------- Rich


def summary_tables(result: CheckResult, width: int = 80) -> list[Text | Table]:
    """Per input its name, then a table with one row per cell: pass/fail and the measured
    value under each budget; the header gives the budget. Numbers and names are never cut:
    when the budgets do not fit ``width`` columns side by side, they go to several tables."""
    columns = budget_columns(result)
    tables: list[Text | Table] = []
    for name in result.inputs:
        tables.append(shown(name, style="bold"))
        tables[-1].overflow = "fold"
        cases = [c for c in result.cases if c.input == name]
        headers = {
            budget: _label(budget) + "\n" + limit_text(budget, _header_limit(result, budget)) for budget in columns
        }
        cells = {budget: [_cell(case, budget, result) for case in cases] for budget in columns}
        wide = {
            b: max([len(line) for line in headers[b].splitlines()] + [len(t.plain) for t in cells[b]]) for b in columns
        }
        # SIMPLE_HEAD: a space at each edge, and padding + separator + padding between columns
        fixed = 1 + len("result") + 3 + max([len("cell")] + [len(c.name) for c in cases]) + 1
        for group in _fit(columns, wide, width - fixed):
            t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
            t.add_column("result", no_wrap=True)
            t.add_column("cell", no_wrap=True)
            for budget in group:
                t.add_column(headers[budget], justify="right", no_wrap=True)
            for i, case in enumerate(cases):
                status = Text("pass", style="green") if case.passed else Text("FAIL", style="bold red")
                t.add_row(status, case.name, *(cells[budget][i] for budget in group))
            tables.append(t)
    return tables


def _label(budget: str) -> str:
    return budget.replace("relative_to", "relative_to\n") if budget in RELATIVE_BUDGETS else budget


def _cell(case: CaseResult, budget: str, result: CheckResult) -> Text:
    c = next((c for c in case.checks if c.budget == budget), None)
    if c is None:
        return Text("-", style="dim")
    return Text(_cell_text(c, _header_limit(result, budget)), style="" if c.passed else "bold red")


def _fit(columns: list[str], wide: dict[str, int], room: int) -> list[list[str]]:
    """Budget columns in order, split into groups whose widths (plus three spaces each) fit ``room``."""
    groups: list[list[str]] = [[]]
    used = 0
    for b in columns:
        need = wide[b] + 3
        if groups[-1] and used + need > room:
            groups.append([])
            used = 0
        groups[-1].append(b)
        used += need
    return groups


def render_summary(result: CheckResult, quiet: bool = False, width: int = 80) -> Group:
    """The table (unless ``quiet``) and the verdict line; the CLI writes the broken budgets to stderr."""
    parts: list[Any] = (
        []
        if quiet
        else [shown(f"attncheck check: config {result.config}, device {result.device}"), *summary_tables(result, width)]
    )
    style = "bold red" if result.failures else "green"
    parts.append(Text(summary_line(result), style=style))
    return Group(*parts)


def print_summary(console: Console, result: CheckResult, quiet: bool = False) -> None:
    console.print(render_summary(result, quiet=quiet, width=console.width))


# --------------------------------------------------------------------------- JUnit


def junit_xml(result: CheckResult) -> str:
    """One <testsuite name="attncheck">, one <testcase> per input x cell; a failure's message
    lists the broken budgets, its text every budget with full-precision numbers."""
    suite = ET.Element(
        "testsuite",
        {
            "name": JUNIT_SUITE,
            "tests": str(len(result.cases)),
            "failures": str(len(result.failures)),
            "errors": "0",
            "skipped": "0",
            "time": f"{result.seconds:.3f}",
        },
    )
    props = ET.SubElement(suite, "properties")
    # XML 1.0 cannot hold most control characters, even escaped: names are written as format.visible shows them.
    for key, value in (
        ("attncheck_version", __version__),
        ("config", visible(result.config)),
        ("device", result.device),
    ):
        ET.SubElement(props, "property", {"name": key, "value": value})
    for case in result.cases:
        tc = ET.SubElement(
            suite,
            "testcase",
            {"classname": f"attncheck.{visible(case.input)}", "name": case.name, "time": f"{case.seconds:.3f}"},
        )
        head = (
            f"input {visible(case.input)}, shape {tuple(case.shape)}, cell {case.name}: {case.rows} rows, "
            f"{case.compared_rows} compared with float64"
        )
        text = "\n".join([head, *check_lines(case)])
        if case.passed:
            ET.SubElement(tc, "system-out").text = text
        else:
            failure = ET.SubElement(
                tc, "failure", {"message": "; ".join(describe_check(c) for c in case.failures), "type": "budget"}
            )
            failure.text = text
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


# --------------------------------------------------------------------------- Markdown


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _md_code(text: str) -> str:
    """A name as a Markdown code span: literal (no emphasis, links or HTML), on one line, its
    backticks kept by a longer fence."""
    text = _md(visible(text))
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown(result: CheckResult) -> str:
    """A GitHub-flavoured summary: verdict, one table row per case, then the failures in words."""
    n, bad = len(result.cases), len(result.failures)
    verdict = f"❌ {bad} of {n} case(s) broke their budget" if bad else f"✅ all {n} case(s) within budget"
    lines = [
        f"### attncheck check: {verdict}",
        "",
        f"Config {_md_code(result.config)}, device `{result.device}`, {len(result.inputs)} input(s), attncheck "
        f"{__version__}.",
        "",
    ]
    columns = budget_columns(result)
    header = [
        "result",
        "input",
        "cell",
        *(f"{name} ({limit_text(name, _header_limit(result, name))})" for name in columns),
    ]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("| " + " | ".join(["---", "---", "---", *("---:" for _ in columns)]) + " |")
    for case in result.cases:
        by_name = {c.budget: c for c in case.checks}
        cells = []
        for name in columns:
            c = by_name.get(name)
            if c is None:
                cells.append("-")
            else:
                text = _md(_cell_text(c, _header_limit(result, name)))
                cells.append(text if c.passed else f"**{text}** ❌")
        status = "✅ pass" if case.passed else "❌ fail"
        lines.append("| " + " | ".join([status, _md_code(case.input), case.name, *cells]) + " |")
    lines += ["", "<details><summary>What the columns measure</summary>", ""]
    lines += [f"- `{name}`: {MEANING[name]}" for name in columns]
    lines += ["", "</details>"]
    if bad:
        lines += ["", "**Budgets broken**", ""]
        for case in result.failures:
            for c in case.failures:
                lines.append(f"- {_md_code(case.input)} {case.name}: {_md(describe_check(c))}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- JSON


def check_json(result: CheckResult) -> dict[str, Any]:
    cases = []
    for case in result.cases:
        checks = []
        for c in case.checks:
            checks.append(
                {
                    "budget": c.budget,
                    "limit": c.limit,
                    "measured": c.measured,
                    "bound": c.bound,
                    "passed": c.passed,
                    "reference": c.reference,
                    "atol": c.atol if c.is_relative else None,
                    "ratio": c.ratio,
                    "worst_row": None if c.worst_row is None else list(c.worst_row),
                    "rows": [list(r) for r in c.rows],
                    "note": c.note or None,
                    "message": describe_check(c),
                }
            )
        cases.append(
            {
                "input": case.input,
                "method": case.method,
                "dtype": case.dtype,
                "name": case.name,
                "passed": case.passed,
                "shape": list(case.shape),
                "rows": case.rows,
                "compared_rows": case.compared_rows,
                "checks": checks,
            }
        )
    return to_jsonable(
        {
            "schema": JSON_SCHEMA,
            "attncheck_version": __version__,
            "config": result.config,
            "config_path": result.config_path,
            "device": result.device,
            "passed": result.passed,
            "summary": {
                "cases": len(result.cases),
                "passed": len(result.cases) - len(result.failures),
                "failed": len(result.failures),
            },
            "budget": to_jsonable(result.budget),
            "dtype_budgets": {d: to_jsonable(b) for d, b in result.dtype_budgets.items()},
            "ignore": list(result.ignore),
            "inputs": list(result.inputs),
            "cases": cases,
        }
    )
