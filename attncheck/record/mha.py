"""Recording inside ``nn.MultiheadAttention`` (mixed into ``Recorder``): ``F.multi_head_attention_forward`` handles
``__torch_function__`` itself, so while it runs its SDPA, softmax and batched matmuls are routed through the
recorder (module attributes, restored when it returns)."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from attncheck.record.ops import BADDBMM, BMM, F_SOFTMAX, SDPA


class MhaMixin:
    """nn.MultiheadAttention's calls."""

    @property
    def _mha_meta(self) -> dict[str, str]:
        return self._mha_info

    def _mha(self, func, args, kwargs):
        num_heads = args[4] if len(args) > 4 else kwargs.get("num_heads")
        need_weights = kwargs.get("need_weights", args[15] if len(args) > 15 else True)
        if self._patched or self.stopped is not None:
            return func(*args, **kwargs)
        originals = {
            (F, "scaled_dot_product_attention"): SDPA,
            (F, "softmax"): F_SOFTMAX,
            (torch, "bmm"): BMM,
            (torch, "baddbmm"): BADDBMM,
        }
        me = threading.get_ident()

        def route(original, current):
            def routed(*a, **kw):
                if threading.get_ident() != me:  # another thread's call while this one's MHA runs
                    return current(*a, **kw)
                return self.__torch_function__(original, (), a, kw)

            return routed

        with self._mha_lock:
            current = {(owner, attr): getattr(owner, attr) for owner, attr in originals}
            self._patched = True
            self._mha_info = {
                "num_heads": str(num_heads),
                "mha": "true",
                "q_prescaled": "true" if need_weights else "false",
            }
            try:
                for key, original in originals.items():
                    setattr(*key, route(original, current[key]))
                return func(*args, **kwargs)
            finally:
                for (owner, attr), value in current.items():
                    setattr(owner, attr, value)
                self._patched = False
                self._mha_info = {}
