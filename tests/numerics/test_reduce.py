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
    v = (torch.randn(300_000, generator=g, dtype=torch.float64) * torch.exp(torch.randn(300_000, generator=g, dtype=torch.float64) * 20))
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
