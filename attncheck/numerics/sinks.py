"""Emergent attention sinks: the share of attention each key receives, averaged over the queries that can see it.

This is the importance the attention-sink literature measures (Gu et al., "When Attention Sink Emerges in Language
Models", sail-sg/Attention-Sink, eval_sink_open_source.py at af49727230ee57b6ecadcc74547653fc776833fc,
``compute_attention_sink``): ``(A / ratios).sum(dim=-2)`` with ``ratios[k] = T - k``, the number of queries of a
causal square pattern that see key k; its sink rate is the share of (sample, layer, head) triples whose importance of
the first key exceeds epsilon = 0.3. Here the divisor is each key's own count of queries that see it (the mask read
from the call: causal, padding, any mask), which is T - k for a causal square pattern and leaves fully masked rows
out. Also accumulated: the share uniform attention over each query's visible keys would give (key 0 of a causal
pattern gets H_T / T of it, 0.34 at T = 8), so that judgement can tell a sink from a short sequence.

Accumulated over the diagnosis's row chunks from the float64 reference it already holds (``ChunkFacts.ref``): three
scatter-adds of a (rows, keys) block per chunk, no copy of the whole tensor.
"""

from __future__ import annotations

import torch

from attncheck.params import MASK_SENTINEL_LIMIT
from attncheck.results.activations import KeyShares


class KeyShareAcc:
    """Per (batch..., head) group of rows (rows are (leading..., query) in row-major order, ``queries`` per group):
    the sum over the queries that see each key of its probability, of 1 / (the query's visible keys), and the
    count of those queries."""

    def __init__(self, groups: int, heads: int, queries: int) -> None:
        self.groups, self.heads, self.queries = groups, heads, queries
        self.share: torch.Tensor | None = None  # (G, Tk) float64
        self.uniform: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def update(self, ref: torch.Tensor, offset: int, visible: torch.Tensor | None, ok: torch.Tensor) -> None:
        """``ref`` (r, Tk) float64 probabilities of rows ``offset``...; ``visible`` (r, Tk) bool: keys each row may
        attend to (None: every key); ``ok`` (r,) rows whose reference is defined (others are left out)."""
        r, tk = ref.shape
        if not r:
            return
        if self.share is None:
            self.share = torch.zeros(self.groups, tk, dtype=torch.float64, device=ref.device)
            self.uniform = torch.zeros_like(self.share)
            self.seen = torch.zeros_like(self.share)
        group = torch.arange(offset, offset + r, device=ref.device) // self.queries
        first = int(group[0])
        # (groups of this chunk, r) one-hot of each defined row's group: products instead of scatters
        onehot = (group[None, :] == torch.arange(first, int(group[-1]) + 1, device=ref.device)[:, None]) & ok[None, :]
        rows = slice(first, first + onehot.shape[0])
        p = ref if bool(ok.all()) else torch.where(ok[:, None], ref, 0.0)  # undefined rows hold NaN
        self.share[rows] += onehot.to(torch.float64) @ p
        if visible is None:  # every key visible to every row: counts per group, 1 / Tk each
            count = onehot.sum(dim=-1, dtype=torch.float64)[:, None]
            self.seen[rows] += count
            self.uniform[rows] += count / tk
            return
        # float32: the counts are exact below 2^24 rows, and the uniform baseline needs no more (bool -> float64
        # would cost 6x the conversion)
        vis = visible.to(torch.float32)  # (r, Tk)
        inv = 1.0 / vis.sum(dim=-1).clamp(min=1.0)  # (r,)
        hot = onehot.to(torch.float32)
        both = torch.cat([hot, hot * inv[None, :]]) @ vis  # one read of vis: (2 x groups, Tk)
        n = hot.shape[0]
        self.seen[rows] += both[:n].to(torch.float64)
        self.uniform[rows] += both[n:].to(torch.float64)

    def finish(self) -> KeyShares | None:
        if self.share is None or not self.heads:
            return None
        share, uniform, seen = (t.cpu() for t in (self.share, self.uniform, self.seen))
        first = torch.where(seen[:, 0] > 0, share[:, 0] / seen[:, 0].clamp(min=1.0), torch.nan)
        # per head, pooled over the batch: (G, Tk) -> (H, Tk)
        h = self.heads
        share_h, uniform_h, seen_h = (t.reshape(-1, h, t.shape[-1]).sum(dim=0) for t in (share, uniform, seen))
        seen_ok = seen_h > 0
        per_key = torch.where(seen_ok, share_h / seen_h.clamp(min=1.0), -1.0)  # (H, Tk)
        base = torch.where(seen_ok, uniform_h / seen_h.clamp(min=1.0), torch.nan)
        top = per_key.argmax(dim=-1)  # (H,)
        top_share = per_key.gather(1, top[:, None])[:, 0]
        top_base = base.gather(1, top[:, None])[:, 0]

        def listed(t: torch.Tensor) -> list[float | None]:
            return [None if v != v or v < 0 else v for v in t.tolist()]  # NaN or -1: no query sees it

        has_top = top_share >= 0
        return KeyShares(
            heads=h,
            first_share=listed(torch.where(seen_ok[:, 0], per_key[:, 0], torch.nan)),
            first_uniform=listed(base[:, 0]),
            top_key=[int(k) if ok else None for k, ok in zip(top.tolist(), has_top.tolist())],
            top_share=listed(top_share),
            top_uniform=listed(torch.where(has_top, top_base, torch.nan)),
            first_importance=listed(first),
        )


def visible_keys(x: torch.Tensor, key_masked: torch.Tensor | None, masked: torch.Tensor) -> torch.Tensor | None:
    """(r, Tk) bool: the keys each row may attend to: the mask where it is known (Q/K inputs), else the scores'
    own values (a finite score above the sentinel limit); None where ``masked`` (the chunk's masked keys per row)
    says no key is masked."""
    if key_masked is not None:
        return ~key_masked
    return None if not bool(masked.any()) else x > MASK_SENTINEL_LIMIT
