"""Attention paths: from Q, K (and V) in a dtype to the probabilities P and the output
O = P@V, each with the rounding points of the implementation it names (registry.PATHS).

- ``eager``: hand-written attention, as Hugging Face's ``eager`` implementation and most
  user code compute it: Q and K cast to the dtype, S = Q@K^T accumulated in fp32 and
  rounded to the dtype, the scale applied to the scores (or to q first), the mask added
  in the dtype (all in ``scores.QKBlock.in_dtype``); the chosen softmax method; P in the
  dtype; O = P@V. Both products are torch's matmul in the dtype (fp32 accumulation
  inside, the result rounded to the dtype): the ops hand-written attention runs, so it
  gets the same bits on the same device (``tests/numerics/methods/test_paths.py``).
- ``sdpa-math``: PyTorch's math backend of ``scaled_dot_product_attention``, as torch 2.13
  computes it (``_scaled_dot_product_attention_math`` in
  aten/src/ATen/native/transformers/attention.cpp): fp16/bf16 q, k and v are upcast to
  fp32 (unless ``allow_fp16_bf16_reduction_math_sdp`` is set), q and k^T are each
  multiplied by sqrt(scale), S = q @ k^T in fp32, the mask (bool -> 0/-inf in the
  dtype) added, ``_safe_softmax`` (softmax, with rows whose every score is -inf set to
  0), O = P @ v in fp32 cast to the dtype. ``tests/numerics/methods/test_paths.py`` checks this
  path against the MATH backend bit for bit.
- ``flash``: the FlashAttention-2 forward, as PyTorch's CPU flash kernel computes it
  (``cpu_flash_attention`` in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, torch
  2.13): S = q @ k^T in fp32 from q and k in the dtype, times the scale in fp32, plus the
  mask; then the online softmax over key blocks (``block``, forward or reverse) with the
  rounding points of ``attncheck.numerics.methods.online`` (the ``tiled`` method's, on fp32
  S): running max m and sum l in fp32, P_j = exp(S_j - m_j) rounded to the dtype, a running
  max of -inf treated as 0 (no exp(-inf - (-inf))), so fully masked rows give zeros. O is
  the effective probabilities P_j exp(m_j - m_final) / l times V in fp32, rounded to the
  dtype once: the kernel accumulates the same sum block by block, rescaling by
  exp(m_{j-1} - m_j) as it goes, which differs from it by fp32 rounding only. The kernel's
  vectorised exp is an approximation of a few fp32 ulp that gives 0 below about -87, ours is
  exp rounded once to fp32 (subnormal down to -103.97): the terms of keys that far below the
  running max are in one and not the other; the CUDA kernels fold the scale into exp2
  (differences at the fp32 rounding level).
- ``flex-math``: FlexAttention without torch.compile, as torch 2.13 computes it (``math_attention``
  in torch/_higher_order_ops/flex_attention.py): q and k upcast to fp32, S = q @ k^T in fp32 times
  the scale in fp32, the score_mod applied in fp32 and masked keys set to -inf (the recorded
  logits, ``AttentionInputs.logits32``, where a score_mod was given), ``_safe_softmax`` in fp32 (rows
  with no key: 0), P cast to the dtype, O = P @ V by torch's matmul in the dtype. Bit-exact with
  torch's own flex_attention (``tests/numerics/methods/test_flex_paths.py``).
- ``flex``: FlexAttention's fused kernel (torch.compile'd flex_attention): on the same fp32 logits,
  the rounding points of ``attncheck.numerics.methods.flex.flex_compiled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from attncheck.numerics.precision import cast
from attncheck.numerics.methods.softmax import MethodOutput, MethodParams
from attncheck.registry import METHODS

if TYPE_CHECKING:
    from attncheck.numerics.inputs.scores import QKBlock

@dataclass
class PathBlock:
    """One block of rows of one path in one dtype."""

    scores: torch.Tensor  # (r, Tk) the scores the softmax ran on; their float64 softmax is the cells' algo reference
    before: list[tuple[str, torch.Tensor]]  # NaN causes before 'fully_masked', in pipeline order
    after: list[tuple[str, torch.Tensor]]  # ... and after it
    cells: list[tuple[str, MethodOutput]]  # (method, its probabilities, events and output)


def _matmul_rows(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(r, Tk) rows of P (heads of v.shape[0]) times v (n, Tk, dv) -> (r, dv)."""
    n, tk = v.shape[0], v.shape[1]
    return torch.matmul(p.reshape(n, -1, tk), v).reshape(-1, v.shape[-1])


def eager(block: "QKBlock", dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    xc, before, after = block.in_dtype(dt)  # (r, Tk) scores in dt
    v = None if block.v is None else cast(block.v, dt)
    cells = []
    for name in methods:
        out = METHODS.get(name).function()(xc, params)
        if v is not None:  # P in the dtype (as .to(value.dtype) leaves it), torch's matmul in the dtype
            out.out = _matmul_rows(out.probs.to(dt), v)
        cells.append((name, out))
    return PathBlock(xc, before, after, cells)


def safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """torch's _safe_softmax: softmax over the last axis, 0 where every score of a row is -inf."""
    p = torch.softmax(s, dim=-1)
    return torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)


def sdpa_math(block: "QKBlock", dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    s, before = block.fp32_scores(dt, "sdpa-math")  # (r, Tk) float32
    p = safe_softmax(s)
    out = MethodOutput(p)
    if block.v is not None:
        out.out = _matmul_rows(p, cast(block.v, dt).float()).to(dt)
    return PathBlock(s, before, [], [("sdpa-math", out)])


def flash(block: "QKBlock", dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    s, before = block.fp32_scores(dt, "flash")  # (r, Tk) float32
    p = (params.online or _online)(s, dt, params.block, params.reverse)  # (r, Tk) effective probabilities, float32
    out = MethodOutput(p)
    if block.v is not None:  # O = P_eff @ V in fp32, rounded to the dtype once
        out.out = _matmul_rows(p, cast(block.v, dt).float()).to(dt)
    return PathBlock(s, before, [], [("flash", out)])


def _online(s: torch.Tensor, p_dtype: torch.dtype, block: int, reverse: bool = False) -> torch.Tensor:
    from attncheck.numerics.methods.online import online_softmax

    return online_softmax(s, p_dtype, min(block, s.shape[-1]), reverse)


def flex_math(block: "QKBlock", dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    s, before = block.fp32_scores(dt, "flex-math")  # (r, Tk) float32: the logits after flex's score_mod and mask
    p = safe_softmax(s).to(dt)  # P as flex's math path casts it, to the query's dtype
    out = MethodOutput(p)  # kept in the dtype, as the eager path's: the KL floor is the dtype's smallest subnormal
    if block.v is not None:
        out.out = _matmul_rows(p, cast(block.v, dt))  # torch's matmul in the dtype
    return PathBlock(s, before, [], [("flex-math", out)])


def flex(block: "QKBlock", dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    from attncheck.numerics.methods.flex import flex_kernel_rows

    s, before = block.fp32_scores(dt, "flex")  # (r, Tk) float32
    v = None if block.v is None else cast(block.v, dt)
    p, o = flex_kernel_rows(s, v, dt, block=block.inp.flex_block)  # effective probabilities (r, Tk) float32; O (r, dv) in dt
    out = MethodOutput(p)
    out.out = o
    return PathBlock(s, before, [], [("flex", out)])
