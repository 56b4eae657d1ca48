"""FlexAttention's operator and its logits as flex's math path computes them (for a call with a score_mod)."""

from __future__ import annotations

import torch


def flex_hop():
    """FlexAttention's operator (None where this torch has none)."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as hop
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return None
    return hop


def flex_logits(q, k, score_mod, block_mask, scale, score_buffers, mask_buffers, working: torch.dtype):
    """(S times the scale, the logits after score_mod and mask_mod) as flex's math path computes
    them (torch's own ``_math_attention_inner``, GQA and batch broadcast as ``math_attention`` does),
    from q and k upcast to ``working``: float32 is what flex computes, float64 the reference."""
    from torch._higher_order_ops.flex_attention import _math_attention_inner

    g = q.shape[1] // k.shape[1]
    k = torch.repeat_interleave(k, g, dim=1)
    k = k.expand(q.shape[0], *k.shape[1:])
    q = q.to(working)
    k = k.to(working)
    return _math_attention_inner(q, k, k, score_mod, block_mask, scale, {}, tuple(score_buffers), tuple(mask_buffers))
