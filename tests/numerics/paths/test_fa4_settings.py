"""FlashAttention-4's settings grid (``--what-if fa4``) and the lazy rescale's headroom (the fa4 cells' limit),
against torch.finfo and torch's own casts, not against the module's arithmetic."""

import math

import pytest
import torch

from attncheck.numerics.methods.softmax import MethodParams
from attncheck.numerics.paths import fa4_settings
from attncheck.numerics.paths.fa4 import Fa4Setup

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def grid(name):
    """The grid of a dtype by its numbers: threshold (16-bit) or (threshold, offset) (FP8)."""
    out = {}
    for s in fa4_settings.settings(name):
        v = dict(s.values)
        out[v["rescale_threshold"] if name in ("fp16", "bf16") else (v["rescale_threshold"], v["max_offset"])] = s
    return out


def test_the_16_bit_grid_is_thresholds_with_the_kernels_8_as_default():
    for name in ("fp16", "bf16"):
        points = grid(name)
        assert sorted(points) == [0.0, 4.0, 8.0, 16.0]
        assert [t for t, s in points.items() if s.default] == [8.0]  # flash_fwd_sm100.py:2190 at 0251105a
        assert all(dict(s.values)["max_offset"] == 0.0 for s in points.values())  # 16-bit: no offset (:2182)
        assert {s.label for s in points.values()} == {"t0", "t4", "t8", "t16"}


def test_the_fp8_grid_is_thresholds_by_offsets_with_0_and_8_as_default():
    for name in ("e4m3", "e5m2"):
        points = grid(name)
        assert sorted(points) == [(0.0, 4.0), (0.0, 8.0), (4.0, 4.0), (4.0, 8.0)]
        assert [p for p, s in points.items() if s.default] == [(0.0, 8.0)]
        assert points[(4.0, 8.0)].label == "t4,o8"


def test_fp32_has_no_grid():
    assert fa4_settings.settings("fp32") == ()


@pytest.mark.parametrize("name", list(DTYPES))
def test_a_setting_is_marked_where_the_kernel_asserts_against_it(name):
    """The kernel asserts max_offset + rescale_threshold < log2(max of the dtype): log2 from torch.finfo here.
    fp16's threshold 16 (log2 65504 = 15.9999...) and e4m3's (4, 8) (log2 448 = 8.81) are past it."""
    top = math.log2(torch.finfo(DTYPES[name]).max)
    for s in fa4_settings.settings(name):
        v = dict(s.values)
        assert (s.refused is not None) == (v["rescale_threshold"] + v["max_offset"] >= top), (name, s)
    refused = {s.label for s in fa4_settings.settings(name) if s.refused}
    assert refused == {"fp16": {"t16"}, "bf16": set(), "e4m3": {"t4,o8"}, "e5m2": set()}[name]


@pytest.mark.parametrize("name", list(DTYPES))
def test_the_headroom_is_how_far_p_may_grow_before_its_dtype_runs_out(name):
    """headroom = ln(max) - (threshold + offset) ln 2 (|S scale| units: P = exp of a logit's lead over the held
    max), from torch.finfo; and it is negative exactly where the largest P the setting allows, 2^(t + o), is
    not held by the dtype: torch's own cast of it saturates, overflows or turns NaN."""
    dt = DTYPES[name]
    top = float(torch.finfo(dt).max)
    for s in fa4_settings.settings(name):
        t, o = dict(s.values)["rescale_threshold"], dict(s.values)["max_offset"]
        kind, threshold, what, value = fa4_settings.limit(dt, MethodParams(fa4=dict(s.params)["fa4"]))
        headroom = threshold - value
        assert kind == "p_saturation"
        assert headroom == pytest.approx(math.log(top) - (t + o) * math.log(2.0), rel=1e-12, abs=1e-12)
        p_max = torch.tensor(2.0 ** (t + o), dtype=torch.float64)
        held = float(p_max.to(torch.float32).to(dt).to(torch.float64)) == 2.0 ** (t + o)
        assert held == (headroom >= 0), (name, t, o, headroom)


def test_the_defaults_apply_where_a_setting_is_none():
    """Fa4Setup(None, None) and no setup at all are the kernel's defaults: bf16 threshold 8, e4m3 0 and 8."""
    ln2 = math.log(2.0)
    for setup in (None, Fa4Setup()):
        params = MethodParams(fa4=setup)
        assert fa4_settings.limit(torch.bfloat16, params)[3] == pytest.approx(8 * ln2)
        assert fa4_settings.limit(torch.float8_e4m3fn, params)[3] == pytest.approx(8 * ln2)
    only_t = MethodParams(fa4=Fa4Setup(rescale_threshold=4.0))
    assert fa4_settings.limit(torch.float8_e4m3fn, only_t)[3] == pytest.approx(12 * ln2)  # offset stays 8
    # e4m3 with PR 2694's threshold 4 and offset 8: P up to 4096 against 448
    kind, threshold, what, value = fa4_settings.limit(torch.float8_e4m3fn, only_t)
    assert threshold - value == pytest.approx(math.log(448 / 4096))
    assert "2^12" in what and "448" in what


def test_a_setting_asked_on_the_command_line_joins_the_grid_once():
    from attncheck.config.run import Options

    asked = Options(fa4=Fa4Setup(rescale_threshold=2.0))
    assert [s.label for s in fa4_settings.settings("bf16", asked)] == ["t0", "t4", "t8", "t16", "t2"]
    # e4m3 with offset 4 and the default threshold 0: already a grid point
    same = Options(fa4=Fa4Setup(max_offset=4.0))
    assert [s.label for s in fa4_settings.settings("e4m3", same)] == ["t0,o4", "t0,o8", "t4,o4", "t4,o8"]
    (extra,) = [s for s in fa4_settings.settings("e4m3", asked) if s.label == "t2,o8"]
    assert extra.refused is not None  # 2 + 8 >= log2(448) = 8.81
    assert dict(extra.params)["fa4"] == Fa4Setup(rescale_threshold=2.0, max_offset=8.0)
