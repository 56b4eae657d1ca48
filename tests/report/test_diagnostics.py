"""Findings as compiler diagnostics, exactly as a user reads them at 80 and 120 columns: the headline
with severity and code, the tensor and rows, the indented fix, each wrapped at the full width with
its later lines indented; names printed as text."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from attncheck.codes import FIX
from attncheck.demo import EXAMPLE_NAME, example_scores
from attncheck.judge import diagnose
from attncheck.report.diagnostics import findings_block
from attncheck.results import Finding


def render(renderable, width: int) -> str:
    buf = io.StringIO()
    Console(width=width, file=buf, color_system=None).print(renderable)
    return buf.getvalue()


@pytest.fixture(scope="module")
def example_findings():
    d = diagnose(EXAMPLE_NAME, example_scores())
    return [f for f in d.findings if f.code in ("exp_overflow", "sentinel_not_representable")]


EXAMPLE_80 = """\
Findings
error[exp_overflow]: naive softmax in fp16: exp overflows to inf in 100 row(s)
    (exp(x) = inf for x > 11.09; largest score 27.15) -> 100 NaN row(s)
  --> example:layer0.scores: rows (0,1,4), (0,1,5), (0,1,6), (0,1,8), ...
   = fix: subtract the row max before exp (stable softmax, torch.softmax), or
          upcast to fp32 before the softmax

warning[sentinel_not_representable]: mask value -1e+09 is not representable in
    fp16 (max 65504): 16016 value(s) become -inf; rows masked only by it become
    all -inf (NaN in naive, stable and torch)
  --> example:layer0.scores
   = fix: use a boolean mask (masked_fill(~keep, torch.finfo(dtype).min) or
          SDPA's bool attn_mask) instead of a constant the dtype cannot hold

attncheck explain CODE prints each code's meaning, threshold, example and fix
"""

EXAMPLE_120 = """\
Findings
error[exp_overflow]: naive softmax in fp16: exp overflows to inf in 100 row(s) (exp(x) = inf for x > 11.09; largest
    score 27.15) -> 100 NaN row(s)
  --> example:layer0.scores: rows (0,1,4), (0,1,5), (0,1,6), (0,1,8), ...
   = fix: subtract the row max before exp (stable softmax, torch.softmax), or upcast to fp32 before the softmax

warning[sentinel_not_representable]: mask value -1e+09 is not representable in fp16 (max 65504): 16016 value(s) become
    -inf; rows masked only by it become all -inf (NaN in naive, stable and torch)
  --> example:layer0.scores
   = fix: use a boolean mask (masked_fill(~keep, torch.finfo(dtype).min) or SDPA's bool attn_mask) instead of a constant
          the dtype cannot hold

attncheck explain CODE prints each code's meaning, threshold, example and fix
"""


@pytest.mark.parametrize("width, expected", [(80, EXAMPLE_80), (120, EXAMPLE_120)])
def test_the_built_in_examples_findings(example_findings, width, expected):
    assert render(findings_block(EXAMPLE_NAME, example_findings), width) == expected


HOSTILE = (
    "dump.pt:model.layers.[red]0[/].self_attn\x1b[2J.qkv_with_a_name_longer_than_any_line_of_eighty_columns_is_folded_x"
)

BACKWARD_80 = """\
Findings
error[grad_nan_masked_row]: eager:torch/fp32 backward: query rows with every key
    masked by -inf have a NaN softmax, and the backward spreads it: NaN in dq 1
    row(s), dk 16, dv 16 (the mask is added to the scores, so the NaN dS reaches
    dQ of the row and dK of every key)
  --> dump.pt:model.layers.[red]0[/].self_attn\\x1b[2J.qkv_with_a_name_longer_tha
      n_any_line_of_eighty_columns_is_folded_x: rows (0,1,3)
   = fix: a query row with every key masked by -inf has a NaN softmax, and its
          backward is NaN even when the row's output is zeroed or left out of
          the loss: use SDPA (its kernels and _safe_softmax give such rows zeros
          and zero gradients), mask with a finite value
          (torch.finfo(dtype).min), or let padded queries attend to one key
          (e.g. themselves)

attncheck explain CODE prints each code's meaning, threshold, example and fix
"""


def test_a_backward_finding_under_a_hostile_name_at_80_columns():
    """Markup in the name stays literal, the escape sequence is written as its escape, and the name,
    longer than a line, is folded rather than cut."""
    f = Finding(
        "grad_nan_masked_row",
        "error",
        "eager:torch/fp32 backward: query rows with every key masked by -inf have a NaN softmax, "
        "and the backward spreads it: NaN in dq 1 row(s), dk 16, dv 16 (the mask is added to the scores, so the NaN dS "
        "reaches dQ of the row and dK of every key)",
        FIX["grad_nan_masked_row"],
        ["eager:torch/fp32"],
        1,
        [(0, 1, 3)],
    )
    assert render(findings_block(HOSTILE, [f]), 80) == BACKWARD_80


def test_every_line_fits_and_later_lines_are_indented():
    f = Finding("exp_overflow", "error", "x " * 200, "y " * 100, [], 0, [(i,) for i in range(10)])
    for width in (40, 80, 120):
        lines = render(findings_block("t", [f]), width).splitlines()
        assert max(len(line) for line in lines) <= width
        fix = [i for i, line in enumerate(lines) if line.startswith("   = fix: ")][0]
        assert all(line.startswith(" " * 10 + "y") for line in lines[fix + 1 : lines.index("")])
        head = lines[1 : lines.index("  --> t: rows 0, 1, 2, 3, ...")]
        assert head[0].startswith("error[exp_overflow]: x x") and all(line.startswith("    x") for line in head[1:])
