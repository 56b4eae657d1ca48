"""The softmax implementations attncheck compares, each computed the way real code does.

All work on the last axis and keep leading axes (batch, heads, queries).
The input is already in the cell's dtype; every tensor op below runs in that
dtype unless a comment says otherwise, so rounding, overflow and NaN behaviour
are the real ones on CPU and CUDA alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attncheck.errors import AttncheckError
from attncheck.names import METHOD_ALIASES, METHOD_NAMES

ACCUMULATIONS = ("fp32", "dtype")


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
    the dtype). 'dtype': pairwise tree with every partial sum rounded to the dtype."""
    if accum == "fp32" or e.dtype in (torch.float32, torch.float64):
        return e.sum(dim=-1, keepdim=True)
    n = e.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    s = torch.nn.functional.pad(e, (0, width - n)) if width != n else e
    while s.shape[-1] > 1:  # log2(T) levels; each addition rounds to the dtype
        s = s[..., 0::2] + s[..., 1::2]
    return s


def naive_softmax(x: torch.Tensor, accum: str = "fp32") -> torch.Tensor:
    """Textbook ``exp(x) / sum(exp(x))`` in x's dtype: overflows for x > ln(max)."""
    return run_method("naive", x, accum=accum).probs


def stable_softmax(x: torch.Tensor, accum: str = "fp32") -> torch.Tensor:
    """``z = x - max(x); exp(z) / sum(exp(z))`` in x's dtype."""
    return run_method("stable", x, accum=accum).probs


def torch_softmax(x: torch.Tensor) -> torch.Tensor:
    """The framework's own ``torch.softmax`` (float32 internally, result in x's dtype)."""
    return torch.softmax(x, dim=-1)


def tiled_softmax(x: torch.Tensor, block: int = 128, reverse: bool = False) -> torch.Tensor:
    """FlashAttention's one-pass online softmax over key blocks; returns float32.

    Running max ``m`` and sum ``l`` are float32, as in the kernels. Block j gives
    ``P_j = exp(S_j - m_j)`` rounded to x's dtype (what the P@V matmul consumes);
    ``l`` sums the float32 exps before that rounding, as the kernels do. The
    effective probability of a block-j entry is ``P_j * exp(m_j - m_final) / l_final``,
    the weight the kernel's rescaled output gives that key. A fully masked row
    gives zeros, not NaN (the kernels guard ``exp(-inf - (-inf))``).
    """
    if block < 1:
        raise AttncheckError(f"block size must be >= 1, got {block}")
    n = x.shape[-1]
    starts = list(range(0, n, block))
    if reverse:
        starts.reverse()
    lead = x.shape[:-1]
    m = torch.full((*lead, 1), float("-inf"), dtype=torch.float32, device=x.device)
    l = torch.zeros((*lead, 1), dtype=torch.float32, device=x.device)
    p_blocks = torch.empty_like(x)  # (..., T) in x's dtype
    m_used = torch.empty((*lead, len(starts)), dtype=torch.float32, device=x.device)
    for j, s0 in enumerate(starts):  # loop over key blocks, not rows
        s = x[..., s0 : s0 + block].float()  # (..., B)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        e = torch.exp(s - m_safe)
        l = torch.exp(m - m_safe) * l + e.sum(dim=-1, keepdim=True)
        p_blocks[..., s0 : s0 + block] = e.to(x.dtype)
        m_used[..., j : j + 1] = m_safe
        m = m_new
    m_final = torch.where(m == float("-inf"), 0.0, m)
    inv_l = torch.where((l == 0) | torch.isnan(l), 1.0, 1.0 / l)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for j, s0 in enumerate(starts):
        rescale = torch.exp(m_used[..., j : j + 1] - m_final) * inv_l  # (..., 1)
        out[..., s0 : s0 + block] = p_blocks[..., s0 : s0 + block].float() * rescale
    return out


@dataclass
class MethodOutput:
    """Probabilities of one method plus what happened inside it, per row."""

    probs: torch.Tensor  # (..., T); x's dtype, float32 for tiled
    overflow_rows: torch.Tensor  # (...) bool: an exp or the row sum hit inf from finite inputs
    underflow_rows: torch.Tensor  # (...) bool: every exp flushed to 0 although the row had finite entries


def canonical_method(name: str) -> str:
    key = name.strip().lower()
    key = METHOD_ALIASES.get(key, key)
    if key not in METHOD_NAMES:
        raise AttncheckError(f"unknown method {name!r} (choose from {', '.join(METHOD_NAMES)})")
    return key


def run_method(
    method: str,
    x: torch.Tensor,
    *,
    block: int = 128,
    reverse: bool = False,
    accum: str = "fp32",
) -> MethodOutput:
    """Run one method on scores already cast to the cell's dtype, keeping its internal events."""
    method = canonical_method(method)
    if accum not in ACCUMULATIONS:
        raise AttncheckError(f"unknown accumulation {accum!r} (choose from {', '.join(ACCUMULATIONS)})")
    no_rows = torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
    if method in ("naive", "stable"):
        x_max = x.amax(dim=-1, keepdim=True)  # (..., 1)
        z = x if method == "naive" else x - x_max
        e = torch.exp(z)
        s = _row_sum(e, accum)
        probs = e / s
        # The row's largest exp tells whether any overflowed or all flushed (stable: it is
        # exp(0) = 1). A finite row max rules out +inf inputs, reported as such elsewhere.
        finite_max = torch.isfinite(x_max.squeeze(-1))
        s = s.squeeze(-1)
        if method == "naive":
            e_max = e.amax(dim=-1)
            overflow = finite_max & (torch.isinf(e_max) | torch.isinf(s))
            underflow = finite_max & (e_max == 0)
        else:
            overflow = finite_max & torch.isinf(s)
            underflow = no_rows
        return MethodOutput(probs, overflow, underflow)
    if method == "tiled":
        return MethodOutput(tiled_softmax(x, block=block, reverse=reverse), no_rows, no_rows)
    return MethodOutput(torch_softmax(x), no_rows, no_rows)
