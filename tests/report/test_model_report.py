"""The model report fits the terminal: at 80 columns no header is cut and no word is broken; long
module names (T5's 'encoder.block.0.layer.0.SelfAttention') lose the parts no call differs in, then
the middle of their words, and stay on one line; the layer x head table shows the heads that fit,
the broken ones among them; the what-if table wraps between finding codes, never inside one. Each
is rendered into Console(width=80, file=io.StringIO(), color_system=None) and checked exactly."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from attncheck.config.run import Options
from attncheck.judge import diagnose_call
from attncheck.model import model_report
from attncheck.report.fit import constant_parts, middle_ellipsis
from attncheck.report.model import render_model
from attncheck.results import CallInfo, WhatIfAnswer

T5 = [
    "encoder.block.0.layer.0.SelfAttention",
    "encoder.block.1.layer.0.SelfAttention",
    "decoder.block.0.layer.0.SelfAttention",
    "decoder.block.0.layer.1.EncDecAttention",
    "decoder.block.1.layer.0.SelfAttention",
    "decoder.block.1.layer.1.EncDecAttention",
]


def render(report, calls, width=80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render_model(report, calls, "cpu"))
    return console.file.getvalue()


def call(index, module, scores, dtype="fp32"):
    info = CallInfo(index, f"c{index}", "softmax", module=module, dtype=dtype)
    return diagnose_call(info, {"scores": scores}, Options(dtypes=(dtype,), methods=("torch",)))


def t5_calls(heads=4):
    g = torch.Generator().manual_seed(0)
    keys = [
        12,
        12,
        6,
        12,
        6,
        12,
    ]  # self-attention over the encoder's 12 tokens or the decoder's 6; cross-attention: 6 x 12
    queries = [12, 12, 6, 6, 6, 6]
    return [
        call(i, name, torch.randn(2, heads, q, k, generator=g)) for i, (name, q, k) in enumerate(zip(T5, queries, keys))
    ]


def test_middle_ellipsis_keeps_numbers_and_the_start_of_each_word():
    assert middle_ellipsis("encoder.0.0.SelfAttention", 25) == "encoder.0.0.SelfAttention"
    assert middle_ellipsis("encoder.0.0.SelfAttention", 20) == "encoder.0.0.SelfAtt…"
    assert middle_ellipsis("decoder.0.1.EncDecAttention", 16) == "decod….0.1.EncD…"
    assert middle_ellipsis("model.layers.10.self_attn", 20) == "model.laye….10.self…"
    for width in range(8, 40):
        for name in T5:
            assert len(middle_ellipsis(name, width)) <= width
    assert constant_parts(T5) == ["block", "layer"]
    assert constant_parts(["transformer.h.0.attn", "transformer.h.1.attn"]) == [
        "h"
    ]  # 'transformer' is the first part: kept


T5_TABLE_80 = """\
                                                          first              
