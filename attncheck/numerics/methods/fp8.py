"""FP8 numerics: the cast the kernels do, and the one-pass softmax whose P is cast to FP8.

The kernels convert fp32 to FP8 with round-to-nearest-even and saturation to the
largest finite value (PTX ``cvt.rn.satfinite.e4m3x2.f32``, which FlashAttention-3 and
SageAttention reach through CUTLASS' converters); NaN stays NaN. torch's own CPU cast
rounds the same way; what it does beyond the range depends on the format and the torch
version (``precision.overflow_result`` measures it): torch 2.13 saturates e4m3fn at 448,
gives inf in e5m2 and NaN in the fnuz formats. ``to_fp8`` is the kernels' conversion;
``cast_overflow`` says which values a cast would clip.

The P cast (FlashAttention-3's FP8 forward, SageAttention): the exps of a key block,
taken against the running row max m_j in fp32, are multiplied by a static scale S
(FlashAttention-3: 2^8, through a max offset of 8 in its exp2; SageAttention: 448) so
that the largest is S, then cast to FP8 for the P@V product. A probability whose scaled
value is below half the smallest FP8 subnormal rounds to 0: for e4m3 (smallest subnormal
2^-9) that is exp(s - m_j) S < 2^-10, i.e. m_j - s > 10 ln 2 + ln S = 6.93 + ln S
(``flush_threshold``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.numerics.methods.online import online_blocks
from attncheck.numerics.precision import rounding_limit, smallest_subnormal

NEG_INF = float("-inf")
BEFORE, AT, AFTER = 0, 1, 2  # a key's block, in visiting order, against the block that holds the row max
POSITIONS = ("before_max", "max_block", "after_max")


def to_fp8(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``x`` (float32) rounded to the FP8 format ``dt`` as the kernels convert it: nearest even,
    finite values beyond the range clamped to +-max (satfinite), NaN kept."""
    top = torch.finfo(dt).max
    return x.clamp(-top, top).to(dt)  # clamp keeps NaN; +-inf become +-max, as satfinite does


