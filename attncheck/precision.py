"""Dtype table and every numeric threshold, derived from ``torch.finfo``.

Nothing here is typed in: overflow and underflow points follow from the
format's largest finite value, its epsilon and its smallest normal number,
under round-to-nearest-even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.errors import AttncheckError
from attncheck.names import DTYPE_ALIASES, DTYPE_NAMES

# Finite scores at or below this look like an additive mask sentinel (-1e4, -1e9,
# finfo.min): no real logit gets there, and every sentinel in use is at or below it.
MASK_SENTINEL_LIMIT = -1e4

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
DTYPE_LABELS: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

# exp() of a low-precision tensor is evaluated in float32 and rounded (CPU and
# CUDA alike), so float32's own overflow point also bounds fp16 and bf16.
_EXP_COMPUTE_DTYPE = torch.float32


def dtype_from_name(name: str) -> torch.dtype:
    """'fp16' / 'float16' / 'half' -> torch.float16; unknown names raise AttncheckError."""
    key = DTYPE_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in DTYPE_NAMES:
        raise AttncheckError(f"unknown dtype {name!r} (choose from {', '.join(DTYPE_NAMES)})")
    return TORCH_DTYPES[key]


def dtype_label(dtype: torch.dtype) -> str:
    """torch.float16 -> 'fp16'; other dtypes fall back to their torch name."""
    return DTYPE_LABELS.get(dtype, str(dtype).removeprefix("torch."))


def rounding_limit(dtype: torch.dtype) -> float:
    """Smallest magnitude that rounds to inf: max + half an ulp at the top binade.

    fp16: 65504 + 16 = 65520, so 65519 still rounds to 65504 and 65520 becomes inf.
    """
    fi = torch.finfo(dtype)
    _, top_exp = math.frexp(fi.max)  # max = m * 2**top_exp with m in [0.5, 1)
    half_ulp = math.ldexp(fi.eps / 2, top_exp - 1)
    return fi.max + half_ulp


def smallest_subnormal(dtype: torch.dtype) -> float:
    """2**(min_exp - mantissa_bits): fp16 2**-24, bf16 2**-133, fp32 2**-149."""
    fi = torch.finfo(dtype)
    return fi.tiny * fi.eps


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
    return math.log(smallest_subnormal(dtype) / 2)


def representable(value: float, dtype: torch.dtype) -> bool:
    """Whether a finite ``value`` stays finite when cast to ``dtype``."""
    return math.isfinite(value) and abs(value) < rounding_limit(dtype)


@dataclass(frozen=True)
class DtypeLimits:
    """What a dtype can hold, for reports."""

    name: str
    max: float
    tiny: float
    smallest_subnormal: float
    eps: float
    exp_overflow: float
    exp_underflow: float

    @classmethod
    def of(cls, dtype: torch.dtype) -> "DtypeLimits":
        fi = torch.finfo(dtype)
        return cls(
            name=dtype_label(dtype),
            max=fi.max,
            tiny=fi.tiny,
            smallest_subnormal=smallest_subnormal(dtype),
            eps=fi.eps,
            exp_overflow=exp_overflow_threshold(dtype),
            exp_underflow=exp_underflow_threshold(dtype),
        )
