"""The fa3 preset: FlashAttention-3's published FP16 error figures (arXiv 2407.08608,
section 4.3), reproduced and checked against PyTorch's own kernels on the same draws."""

import math

import pytest
import torch

from attncheck.numerics.presets import FA3_D, FA3_HEADS, FA3_SEQ, fa3
from attncheck.numerics.synthetic import make_qk


@pytest.fixture(scope="module")
def result():
    return fa3()


@pytest.fixture(scope="module")
def draws():
    q, k, v = make_qk(FA3_HEADS, FA3_SEQ, FA3_SEQ, FA3_D, dist="outliers", seed=0, with_v=True)  # (H, T, d) float64
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(FA3_D), dim=-1) @ v
    return q.half(), k.half(), v.half(), exact


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
    o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, False)
    flash = next(r.measured for r in result.rows if r.cell == "flash/fp16")
    assert flash == pytest.approx(rmse(o[0], exact), rel=0.02)


def test_fa3_baseline_figure_is_hand_written_fp16_attention(result, draws):
    """Standard attention written with fp16 tensors: every intermediate in fp16."""
    q, k, v, exact = draws
    s = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(FA3_D))
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    o = torch.matmul(e / e.sum(dim=-1, keepdim=True), v)
    assert o.dtype == torch.float16
    base = next(r.measured for r in result.rows if r.cell == "eager:stable/fp16")
    assert base == pytest.approx(rmse(o, exact), rel=1e-9)
