"""The torch side of the dtype registry: torch dtypes and every numeric threshold.

Nothing here is typed in: overflow and underflow points follow from the
format's largest finite value, its epsilon and its smallest normal number
(``torch.finfo``) under round-to-nearest-even, and what a cast beyond the range
gives (inf, NaN, or the largest value) is measured with torch's own cast.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from attncheck.dtypes import (  # noqa: F401  (defined below loaders and numerics; numerics take them from here)
    _labels,
    check_scores_dtype,
    dtype_from_name,
    dtype_label,
    scores_dtype_error,
    spec_of,
    torch_dtype,
)
from attncheck.params import MASK_SENTINEL_LIMIT  # noqa: F401  (numerics take it from here)
from attncheck.results.common import DtypeLimits

# exp() of a low-precision tensor is evaluated in float32 and rounded (CPU and
# CUDA alike), so float32's own overflow point also bounds fp16 and bf16.
_EXP_COMPUTE_DTYPE = torch.float32


@lru_cache(maxsize=None)  # a few (value, dtype) pairs, asked for every chunk and cell
def _step(value: float, dtype: torch.dtype, by: int) -> float:
    """The value ``by`` bit patterns away from a positive ``value`` of ``dtype`` (read from the
    bits, not from finfo: torch 2.13's finfo(float8_e5m2fnuz).eps is 2**-3, its spacing is 2**-2)."""
    t = torch.tensor([value], dtype=dtype)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return float((t.view(ints) + by).view(dtype).to(torch.float64))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` at ``|value|`` rounded to it: from that value to the next one up (to
    the next one down at the largest finite value; the smallest subnormal at 0)."""
    at = float(torch.tensor([abs(value)], dtype=torch.float64).to(dtype).to(torch.float64))
    top = float(torch.finfo(dtype).max)
    at = min(at, top)
    return at - _step(at, dtype, -1) if at == top else _step(at, dtype, 1) - at


def ulp_of_one(dtype: torch.dtype) -> float:
    """The spacing just above 1.0: fp16 2**-10, bf16 2**-7, e4m3 2**-3, e5m2 2**-2."""
    return _step(1.0, dtype, 1) - 1.0


# Where rounding float32 to fp16 / bf16 is a tie: the float32 bits it drops (13 / 16) are
# exactly one half. Below fp16's smallest normal (float32 exponent field < 113) it drops
# more bits, so every such value is checked.
_TIES = {torch.float16: (0x1FFF, 0x1000, 113 << 23), torch.bfloat16: (0xFFFF, 0x8000, None)}


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded once to the nearest value of ``dtype`` (ties to even), as an IEEE cast does.

    torch casts float64 to fp16 and bf16 through float32, rounding twice: a float64 just
    below the midpoint of two fp16 values lands on the midpoint in float32 and then rounds
    up (11.0898437499 becomes 11.09375, whose exp overflows fp16; 65519.99 becomes inf).
    That can only happen where the float32 value is such a tie; those few values are
    rounded again from float64 through float32 with round-to-odd (truncate, then set the
    last bit when inexact), which float32's 13 and 16 spare bits make exact.
    """
    if x.dtype != torch.float64 or dtype not in _TIES:
        return x.to(dtype)
    f = x.to(torch.float32).contiguous()
    out = f.to(dtype)  # (...) contiguous, as f
    low, half, tiny = _TIES[dtype]
    if f.device.type == "cpu":  # numpy's integer ops are several times faster here than torch's
        bits = f.reshape(-1).numpy().view(np.int32)
        suspect = (bits & low) == half
        if tiny is not None:
            suspect |= (bits & 0x7F800000) < tiny
        idx = torch.from_numpy(np.flatnonzero(suspect))
    else:
        bits = f.reshape(-1).view(torch.int32)
        suspect = (bits & low) == half
        if tiny is not None:
            suspect |= (bits & 0x7F800000) < tiny
        idx = suspect.nonzero().flatten()
    if idx.numel():
        idx = idx.to(f.device)
        out.view(-1)[idx] = _round_to_odd(x.reshape(-1)[idx]).to(dtype)
    return out


def _round_to_odd(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, truncated, with the last bit set where the dropped part was not 0."""
    f = x.to(torch.float32)  # round to nearest: one step too far in magnitude where it rounded up
    back = f.to(torch.float64)
    inexact = (back != x) & ~torch.isnan(x)
    f = torch.where(inexact & (back.abs() > x.abs()), torch.nextafter(f, torch.zeros_like(f)), f)  # truncated
    return (f.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)


@lru_cache(maxsize=None)
def known_sentinels() -> tuple[float, ...]:
    """Mask constants in use: finfo(dtype).min of every registered dtype torch has, and
    -1e4 ... -1e38 (the -1e4 / -1e9 / -1e30 of model code)."""
    mins = [torch.finfo(dt).min for dt in _labels() if dt.is_floating_point]
    return tuple(sorted(set(mins + [-(10.0**k) for k in range(4, 39)])))


def rounding_limit(dtype: torch.dtype) -> float:
    """Smallest magnitude that rounds past the largest finite value: max + half an ulp at the top binade.

    fp16: 65504 + 16 = 65520, so 65519 still rounds to 65504 and 65520 becomes inf.
    """
    top = float(torch.finfo(dtype).max)
    return top + (top - _step(top, dtype, -1)) / 2


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The bit pattern 1: fp16 2**-24, bf16 2**-133, fp32 2**-149, e4m3 2**-9, e5m2fnuz 2**-17."""
    return _step(0.0, dtype, 1)


@lru_cache(maxsize=None)
def overflow_result(dtype: torch.dtype) -> float:
    """What torch's cast makes of a finite value beyond the range: +inf, NaN, or the largest
    finite value (a saturating cast). Measured, not assumed: in torch 2.13 on the CPU, fp16,
    bf16 and e5m2 give inf, e4m3fn saturates at 448 and the fnuz formats give NaN."""
    beyond = torch.tensor(rounding_limit(dtype) * 4, dtype=torch.float64).to(torch.float32)
    return float(beyond.to(dtype).to(torch.float64))


def exp_overflow_threshold(dtype: torch.dtype) -> float:
    """exp(x) evaluated in ``dtype`` is inf for x above this (fp16 ~11.09, bf16/fp32 ~88.72).

    Before exp, x itself is rounded to ``dtype``: in bf16 the largest x that
    survives is 88.5, and x > 88.75 rounds to 89.
    """
    limit = math.log(rounding_limit(dtype))
    if dtype != _EXP_COMPUTE_DTYPE and torch.finfo(dtype).bits < 32:
        limit = min(limit, math.log(rounding_limit(_EXP_COMPUTE_DTYPE)))
    return limit


def exp_underflow_threshold(dtype: torch.dtype) -> float:
    """exp(x) rounds to 0 in ``dtype`` for x below this (fp16 ~-17.33, bf16 ~-92.9, fp32 ~-103.97).

    Halfway to the smallest subnormal rounds to even, i.e. to zero.
    """
    tiniest = smallest_subnormal(dtype)
    half = tiniest / 2
    return math.log(half) if half > 0 else math.log(tiniest) - math.log(2)  # float64's half is 0 itself


def representable(value: float, dtype: torch.dtype) -> bool:
    """Whether a finite ``value`` stays finite and unclipped when cast to ``dtype``."""
    return math.isfinite(value) and abs(value) < rounding_limit(dtype)


def limits_of(dtype: torch.dtype) -> DtypeLimits:
    """Every limit of ``dtype`` as plain numbers."""
    fi = torch.finfo(dtype)
    beyond = overflow_result(dtype)
    return DtypeLimits(
        name=dtype_label(dtype),
        max=fi.max,
        tiny=fi.tiny,
        smallest_subnormal=smallest_subnormal(dtype),
        eps=ulp_of_one(dtype),
        rounding_limit=rounding_limit(dtype),
        overflow="inf" if math.isinf(beyond) else "nan" if math.isnan(beyond) else "saturate",
        exp_overflow=exp_overflow_threshold(dtype),
        exp_underflow=exp_underflow_threshold(dtype),
    )
