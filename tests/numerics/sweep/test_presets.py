"""The fa3 preset: FlashAttention-3's published FP16 error figures (arXiv 2407.08608,
section 4.3), reproduced and checked against PyTorch's own kernels on the same draws."""

import math

import numpy as np
import pytest
import torch

from attncheck.numerics.sweep.presets import FA3_D, FA3_HEADS, FA3_SEQ, fa3
from attncheck.numerics.sweep.synthetic import make_qk


@pytest.fixture(scope="module")
def result():
    return fa3()


@pytest.fixture(scope="module")
def draws():
    q, k, v = make_qk(FA3_HEADS, FA3_SEQ, FA3_SEQ, FA3_D, dist="outliers", seed=0, with_v=True)  # (H, T, d) float64
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(FA3_D), dim=-1) @ v
    return q, k, v, exact


def rmse(o: torch.Tensor, exact: torch.Tensor) -> float:
    return float((o.double() - exact).pow(2).mean().sqrt())


def test_fa3_reproduces_the_ratio_and_each_figure_within_2x(result):
    by_cell = {r.cell: r for r in result.rows}
    base, flash = by_cell["eager:stable/fp16"].measured, by_cell["flash/fp16"].measured
    assert 1.3 <= base / flash <= 2.3  # the paper: 1.7
    assert 0.5 <= base / 3.2e-4 <= 2 and 0.5 <= flash / 1.9e-4 <= 2
    assert all(c.holds for c in result.checks) and [c.value for c in result.checks][0] == pytest.approx(base / flash)


def test_fa3_flash_figure_is_pytorchs_cpu_flash_kernel(result, draws):
    """The same draws through PyTorch's CPU FlashAttention kernel (key blocks of 512, ours 128)."""
    q, k, v, exact = draws
    q, k, v = q.half(), k.half(), v.half()
    o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, False)
    flash = next(r.measured for r in result.rows if r.cell == "flash/fp16")
    assert flash == pytest.approx(rmse(o[0], exact), rel=0.02)


def test_fa3_baseline_figure_is_hand_written_fp16_attention(result, draws):
    """Standard attention written with fp16 tensors: every intermediate in fp16 (the float64
    draws rounded once to fp16, as numpy casts; torch's .half() would round twice, through fp32)."""
    q, k, v, exact = draws
    q, k, v = (torch.from_numpy(t.numpy().astype(np.float16)) for t in (q, k, v))
    s = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(FA3_D))
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    o = torch.matmul(e / e.sum(dim=-1, keepdim=True), v)
    assert o.dtype == torch.float16
    base = next(r.measured for r in result.rows if r.cell == "eager:stable/fp16")
    assert base == pytest.approx(rmse(o, exact), rel=1e-9)


def test_fa3_fp8_rows_reproduce_table_3(result):
    """FlashAttention-3's FP8 figures: the baseline / FA3 ratio (paper 2.6) within 1.8 to 3.5, every
    figure within 2x, and incoherent processing below every row without it (the paper's ordering)."""
    fp8 = {r.cell: r.measured for r in result.rows if "e4m3" in r.cell}
    base, fa3_fp8 = fp8["baseline-fp8/e4m3"], fp8["flash-fp8/e4m3 block, incoherent"]
    assert 1.8 <= base / fa3_fp8 <= 3.5
    for r in result.rows:
        assert 0.5 <= r.measured / r.paper <= 2, r.label
    incoherent = max(fa3_fp8, fp8["flash-fp8/e4m3 tensor, incoherent"])
    assert incoherent < min(fp8["flash-fp8/e4m3 block"], base)


def test_fa3_fp8_baseline_is_an_independent_fp8_computation(result, draws):
    """The paper's baseline FP8 attention written out here: per-tensor e4m3 Q, K, V, S rounded to
    fp16, fp16 softmax, P cast to e4m3 as is, P8 @ V8 in fp32, O in bf16."""
    q, k, v, exact = draws
    e4m3 = torch.float8_e4m3fn

    def quant(x):
        ds = (x.double().abs().max() / 448).float()
        return (x.float() / ds).clamp(-448, 448).to(e4m3).float(), ds

    (q8, dq), (k8, dk), (v8, dv) = (quant(t) for t in (q, k, v))
    s = (q8 @ k8.transpose(-1, -2) * (dq * dk) / math.sqrt(FA3_D)).half()
    p = torch.softmax(
        s.float(), dim=-1
    ).half()  # fp16 softmax: torch's fp16 softmax rounds once, the paper keeps fp16 intermediates
    o = ((p.float().to(e4m3).float() @ v8) * dv).bfloat16()
    base = next(r.measured for r in result.rows if r.cell == "baseline-fp8/e4m3")
    assert base == pytest.approx(rmse(o, exact), rel=0.05)


def test_pcast_preset_measures_the_sink_collapse():
    from attncheck.numerics.sweep.presets import PCAST_SCALES, pcast

    r = pcast()
    assert all(c.holds for c in r.checks), [(c.claim, c.value) for c in r.checks]
    rows = {(row[0], row[1]): row for row in r.grids[0].rows}
    assert len(rows) == 7 * len(PCAST_SCALES)
    # Past the critical gap 6.93 + ln S - delta_k the forward share passes one half, as the closed form says.
    assert rows[("8", "1")][4] > 0.5 > rows[("4", "1")][4]
    assert rows[("12", "448")][3] == pytest.approx(0.5, abs=0.05)  # 12 + 1.03 ~ 6.93 + ln 448 = 13.04
