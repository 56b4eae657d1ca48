"""The one-pass (online) softmax over key blocks that ``tiled`` and the FP8 P cast share.

Its rounding points, stated once because two implementations follow them to the bit
(these torch ops, which run on any device, and the fused CPU kernel
``numba_kernels.tiled_rows``; ``tests/numerics/methods/test_tiled_kernel.py`` holds them equal):

- scores s in float32; a row is cut into key blocks of ``block`` (the last may be short,
  padded with -inf keys), visited first to last or last to first (``reverse``);
- m_j: the running max after visited block j, float32; the guard m'_j = 0 where m_j = -inf;
- e = exp(s - m'_j): the subtraction in float32, the exp correctly rounded to float32
  (taken in float64; a GPU's exp2.approx is within 2 ulp of it, torch's CPU exp within 1);
- the block sum of e: a halving tree in float32 (the block zero-padded to a power of two,
  its two halves added elementwise until one value is left), as a warp's shuffle reduction
  combines lanes;
- l_j = exp(m_{j-1} - m'_j) l_{j-1} + blocksum_j, each product and sum rounded to float32;
- the effective probability of a key of block j: P_j exp(m_j - m_final) / l, where P_j is e
  as the P@V product consumes it (rounded to the cell's dtype, or scaled and cast to FP8),
  with exp(m_j - m_final) rounded to float32, times 1/l (float32; 1 where l is 0, so a fully
  masked row gives zeros), and for FP8 then divided by the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def exp_f32(z: torch.Tensor) -> torch.Tensor:
    """exp of float32 ``z``, rounded once to float32 (computed in float64)."""
    return torch.exp(z.double()).float()


def halving_sum(e: torch.Tensor) -> torch.Tensor:
    """(..., B) float32 -> (...): the halving-tree sum in float32 (zero-padded to a power of two)."""
    n = e.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    s = torch.nn.functional.pad(e, (0, width - n)) if width != n else e
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


@dataclass
class OnlineBlocks:
    """A row block's online softmax before P is formed: blocks in visiting order."""

    e: torch.Tensor  # (..., nb, B) float32 exp(s - m'_j)
    m_run: torch.Tensor  # (..., nb) running max after each visited block
    rescale: torch.Tensor  # (..., nb) float32 exp(m_j - m_final) / l
    n: int  # keys
    block: int
    reverse: bool

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """(..., nb, B) in visiting order -> (..., n) in key order."""
        if self.reverse:
            t = t.flip(-2)
        return t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])[..., : self.n]

    def first_at_max(self) -> torch.Tensor:
        """(..., 1): the visited block where the running max reaches the row max."""
        return (self.m_run == self.m_run[..., -1:]).to(torch.int8).argmax(dim=-1, keepdim=True)


def online_blocks(x: torch.Tensor, block: int, reverse: bool = False) -> OnlineBlocks:
    """The online softmax of ``x`` (..., T) over key blocks of ``block`` (see the module's rounding points)."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    nb = -(-n // block)
    s = x.float()
    if nb * block != n:
        s = torch.nn.functional.pad(s, (0, nb * block - n), value=NEG_INF)
    s = s.reshape(*lead, nb, block)
    if reverse:
        s = s.flip(-2)
    m_run = torch.cummax(s.amax(dim=-1), dim=-1).values  # (..., nb)
    m_safe = torch.where(m_run == NEG_INF, 0.0, m_run)  # guard exp(-inf - (-inf))
    e = exp_f32(s - m_safe.unsqueeze(-1))  # (..., nb, B)
    block_sum = halving_sum(e)  # (..., nb)
    m_prev = torch.cat([torch.full_like(m_run[..., :1], NEG_INF), m_run[..., :-1]], dim=-1)
    decay = exp_f32(m_prev - m_safe)  # (..., nb): rescales l from m_{j-1} to m_j
    l = torch.zeros(lead, dtype=torch.float32, device=x.device)
    for j in range(nb):  # loop over key blocks, not rows
        l = decay[..., j] * l + block_sum[..., j]
    inv_l = torch.where((l == 0) | torch.isnan(l), 1.0, 1.0 / l).unsqueeze(-1)  # (..., 1)
    # The kernel rescales its output block by block; the factors telescope to exp(m_j - m_final).
    # A block whose running max is still -inf contributed P_j = 0 and is rescaled by exp(-inf) = 0.
    rescale = exp_f32(m_run - m_safe[..., -1:]) * inv_l  # (..., nb)
    return OnlineBlocks(e, m_run, rescale, n, block, reverse)


def online_softmax(x: torch.Tensor, p_dtype: torch.dtype, block: int, reverse: bool = False) -> torch.Tensor:
    """The effective probabilities (..., T) float32 of the online softmax of ``x``, with P_j rounded
    to ``p_dtype`` (kept in float32 for float32): tiled's softmax on scores of any dtype, and the
    flash path's on its float32 S."""
    ob = online_blocks(x, block, reverse)
    p = ob.e if p_dtype == torch.float32 else ob.e.to(p_dtype).float()  # P_j as the P@V matmul consumes it
    return ob.keys(p.mul_(ob.rescale.unsqueeze(-1)))