# call                        shape     logit    room NaN cause   err verdict
─────────────────────────────────────────────────────────────────────────────
0 encoder.0.0.SelfAttention   2x4x12x12
1 encoder.1.0.SelfAttention   2x4x12x12
2 decoder.0.0.SelfAttention   2x4x6x6  
3 decoder.0.1.EncDecAttention 2x4x6x12 
4 decoder.1.0.SelfAttention   2x4x6x6  
5 decoder.1.1.EncDecAttention 2x4x6x12 
"""  # noqa: W291 (the padding is part of the rendered table)


def table_lines(text: str, first: str, count: int) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    return lines[start : start + count]


def test_t5_names_stay_on_one_line_at_80_columns():
    """At 80 columns T5's names would take three lines each; they lose 'block' and 'layer' (the legend
    says so) and keep everything that tells one call from another, on one line."""
    calls = t5_calls()
    text = render(model_report(calls), calls)
    assert "names without 'block', 'layer'" in " ".join(text.split())
    table = table_lines(text, "first", 9)
    expected = T5_TABLE_80.splitlines()
    assert table[:3] == expected[:3]
    assert [line[: len(e)] for line, e in zip(table[3:], expected[3:])] == expected[3:]  # the numbers follow: see below
    assert [line.split()[-1] for line in table[3:]] == ["ok"] * 6 and all(len(line) <= 80 for line in text.splitlines())
    # with room, the names stay whole
    wide = render(model_report(calls), calls, width=120)
    assert "encoder.block.0.layer.0.SelfAttention" in table_lines(wide, "#", 3)[2] and "names without" not in wide


def test_mixed_cells_shapes_and_an_error_keep_every_header_whole_at_80_columns():
    """The case that cut the last header to 'ver': a cell and a shape column, long names, an error."""
    g = torch.Generator().manual_seed(1)
    calls = []
    for i, name in enumerate(T5[:4]):
        dtype = "fp16" if i % 2 else "fp32"
        x = torch.randn(2, 32, 8, 8 + 4 * i, generator=g).to(torch.float16 if dtype == "fp16" else torch.float32)
        if i == 2:
            x[0, 23, 1, 2] = float("inf")  # head 23: +inf in the scores, a NaN row in torch.softmax
        calls.append(call(i, name, x, dtype))
    text = render(model_report(calls), calls)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    header = table_lines(text, "#", 1)[0].split()
    assert header == ["#", "call", "shape", "cell", "logit", "room", "NaN", "cause", "err", "verdict"]
    rows = table_lines(text, "0 ", 4)
    assert [row[4:].split()[0] for row in rows] == ["enc….0.0.Sel…", "enc….1.0.Sel…", "dec….0.0.Sel…", "dec….0.1.Enc…"]
    assert rows[2].split()[-3:] == ["inf_input", "6e-08", "nan"] and rows[2].startswith("2 >")
    # the layer x head table: as many heads as fit, head 23 (its NaN row) among them
    matrix = table_lines(text, "call  ", 6)
    assert matrix[0].split() == ["call", "h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7", "h23"]
    assert matrix[4].split()[0] == "decoder.block.0.layer.0.SelfAttention" and matrix[4].split()[-1] == "N1"
    assert "(9 of 32 heads: the first and those marked; --json has all)" in " ".join(text.split())


def test_what_if_codes_wrap_between_codes_never_inside_one():
    calls = t5_calls()
    report = model_report(calls)
    first = report.lines[3]
    codes = {"grad_underflow": 1, "probability_flush": 6, "sentinel_not_representable": 2, "fp8_overflow": 3}
    report.what_if = [
        WhatIfAnswer("eager:naive/fp16", 6, 1, first, 4, 1e-3, 11.0, None, codes),
        WhatIfAnswer("flash-fp8/e4m3", 6, 0, None, 0, 1e-2, 12.4, None, {}),
    ]
    text = render(report, calls)
    assert all(len(line) <= 80 for line in text.splitlines())
    table = text.split("What if the model ran these instead")[1]
    found = [word.replace("\u00a0", " ") for line in table.splitlines() for word in line.split("  ") if "(" in word]
    for code, n in codes.items():  # each code with its count, whole, on one line
        assert any(f"{code} ({n})" in w for w in found), (code, table)
    # too long for a column at 80: the codes are listed under the table, one what-if cell a line
    assert "Findings of the what-if cells:\n  eager:naive/fp16: grad_underflow (1), probability_flush (6),\n" in table
    assert "#3 decoder.0.1.EncDecAttention" in table
    # short enough, beside a short first call: in their column, wrapped between codes
    report.what_if[0].findings = {"grad_underflow": 1, "probability_flush": 6, "fp8_overflow": 3}
    report.what_if[0].first = report.lines[0]
    report.lines[0].module = "enc.0"
    table = render(report, calls).split("What if the model ran these instead")[1]
    assert "Findings of the what-if cells" not in table
    cells = [line.rstrip().split("  ")[-1].strip() for line in table.splitlines() if "\u00a0(" in line]
    assert " ".join(cells).replace("\u00a0", " ") == "grad_underflow (1), probability_flush (6), fp8_overflow (3)"


def test_two_captures_read_together_keep_their_names_and_outlier_marks_in_the_head_grid(tmp_path):
    """Two single-process captures share call indices (0, 1 each) and no rank: the layer x head grid
    names each row by its own call and stars only the call whose k head is the outlier (it once
    keyed rows by (rank, index), printing the second capture's names and stars over the first's)."""
    import torch.nn.functional as F
    from typer.testing import CliRunner

    import attncheck
    from attncheck.cli import app

    class A(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    class M(torch.nn.Module):
        def __init__(self, names):
            super().__init__()
            for n in names:
                self.add_module(n, A())

        def forward(self, q, k, v):
            for m in self.children():
                q = m(q, k, v)
            return q

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=g) for _ in range(3))
    k_bad = k.clone()
    k_bad[:, 1] *= 1000  # head 1's k: an outlier in the second capture only
    for out, names, kk in ((tmp_path / "a", ["alpha", "beta"], k), (tmp_path / "b", ["gamma", "delta"], k_bad)):
        with attncheck.capture(out):
            M(names)(q, kk, v)
    r = CliRunner().invoke(app, ["run", str(tmp_path / "a"), str(tmp_path / "b")], env={"COLUMNS": "100"})
    grid = r.stdout.split("Layer x head")[1].split("Outlier heads")[0]
    names = ("alpha", "beta", "gamma", "delta")
    rows = {line.split()[0]: line.split()[1:] for line in grid.splitlines() if line.split()[:1] in ([n] for n in names)}
    assert sorted(rows) == ["alpha", "beta", "delta", "gamma"]
    assert [name for name, cells in rows.items() if any(c.endswith("*") for c in cells)] == ["gamma", "delta"]
    assert all(cells[1].endswith("*") for name, cells in rows.items() if name in ("gamma", "delta"))
