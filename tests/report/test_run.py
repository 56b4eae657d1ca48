"""What a user reads in `attncheck run`'s report: at 80 columns nothing is cut, codes and
numbers stay whole; mask values as the mask holds them; where NaN rows sit, and how many
leading indices are left out."""

from __future__ import annotations

import io
import json

import torch
from rich.console import Console

from attncheck.demo import EXAMPLE_NAME, example_scores
from attncheck.judge import diagnose, diagnose_attention
from attncheck.numerics.cells.diagnose import Options
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.report.model import run_json
from attncheck.report.run import print_report


def render(diags, width: int = 80) -> str:
    buf = io.StringIO()
    print_report(Console(width=width, file=buf, color_system=None), diags, "cpu")
    return buf.getvalue()


def float_mask_diagnosis():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 8, 16, generator=g) * 3, torch.randn(1, 2, 8, 16, generator=g) * 3
    q[0, 0, 3, 0], k[0, 0, 5, 0] = (
        100.0,
        -100.0,
    )  # one strongly negative score (-2500 once scaled): the sentinel overflows on add
    mask = torch.zeros(8, 8)
    mask[~torch.ones(8, 8, dtype=torch.bool).tril()] = torch.finfo(torch.float16).min
    mask[0] = torch.finfo(torch.float16).min
    return diagnose_attention("qk", prepare_inputs(q, k, mask), Options(dtypes=("fp16", "fp32")))


def test_nothing_is_cut_at_80_columns():
    diags = [diagnose(EXAMPLE_NAME, example_scores()), float_mask_diagnosis()]
    text = render(diags)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())  # wrapped text read as one line
    for d in diags:
        for f in d.findings:
            assert f"{f.severity}[{f.code}]:" in text.split(), f.code  # whole, on one line
    assert "0/16016" in flat  # the example's cast to fp16: 16016 values become -inf
    assert "sentinel_not_representable" in text and "sentinel_overflow_on_add" in text


def test_every_dtype_at_80_columns():
    """Seven dtypes (four FP8 formats among them), every path and V: the path x dtype table splits
    into tables of the dtypes that fit, the others close up their headers; nothing is cut."""
    from attncheck.registry import dtype_names

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    fp8 = ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz")
    dtypes = tuple(dtype_names()) + fp8
    d = diagnose_attention("qkv", prepare_inputs(q, k, None, v=v), Options(dtypes=dtypes))
    text = render([d])
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    headers = [line.split("┃")[1:-1] for line in text.splitlines() if line.startswith("┃")]
    rows = [[h.strip() for h in row] for row in headers]
    assert len(rows) > 1 and all(row[0] == "path" for row in rows)
    assert [h for row in rows for h in row[1:]] == [*dtype_names(), *fp8]  # each dtype once, in order
    assert "flash-fp8/e5m2" in text.split() and "before/" in text.split()  # the FP8 P cast table, its headers on lines


def test_pipeline_table_shows_the_float_mask_value():
    d = float_mask_diagnosis()
    text = render([d], width=120)
    row = next(line for line in text.splitlines() if line.strip().startswith("fp16") and "-65504" in line)
    assert "-inf" not in row
    doc = run_json([d], "cpu")["tensors"][0]["attention"]
    assert doc["mask_value"] == "-65504.0" and doc["float_mask_value"] == -65504.0
    assert doc["dtypes"]["fp16"]["sentinel_value"] == -65504.0 and doc["dtypes"]["fp16"]["mask_values"] == [-65504.0]
    json.dumps(doc, allow_nan=False)


def test_nan_rows_by_leading_index_say_how_many_are_left_out():
    x = torch.randn(4, 4, 3, 8)
    x[:, :, 0] = float("-inf")  # every (batch, head) has one fully masked row: 16 indices
    d = diagnose("x", x, Options(dtypes=("fp32",), methods=("stable",)))
    cell = d.cell("stable", "fp32")
    assert len(cell.nan_rows_by_head) == 16 and sum(n for _, n in cell.nan_rows_by_head) == 16
    text = " ".join(render([d], width=200).split())
    assert "stable/fp32: (0,0) 1, (0,1) 1, (0,2) 1 and 13 more" in text
    assert len(run_json([d], "cpu")["tensors"][0]["cells"][0]["nan_rows_by_head"]) == 16


def test_census_json_gives_each_mask_value_its_span():
    s = (torch.rand(16, 8, generator=torch.Generator().manual_seed(1)) * 400).half()
    x = torch.where(torch.arange(8) >= 4, s + torch.finfo(torch.float16).min, s)
    d = diagnose("m", x, Options(dtypes=("fp16",), methods=("stable",)))
    (entry,) = run_json([d], "cpu")["tensors"][0]["census"]["sentinels"]
    assert entry["value"] == -65504.0 and entry["rows"] == 16 and entry["min"] <= entry["max"] < -65000
    assert "mask values -65504 (16 rows; row minima" in " ".join(render([d], width=100).split())


def test_json_findings_link_their_section_of_the_reference():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "findings.md").read_text()
    findings = run_json([diagnose(EXAMPLE_NAME, example_scores())], "cpu")["tensors"][0]["findings"]
    assert {f["code"] for f in findings} >= {"exp_overflow", "fully_masked_rows"}
    for f in findings:
        assert f["doc"] == f"docs/reference/findings.md#{f['code']}"
        assert f"\n### {f['code']}\n" in page
