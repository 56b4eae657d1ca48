"""FlexAttention's logits and its eager forward as torch 2.13 computes them: S = q @ k^T scaled, the
score_mod vmapped over (b, h, q, kv) and the mask applied in the working precision (the post-mod logits
the compiled kernel of ``methods/flex.py`` starts from), then logsumexp and ``_safe_softmax``. Rounding
points in the docstring of ``methods/flex.py``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attncheck.numerics.methods.flex_libm import NEG_INF

_LN2 = math.log(2.0)


def _kv_for_heads(t: torch.Tensor, hq: int, bq: int, enable_gqa: bool) -> torch.Tensor:
    """k or v (B, Hkv, Tk, d) repeated over the query heads and expanded over the batch, as
    ``math_attention`` does (``repeat_interleave`` even for G = 1)."""
    hkv = t.size(1)
    if hq % hkv != 0 or (hq != hkv and not enable_gqa):
        raise ValueError(f"Hq={hq} and Hkv={hkv}: set enable_gqa=True for GQA (Hq a multiple of Hkv)")
    t = torch.repeat_interleave(t, hq // hkv, dim=1)
    if not (t.size(0) == bq or t.size(0) == 1):
        raise ValueError(f"Bq={bq} and Bkv={t.size(0)} must broadcast")
    return t.expand((bq, *t.size()[1:]))


def _scaled_scores(q, k, scale, enable_gqa, working):
    key = _kv_for_heads(k, q.size(1), q.size(0), enable_gqa)
    if working is None:
        working = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    scores = q.to(working) @ key.to(working).transpose(-2, -1)
    return (scores * scale).to(working), working, scale


def flex_post_mod_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None,
    score_mod: Callable | None = None,
    mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    working: torch.dtype | None = None,
) -> torch.Tensor:
    """The (B, Hq, Tq, Tk) logits after score_mod and mask as flex's math path computes them
    (torch 2.13, ``_higher_order_ops/flex_attention.py:_math_attention_inner``, lines 177-217,
    with the GQA repeat and batch expand of ``math_attention``, lines 248-258).

    q, k upcast to ``working`` (default fp32, fp64 when q is fp64); S = q @ k^T by torch's matmul;
    ``(S * scale)`` in ``working`` (``scale=None``: 1/sqrt(E), as flex); ``score_mod(score, b, h,
    q_idx, kv_idx)`` vmapped with torch's own ``_vmap_for_bhqkv`` under ``TransformGetItemToIndex``
    (so ``tensor[h]`` inside it works as in flex); entries where the bool ``mask`` (broadcastable to
    (B, Hq, Tq, Tk), True = attend) is False -> -inf. With the same inputs the result is bit-equal
    to the logits inside torch's eager flex_attention. With ``working=torch.float64`` and float64
    q, k it is the float64 reference's logits (the score_mod then runs in float64).
    """
    # torch._dynamo is slow to import: only a call that runs a score_mod pays for it
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    scores, working, _ = _scaled_scores(q, k, scale, enable_gqa, working)
    with TransformGetItemToIndex():
        if score_mod is not None:
            dev = scores.device
            b, h, m, n = (torch.arange(0, scores.size(i), device=dev) for i in range(4))
            scores = _vmap_for_bhqkv(score_mod, prefix=(0,))(scores, b, h, m, n)
        if mask is not None:
            minus_inf = torch.tensor(NEG_INF, dtype=working, device=scores.device)
            scores = torch.where(mask.to(device=scores.device, dtype=torch.bool), scores, minus_inf)
    return scores


def flex_eager(
    scores_fp32: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, enable_gqa: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of eager flex_attention from its post-mod logits (torch 2.13,
    ``_higher_order_ops/flex_attention.py:math_attention`` lines 220-290 and ``sdpa_dense``, then
    ``nn/attention/flex_attention.py:_finalize_outputs``).

    ``scores_fp32`` (B, Hq, Tq, Tk) in the working precision (fp32; fp64 for an fp64 q), v
    (B, Hkv, Tk, Ev), ``dtype`` q's dtype. lse = ``logsumexp`` (-inf on rows with no key), divided
    by ln 2 and multiplied by ln 2 (two roundings, as torch); P = ``torch._safe_softmax`` (rows with
    no key: 0), cast to ``dtype``; out = P @ V by torch's matmul in ``dtype`` (rows with no key: 0).
    Bit-exact with torch's eager flex_attention given its logits (tests/numerics/methods/test_flex.py).
    """
    s = scores_fp32
    value = _kv_for_heads(v, s.size(1), s.size(0), enable_gqa)
    lse = s.logsumexp(dim=-1)
    lse = torch.where(torch.all(s == NEG_INF, dim=-1), NEG_INF, lse)
    p = torch._safe_softmax(s, dim=-1)
    out = p.to(dtype) @ value.to(dtype)
    return out, (lse / math.log(2)) * _LN2
