"""The model report: lines per call, the first call that goes wrong, outlier heads, --ignore, and
how it is rendered (one screen) and written to JSON."""

import io
import json

import torch
from rich.console import Console

from attncheck.config.run import Options
from attncheck.findings import counted_rows, counted_verdict, failed_conditions
from attncheck.judge import diagnose_call
from attncheck.model import OUTLIER_RATIO, model_report, outliers
from attncheck.report.model import render_model, run_json, shared_prefix
from attncheck.results import CallInfo, CallReport, HeadStat

OPTS = Options(dtypes=("fp16",), methods=("torch",))


def softmax_call(index, scores, module=None):
    info = CallInfo(index, f"c{index}", "softmax", module=module or f"model.layers.{index}.attn")
    return diagnose_call(info, {"scores": scores}, OPTS)


def healthy(seed=0, heads=4):
    return torch.randn(2, heads, 8, 8, generator=torch.Generator().manual_seed(seed)).half()  # an fp16 model's scores


def test_first_call_that_goes_wrong_is_the_first_in_call_order():
    bad = healthy(1)
    bad[0, 3, 2, 1] = float("inf")  # +inf in the scores: NaN in torch.softmax
    masked = healthy(2)
    masked[1, 0, 5] = float("-inf")  # a fully masked row: NaN in torch.softmax too
    calls = [softmax_call(0, healthy()), softmax_call(1, masked), softmax_call(2, bad)]
    report = model_report(calls)
    assert [line.verdict for line in report.lines] == ["ok", "nan", "nan"]
    assert report.first_bad == 1 and report.lines[1].first_cause == "fully_masked" and report.lines[1].heads == [0]
    assert report.lines[2].first_cause == "inf_input" and report.lines[2].heads == [3] and report.lines[2].nan_rows == 1
    # with the fully masked rows judged expected, the first call that goes wrong is the next one
    ignored = model_report(calls, ignore=("fully_masked_rows",))
    assert ignored.first_bad == 2 and ignored.lines[1].nan_rows == 0 and ignored.lines[1].verdict == "ok"
    assert failed_conditions([c.diagnosis for c in calls[:2]], ["nan"], ("fully_masked_rows",)) == []
    assert failed_conditions([c.diagnosis for c in calls[:2]], ["nan"]) == ["nan: c1: torch/fp16"]


def test_counted_rows_and_verdict_leave_out_ignored_causes():
    cell = softmax_call(0, healthy()).diagnosis.cell("torch", "fp16")
    cell.nan_rows, cell.nan_causes = 5, {"fully_masked": 3, "exp_overflow": 2}
    assert counted_rows(cell.nan_rows, cell.nan_causes, ("fully_masked_rows",)) == 2
    assert counted_verdict(cell, ("fully_masked_rows",)) == "nan"
    assert counted_verdict(cell, ("fully_masked_rows", "exp_overflow")) == "ok"


def head(h, q, k=1.0):
    return HeadStat(h, q, k, 1.0)


def test_outliers_at_the_ratio_to_the_median_over_heads():
    info = CallInfo(2, "c", "softmax", module="layers.2.attn")
    heads = [head(h, 1.5) for h in range(6)] + [head(6, 1.5 * OUTLIER_RATIO), head(7, 1.5 * OUTLIER_RATIO * 0.99)]
    found = outliers(CallReport(info, None, heads))
    assert [(o.head, o.tensor) for o in found] == [(6, "q")]
    assert found[0].message == "layers.2.attn head 6: max|q| 15 vs median 1.5 over the other heads"


def test_shared_prefix():
    assert shared_prefix(["model.layers.0.self_attn", "model.layers.1.self_attn"]) == "model.layers."
    assert shared_prefix(["a.attn", "a.attn"]) == "a."
    assert shared_prefix(["x"]) == "" and shared_prefix(["", "a.b"]) == ""


def render(report, calls, width=100):
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render_model(report, calls, "cpu"))
    return console.file.getvalue()


def test_many_calls_fit_one_screen_and_the_closing_line_names_the_first_bad_call():
    calls = [softmax_call(i, healthy(i, heads=16)) for i in range(24)]
    calls[9].diagnosis.cell("torch", "fp16").nan_rows = 0  # untouched: every call healthy but one
    bad = healthy(99, heads=16)
    bad[0, 5, 0, 0] = float("inf")
    calls[13] = softmax_call(13, bad)
    text = render(model_report(calls), calls)
    lines = text.splitlines()
    assert len(lines) < 80, len(lines)
    assert lines[-1].startswith("24 call(s) on cpu:") or "first call that goes wrong: #13 model.layers.13.attn" in text
    assert (
        "first call that goes wrong: #13 model.layers.13.attn (softmax, torch/fp16): NaN in 1 row(s), first cause "
        "inf_input in head 5" in " ".join(text.split())
    )
    assert "13 >" in text  # the row is marked
    row = next(line for line in lines if line.startswith(" 13.attn"))  # the layer x head matrix
    assert row.split()[6] == "N1" and all(c.replace(".", "").isdigit() for c in row.split()[1:6])