def fp8_values(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``to_fp8(x, dt)`` as float32 values (copied into a float32 tensor: on the CPU that is
    several times faster than ``.float()`` of the FP8 tensor, with the same values)."""
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(to_fp8(x, dt))


def cast_overflow(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Where a finite ``x`` lies beyond what ``dt`` holds: the values a cast clips (or, in a
    non-saturating cast, turns into inf or NaN). Half an ulp past the top still rounds down."""
    return torch.isfinite(x) & (x.abs() >= rounding_limit(dt))


def flush_threshold(dt: torch.dtype, p_scale: float) -> float:
    """m - s beyond which exp(s - m) * p_scale rounds to 0 in ``dt``: ln(p_scale) - ln(tiny / 2),
    with tiny the smallest subnormal (e4m3: 2^-9, so 10 ln 2 + ln S = 6.93 + ln S)."""
    return math.log(p_scale) - math.log(smallest_subnormal(dt) / 2)


@dataclass
class PCastTally:
    """What the P cast did to the probabilities a chunk's reference holds (``live``: the
    reference is > 0), by block position (BEFORE, AT, AFTER)."""

    live: torch.Tensor  # (3,) int64
    flushed: torch.Tensor  # (3,) int64: live keys the cast flushed to 0
    mass: torch.Tensor  # (k,) float64: the reference probability flushed, in each row that lost any


@dataclass
class PCastSoftmax:
    """The one-pass softmax of a row block whose P is cast to FP8 after scaling by S."""

    probs: torch.Tensor  # (..., T) float32: the weight the output gives each key, fp8(P~_j)/S exp(m_j - m) / l
    flushed: torch.Tensor  # (..., T) bool: P~ > 0 in fp32 but 0 after the FP8 cast
    block_position: (
        torch.Tensor
    )  # (..., nb) int8 per key block (in key order): against the row max's block, in visiting order (BEFORE/AT/AFTER)
    overflow: torch.Tensor  # (...) bool rows where some P~ exceeded the FP8 range (S above its max) and was clipped
    p_scale: float = 1.0  # S
    block: int = 0  # keys per block (the last may be cut short)

    @property
    def position(self) -> torch.Tensor:
        """(..., T) int8: each key's ``block_position``."""
        n = self.flushed.shape[-1]
        return self.block_position.repeat_interleave(self.block, dim=-1)[..., :n]

    def counts_by_position(self, mask: torch.Tensor) -> torch.Tensor:
        """(3,) int64: the keys where ``mask`` (..., T) holds, by block position (BEFORE, AT, AFTER);
        counted per block, then per position, never per key."""
        n, nb = mask.shape[-1], self.block_position.shape[-1]
        m = mask.reshape(-1, n)
        if nb * self.block != n:
            m = torch.nn.functional.pad(m, (0, nb * self.block - n))
        per_block = m.reshape(-1, nb, self.block).sum(dim=-1)  # (r, nb)
        pos = self.block_position.reshape(-1, nb)
        return torch.stack([(per_block * (pos == k)).sum() for k in (BEFORE, AT, AFTER)]).cpu()

    def tally(self, ref: torch.Tensor, rows: torch.Tensor) -> PCastTally:
        """The keys of ``rows`` (r,) bool where ``ref`` (r, T) float64 is > 0, and those the cast flushed."""
        keys = ref.shape[-1]
        live = (ref > 0) & rows[:, None]
        flushed = self.flushed.reshape(-1, keys) & live
        hit = torch.nonzero(flushed.any(dim=-1)).flatten()
        mass = (ref[hit] * flushed[hit]).sum(dim=-1)  # reference probability the cast dropped, in rows that lost any
        return PCastTally(self.counts_by_position(live), self.counts_by_position(flushed), mass.cpu())


@dataclass
class PCastRows:
    """The P cast's counts per row, as the fused kernel takes them against the reference of
    the rows where it is defined (``algo.ok``): the same tally as ``PCastSoftmax`` gives."""

    live: torch.Tensor  # (r, 3) int64
    flushed: torch.Tensor  # (r, 3) int64
    mass: torch.Tensor  # (r,) float64
    overflow: torch.Tensor  # (r,) bool
    p_scale: float

    def tally(self, ref: torch.Tensor, rows: torch.Tensor) -> PCastTally:
        hit = rows & (self.flushed.sum(dim=-1) > 0)
        return PCastTally(self.live[rows].sum(dim=0), self.flushed[rows].sum(dim=0), self.mass[hit])


def pcast_softmax(x: torch.Tensor, dt: torch.dtype, p_scale: float, block: int, reverse: bool = False) -> PCastSoftmax:
    """FlashAttention's one-pass softmax over key blocks with P cast to ``dt`` (FP8).

    Scores in float32; key blocks of ``block`` visited first to last or last to first
    (``reverse``, as FlashAttention-3's FP8 forward does). The running max m_j and the
    row sum l are float32; l sums the fp32 exps before the cast, as the kernels' row sum
    does. Block j gives P~_j = exp(s - m_j) * p_scale in fp32, cast to ``dt`` (``to_fp8``).
    The effective probability of a key is fp8(P~_j) * exp(m_j - m_final) / l / p_scale:
    the weight the kernel's rescaled output gives it. Fully masked rows give zeros. The
    rounding points are ``attncheck.numerics.methods.online``'s; the fused CPU kernel follows them.
    """
    lead = x.shape[:-1]
    ob = online_blocks(x, block, reverse)
    scaled = ob.e.mul_(p_scale)  # P~ in fp32, at most p_scale: exp(s - m_j) <= 1 against the running max
    if p_scale < rounding_limit(dt):  # nothing reaches the top of the format: no clip to count
        overflow = torch.zeros(lead, dtype=torch.bool, device=x.device)
    else:
        overflow = cast_overflow(scaled, dt).flatten(-2).any(dim=-1)
    p8 = fp8_values(scaled, dt)
    flushed = (p8 == 0) & (scaled > 0)
    probs = p8.mul_(ob.rescale.unsqueeze(-1)).div_(p_scale)
    # The block (in visiting order) where the running max reaches the row max.
    first = ob.first_at_max()
    nb = ob.m_run.shape[-1]
    j = torch.arange(nb, device=x.device)
    pos = torch.where(j < first, BEFORE, torch.where(j == first, AT, AFTER)).to(torch.int8)  # (..., nb)
    if reverse:
        pos = pos.flip(-1)
    return PCastSoftmax(ob.keys(probs), ob.keys(flushed), pos, overflow, p_scale, block)
