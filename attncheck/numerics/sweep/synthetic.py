"""Seeded synthetic queries and keys with i.i.d. entries, for the sweep.

Shapes follow attention: ``heads`` independent groups (batch x heads), each with
``queries`` query vectors that share the head's ``seq`` key vectors. Every query
is drawn on its own, so two rows never share a q; rows of one head share keys,
as they do in a real attention layer.

Distributions of one entry (``std`` multiplies both):

- ``normal``: N(0, std^2);
- ``outliers``: N(0, 1) + N(0, 100) * Bernoulli(0.001), the inputs FlashAttention-3
  measured its numerical error on; variance 1 + 0.001 * 100 = 1.1.
"""

from __future__ import annotations

import torch

from attncheck.draws import (
    DIST_NAMES,
    MEMORY_BUDGET_BYTES,
    OUTLIER_PROB,
    OUTLIER_VAR,
    gib,
    head_layout,
    qk_bytes,
)
from attncheck.errors import AttncheckError


def entry_moments(dist: str, std: float = 1.0) -> tuple[float, float]:
    """(E[x^2], E[x^4]) of one entry: normal (std^2, 3 std^4); the outlier mixture
    adds an independent N(0, 100) with probability p, so given it fired x ~ N(0, 101)."""
    if dist == "normal":
        return std**2, 3 * std**4
    if dist == "outliers":
        p, v_hit = OUTLIER_PROB, 1.0 + OUTLIER_VAR
        return std**2 * (1 + p * OUTLIER_VAR), std**4 * 3 * ((1 - p) + p * v_hit**2)
    raise AttncheckError(f"unknown distribution {dist!r} (choose from {', '.join(DIST_NAMES)})")


def _draw(shape: tuple[int, ...], dist: str, std: float, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """In place where it can be (the same numbers as x + hit * 10 * noise, then * std), so a
    draw holds at most two tensors of its size: ``qk_bytes`` counts them."""
    x = torch.randn(shape, generator=g, dtype=dtype)
    if dist == "outliers":
        hit = torch.rand(shape, generator=g, dtype=dtype) < OUTLIER_PROB
        noise = torch.randn(shape, generator=g, dtype=dtype)
        x += noise.masked_fill_(~hit, 0.0).mul_(OUTLIER_VAR**0.5)  # (not mul_(hit): that makes a float copy of hit)
        del noise, hit
    return x.mul_(std)


def make_qk(
    heads: int,
    queries: int,
    seq: int,
    dk: int,
    *,
    dist: str = "normal",
    std: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    budget: int = MEMORY_BUDGET_BYTES,
    with_v: bool = False,
) -> tuple[torch.Tensor, ...]:
    """q (H, Q, d) and k (H, S, d) with i.i.d. entries, reproducible from ``seed``; with
    ``with_v`` also v (H, S, d) drawn like them, after them (so q and k are the same draws).

    The same seed gives the same draws for any ``std`` (std only multiplies), so
    grids over std compare like with like. Sizes whose draws would exceed ``budget``
    bytes (``qk_bytes``) are refused before anything is allocated.
    """
    for name, v in (("heads", heads), ("queries", queries), ("seq", seq), ("d_k", dk)):
        if v < 1:
            raise AttncheckError(f"synthetic Q/K: {name} must be >= 1, got {v}")
    if dist not in DIST_NAMES:
        raise AttncheckError(f"unknown distribution {dist!r} (choose from {', '.join(DIST_NAMES)})")
    item = torch.empty((), dtype=dtype).element_size()
    need = qk_bytes(heads, queries, seq, dk, dist) * item // 8 + (item * heads * seq * dk if with_v else 0)
    if need > budget:
        raise AttncheckError(
            f"synthetic Q/K of {heads} heads x ({queries} queries + {seq} keys) x d_k {dk} need "
            f"{gib(need)}, over the {gib(budget)} budget"
        )
    g = torch.Generator().manual_seed(seed)
    q = _draw((heads, queries, dk), dist, std, g, dtype)  # (H, Q, d)
    k = _draw((heads, seq, dk), dist, std, g, dtype)  # (H, S, d)
    if with_v:
        return q, k, _draw((heads, seq, dk), dist, std, g, dtype)  # (H, S, d)
    return q, k


def scores_of(q: torch.Tensor, k: torch.Tensor, rows: int) -> torch.Tensor:
    """Unscaled logits q . k_j of heads q (H, Q, d), k (H, S, d), one row per query, the
    first ``rows`` of them: (rows, S)."""
    s = q @ k.transpose(-1, -2)  # (H, Q, S)
    return s.reshape(-1, s.shape[-1])[:rows]


def make_scores(
    rows: int,
    seq: int,
    dk: int,
    *,
    dist: str = "normal",
    std: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Unscaled logits q . k_j, one row per query: (rows, seq).

    Rows are laid out as ``head_layout(rows, seq)``: heads of up to ``seq``
    queries over ``seq`` shared keys; the last head is cut to give ``rows`` rows.
    """
    heads, queries = head_layout(rows, seq)
    item = torch.empty((), dtype=dtype).element_size()
    need = qk_bytes(heads, queries, seq, dk, dist) * item // 8 + item * heads * queries * seq
    if need > MEMORY_BUDGET_BYTES:
        raise AttncheckError(
            f"synthetic scores of {heads} heads x {queries} queries x {seq} keys (d_k {dk}) need "
            f"{gib(need)}, over the {gib(MEMORY_BUDGET_BYTES)} budget"
        )
    q, k = make_qk(heads, queries, seq, dk, dist=dist, std=std, seed=seed, dtype=dtype)
    return scores_of(q.to(device), k.to(device), rows)  # (R, S)
