"""FlashAttention-4's exp2: the software emulation (utils.py ``ex2_emulation_2``) and the hardware
``ex2.approx.ftz.f32`` as modelled, and the tuning table that picks which columns of a key block the
emulation computes (flash_fwd_sm100.py:100-119). A helper of the fa4 path (``paths/fa4.py``, whose docstring
states the rounding points), not a path itself: it is not registered. Torch-free at import (the fa4 path
imports it when the CLI reads the paths' specs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


M_BLOCK = 128


FRG_TILE = 32  # softmax.py:370


EMU_RES = 4  # softmax.py:366, the default apply_exp2_convert is called with


FLT_MIN = 2.0**-126


ROUND_INT = float(2**23 + 2**22)  # utils.py:775


# utils.py:42-46 (POLY_EX2[3]): fp32 values (the hex constants of e2e_asm2, utils.py:806-813)
POLY3 = (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625)


# The share of bf16-rounded exp2 results where the emulation and the modelled hardware exp2 differ, 10^6 uniform
# fp32 inputs on [-20, 0) and [-10, 0) (test_fa4.py::test_exp2_emulation_differs_from_the_model_as_issue_2263)
EX2_BF16_DIFF_20 = 0.0100


EX2_BF16_DIFF_10 = 0.0100


# flash_fwd_sm100.py:100-119: (use_2cta_instrs, is_causal, head_dim_padded, is_sm103) -> (freq, start)
_TUNING = {
    (True, False, 128, False): (10, 1),
    (False, True, 128, False): (16, 1),
    (True, False, 192, False): (16, 0),
    (False, True, 192, False): (32, 1),
    (True, False, 128, True): (0, 0),
    (False, True, 128, True): (0, 0),
    (True, False, 192, True): (0, 0),
    (False, True, 192, True): (0, 0),
    (True, False, 256, False): (14, 0),
    (True, True, 256, False): (14, 0),
}


_FP8_TUNING = {(True, False, 128, False): (10, 1), (False, True, 128, False): (8, 1)}


def _pad16(d: int) -> int:
    return -(-d // 16) * 16


def use_2cta(
    head_dim: int, head_dim_v: int, *, causal: bool, seqlen_q: int, qhead_per_kvhead: int = 1, local: bool = False
) -> bool:
    """interface.py:822-840: whether the forward runs the 2-CTA MMA (no split-KV, varlen, paging, block
    sparsity: none are modelled). PackGQA is on with GQA (interface.py:694-695)."""
    pack = qhead_per_kvhead > 1
    if head_dim == 256 and head_dim_v == 256:
        return True
    return (
        not causal
        and not local
        and _pad16(head_dim) in (128, 192)
        and _pad16(head_dim_v) == 128
        and seqlen_q * (qhead_per_kvhead if pack else 1) > 2 * M_BLOCK
        and (M_BLOCK % qhead_per_kvhead == 0 or not pack)
    )


def emu_config(
    head_dim: int,
    *,
    fp8: bool = False,
    causal: bool = False,
    seqlen_q: int = 1,
    qhead_per_kvhead: int = 1,
    head_dim_v: int | None = None,
    sm103: bool = False,
    local: bool = False,
    varlen: bool = False,
) -> tuple[int, int, int]:
    """(ex2_emu_freq, ex2_emu_res, ex2_emu_start_frg) of a call, as flash_fwd_sm100.py:244-246, 359-363 and
    507-532 derive them (freq 0: every exp2 in hardware)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    hdp = _pad16(head_dim)
    two = use_2cta(head_dim, dv, causal=causal, seqlen_q=seqlen_q, qhead_per_kvhead=qhead_per_kvhead, local=local)
    key = (two, causal, hdp, sm103)
    enable = (hdp <= 128 or (hdp == 192 and two and not causal and not local)) and not sm103
    tune = dict(zip(("freq", "start"), _TUNING[key])) if key in _TUNING else {}
    if "freq" in tune:
        enable = tune["freq"] > 0
    if fp8 and hdp >= 96 and key in _FP8_TUNING:
        tune = dict(zip(("freq", "start"), _FP8_TUNING[key]))
        enable = tune["freq"] > 0
    start = tune.get("start", 1)
    freq = 0
    if enable:
        freq = tune.get("freq", 16)
        if qhead_per_kvhead > 1 and hdp > 64 and not causal and not local:  # PackGQA
            freq = 32 if varlen else tune.get("freq", 10)
    return freq, EMU_RES, start


