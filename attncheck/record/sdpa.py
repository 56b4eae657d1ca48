"""Recording an ``F.scaled_dot_product_attention`` call (mixed into ``Recorder``): q, k, v, the mask, causal, the
scale, GQA and dropout as the caller passed them, the backend PyTorch picks, and its output for the backward."""

from __future__ import annotations

import torch

from attncheck.record.ops import SDPA_ARGS, as_autocast, compact, dtype_name, sdpa_backend


class SdpaMixin:
    """SDPA calls."""

    def _sdpa(self, func, args, kwargs):
        out = func(*args, **kwargs)
        module = self.tracker.path
        if not self._wanted(module):
            return out
        self.flush()
        bound = dict(zip(SDPA_ARGS, args))
        bound.update(kwargs)
        q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
        mask = bound.get("attn_mask")
        tensors = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
        if isinstance(mask, torch.Tensor):
            tensors["attn_mask"] = compact(mask.detach())
        scale = bound.get("scale")
        device_type = q.device.type
        autocast = torch.is_autocast_enabled(device_type) if hasattr(torch, "get_autocast_dtype") else False
        compute = (
            torch.get_autocast_dtype(device_type) if autocast and q.dtype in (torch.float32, torch.float64) else q.dtype
        )
        meta = {
            "dtype": dtype_name(compute),
            "is_causal": "true" if bound.get("is_causal") else "false",
            "scale": "none" if scale is None else repr(float(scale)),
            "scale_source": "default" if scale is None else "argument",
            "enable_gqa": "true" if bound.get("enable_gqa") else "false",
            "dropout_p": repr(float(bound.get("dropout_p") or 0.0)),
            "autocast_dtype": dtype_name(torch.get_autocast_dtype(device_type)) if autocast else "none",
            "sdpa_backend": sdpa_backend(
                *as_autocast(autocast, device_type, q, k, v, mask),
                float(bound.get("dropout_p") or 0.0),
                bool(bound.get("is_causal")),
                scale,
                bool(bound.get("enable_gqa")),
            ),
        }
        owner = self.tracker.stack[-1][0] if self.tracker.stack else None
        sinks = getattr(owner, "sinks", None)
        if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and q.dim() == 4 and sinks.numel() == q.shape[1]:
            # the module holds learned sinks (gpt-oss) its SDPA call was not given: SDPA has no sinks, transformers'
            # integration drops them without a word where config._attn_implementation is forced to 'sdpa'
            tensors["sinks"] = sinks.detach()
            meta["module_sinks"] = "ignored"
        meta.update(self._mha_meta)
        track = self._tracks_grads(out)
        if track or self.outputs:
            tensors["out"] = out.detach()  # the flash backward reads O; the watch counts its broken rows
        call = self._new_call("sdpa", module, tensors, meta)
        call.expects_grads = track
        if self._emit(call) and track:
            node = (
                out.grad_fn if "ScaledDotProduct" in type(out.grad_fn).__name__ else None
            )  # a fused kernel's own node
            self._watch(call, out, node, {"grad_q": q, "grad_k": k, "grad_v": v})
        return out
