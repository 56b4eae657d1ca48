"""What the recorder keeps per thread while it records, and the gradient hooks of one recorded call."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attncheck.record.ops import Recorded

if TYPE_CHECKING:
    from attncheck.record.mode import Recorder


@dataclass
class Pending:
    """A softmax call waiting for the matmul that consumes its output (which gives v)."""

    call: Recorded
    depth: int
    probs: dict[int, weakref.ref]  # id -> the softmax output and tensors derived from it (not kept alive)
    qk: tuple | None = None  # the live operands (q, k^T) of its Q@K^T, to hook their gradients
    grads: dict | None = None  # role -> the live tensor whose gradient is that role, once v is found


class GradWatch:
    """Collects the gradients of one recorded call as the backward reaches them, and hands them
    over once all expected have come (the first backward through the call only)."""

    def __init__(self, recorder: "Recorder", call: Recorded, expected: set[str]) -> None:
        self.recorder, self.call, self.expected = recorder, call, set(expected)
        self.got: dict[str, torch.Tensor] = {}
        self.handles: list = []
        self.done = False

    def put(self, role: str, grad) -> None:
        if self.done or role in self.got or role not in self.expected or not isinstance(grad, torch.Tensor):
            return
        self.got[role] = grad.detach()
        if set(self.got) >= self.expected:
            self.done = True
            self.remove()
            self.recorder._deliver_grads(self)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@dataclass
class ThreadState:
    """What the recorder follows in one thread: the matmul that may give a softmax its q and k, the
    tensors derived from it, the softmax waiting for its v, an nn.MultiheadAttention call running."""

    qk: dict | None = None
    scores: dict = field(default_factory=dict)
    pending: Pending | None = None
    patched: bool = False
    mha_info: dict = field(default_factory=dict)
    mode: bool = False  # the mode is on this thread's stack: torch dispatches its calls to the recorder
    in_flash: bool = False  # a flash-attn function runs: what it calls is part of the call recorded
