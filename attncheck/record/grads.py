"""A recorded call's gradients (mixed into ``Recorder``): autograd hooks that only read, and handing the gradients
to the sink within max_bytes once the backward has produced them all."""

from __future__ import annotations

import torch

from attncheck.errors import AttncheckError
from attncheck.record.ops import GRAD_ROLES, Recorded
from attncheck.record.state import GradWatch


class GradsMixin:
    """Gradient hooks of recorded calls (reads the ``Recorder``'s settings, counters and lock)."""

    def _tracks_grads(self, out) -> bool:
        return self.grads and isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled()

    def _watch(self, call: Recorded, out: torch.Tensor, node, inputs: dict[str, torch.Tensor]) -> None:
        """Hooks for a recorded call's gradients: dO from its output; dq, dk, dv from the kernel's own
        autograd ``node`` (its first three gradient inputs) where given, else from each input tensor
        that requires grad."""
        wanted = {role: t for role, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad}
        watch = GradWatch(self, call, {"grad_out", *wanted})
        watch.handles.append(out.register_hook(lambda g: watch.put("grad_out", g)))
        if node is not None:

            def from_node(grad_inputs, grad_outputs):
                for role, g in zip(GRAD_ROLES, grad_inputs):
                    watch.put(role, g)

            watch.handles.append(node.register_hook(from_node))
        else:
            for role, t in wanted.items():
                flip = role == "grad_k" and call.kind == "softmax"  # the hooked operand is k^T
                watch.handles.append(
                    t.register_hook(lambda g, role=role, flip=flip: watch.put(role, g.transpose(-1, -2) if flip else g))
                )
        with self._lock:
            self._watches.append(watch)

    def _deliver_grads(self, watch: GradWatch) -> None:
        """A call's gradients are all in (called from the backward): hand them to the sink within max_bytes."""
        with self._lock:
            self._deliver_grads_locked(watch)

    def _deliver_grads_locked(self, watch: GradWatch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)
        if self.stopped is not None:
            return
        size = sum(t.numel() * t.element_size() for t in watch.got.values())
        call = watch.call
        if self.max_bytes is not None and self.bytes + size > self.max_bytes:
            self._stop(
                f"max_bytes {self.max_bytes} would be passed by the gradients of call {call.index} ({call.kind} in "
                f"{call.module or 'global'}, {size} bytes; {self.bytes} recorded)",
                call,
                "gradients",
            )
            return
        grads = getattr(self.sink, "grads", None)  # a plain callable (a Sink without grads) takes no gradients
        if grads is None:
            return
        try:
            grads(call, dict(watch.got))
        except AttncheckError as e:
            self._stop(e.render(), call, "gradients")
            return
        self.bytes += size
        self.grad_calls += 1
