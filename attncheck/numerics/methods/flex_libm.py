"""The fp32 arithmetic of FlexAttention's compiled CPU kernel, emulated on tensors: one-rounding fp32 FMA,
``Vectorized<float>::exp_u20`` bit for bit (its polynomial constants as float bits), the C library's ``expf``,
the SIMD width, and the unit roundoffs and error constants the bounds of ``methods/flex.py`` are stated with."""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


U32 = 2.0**-24  # fp32 unit roundoff


# exp_u20's largest relative error against exp, measured (our emulation, bit-identical to the
# AVX2 exp_u20 on 9.2e7 inputs, among them every float in [-1, -2^-10]) at 6.43 * 2^-24 for
# outputs above 2^-125; taken as 8 * 2^-24. Below that it returns 0 (absolute error < 2^-124).
ETA_U20 = 8 * U32


ETA_EXPF = 2 * U32  # glibc expf: at most 0.502 ulp, one ulp is at most 2^-23 of the value


ETA_TAIL = U32 * (1 + 2.0**-27)  # the tail's double exp rounded to float (and ours, likewise)


_TINY = 2.0**-124  # absolute floor of an exp near the bottom of the fp32 range


_MANT = {torch.float32: (24, -126), torch.bfloat16: (8, -126), torch.float16: (11, -14)}


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


# the constants of Vectorized<float>::exp_u20 (vec256_float.h / vec512_float.h), as float bits
_C1, _C2, _C3, _C4, _C5 = (_f32(b) for b in (0x3F7FFFFB, 0x3EFFFEE3, 0x3E2AAD40, 0x3D2B9D0D, 0x3C07CFCE))


_LOG2E, _LN2F = _f32(0x3FB8AA3B), _f32(0x3F317218)


_LN_FLT_MIN, _LN_FLT_MAX = _f32(0xC2AEAC50), _f32(0x42B17218)


def fma32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """fp32 fused multiply-add a*b + c rounded once (as _mm256_fmadd_ps): the product is exact in
    float64, the sum is rounded to odd in float64 (TwoSum error, then the odd neighbour), which
    then rounds to float32 as the single rounding would."""
    a64 = a.double()
    b64 = torch.as_tensor(b, dtype=torch.float64)
    c64 = torch.as_tensor(c, dtype=torch.float64)
    p = a64 * b64
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    adj = (err != 0) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(err > 0, math.inf, -math.inf)
    return torch.where(adj, torch.nextafter(s, toward.to(s.dtype)), s).float()


def exp_u20(x: torch.Tensor) -> torch.Tensor:
    """``at::vec::Vectorized<float>::exp_u20`` of torch 2.13 (``ATen/cpu/vec/vec256/vec256_float.h``,
    the AVX512 version is the same arithmetic) on float32 ``x``, bit for bit: fx = floor(x log2e +
    1/2), r = x - fx ln2 (fused), a degree-5 Horner polynomial of FMAs, times 2^(fx-1) built from
    its bits, times 2; 0 below ln(FLT_MIN)."""
    x = x.float()
    less = x < _LN_FLT_MIN
    src = x.clamp(max=_LN_FLT_MAX).clamp(min=_LN_FLT_MIN)
    fx = torch.floor(fma32(src, _LOG2E, 0.5))
    r = fma32(-fx, _LN2F, src)
    res = fma32(r, _C5, _C4)
    for c in (_C3, _C2, _C1, 1.0):
        res = fma32(r, res, c)
    n = (fx - 1).to(torch.int32)
    two = ((n + 127) << 23).view(torch.float32)  # 2^(fx-1); bits 0 (the value 0) at fx = -126
    two = torch.where(less, 0.0, two)
    return (res * two) * 2.0


def expf(x: torch.Tensor) -> torch.Tensor:
    """exp of float32 ``x`` rounded to float32 (computed in float64): a stand-in for glibc's expf
    (at most 0.502 ulp; the two differ by one ulp on about 1 input in 1400)."""
    return torch.exp(x.double()).float()


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (float64; the subnormal spacing below the normal range)."""
    p, emin = _MANT[dtype]
    _, e = torch.frexp(x.double().abs())
    e = torch.where(x == 0, emin - p + 1, e - p).clamp(min=emin - p + 1)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e)


def gamma(n: torch.Tensor | float) -> torch.Tensor:
    """Higham's gamma_n = n u / (1 - n u) for fp32: a sum of n roundings of relative size <= u."""
    n = torch.as_tensor(n, dtype=torch.float64)
    return n * U32 / (1 - n * U32)


def _rounds_same(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True where rounding to ``dtype`` (through float32) is constant on [lo, hi]: both ends round
    to the same value, and rounding is monotone."""

    def rd(t: torch.Tensor) -> torch.Tensor:
        return t.float().to(dtype)

    return rd(lo) == rd(hi)


def vec_width(width: int | None = None) -> int:
    """Floats per ``at::vec::Vectorized<float>`` in the kernel torch 2.13's inductor builds here: 16
    with AVX512, else 8 (AVX2; compiled flex on CPU needs AVX2, ``_inductor/kernel/flex/flex_cpu.py:
    check_cpu_supported``)."""
    if width is not None:
        return int(width)
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
