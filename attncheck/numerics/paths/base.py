"""What a path is asked about a call, free of torch: ``CallFacts`` (the facts of a call a
kernel's support depends on) and ``Stands`` (a captured implementation a path stands for)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stands:
    """A captured implementation: the call's kind ('sdpa', 'flex', 'flash_attn', ...), the
    implementation the capture recorded for it (an SDPA backend: 'flash_attention'; a flex
    implementation: 'compiled'; a flash-attn function: 'flash_attn_func'; '' for any), and the
    device type it ran on ('cuda', 'cpu'; '' for any)."""

    kind: str
    impl: str = ""
    device: str = ""

    def matches(self, kind: str, impl: str, device: str) -> bool:
        return self.kind == kind and self.impl in ("", impl) and self.device in ("", device)


@dataclass(frozen=True)
class CallFacts:
    """The facts of one call a kernel's support and tiles depend on."""

    dtype: str  # the cell's dtype: 'fp16', 'bf16', 'fp32', 'e4m3', ...
    head_dim: int  # d of q and k
    head_dim_v: int  # d of v
    tq: int
    tk: int
    mask: str = "none"  # 'none', 'causal' (is_causal alone), 'explicit' (an attn_mask tensor, with or without causal)
    dropout: float = 0.0
    capability: tuple[int, int] | None = None  # the GPU's compute capability where the capture recorded it
    gqa: bool = False  # fewer kv heads than query heads
    softcap: float | None = None
    window: tuple[int, int] | None = None  # a sliding window (left, right) in keys; None: none