def test_json_model_section():
    bad = healthy(1)
    bad[0, 3, 2, 1] = float("inf")
    calls = [softmax_call(0, healthy()), softmax_call(1, bad)]
    report = model_report(calls)
    doc = json.loads(json.dumps(run_json([c.diagnosis for c in calls], "cpu", [], report, calls), allow_nan=False))
    assert doc["schema"] == "attncheck.run/3" and {"tensors", "failed", "options", "device"} <= doc.keys()
    m = doc["model"]
    assert m["first_bad"] == {
        "index": 1,
        "rank": None,
        "name": "c1",
        "module": "model.layers.1.attn",
        "verdict": "nan",
        "first_cause": "inf_input",
        "heads": [3],
        "nan_rows": 1,
        "errors": ["inf_input"],
    }
    assert [c["verdict"] for c in m["calls"]] == ["ok", "nan"] and m["calls"][1]["cell"] == "torch/fp16"
    assert m["calls"][1]["heads"][3]["nan_rows"] == 1 and len(m["calls"][1]["heads"]) == 4


def test_the_closing_line_never_counts_errors_next_to_no_call_going_wrong():
    """Errors of any cell count for a call of unknown implementation (every cell is asked), so a
    naive fp16 overflow marks its call; the closing line names it rather than 'no call goes wrong'."""
    from attncheck.judge import diagnose
    from attncheck.numerics.cells.calls import scores_report

    opts = Options(dtypes=("fp16",), methods=("naive", "torch"))
    quiet = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    loud = quiet * 20  # logits past 11.09: naive fp16's exp overflows; torch.softmax is fine
    calls = [
        scores_report(CallInfo(i, f"t{i}", "scores"), diagnose(f"t{i}", x, opts)) for i, x in enumerate((quiet, loud))
    ]
    report = model_report(calls)
    assert report.lines[1].verdict == "error" and "exp_overflow" in report.lines[1].errors and report.first_bad == 1
    text = " ".join(render(report, calls).split())
    assert "1 error(s)" in text or "2 error(s)" in text
    assert "no call goes wrong" not in text and "first call that goes wrong: #1 t1" in text


# causes before consequences: the first call that goes wrong (#1, a fully masked row) first, the +inf a later
# call's input holds after it, whatever their severities
SUMMARY_80 = """\
Findings of the cells the model runs (--detail NAME, --full: per-call reports)
warning[fully_masked_rows]: a query row has every key masked
  --> 1 call(s), first model.layers.1.attn
   = fix: a query that may attend to nothing has no softmax: zero such rows
          (torch.where(keep.any(-1, keepdim=True), p, 0)) and drop them from the
          loss, or use a kernel that returns zeros (FlashAttention, SDPA >=
          2.5); even then their backward pass can poison gradients if a NaN
          reaches it

error[inf_input]: a row of the scores holds +inf
  --> 2 call(s), first model.layers.2.attn; after the first call that goes wrong
      (#1 model.layers.1.attn), whose NaN its input can carry
   = fix: the scores hold +inf (softmax gives inf - inf = NaN): find where they
          overflow, e.g. Q@K^T in fp16 without 1/sqrt(d_k); scale q first or
          compute scores in fp32

attncheck explain CODE prints each code's meaning, threshold, example and fix
"""


def test_the_model_reports_findings_read_as_diagnostics_once_per_code():
    from attncheck.report.model import findings_summary

    bad = healthy(1)
    bad[0, 3, 2, 1] = float("inf")
    masked = healthy(2)
    masked[1, 0, 5] = float("-inf")
    calls = [softmax_call(0, healthy()), softmax_call(1, masked), softmax_call(2, bad), softmax_call(3, bad.clone())]
    buf = io.StringIO()
    Console(width=80, file=buf, color_system=None).print(findings_summary(calls, known=True))
    assert buf.getvalue() == SUMMARY_80


def test_ignored_nan_rows_leave_the_head_grid_as_they_leave_the_call_table():
    """--ignore fully_masked_rows: the call table counts 0 NaN rows for a call whose only NaN rows are fully
    masked ones, and the layer x head grid says the same (it showed N2 beside the table's 0)."""
    masked = healthy(2)
    masked[1, 0, 5] = float("-inf")  # head 0: two fully masked rows, over the batch
    masked[0, 0, 3] = float("-inf")
    bad = healthy(1)
    bad[0, 3, 2, 1] = float("inf")  # head 3: +inf, not ignored
    calls = [softmax_call(0, masked), softmax_call(1, bad)]
    assert calls[0].heads[0].nan_rows == 2 and calls[0].heads[0].nan_causes == {"fully_masked": 2}

    def grid(text):  # the layer x head grid's rows (the call table's rows start with the call's number)
        return [line.split() for line in text.splitlines() if line.strip().startswith(("0.attn", "1.attn"))][-2:]

    shown = grid(render(model_report(calls), calls))
    assert shown[0][1] == "N2" and shown[1][4] == "N1"
    report = model_report(calls, ignore=("fully_masked_rows",))
    assert report.lines[0].nan_rows == 0
    shown = grid(render(report, calls))
    assert not any(cell.startswith("N") for cell in shown[0][1:]) and shown[1][4] == "N1"
