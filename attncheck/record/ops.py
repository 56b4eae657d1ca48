"""What the recorder reads from the torch calls it sees: the functions as torch defines them, the operations that
keep a tensor "the scores" while tracing, a recorded call (``Recorded``), and the small facts of a call (the SDPA
backend torch would choose, the dtype and number as the metadata keeps them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

# The functions as torch defines them (while an MHA call runs, the module attributes are routed).
SDPA = F.scaled_dot_product_attention
F_SOFTMAX = F.softmax
MHA_FORWARD = F.multi_head_attention_forward
BMM, BADDBMM = torch.bmm, torch.baddbmm
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
MATMULS = {"matmul", "__matmul__", "bmm", "baddbmm"}
MULS = {"mul", "__mul__", "__rmul__", "mul_", "__imul__", "multiply"}
DIVS = {"div", "__truediv__", "div_", "__itruediv__", "true_divide", "divide"}
FILLS = {"masked_fill", "masked_fill_", "where"}  # how a mask can be applied: filled (dS zeroed there) ...
ADDS = {"add", "__add__", "__radd__", "add_", "__iadd__", "baddbmm"}  # ... or added (dS passes through)
TANH = {"tanh", "tanh_"}  # a soft cap (Gemma-2, Grok): cap * tanh(S * scale / cap)
GRAD_ROLES = ("grad_q", "grad_k", "grad_v")
# Same-shape operations that keep a tensor "the scores" (or "the probabilities") for tracing.
PASSES = {
    "add",
    "__add__",
    "__radd__",
    "add_",
    "__iadd__",
    "sub",
    "__sub__",
    "sub_",
    "__isub__",
    "masked_fill",
    "masked_fill_",
    "where",
    "to",
    "type",
    "float",
    "half",
    "bfloat16",
    "contiguous",
    "clone",
    "dropout",
    "type_as",
}


@dataclass
class Recorded:
    """One call as recorded: its tensors (role -> tensor, on the device the model used, not
    yet copied) and its metadata (strings, as safetensors keeps them)."""

    index: int
    kind: str  # 'sdpa' or 'softmax'
    module: str
    forward: int | None
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)
    expects_grads: bool = False  # hooks will hand its gradients over when the backward reaches it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@runtime_checkable
class Sink(Protocol):
    """Where the recorder hands what it records (``Recorder(sink)``): each call as it is recorded, and its
    gradients when the backward reaches it (a plain callable is a sink that takes no gradients). The capture's
    sinks (``store.DirectorySink``, ``MemorySink``, ``DiagnoseSink``) also take ``close(facts)`` from
    ``attncheck.capture`` at the end; the watch (``attncheck.watch``) is a sink of its own steps."""

    def __call__(self, call: Recorded) -> None:
        """A call, recorded; its tensors are the model's own (copy what is kept)."""

    def grads(self, call: Recorded, tensors: dict[str, torch.Tensor]) -> None:
        """The gradients of a call handed over before (role -> tensor: grad_out, grad_q, grad_k, grad_v)."""


def compact(t: torch.Tensor) -> torch.Tensor:
    """A broadcast view (stride 0) kept at size 1 on those axes: the same values once broadcast,
    without materialising the copies (masks are often expanded over heads)."""
    for dim in range(t.dim()):
        if t.stride(dim) == 0 and t.shape[dim] > 1:
            t = t.narrow(dim, 0, 1)
    return t


def sdpa_backend(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> str:
    """The backend PyTorch chooses for this SDPA call ('flash_attention', 'efficient_attention',
    'cudnn_attention', 'math', ...), asked of torch itself (``torch._fused_sdp_choice``, which
    honours ``sdpa_kernel`` and the device's kernels); 'unknown' where torch cannot say."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    try:
        # torch.nn.attention (torch >= 2.2) inside the try: any failure leaves the backend 'unknown'
        from torch.nn.attention import SDPBackend

        return SDPBackend(choose(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)).name.lower()
    except Exception:  # a private API: any failure only means the backend is not recorded
        return "unknown"


def as_autocast(autocast: bool, device_type: str, *tensors):
    """The floating inputs of an SDPA call as autocast hands them to the kernel: all in the autocast
    dtype, so that the backend torch is asked about is the one it runs (Llama under bf16 autocast
    passes fp32 q and k from its rotary embedding beside a bf16 v: as given, torch answers 'math';
    it runs the flash kernel)."""
    if not autocast:
        return tensors
    dt = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dt else t for t in tensors
    )


def dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def number(x) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() == 0:
        return float(x)
    return None


def smallest_broadcast(mask: torch.Tensor) -> torch.Tensor:
    """A (B, H, Tq, Tk) mask kept at size 1 on the axes it does not vary over (batch, heads)."""
    for dim in (0, 1):
        if mask.shape[dim] > 1 and bool((mask == mask.narrow(dim, 0, 1)).all()):
            mask = mask.narrow(dim, 0, 1)
    return mask.contiguous()


def callable_name(fn) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "".join(ch if ch.isprintable() else "?" for ch in str(name))[:80]
