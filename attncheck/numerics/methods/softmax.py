"""The softmax implementations attncheck compares, each computed the way real code does.

Each is registered in ``attncheck.registry.METHODS`` as a function
``(x, MethodParams) -> MethodOutput``. All work on the last axis and keep leading
axes (batch, heads, queries). The input is already in the cell's dtype; every tensor op below runs in that
dtype unless a comment says otherwise, so rounding, overflow and NaN behaviour
are the real ones on CPU and CUDA alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.methods.fp8 import pcast_softmax
from attncheck.numerics.methods.online import online_softmax
from attncheck.numerics.reduce import count, finite, infinite
from attncheck.numerics.rowmath import row_sum
from attncheck.params import ACCUMULATIONS, DEFAULT_BLOCK
from attncheck.registry import EVENTS, METHODS


def reference_softmax(x: torch.Tensor) -> torch.Tensor:
    """float64 max-subtracted softmax of ``x`` as given: the yardstick for every error.

    Rows that are all -inf, or hold +inf or NaN, come out NaN: the softmax of
    such a row is undefined, and the diagnosis names the reason.
    """
    x64 = x.to(torch.float64)
    z = x64 - x64.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    return e / e.sum(dim=-1, keepdim=True)


def _row_sum(e: torch.Tensor, accum: str) -> torch.Tensor:
    """Row sum with keepdim. 'fp32': as torch does (float32 inside, result rounded to
    the dtype; fp32 by torch's own sum). 'dtype': pairwise tree with every partial sum
    rounded to the dtype (fp32 included), as a hand-written tree reduction does."""
    if accum == "fp32" or e.dtype == torch.float64:
        return row_sum(e, keepdim=True)
    n = e.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    s = torch.nn.functional.pad(e, (0, width - n)) if width != n else e
    while s.shape[-1] > 1:  # log2(T) levels; each addition rounds to the dtype
        s = s[..., 0::2] + s[..., 1::2]
    return s


def naive_softmax(x: torch.Tensor, accum: str = "fp32") -> torch.Tensor:
    """Textbook ``exp(x) / sum(exp(x))`` in x's dtype: overflows for x > ln(max)."""
    return naive_method(x, MethodParams(accum=accum)).probs


def stable_softmax(x: torch.Tensor, accum: str = "fp32") -> torch.Tensor:
    """``z = x - max(x); exp(z) / sum(exp(z))`` in x's dtype."""
    return stable_method(x, MethodParams(accum=accum)).probs


def torch_softmax(x: torch.Tensor) -> torch.Tensor:
    """The framework's own ``torch.softmax`` (float32 internally, result in x's dtype)."""
    return torch.softmax(x, dim=-1)


def tiled_softmax(x: torch.Tensor, block: int = DEFAULT_BLOCK, reverse: bool = False) -> torch.Tensor:
    """FlashAttention's one-pass online softmax over key blocks; returns float32.

    Running max ``m`` and sum ``l`` are float32, as in the kernels. Block j gives
    ``P_j = exp(S_j - m_j)`` rounded to x's dtype (what the P@V matmul consumes);
    ``l`` sums the float32 exps before that rounding, as the kernels do. The
    effective probability of a block-j entry is ``P_j * exp(m_j - m_final) / l_final``,
    the weight the kernel's rescaled output gives that key. A fully masked row
    gives zeros, not NaN (the kernels guard ``exp(-inf - (-inf))``). Every rounding
    point is listed in ``attncheck.numerics.methods.online``; the fused CPU kernel follows the
    same ones to the bit.
    """
    if block < 1:
        raise AttncheckError(f"must be >= 1, got {block}", param="block")
    block = min(block, x.shape[-1])  # a block wider than the row is the row: same numbers, no padding to allocate
    return online_softmax(x, x.dtype, block, reverse)


@dataclass(frozen=True)
class MethodParams:
    """What a method may be told besides the scores."""

    block: int = DEFAULT_BLOCK  # key block of tiled
    reverse: bool = False  # tiled visits key blocks last to first
    accum: str = "fp32"  # row sums of naive/stable: 'fp32' (as torch) or 'dtype' (pairwise in the dtype)
    fp8: Any = None  # FP8 cells: fp8_attention.Fp8Setup (the P format and scale, how Q, K, V are quantised)
    buffers: "Buffers | None" = None  # where a method writes its probabilities; None: fresh tensors
    # (scores (r, T), P dtype, block, reverse) -> the online softmax's effective probabilities, as the
    # row backend computes them (its fused kernel); None: online.online_softmax's torch ops (same bits)
    online: Any = None
    fa4: Any = None  # the fa4 path's what-if: paths.fa4.Fa4Setup (rescale threshold, max offset); None: the kernel's


class Buffers:
    """Output tensors reused from chunk to chunk: a method's probabilities go into the
    buffer of its name, valid until that name is taken again (the diagnosis takes each
    name once per dtype and is done with the output before the next dtype). Writing
    into the same memory saves an allocation and its page faults per method and chunk;
    the numbers are those of the same ops into fresh tensors."""

    def __init__(self) -> None:
        self._bytes: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of ``like``'s shape, dtype and device."""
        n = like.numel() * like.element_size()
        raw = self._bytes.get(name)
        if raw is None or raw.numel() < n or raw.device != like.device:
            raw = self._bytes[name] = torch.empty(n, dtype=torch.uint8, device=like.device)
        return raw[:n].view(like.dtype).view(like.shape)


def _output(params: MethodParams, name: str, like: torch.Tensor) -> torch.Tensor | None:
    """The tensor method ``name`` writes into: a reused buffer, or None (the op allocates)."""
    return None if params.buffers is None or not like.is_contiguous() else params.buffers.take(name, like)


@dataclass
class MethodOutput:
    """Probabilities of one method plus what happened inside it, per row."""

    probs: torch.Tensor  # (..., T); x's dtype, or float32 for methods whose output is 'fp32'
    events: dict[str, torch.Tensor] = field(default_factory=dict)  # registry.EVENTS name -> (...) bool rows
    out: torch.Tensor | None = None  # (..., dv) the output O = P@V as the implementation computes it, with V
    pcast: Any = None  # FP8 cells: fp8.PCastSoftmax (which probabilities the P cast flushed, and where)
    # Per event, a per-row value the report quotes for the event's rows (the least over them): a kernel's
    # log-sum-exp for its backward hazard
    extremes: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per event, how many values of each row it hit (summed over the rows): FlashAttention-4's saturated P
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    # FP8 cells with the tensor cores' reduced accumulator: O (..., dv) of the same kernel under other
    # accumulators ('fp32', 'flush N'; fp8_attention.accum_companions), for the fp8_accumulator finding
    companions: dict[str, torch.Tensor] = field(default_factory=dict)
    accum: str | None = None  # FP8 cells: how P@V accumulates (fp8_attention.accum_label)

    @property
    def overflow_rows(self) -> torch.Tensor:
        return event_rows(self.events, "overflow", self.probs.shape[:-1], self.probs.device)

    @property
    def underflow_rows(self) -> torch.Tensor:
        return event_rows(self.events, "underflow", self.probs.shape[:-1], self.probs.device)


def event_rows(
    events: dict[str, torch.Tensor], kind: str, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """(...) bool: rows with any event that counts as ``kind`` ('overflow' or 'underflow')."""
    out = torch.zeros(shape, dtype=torch.bool, device=device)
    for name, hit in events.items():
        if EVENTS[name] == kind:
            out |= hit
    return out


def _exp_softmax(x: torch.Tensor, accum: str, subtract_max: bool, out: torch.Tensor | None = None) -> MethodOutput:
    """exp, row sum and division as three tensor ops in x's dtype, into ``out`` when given
    (the division in place: the same rounding as ``e / s``)."""
    if subtract_max:
        x_max = x.amax(dim=-1, keepdim=True)  # (..., 1)
        e = torch.sub(x, x_max, out=out).exp_()
    else:
        e = torch.exp(x, out=out)
    s = _row_sum(e, accum).squeeze(-1)
    # An inf row sum means an exp overflowed (then the sum is inf too) or, every exp being
    # finite, the sum itself did; only those rows are searched for an inf exp. A zero sum
    # means every exp flushed to 0 (stable has exp(0) = 1). A finite row max rules out NaN
    # and +inf inputs, reported as such elsewhere; naive needs it only in the rows whose
    # sum is inf or 0, so only those are searched for their max.
    if subtract_max:  # exp(x - max) <= 1: only the sum can overflow
        events = {"sum_overflow": finite(x_max.squeeze(-1)) & infinite(s)}
    else:
        finite_max = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
        exp_inf = torch.zeros_like(finite_max)
        inf_sum = infinite(s)
        suspect = inf_sum | (s == 0)
        n_suspect = count(suspect)
        if n_suspect:
            flat = x.reshape(-1, x.shape[-1])
            if 8 * n_suspect > flat.shape[0]:  # many (an fp16 sum overflows often): one pass beats a gather
                finite_max = finite(x.amax(dim=-1))
            else:
                rows = torch.nonzero(suspect.reshape(-1)).flatten()
                finite_max.view(-1)[rows] = finite(flat[rows].amax(dim=-1))
            inf_sum &= finite_max
            hit = torch.nonzero(inf_sum.reshape(-1)).flatten()
            if hit.numel():
                exp_inf.view(-1)[hit] = torch.isinf(e.reshape(-1, e.shape[-1])[hit]).any(dim=-1)
        events = {"exp_overflow": exp_inf, "sum_overflow": inf_sum & ~exp_inf, "underflow": finite_max & (s == 0)}
    probs = e.div_(s.unsqueeze(-1))  # after the events, which read the exps
    return MethodOutput(probs, events)


def naive_method(x: torch.Tensor, params: MethodParams) -> MethodOutput:
    return _exp_softmax(x, params.accum, subtract_max=False, out=_output(params, "naive", x))


def stable_method(x: torch.Tensor, params: MethodParams) -> MethodOutput:
    return _exp_softmax(x, params.accum, subtract_max=True, out=_output(params, "stable", x))


def tiled_method(x: torch.Tensor, params: MethodParams) -> MethodOutput:
    if params.fp8 is not None:  # an FP8 cell: x is fp32, P is scaled and cast to the format (numerics.fp8)
        r = pcast_softmax(x, params.fp8.fmt, params.fp8.p_scale, params.block, params.reverse)
        return MethodOutput(r.probs, pcast=r)
    return MethodOutput(tiled_softmax(x, block=params.block, reverse=params.reverse))


def torch_method(x: torch.Tensor, params: MethodParams) -> MethodOutput:
    out = _output(params, "torch", x)
    if out is None:
        return MethodOutput(torch_softmax(x))
    return MethodOutput(torch._softmax(x, -1, False, out=out))  # the kernel torch.softmax calls, into the buffer


def run_method(
    method: str, x: torch.Tensor, *, block: int = DEFAULT_BLOCK, reverse: bool = False, accum: str = "fp32"
) -> MethodOutput:
    """Run one registered method on scores already cast to the cell's dtype, keeping its events."""
    spec = METHODS.get(method, param="methods")
    if accum not in ACCUMULATIONS:
        raise AttncheckError(f"unknown accumulation {accum!r} (choose from {', '.join(ACCUMULATIONS)})", param="accum")
    if block < 1:
        raise AttncheckError(f"must be >= 1, got {block}", param="block")
    return spec.function()(x, MethodParams(block=block, reverse=reverse, accum=accum))
