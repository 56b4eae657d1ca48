"""FlexAttention's operator and its logits as flex's math path computes them (for a call with a score_mod)."""

from __future__ import annotations

import math

import torch

from attncheck.record.compiled import in_compiled_code
from attncheck.record.ops import callable_name, dtype_name, smallest_broadcast


def flex_hop():
    """FlexAttention's operator (None where this torch has none)."""
    try:
        # optional: a torch without FlexAttention (< 2.5) has none; the recorder imports without it
        from torch._higher_order_ops.flex_attention import flex_attention as hop
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return None
    return hop


def flex_logits(q, k, score_mod, block_mask, scale, score_buffers, mask_buffers, working: torch.dtype):
    """(S times the scale, the logits after score_mod and mask_mod) as flex's math path computes
    them (torch's own ``_math_attention_inner``, GQA and batch broadcast as ``math_attention`` does),
    from q and k upcast to ``working``: float32 is what flex computes, float64 the reference."""
    # optional: a torch without FlexAttention (< 2.5) has none; the recorder imports without it
    from torch._higher_order_ops.flex_attention import _math_attention_inner

    g = q.shape[1] // k.shape[1]
    k = torch.repeat_interleave(k, g, dim=1)
    k = k.expand(q.shape[0], *k.shape[1:])
    q = q.to(working)
    k = k.to(working)
    return _math_attention_inner(q, k, k, score_mod, block_mask, scale, {}, tuple(score_buffers), tuple(mask_buffers))


class FlexMixin:
    """FlexAttention calls (mixed into ``Recorder``): q, k, v, the mask_mod as a boolean mask and the logits after
    a score_mod (fp32 as flex computes them, float64 as the reference)."""

    def _flex(self, func, args, kwargs):
        out = func(*args, **kwargs)
        module = self.tracker.path
        if not self._wanted(module):
            return out
        self.flush()
        names = (
            "query",
            "key",
            "value",
            "score_mod",
            "block_mask",
            "scale",
            "kernel_options",
            "score_mod_other_buffers",
            "mask_mod_other_buffers",
        )
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v = (bound[n].detach() for n in ("query", "key", "value"))
        score_mod, block_mask, scale = bound["score_mod"], bound["block_mask"], float(bound["scale"])
        mask_mod = block_mask[-1]
        identity = getattr(score_mod, "__name__", "") == "_identity"
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        planned = sum(t.numel() * t.element_size() for t in (q, k, v)) + scores * (
            1 + (0 if identity else 4 + 8 * self.flex_reference)
        )
        with self._lock:
            over = self.max_bytes is not None and self.stopped is None and self.bytes + planned > self.max_bytes
            if over:  # refused before its logits are computed: a long sequence's would not fit in memory
                self.seen += 1
                self._stop(
                    f"max_bytes {self.max_bytes} would be passed by call {self.seen - 1} (flex in "
                    f"{module or 'global'}, {planned} bytes with its logits; {self.bytes} recorded)",
                    kind="flex",
                    module=module or "",
                    index=self.seen - 1,
                )
        if over or self.stopped is not None:
            return out
        tensors, before, identity = self._flex_tensors(bound, q, k, v, score_mod, block_mask, scale, identity)
        meta = self._flex_meta(q, k, scale, identity, score_mod, mask_mod, block_mask, before)
        if self.outputs:
            tensors["out"] = (out[0] if isinstance(out, tuple) else out).detach()
        call = self._new_call("flex", module, tensors, meta)
        self._emit(call)
        return out

    def _flex_tensors(self, bound, q, k, v, score_mod, block_mask, scale, identity):
        """The tensors a flex call records: q, k, v, the mask its mask_mod makes, and its logits after a score_mod
        that changes them (in float64 too with ``flex_reference``): (tensors, the largest unmasked logit before the
        score_mod, whether the score_mod is the identity here)."""
        with torch.no_grad():
            raw, mod = flex_logits(
                q,
                k,
                score_mod,
                block_mask,
                scale,
                bound.get("score_mod_other_buffers", ()),
                bound.get("mask_mod_other_buffers", ()),
                torch.float32,
            )
            attend = ~torch.isneginf(mod) | ~torch.isfinite(
                raw
            )  # a key the mask_mod masks is -inf after it (NaN, inf logits kept)
            tensors = {"q": q, "k": k, "v": v}
            if not bool(attend.all()):
                tensors["attn_mask"] = smallest_broadcast(attend)
            open_raw = raw.masked_fill(~attend | ~torch.isfinite(raw), float("-inf"))
            before = float(open_raw.amax()) if open_raw.numel() else float("-inf")
            if not identity and bool(((mod == raw) | ~attend).all()):
                # a score_mod that changes no logit here (transformers passes one always): S from q and k is the same
                identity = True
            if not identity:
                tensors["scores_mod"] = mod
            if not identity and self.flex_reference:
                tensors["scores_mod64"] = flex_logits(
                    q,
                    k,
                    score_mod,
                    block_mask,
                    scale,
                    bound.get("score_mod_other_buffers", ()),
                    bound.get("mask_mod_other_buffers", ()),
                    torch.float64,
                )[1]
        return tensors, before, identity

    def _flex_meta(self, q, k, scale, identity, score_mod, mask_mod, block_mask, before) -> dict:
        """A flex call's facts: dtype, scale, GQA, its score_mod and mask_mod, the implementation and the
        BlockMask's tiles."""
        meta = {
            "dtype": dtype_name(q.dtype),
            "scale": repr(scale),
            "scale_source": "argument",
            "enable_gqa": "true" if q.shape[1] != k.shape[1] else "false",
            "is_causal": "false",
            "score_mod": "none" if identity else callable_name(score_mod),
            "mask_mod": "none" if getattr(mask_mod, "__name__", "") == "noop_mask" else callable_name(mask_mod),
            "flex_impl": "compiled" if self.tracker.in_compiled or in_compiled_code() else "math",
        }
        sizes = block_mask[-3:-1] if len(block_mask) >= 3 else ()
        if len(sizes) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            meta["flex_q_block"], meta["flex_kv_block"] = (
                str(sizes[0]),
                str(sizes[1]),
            )  # the BlockMask's: the kernel's tiles
        if not identity and math.isfinite(before):
            meta["logit_before_mod"] = repr(
                before
            )  # the largest unmasked logit before the score_mod (after it: the diagnosis's)
        return meta
