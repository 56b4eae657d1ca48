"""--what-if fa4 on Q/K/V: FlashAttention-4's FP8 settings grid on logits of standard deviation 2 (flash-attention
PR 2694's setup, e4m3 values): threshold 4 with offset 8 lets P reach 2^12 = 4096 against e4m3's 448 and
saturates it (``p_saturation``), offset 4 keeps P within 2^8 and does not; the errors against float64 are
ordered as PR 2694 measured (offset 8: 0.361, offset 4: 0.022 at std 2), and the best setting is named."""

import math

import pytest
import torch

from attncheck.codes import SEVERITY
from attncheck.config.run import Options
from attncheck.judge import diagnose_attention
from attncheck.numerics.cells.plan import setting_cells
from attncheck.numerics.inputs.scores import prepare_inputs


def std2_inputs(seed: int = 0):
    """One head, 64 queries over 2048 keys, d = 64, logits S = q.k / 8 of std 2; values e4m3 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    e4m3 = torch.float8_e4m3fn
    q = (torch.randn(1, 1, 64, 64, generator=g) * 2.0).to(e4m3).to(torch.bfloat16)
    k = torch.randn(1, 1, 2048, 64, generator=g).to(e4m3).to(torch.bfloat16)
    v = torch.randn(1, 1, 2048, 64, generator=g).to(e4m3).to(torch.bfloat16)
    return prepare_inputs(q, k, None, v=v)


@pytest.fixture(scope="module")
def grid():
    inputs = std2_inputs()
    s = torch.einsum("bhqd,bhkd->bhqk", inputs.q, inputs.k) * inputs.scale  # float64: the logits as drawn
    assert 1.8 < float(s.std()) < 2.2
    diag = diagnose_attention("std2", inputs, Options(dtypes=("e4m3",)), cells=setting_cells(("fa4",), ("e4m3",)))
    (choice,) = diag.choices
    return diag, choice


def test_threshold_4_offset_8_saturates_p_and_offset_4_does_not(grid):
    diag, choice = grid
    events = {p.label: p.events.get("p_saturation", 0) for p in choice.points}
    assert events["t4,o8"] > 0 and events["t4,o4"] == 0
    # the kernel's default (threshold 0) keeps P within 2^8 < 448 whatever the offset
    assert events["t0,o8"] == 0 and events["t0,o4"] == 0
    assert choice.point("t4,o8").calls_bad == 1 and choice.point("t4,o4").calls_bad == 0
    if "p_saturation" in SEVERITY:  # the finding, where registered, names the saturating setting alone
        cells = {c for f in diag.findings if f.code == "p_saturation" for c in f.cells}
        assert "fa4(t4,o8)/e4m3" in cells and "fa4(t4,o4)/e4m3" not in cells


def test_the_errors_are_ordered_as_pr_2694_measured_and_the_best_is_named(grid):
    diag, choice = grid
    assert choice.metric == "out_rel_l1"
    err = {p.label: p.err for p in choice.points}
    assert err["t4,o8"] > 3 * err["t4,o4"]  # PR 2694 at std 2: 0.361 against 0.022 (with the quantisation's error)
    assert choice.default == "t0,o8"
    fit = [e for label, e in err.items() if label != "t4,o8"]
    assert choice.best is not None and choice.best != "t4,o8"
    assert choice.point(choice.best).err <= min(fit) * (1 + choice.tie)
    # the setting the kernel asserts against is marked, and its headroom is negative: ln(448 / 2^12)
    assert choice.point("t4,o8").refused is not None
    assert choice.point("t4,o8").headroom == pytest.approx(math.log(448 / 4096))
