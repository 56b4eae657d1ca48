"""Write the attention dumps that examples/ci/pyproject.toml checks, offline and reproducibly.

Two layers of a small causal decoder, scores scaled by 1/sqrt(d_k) and masked
with -inf, saved in fp32 as a training step would dump them. In your own
project these files come from your model (or you use synthetic inputs only).

    python examples/ci/make_dumps.py [OUTDIR]     # default: examples/ci/dumps
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def causal_scores(seed: int, batch: int = 1, heads: int = 4, seq: int = 128, d_k: int = 64) -> torch.Tensor:
    """softmax-ready logits q.k / sqrt(d_k) with a causal -inf mask: (B, H, T, T) fp32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, d_k, generator=g)  # (B, H, T, d_k)
    k = torch.randn(batch, heads, seq, d_k, generator=g)
    s = q @ k.transpose(-1, -2) / math.sqrt(d_k)  # (B, H, T, T)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return s.masked_fill(future, float("-inf"))


def write_dumps(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer in range(2):
        path = out / f"layer{layer}.safetensors"
        save_file({"attn.scores": causal_scores(seed=layer).contiguous()}, str(path))
        paths.append(path)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "dumps"
    for p in write_dumps(target):
        print(f"wrote {p}")
