"""What the watch takes of each recorded call (mixed into ``Watch``, the recorder's sink): the statistics of its
scores (or, for SDPA and flex, its tensors, reduced with the step's others at its end), the kernel path that ran it,
the largest logit it can have, and its gradients."""

from __future__ import annotations

import math
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

from attncheck.numerics.cells.plan import model_path as kernel_path  # wrappers.model_path is the module's
from attncheck.registry import eager_path
from attncheck.results import CallInfo
from attncheck.wrappers import model_path


@dataclass
class _CallEntry:
    module: str
    kind: str
    dtype: str
    path: str
    scale: float
    limit_logit: float
    limit_what: str
    stats: object  # stats.CallStats


class RecordingMixin:
    """The sink the recorder hands calls and gradients to."""

    def __call__(self, call) -> None:
        if self._skip or self._flushing:
            return  # not the watched module's: it neither starts a step nor counts in one
        if self.step_number == 0:
            self.step_number = 1
        if not self.sampling:
            return
        inside = self._prefix and (call.module == self._prefix or call.module.startswith(self._prefix + "."))
        if self._nested and self._prefix and not inside:
            return  # inside the module holding the watched one, but not the watched one's
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
        import torch

        from attncheck.numerics.cells.diagnose import bookkeeping  # small ops on one torch thread

        device = next((t.device for t in call.tensors.values() if isinstance(t, torch.Tensor)), None)
        with bookkeeping(device) if device is not None else nullcontext():
            self._take(call)

    def _take(self, call) -> None:
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
        import torch

        from attncheck.watcher.stats import scores_stats

        t, meta = call.tensors, call.meta
        dtype = meta.get("dtype", "none")
        if call.kind == "flex" and "scores_mod" in t:  # its logits after the score_mod, as the kernel sees them (fp32)
            k = t["k"]
            if k.dim() == 4 and k.shape[1] != t["q"].shape[1]:  # GQA: the kv head each query head reads
                k = k.repeat_interleave(t["q"].shape[1] // k.shape[1], dim=1)
            stats = scores_stats(t["scores_mod"], t["q"], k)
            out = t.get("out")  # flex gives 0 on a row with no key: NaN or inf rows are the output's
            stats.nonfinite_rows = (
                (~torch.isfinite(out.sum(dim=-1, dtype=torch.float32))).sum()
                if out is not None
                else stats.nonfinite_rows * 0
            )
            scale, path = _number(meta.get("scale")) or 1.0, _kernel_path(call)
            limit_logit, what = _limit("float32", 1.0, f"the logits after {meta.get('score_mod', 'score_mod')} in fp32")
        elif call.kind in ("sdpa", "flex"):
            scale = _number(meta.get("scale"))
            # computed with the step's other SDPA calls at its end (one set of ops for all layers); the tensors
            # are those autograd holds for the backward anyway
            stats = (t["q"], t["k"], t.get("out"), t.get("attn_mask"), scale, meta.get("is_causal") == "true")
            scale = scale if scale is not None else 1.0 / math.sqrt(t["q"].shape[-1])
            path = _kernel_path(call)
            limit_logit, what = _limit("float32", 1.0, "S = Q@K^T in fp32 (SDPA's kernels)")
        else:
            scores, q, k = t["scores"], t.get("q"), t.get("k")
            heads = meta.get("num_heads", "")
            if (
                scores.dim() == 3 and heads.isdigit() and int(heads) > 0 and scores.shape[0] % int(heads) == 0
            ):  # nn.MultiheadAttention: (B*H, T, T)
                h = int(heads)
                scores = scores.reshape(-1, h, *scores.shape[1:])
                q = None if q is None or q.dim() != 3 else q.reshape(-1, h, *q.shape[1:])
                k = None if k is None or k.dim() != 3 else k.reshape(-1, h, *k.shape[1:])
            stats = scores_stats(scores, q, k)
            traced = (
                _number(meta.get("scale"))
                if meta.get("scale_source") == "traced" and meta.get("q_prescaled") != "true"
                else None
            )
            scale, path = traced or 1.0, eager_path()
            limit_logit, what = _limit(
                dtype, scale, "S = Q@K^T" + (" (before the scale)" if traced else "") + f" in {_label(dtype)}"
            )
        named = self._prefix is not None or self._nested
        module = model_path(call.module, self._prefix, self._name) if named else call.module
        self._taken[id(call)] = (weakref.ref(call), module)  # its gradients come later, named the same
        self._calls.append(_CallEntry(module, call.kind, _label(dtype), path, scale, limit_logit, what, stats))

    def grads(self, call, tensors) -> None:
        taken = self._taken.get(id(call))
        if taken is None or taken[0]() is not call:
            return  # a call of a module not watched (or of a step already written): not the watched module's
        # counted with the step's others at its end
        self._grads.append((taken[1], tensors))


def _kernel_path(call) -> str:
    """The path of the kernel that ran a watched SDPA or flex call (as a capture's report judges it)."""
    meta = call.meta
    info = CallInfo(
        index=0,
        name="",
        kind=call.kind,
        meta=meta,
        dtype=meta.get("dtype"),
        is_causal=meta.get("is_causal") == "true",
        dropout_p=_number(meta.get("dropout_p")) or 0.0,
    )
    return kernel_path(info) or eager_path()


def _number(x) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _label(torch_name: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}.get(torch_name, torch_name)


def _limit(dtype: str, scale: float, what: str) -> tuple[float, str]:
    """The largest logit a call can have before its first failure: S beyond the rounding limit of
    the dtype that holds it (for hand-written attention S = Q@K^T before the scale: the limit times
    the scale)."""
    # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
    import torch

    from attncheck.numerics.precision import rounding_limit

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}.get(dtype, torch.float32)
    limit = rounding_limit(dt)
    return limit * abs(scale), f"{what} rounds to inf at |S| >= {limit:.6g}"
