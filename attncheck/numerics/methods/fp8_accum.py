"""The FP8 tensor cores' accumulator (Hopper and Ada), as a stated model.

What is published (no NVIDIA documentation states it):

- SageAttention 2 (thu-ml/SageAttention; the paper, quoted in thu-ml/SageAttention issue 287 and by its
  authors in deepseek-ai/DeepGEMM issue 37): for ``mma(f32.e4m3.e4m3.f32)`` / an FP8 WGMMA, D = A B + C
  with A = B = 0 returns C unchanged when C has at most 13 mantissa bits (1 sign, 8 exponent, 13 mantissa:
  "FP22") and C with its 10 low mantissa bits zeroed (truncated) when it has more.
- DeepSeek-V3's technical report (quoted in deepseek-ai/DeepGEMM issue 50): the FP8 GEMM aligns the
  mantissa products by right shifts to the largest exponent and keeps about 14 bits of each, the rest
  truncated; DeepGEMM promotes the partial sum to an fp32 accumulator on the CUDA cores every
  N_C = 128 elements of K ("two-level accumulation").
- vllm-project/flash-attention PR 104 (upstreamed as Dao-AILab/flash-attention PR 2250, open) runs each
  key block's P@V on a zeroed accumulator and adds it to the fp32 O in fp32 (`hopper/utils.h`, `gemm`:
  `tCrC = tCrC_original + tCrC`); PR 122 does it every N key blocks ("steps", interval 4 by default in
  `hopper/setup.py` FLASH_ATTENTION_FP8_TWO_LEVEL_INTERVAL): the working O is merged into a separate fp32
  accumulator with the deferred rescale (`softmax.h`, `merge_accum_with_scale`) and cleared. Figures
  (Llama-3.1-8B, FP8 KV cache, needle-in-a-haystack multikey at 128k): 0.89 / 0.88 / 0.856 with a flush
  every 1 / 4 / 64 steps. Upstream FlashAttention-3 has none of it: its FP8 P@V WGMMAs accumulate into O
  itself for the whole key range.

The model (``mma_accumulate_fp8``), one step per MMA instruction of ``k_step`` = 32 FP8 elements of K (the
K of an e4m3/e5m2 WGMMA or mma.sync m16n8k32):

1. the step's products a_ik b_kj and their sum are exact, and are added to the accumulator's value exactly;
2. the result is truncated toward zero to ``mantissa_bits`` mantissa bits (13 by default) in fp32's
   exponent range; that is the accumulator after the step.

Exact: step 1 for e4m3 operands (every product is a multiple of 2^-18 below 2^18, so a sum of 32 of
them and the accumulator's value are exact in float64 unless the accumulator passes 2^35); the
truncation itself (the low bits of float64's encoding cleared). Assumed: that the
truncation applies once per instruction to the exact sum (the published experiment isolates it on C
alone; DeepSeek's account truncates each aligned product instead, which differs by at most a few
units in the 13th bit); e5m2 products span more than float64's 53 bits and are summed in float64;
subnormal accumulator values are truncated as if fp32 had more exponent range. ``flush_every`` = N
keeps that reduced accumulator for N steps, then adds it in fp32 (round to nearest) to a separate
fp32 accumulator and starts again from zero, as the two-level schemes do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch

DEFAULT_MANTISSA_BITS = 13  # FP22: SageAttention 2's measurement on Ada and Hopper
K_STEP = 32  # FP8 elements of K per tensor-core instruction (wgmma k = 32, mma.sync m16n8k32)
FP32_MANTISSA_BITS = 23


def truncate_mantissa(x: "torch.Tensor", mantissa_bits: int) -> "torch.Tensor":
    """``x`` (float64) truncated toward zero to ``mantissa_bits`` bits after the leading one; exact for
    normal float64 values (every value an fp32 accumulator can hold): float64 is sign and magnitude, so
    clearing the low 52 - mantissa_bits bits of its encoding truncates the magnitude."""
    if not 0 <= mantissa_bits <= 52:
        raise ValueError(f"mantissa_bits must be in 0..52, got {mantissa_bits}")
    mask = -(1 << (52 - mantissa_bits))  # ...111000 in two's complement: the low bits cleared
    return (x.contiguous().view(torch.int64) & mask).view(torch.float64)


def mma_accumulate_fp8(
    acc: "torch.Tensor | None",
    a: "torch.Tensor",
    b: "torch.Tensor",
    *,
    mantissa_bits: int | None = DEFAULT_MANTISSA_BITS,
    flush_every: int | None = None,
    k_step: int = K_STEP,
) -> "torch.Tensor":
    """acc + a @ b as an FP8 tensor core accumulates it (the model in the module docstring).

    ``a`` (..., m, K) and ``b`` (..., K, n) float64 holding FP8 values; ``acc`` (..., m, n) fp32 (or
    None: zero). Each step of ``k_step`` elements of K adds its exact partial sum to the accumulator and
    truncates the result to ``mantissa_bits`` (None: fp32, the sum rounded to nearest fp32 instead). With
    ``flush_every`` = N, the truncated accumulator starts at zero, and every N steps (and after the last)
    it is added to the fp32 accumulator (which starts at ``acc``) in fp32. Returns float32 (..., m, n).
    """
    if flush_every is not None and flush_every < 1:
        raise ValueError(f"flush_every must be at least 1, got {flush_every}")
    kdim = a.shape[-1]
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    outer = torch.zeros(shape, dtype=torch.float64, device=a.device) if acc is None else acc.double()
    a64, b64 = a.double(), b.double()

    def step_round(x: torch.Tensor) -> torch.Tensor:
        if mantissa_bits is None:
            return x.float().double()
        return truncate_mantissa(x, mantissa_bits)

    if flush_every is None:
        work = outer
        for k0 in range(0, kdim, k_step):  # one instruction per step; rows and columns vectorised
            work = step_round(work + a64[..., k0 : k0 + k_step] @ b64[..., k0 : k0 + k_step, :])
        return work.float()
    work = torch.zeros_like(outer)
    nsteps = -(-kdim // k_step)
    for i, k0 in enumerate(range(0, kdim, k_step)):
        work = step_round(work + a64[..., k0 : k0 + k_step] @ b64[..., k0 : k0 + k_step, :])
        if (i + 1) % flush_every == 0 or i == nsteps - 1:
            outer = (outer + work).float().double()  # the fp32 add on the CUDA cores
            work = torch.zeros_like(outer)
    return outer.float()
