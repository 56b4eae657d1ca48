"""A soft cap between Q@K^T and the softmax, ``cap * tanh(S * scale / cap)`` as Gemma-2's eager
attention computes it (every step in the scores' dtype): S can round to inf in that dtype while the
capped logits stay finite, so the headroom is S's, measured before the cap, and an overflow the cap
hides is said with what it does to the logit and to the gradient, asked of torch itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attncheck.numerics.inputs.heads import qk_overflow_per_head
from attncheck.numerics.precision import dtype_label, rounding_limit
from attncheck.results import SoftCap

if TYPE_CHECKING:
    from attncheck.numerics.inputs.scores import AttentionInputs


def capped(s: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """The cap as Gemma-2's eager code applies it: S * scale, / cap, tanh, * cap, each rounded to S's dtype."""
    return torch.tanh(s * scale / cap) * cap


def softcap_facts(inp: "AttentionInputs", dtype: torch.dtype, cap: float, max_qk: float) -> SoftCap:
    """What the cap does with S held in ``dtype``: the scores of Q@K^T that round to inf there (counted
    as ``heads.qk_overflow_per_head`` computes the model's S; skipped when float64's max |q.k| is far
    from the limit), whether an inf S gives the logit the largest finite S gives (the cap saturates
    before the overflow, so the output is unchanged), and whether torch's autograd through the cap
    at S = inf gives a finite gradient."""
    limit = rounding_limit(dtype)
    overflow = sum(qk_overflow_per_head(inp, dtype)) if max_qk >= limit * 0.99 else 0  # fp32 accumulation may round up
    with torch.enable_grad():  # the diagnosis may run under no_grad (a capture of inference)
        # the largest finite S and an overflowed one
        top = torch.tensor([torch.finfo(dtype).max, float("inf")], dtype=dtype, requires_grad=True)
        y = capped(top, inp.scale, cap)  # (2,)
        (g,) = torch.autograd.grad(y.sum(), top)
    saturated = bool(y[0] == y[1])
    return SoftCap(
        cap=cap,
        scale=inp.scale,
        dtype=dtype_label(dtype),
        limit=limit,
        max_qk=max_qk,
        overflow=overflow,
        saturated=saturated,
        grad_finite=bool(torch.isfinite(g[1])),
    )
