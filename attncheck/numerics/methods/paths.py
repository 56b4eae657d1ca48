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
  mask; then over key blocks (``block``, forward or reverse) the running max m and sum l
  in fp32, P_j = exp(S_j - m_j) rounded to the dtype for the P@V product, O accumulated
  in fp32 and rescaled by exp(m_{j-1} - m_j), and at the end O times 1/l, rounded to the
  dtype; a running max of -inf is treated as 0 (no exp(-inf - (-inf))) and fully masked
  rows give zeros. The CUDA kernels fold the scale into exp2 (differences at the fp32
  rounding level); the CPU kernel's vectorised exp is an approximation of a few fp32 ulp.
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

NEG_INF = float("-inf")


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
    v = None if block.v is None else cast(block.v, dt)
    n = block.q.shape[0]
    p, o = online_attention(s.reshape(n, -1, s.shape[-1]), dt, params.block, params.reverse, v)
    out = MethodOutput(p.reshape(s.shape), out=None if o is None else o.reshape(-1, o.shape[-1]))
    return PathBlock(s, before, [], [("flash", out)])


def online_attention(s: torch.Tensor, p_dtype: torch.dtype, block: int, reverse: bool = False, v: torch.Tensor | None = None):
    """FlashAttention's one-pass softmax (and P@V) over key blocks, block by block.

    ``s`` (n, tq, T) float32 scores; ``v`` (n, T, dv) in ``p_dtype`` or None. Returns the
    effective probabilities (n, tq, T) float32, P_j exp(m_j - m_final) / l (the weight
    the output gives each key), and O (n, tq, dv) in ``p_dtype`` (None without v).
    """
    n, tq, t = s.shape
    nb = -(-t // block)
    m = torch.full((n, tq, 1), NEG_INF, device=s.device)
    l = torch.zeros((n, tq, 1), device=s.device)
    acc = None if v is None else torch.zeros((n, tq, v.shape[-1]), device=s.device)
    p_blocks: list = [None] * nb
    m_at: list = [None] * nb
    for j in (range(nb - 1, -1, -1) if reverse else range(nb)):  # loop over key blocks, not rows
        keys = slice(j * block, min((j + 1) * block, t))
        m_new = torch.maximum(m, s[..., keys].amax(dim=-1, keepdim=True))
        base = torch.where(m_new == NEG_INF, 0.0, m_new)  # a running max of -inf counts as 0
        e = torch.exp(s[..., keys] - base)  # (n, tq, B) float32
        alpha = torch.exp(m - base)  # rescales the sum and output so far to the new max
        l = l * alpha + e.sum(dim=-1, keepdim=True)
        pj = e.to(p_dtype)  # what the P@V product consumes
        if acc is not None:
            acc = acc * alpha + torch.matmul(pj.float(), v[:, keys].float())
        p_blocks[j], m_at[j] = pj, m_new
        m = m_new
    inv = torch.where(l == 0, 1.0, 1.0 / l)  # fully masked rows: sum 0 is taken as 1, so they give zeros
    m_final = torch.where(m == NEG_INF, 0.0, m)
    # A block seen while the running max was -inf has P_j = 0: its factor is 0, not exp(0 - m_final).
    scale = [torch.where(mj == NEG_INF, 0.0, torch.exp(mj - m_final)) * inv for mj in m_at]
    p_eff = torch.cat([pj.float() * f for pj, f in zip(p_blocks, scale)], dim=-1)
    out = None if acc is None else (acc * inv).to(p_dtype)
    return p_eff, out