def emulated_columns(block_n: int, freq: int, res: int = EMU_RES, start: int = 1) -> list[int]:
    """The columns of a key block whose exp2 the emulation computes (softmax.py:378-399)."""
    if freq == 0:
        return []
    frg_cnt = block_n // FRG_TILE
    cols = []
    for j in range(frg_cnt):
        for k in range(0, FRG_TILE, 2):
            if not (k % freq < freq - res or j >= frg_cnt - 1 or j < start):
                cols += [j * FRG_TILE + k, j * FRG_TILE + k + 1]
    return cols


def _f32(x: float) -> float:
    """A Python float rounded to fp32."""
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    return float(torch.tensor(x, dtype=torch.float32))


def _fma32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """fma(a, b, c) of fp32 values with one rounding to fp32. The float64 product of two fp32 values is exact
    (48 bits); the sum with c is rounded to odd in float64 (TwoSum's error sets the last bit where the sum is
    inexact), and a round-to-odd result with 53 >= 24 + 2 bits rounds to fp32 as the exact sum would: no
    double rounding."""
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    a64 = a.double()
    p = a64 * (b.double() if isinstance(b, torch.Tensor) else float(b))
    cc = c.double() if isinstance(c, torch.Tensor) else torch.full_like(p, float(c))
    s = p + cc
    bb = s - p
    err = (p - (s - bb)) + (cc - bb)  # TwoSum: s + err = p + c exactly
    bits = s.view(torch.int64)
    fix = torch.isfinite(s) & (err != 0) & ((bits & 1) == 0)
    if bool(fix.any()):
        toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
        s = torch.where(fix, torch.nextafter(s, toward), s)
    return s.float()


def hardware_exp2(x: torch.Tensor) -> torch.Tensor:
    """ex2.approx.ftz.f32 as modelled: 2^x (x fp32) exactly, rounded once to fp32, results below 2^-126 -> 0."""
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    y = torch.exp2(x.double()).float()
    return torch.where(y < FLT_MIN, torch.zeros_like(y), y)


def ex2_emulation(x: torch.Tensor) -> torch.Tensor:
    """utils.py ``ex2_emulation_2`` on fp32 ``x``, bit for bit (module docstring, 8)."""
    # inside the function: the module imports without torch (the registry reads its spec at CLI start)
    import torch

    xc = torch.fmax(x.float(), torch.tensor(-127.0))  # fmax: NaN gives -127
    # add.rm: the exact sum rounded toward -inf to fp32. float64 may round the sum itself (x tiny: 2^23 + 2^22 -
    # 1e-40 is 2^23 + 2^22 in float64), so TwoSum keeps its error: the fp32 r lies at or below the exact sum
    # where r < s64, or r == s64 and the error is >= 0
    x64 = xc.double()
    s64 = x64 + ROUND_INT
    bb = s64 - x64
    err = (x64 - (s64 - bb)) + (ROUND_INT - bb)
    r = s64.float()
    r64 = r.double()
    above = (r64 > s64) | ((r64 == s64) & (err < 0))
    r = torch.where(above, torch.nextafter(r, torch.tensor(-math.inf)), r)
    back = r - torch.tensor(ROUND_INT, dtype=torch.float32)  # fp32 subtractions, round to nearest
    f = xc - back
    p = torch.full_like(f, POLY3[3])
    for c in (POLY3[2], POLY3[1], POLY3[0]):
        p = _fma32(p, f, c)
    bits = (r.view(torch.int32).long() << 23) + p.view(torch.int32).long()
    bits = bits & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)
