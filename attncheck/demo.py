"""The built-in example behind ``attncheck run --example``: attention logits with
the problems people meet in practice, generated in memory (seeded, no download)."""

from __future__ import annotations

import math

import torch

EXAMPLE_NAME = "example:layer0.scores"


def example_scores(seed: int = 0) -> torch.Tensor:
    """(batch=2, heads=4, queries=64, keys=64) float32 logits of a causal decoder layer.

    - head 1 forgot the 1/sqrt(d_k) scaling: logits of std ~8 overflow exp in fp16;
    - the causal mask is added as -1e9, which fp16 cannot hold (it becomes -inf);
    - batch 1 is left-padded by 8 tokens (keys masked with -inf), so its first
      8 queries may attend to nothing: fully masked rows.
    """
    g = torch.Generator().manual_seed(seed)
    b, h, t, d = 2, 4, 64, 64
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, h, t, d, generator=g)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # (B, H, T, T)
    scores[:, 1] *= math.sqrt(d)  # the head that skips the scaling
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, -1e9)
    scores[1, :, :, :8] = float("-inf")  # left padding of batch 1
    return scores
