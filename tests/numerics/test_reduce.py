"""ExactSum keeps its memory bounded and its bits: the total is math.fsum of every block sum."""

import math

import pytest
import torch

from attncheck.numerics import reduce
from attncheck.numerics.reduce import ROW_BLOCK, ExactSum


def _blocks(values: torch.Tensor) -> list[float]:
    full = values.numel() - values.numel() % ROW_BLOCK
    out = values[:full].reshape(-1, ROW_BLOCK).sum(dim=-1).tolist()
    return out + ([float(values[full:].sum())] if full < values.numel() else [])


@pytest.mark.parametrize("chunk", [1000, 4096 * 64, 77777])
def test_total_is_fsum_of_the_block_sums_with_bounded_memory(chunk, monkeypatch):
    monkeypatch.setattr(reduce, "COMPRESS_AT", 64)
    g = torch.Generator().manual_seed(chunk)
    # values over 40 orders of magnitude, both signs: an expansion of several terms
    v = torch.randn(300_000, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(300_000, generator=g, dtype=torch.float64) * 20
    )
    acc = ExactSum()
    for i in range(0, v.numel(), chunk):
        acc.add(v[i : i + chunk])
        assert acc.held < 64 + chunk // ROW_BLOCK + 1  # folded, not kept
    assert acc.total() == math.fsum(_blocks(v))


def test_non_finite_blocks_give_fsums_answer(monkeypatch):
    monkeypatch.setattr(reduce, "COMPRESS_AT", 4)
    v = torch.ones(64 * 50, dtype=torch.float64)
    v[64 * 3] = math.inf
    acc = ExactSum()
    for i in range(0, v.numel(), 64):
        acc.add(v[i : i + 64])
    assert acc.total() == math.inf and len(acc.special) == 1
    v[64 * 30] = math.nan
    acc = ExactSum()
    for i in range(0, v.numel(), 64):
        acc.add(v[i : i + 64])
    assert math.isnan(acc.total())


def test_exact_scaled_sum_is_exact_on_extremes():
    v = torch.tensor([2.0**-1074, -(2.0**-1074), 1.7e308, -1.7e308, 1.0, 2.0**-60, -0.0, 3.0], dtype=torch.float64)
    assert reduce.exact_scaled_sum(v[:0].numpy()) == 0
    from fractions import Fraction

    want = sum(Fraction(x) for x in v.tolist())
    assert Fraction(reduce.exact_scaled_sum(v.numpy()), 2**reduce._SHIFT) == want
    big = torch.full((5000,), 1.7e308, dtype=torch.float64)  # exact sums far past float64's range
    assert Fraction(reduce.exact_scaled_sum(big.numpy()), 2**reduce._SHIFT) == 5000 * Fraction(1.7e308)


def _rows_fixture() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = torch.randn(1000, generator=g, dtype=torch.float64)
    t[[3, 50, 999]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.float64)
    return t, torch.rand(1000, generator=g) < 0.3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_numpy_row_helpers_agree_with_torch(dtype):
    """count, any_true, finite, infinite and take_rows (numpy on the CPU) give what torch's own
    ops give, on contiguous and strided vectors, with NaN and +-inf, and for dtypes numpy lacks."""
    t, mask = _rows_fixture()
    t = t.to(dtype)
    for m in (mask, mask[::2], torch.zeros(5, dtype=torch.bool), torch.ones(0, dtype=torch.bool)):
        assert reduce.count(m) == int(m.sum())
        assert reduce.any_true(m) == bool(m.any())
    for v in (t, t[::3]):
        assert torch.equal(reduce.finite(v), torch.isfinite(v))
        assert torch.equal(reduce.infinite(v), torch.isinf(v))
    got, want = reduce.take_rows(t, mask), t[mask]
    assert got.dtype == want.dtype and torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5))
    every = torch.ones_like(mask)
    assert torch.equal(reduce.take_rows(t, every).nan_to_num(0.5), t.nan_to_num(0.5))
    assert reduce.take_rows(t, ~every).numel() == 0
    ints = torch.arange(1000)
    assert torch.equal(reduce.take_rows(ints, mask), ints[mask])
