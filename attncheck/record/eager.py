"""Recording the eager path's softmax (mixed into ``Recorder``): the softmax over the last axis of 3+-D scores, the
Q@K^T matmul its input derives from (through the scale, masks, fills, casts and a soft cap, traced op by op) and the
P@V matmul that consumes its output (which gives v)."""

from __future__ import annotations

import json
import math
import weakref

import torch

from attncheck.record.ops import ADDS, DIVS, F_SOFTMAX, FILLS, MATMULS, MULS, PASSES, TANH, dtype_name, number
from attncheck.record.state import Pending

# In the traced scores (``self._scores``, reset with them): a learned-sink column concatenated to the scores (gpt-oss's
# eager attention: ``cat([S, sinks], -1)`` before its softmax): the scores before it, the sink logit per head, and the
# ids of the concatenation and the tensors derived from it.
SINK_COLUMN = "sink_column"


class EagerMixin:
    """The eager softmax and the tracing of q, k, v around it."""

    def _softmax(self, func, args, kwargs):
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            return out
        if func is F_SOFTMAX:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        module = self.tracker.path
        if not isinstance(dim, int) or dim not in (-1, x.dim() - 1) or module is None or not self._wanted(module):
            return out
        self.flush()
        tensors = {"scores": x.detach()}
        autocast = torch.is_autocast_enabled(x.device.type) if hasattr(torch, "get_autocast_dtype") else False
        meta = {
            "dtype": dtype_name(x.dtype),
            "softmax_dtype": dtype_name(dtype if isinstance(dtype, torch.dtype) else None),
            "has_qk": "false",
            "scale_source": "unknown",
            "autocast_dtype": dtype_name(torch.get_autocast_dtype(x.device.type)) if autocast else "none",
        }
        traced = self._scores.get(id(x))
        traced = traced if traced is not None and traced[0]() is x else None
        qk = self._qk
        live = None
        if qk is not None and qk["path"] == module and (traced is not None or qk["shape"] == tuple(x.shape)):
            a, b = qk["a"], qk["b"]
            if a.shape[-1] == b.shape[-2]:
                tensors["q"], tensors["k"] = a.detach(), b.detach().transpose(-1, -2)
                meta["has_qk"] = "true"
                live = (a, b)
                if traced is not None and traced[3] is None and traced[1] is not None:
                    meta["scale"], meta["scale_source"] = repr(traced[1]), "traced"
                elif traced is not None and traced[3] is not None:  # soft-capped: cap * tanh(S * scale / cap)
                    before, cap = traced[3][0], traced[1]
                    if before is not None and cap is not None and cap > 0 and before > 0:
                        meta["scale"], meta["scale_source"], meta["softcap"] = repr(before * cap), "traced", repr(cap)
                    else:
                        meta["softcap"] = "unknown"  # a tanh between Q@K^T and the softmax whose factors the trace lost
                if meta["scale_source"] == "unknown" and meta.get("softcap") is None:
                    # transformers' attention modules name theirs
                    own = number(getattr(self.tracker.stack[-1][0], "scaling", None))
                    if own is not None and math.isfinite(own) and own > 0:
                        meta["scale"], meta["scale_source"] = repr(own), "module"
        if traced is not None:  # how a mask entered the scores: added (dS passes it) or filled (dS zeroed there)
            ops = traced[2]
            meta["mask_op"] = "add" if ops & ADDS else "fill" if ops & FILLS else "none"
        sunk = self._scores.get(SINK_COLUMN)
        if sunk is not None and id(x) in sunk["ids"] and sunk["ids"][id(x)]() is x:
            # the softmax of [S, sink]: recorded as S (its Tk keys) and one sink logit per head, compactly
            tensors["scores"], tensors["sinks"] = sunk["scores"].detach(), sunk["sinks"].detach()
            meta["sinks"] = "true"
        meta.update(self._mha_meta)
        call = self._new_call("softmax", module, tensors, meta)
        self._qk, self._scores = None, {}
        self._pending = Pending(call, len(self.tracker.stack), {id(out): weakref.ref(out)}, qk=live)
        return out

    def _trace(self, name: str, args, kwargs, out) -> None:
        if name in MATMULS:
            self._trace_matmul(name, args, out)
            return
        if not isinstance(out, torch.Tensor):
            return
        if name == "cat" and self._scores:
            self._sink_column(args, kwargs, out)
            return
        self._follow_probs(name, args, kwargs, out)
        self._trace_scale(name, args, kwargs, out)

    def _trace_matmul(self, name: str, args, out) -> None:
        """A batched matmul: P@V of the pending softmax (its v, and its gradients' live tensors) ends that call;
        another (Q@K^T) starts a score tensor to follow."""
        a, b = (
            (args[1], args[2])
            if name == "baddbmm" and len(args) >= 3
            else (args[0] if args else None, args[1] if len(args) > 1 else None)
        )
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 3 and b.dim() >= 3):
            return
        pending = self._pending
        if pending is not None and id(a) in pending.probs and pending.probs[id(a)]() is a:
            pending.call.tensors["v"] = b.detach()
            pending.call.meta["shapes"] = json.dumps({role: list(t.shape) for role, t in pending.call.tensors.items()})
            pending.call.meta["dtypes"] = json.dumps(
                {role: dtype_name(t.dtype) for role, t in pending.call.tensors.items()}
            )
            if self._tracks_grads(out):
                q_live, kt_live = pending.qk if pending.qk is not None else (None, None)
                pending.grads = {"grad_out": out, "grad_q": q_live, "grad_k": kt_live, "grad_v": b}
            self.flush()
            return
        if isinstance(out, torch.Tensor):
            self._qk = {"a": a, "b": b, "shape": tuple(out.shape), "path": self.tracker.path}
            ops = frozenset({"baddbmm"} if name == "baddbmm" else ())
            self._scores = {id(out): (weakref.ref(out), 1.0, ops, None)}  # (the scores, scale, ops, soft cap)
        return

    def _follow_probs(self, name: str, args, kwargs, out: torch.Tensor) -> None:
        """The pending softmax's probabilities followed through ops that pass them on (a dropout's p recorded)."""
        first = args[0] if args else None
        pending = self._pending
        if (
            pending is not None
            and (name in PASSES or (name == "__getitem__" and pending.call.meta.get("sinks") == "true"))
            and isinstance(first, torch.Tensor)
            and id(first) in pending.probs
            and pending.probs[id(first)]() is first
            and (out.shape == first.shape or _drops_sink(name, first, out))
        ):
            pending.probs[id(out)] = weakref.ref(out)
            if (
                name == "dropout"
            ):  # F.dropout(input, p, training, inplace) on the probabilities: their backward has its mask
                p = number(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
                training = args[2] if len(args) > 2 else kwargs.get("training", True)
                if training and p:
                    pending.call.meta["dropout_p"] = repr(p)

    def _trace_scale(self, name: str, args, kwargs, out: torch.Tensor) -> None:
        """The scores followed to the softmax: the scale multiplied or divided in, a tanh soft cap, the ops that
        add a mask or bias or fill."""
        if not self._scores:
            return
        source = next(
            (
                t
                for t in args
                if isinstance(t, torch.Tensor) and id(t) in self._scores and self._scores[id(t)][0]() is t
            ),
            None,
        )
        if source is None or out.shape != source.shape:
            return
        sunk = self._scores.get(SINK_COLUMN)
        if sunk is not None and id(source) in sunk["ids"]:  # [S, sink] minus its row max, cast: still that softmax's
            sunk["ids"][id(out)] = weakref.ref(out)
        _, scale, ops, capped = self._scores[id(source)]
        if name in TANH:
            if capped is not None:  # a second tanh: no soft cap the trace can name
                scale, capped = None, (None,)
            else:  # the factor so far is scale / cap; the one after the tanh will be the cap
                scale, capped = 1.0, (scale,)
        elif name in MULS or name in DIVS:
            other = next((x for x in args if x is not source), kwargs.get("other"))
            factor = number(other)
            if factor is None or scale is None or factor == 0 or (name in DIVS and other is not args[-1]):
                scale = None  # a tensor factor, or a number divided by the scores: the scale is unknown
            else:
                scale = scale * factor if name in MULS else scale / factor
                scale = scale if math.isfinite(scale) else None
        elif name not in PASSES:
            return
        if name in FILLS or (name in ADDS and sum(isinstance(t, torch.Tensor) for t in args) > 1):
            ops = ops | {name}  # a tensor added (a mask or a bias) or a fill
        self._scores[id(out)] = (weakref.ref(out), scale, ops, capped)

    def _sink_column(self, args, kwargs, out: torch.Tensor) -> None:
        """``torch.cat([S, sinks], dim=-1)`` of traced 4-D scores S (batch, heads, Tq, Tk) and a column holding one
        logit per head (gpt-oss's learned sinks, expanded over batch and queries): the concatenation is traced as
        those scores, and the softmax over it is recorded as an attention call with its sinks."""
        parts = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or len(parts) != 2:
            return
        scores, column = parts
        if not (isinstance(scores, torch.Tensor) and isinstance(column, torch.Tensor)) or scores.dim() != 4:
            return
        entry = self._scores.get(id(scores))
        if entry is None or entry[0]() is not scores or dim not in (-1, 3):
            return
        if tuple(column.shape) != (*scores.shape[:-1], 1) or column.dtype != scores.dtype:
            return
        per_head = column[:1, :, :1, 0].reshape(-1)
        each = per_head.reshape(1, -1, 1, 1).expand_as(column)
        if not bool(((column == each) | (torch.isnan(column) & torch.isnan(each))).all()):  # a NaN sink is one too
            return  # not one logit per head: the softmax stays a softmax over Tk + 1 keys
        _, scale, ops, capped = entry
        self._scores[id(out)] = (weakref.ref(out), scale, ops, capped)
        self._scores[SINK_COLUMN] = {"ids": {id(out): weakref.ref(out)}, "scores": scores, "sinks": per_head}


def _drops_sink(name: str, probs: torch.Tensor, out: torch.Tensor) -> bool:
    """``P[..., :-1]``: the probabilities of a softmax with a sink column, the sink's dropped (gpt-oss)."""
    return (
        name == "__getitem__"
        and out.dim() == probs.dim()
        and tuple(out.shape[:-1]) == tuple(probs.shape[:-1])
        and out.shape[-1] == probs.shape[-1] - 1
    )
