"""Thresholds derived from torch.finfo, checked against brute-force measurement and DESIGN.md's table."""

import math

import pytest
import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.precision import (
    cast,
    dtype_from_name,
    exp_overflow_threshold,
    exp_underflow_threshold,
    representable,
    rounding_limit,
    smallest_subnormal,
)

from .rounding import nearest


def _first_x_where(dtype, predicate, lo, hi, n=400_001):
    """Smallest float64 x on a fine grid (x cast to dtype before exp) where predicate(exp(x)) holds."""
    xs = torch.linspace(lo, hi, n, dtype=torch.float64)
    hit = predicate(torch.exp(xs.to(dtype)))
    assert hit.any()
    return xs[hit][0].item()


@pytest.mark.parametrize(
    "dtype,expected",
    [(torch.float16, 11.09), (torch.bfloat16, 88.72), (torch.float32, 88.72)],
    ids=["fp16", "bf16", "fp32"],
)
def test_exp_overflow_threshold_matches_design_table(dtype, expected):
    assert exp_overflow_threshold(dtype) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(
    "dtype,expected",
    [(torch.float16, -17.33), (torch.bfloat16, -92.8), (torch.float32, -103.97)],
    ids=["fp16", "bf16", "fp32"],
)
def test_exp_underflow_threshold_matches_design_table(dtype, expected):
    assert exp_underflow_threshold(dtype) == pytest.approx(expected, abs=0.1)


def test_exp_overflow_threshold_matches_measured_exp(dtype):
    thr = exp_overflow_threshold(dtype)
    measured = _first_x_where(dtype, torch.isinf, thr - 1.0, thr + 1.0)
    # x is rounded to the dtype before exp: the measured switch point lies within
    # half an ulp of x at the threshold (bf16: 0.25 near 88.7, so 88.75).
    half_ulp_x = math.ldexp(torch.finfo(dtype).eps, math.frexp(thr)[1] - 1) / 2
    assert abs(measured - thr) <= half_ulp_x + 1e-4


def test_bf16_overflow_switches_at_88_75_after_rounding():
    assert not torch.isinf(torch.exp(torch.tensor(88.74, dtype=torch.float64).to(torch.bfloat16)))
    assert torch.isinf(torch.exp(torch.tensor(88.76, dtype=torch.float64).to(torch.bfloat16)))


def test_exp_underflow_threshold_matches_measured_exp(dtype):
    thr = exp_underflow_threshold(dtype)
    xs = torch.linspace(thr - 1.0, thr + 1.0, 400_001, dtype=torch.float64)
    zero = torch.exp(xs.to(dtype)) == 0
    last_zero = xs[zero][-1].item()
    half_ulp_x = math.ldexp(torch.finfo(dtype).eps, math.frexp(abs(thr))[1] - 1) / 2
    assert abs(last_zero - thr) <= half_ulp_x + 1e-4


def test_rounding_limit_is_where_the_cast_overflows(dtype):
    # float32 inputs (what dumps hold): the float32 just below the limit stays finite.
    limit = torch.tensor(rounding_limit(dtype), dtype=torch.float32)
    below = torch.nextafter(limit, torch.tensor(0.0))
    assert torch.isfinite(below.to(dtype)) and torch.isinf(limit.to(dtype))


def test_torch_casts_float64_through_float32_but_cast_rounds_once():
    # Double rounding: a float64 just below fp16's limit first rounds up to 65520 in
    # float32, then to inf. attncheck's cast rounds once: to 65504, the nearest fp16.
    v = math.nextafter(rounding_limit(torch.float16), 0)
    assert torch.isinf(torch.tensor(v, dtype=torch.float64).to(torch.float16))
    assert cast(torch.tensor(v, dtype=torch.float64), torch.float16).item() == 65504.0


FORMATS = {torch.float16: (11, -14, 15), torch.bfloat16: (8, -126, 127)}


@pytest.mark.parametrize("dtype", list(FORMATS), ids=["fp16", "bf16"])
def test_cast_rounds_float64_once_to_the_nearest_value(dtype):
    # Midpoints between neighbouring values of the dtype, a hair either side of them
    # (below float32's resolution there, where rounding through float32 goes wrong), and
    # random values over the whole range including subnormals and overflow.
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-(2**15), 2**15 - 1, (4000,), generator=g, dtype=torch.int32).to(torch.int16)
    grid = ints.view(dtype).double()
    grid = grid[torch.isfinite(grid)]
    nxt = torch.nextafter(grid.to(dtype), torch.tensor(math.inf, dtype=dtype)).double()
    ok = torch.isfinite(nxt)
    mid = (grid[ok] + nxt[ok]) / 2
    tiny = mid.abs() * 2.0**-40
    rand = torch.exp(torch.rand(4000, generator=g, dtype=torch.float64) * 400 - 200) * torch.sign(
        torch.randn(4000, generator=g, dtype=torch.float64)
    )
    xs = torch.cat(
        [
            mid,
            mid - tiny,
            mid + tiny,
            rand,
            torch.tensor([65519.99999, -65519.99999, 1e300, -1e-300, 0.0, math.inf, -math.inf]),
        ]
    )
    bits, emin, emax = FORMATS[dtype]
    want = torch.tensor([nearest(v, bits, emin, emax) for v in xs.tolist()], dtype=torch.float64)
    got = cast(xs, dtype).double()
    assert torch.equal(got, want), xs[got != want][:5]
    assert torch.isnan(cast(torch.tensor([math.nan], dtype=torch.float64), dtype)).all()
    assert (
        torch.tensor([math.nextafter(11.08984375, 0)], dtype=torch.float64).to(torch.float16) == 11.09375
    ).all()  # torch: twice


def test_fp16_known_limits():
    assert rounding_limit(torch.float16) == 65520.0
    assert smallest_subnormal(torch.float16) == 2.0**-24
    assert smallest_subnormal(torch.bfloat16) == 2.0**-133
    assert smallest_subnormal(torch.float32) == 2.0**-149
    assert not representable(-1e9, torch.float16)
    assert representable(torch.finfo(torch.float16).min, torch.float16)
    assert not representable(torch.finfo(torch.float32).min, torch.bfloat16)


def test_smallest_subnormal_is_the_smallest_positive_value(dtype):
    s = smallest_subnormal(dtype)
    assert torch.tensor(s, dtype=torch.float64).to(dtype).item() == s
    assert torch.tensor(s * 0.5, dtype=torch.float64).to(dtype).item() == 0.0  # ties to even: 0


@pytest.mark.parametrize(
    "name,expected",
    [("fp16", torch.float16), ("half", torch.float16), ("BF16", torch.bfloat16), ("float32", torch.float32)],
)
def test_dtype_names(name, expected):
    assert dtype_from_name(name) is expected


def test_unknown_dtype_name():
    with pytest.raises(AttncheckError, match="unknown dtype 'fp8'"):
        dtype_from_name("fp8")
