"""Aggregation across row chunks that gives the same bits whatever the chunking."""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

import torch

from attncheck.results import UNEXPLAINED

ROW_BLOCK = 64  # rows per exact-sum block; chunk sizes do not change any result


COMPRESS_AT = 4096  # block sums held before they are folded into an exact expansion


def _grow_expansion(partials: list[float], x: float) -> None:
    """Add ``x`` to ``partials``, a list of non-overlapping floats whose exact sum is kept
    exactly (Shewchuk's algorithm, the one math.fsum runs on its input)."""
    i = 0
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            partials[i] = lo
            i += 1
        x = hi
    partials[i:] = [x]


class ExactSum:
    """Sum of per-row values that does not depend on how rows are chunked.

    Rows are summed by torch in fixed global blocks of ROW_BLOCK, and the block
    sums with math.fsum (correctly rounded), so any chunking gives the same bits.
    Every COMPRESS_AT block sums are folded into an exact expansion (a few floats whose
    sum is exactly theirs), so memory stays bounded however many rows there are and the
    total, the correctly rounded exact sum, keeps the same bits.
    """

    def __init__(self) -> None:
        self.blocks: list[float] = []
        self.partials: list[float] = []
        self.special: list[float] = []
        self.carry = torch.zeros(0, dtype=torch.float64)

    def add(self, values: torch.Tensor) -> None:
        v = torch.cat([self.carry, values.detach().to("cpu", torch.float64)])
        full = v.numel() - v.numel() % ROW_BLOCK
        if full:
            self.blocks.extend(v[:full].reshape(-1, ROW_BLOCK).sum(dim=-1).tolist())
            if len(self.blocks) >= COMPRESS_AT:
                self._compress()
        self.carry = v[full:]

    def _compress(self) -> None:
        for b in self.blocks:
            if math.isfinite(b):
                _grow_expansion(self.partials, b)
            elif not any(b == s or (b != b and s != s) for s in self.special):
                self.special.append(b)  # inf or NaN: fsum's rules need each kind once, not each one
        self.blocks = []

    def total(self) -> float:
        tail = [float(self.carry.sum())] if self.carry.numel() else []
        return math.fsum(self.partials + self.special + self.blocks + tail)


class Max:
    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, values: torch.Tensor) -> None:
        if values.numel():
            v = float(values.max())
            self.value = v if self.value is None else max(self.value, v)


class Examples:
    """First few flat row indices per label."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rows: dict[str, list[int]] = {}

    def add(self, label: str, mask: torch.Tensor, offset: int) -> None:
        have = self.rows.setdefault(label, [])
        if len(have) >= self.limit or not bool(mask.any()):
            return
        idx = torch.nonzero(mask).flatten()[: self.limit - len(have)]
        have.extend(int(i) + offset for i in idx.tolist())

    def unravel(self, lead: tuple[int, ...]) -> dict[str, list[tuple[int, ...]]]:
        return {k: [unravel(i, lead) for i in v] for k, v in self.rows.items() if v}


def unravel(flat: int, lead: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for dim in reversed(lead):
        out.append(flat % dim)
        flat //= dim
    return tuple(reversed(out))


def attribute(target: torch.Tensor, causes: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Give each target row the first cause (pipeline order) that holds for it."""
    left = target.clone()
    out = {}
    for name, cond in causes:
        hit = left & cond
        out[name] = hit
        left &= ~hit
    out[UNEXPLAINED] = left
    return out


def most_common(counter: Counter, k: int = 3) -> list[tuple[float, int]]:
    """Most frequent first, ties by value: the same order whatever the chunking."""
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def count_values(counter: Counter, values: torch.Tensor) -> None:
    """Add how often each value occurs in a 1-D tensor (one entry per row) to ``counter``."""
    if values.numel():
        uniq, counts = torch.unique(values.to(torch.float64), return_counts=True)
        counter.update(dict(zip(uniq.tolist(), counts.tolist())))


SENTINEL_SPREAD = 2.0**-5  # values within this share of each other's magnitude are one mask constant plus scores


def group_mask_values(counter: Counter, known: tuple[float, ...] = (), k: int = 3) -> list[tuple[float, int, float, float]]:
    """Mask-like values (row minima, overflowed values) grouped into the constants a mask holds.

    A mask added to the scores shows as its constant plus each row's score: finfo(fp16).min
    + scores rounds to -65504, -65280, -65152 ... Values of one sign within SENTINEL_SPREAD
    of the group's first (largest magnitude) are one group, reported as the ``known`` constant
    inside its span if there is one, else as its most frequent value. Returns
    (value, count, lowest, highest) per group, the most frequent first; the same whatever the
    chunking (it only reads the counts).
    """
    groups: list[list[tuple[float, int]]] = []
    for v, n in sorted(counter.items(), key=lambda kv: -abs(kv[0])):  # largest magnitude first
        g = groups[-1] if groups else None
        if g and (g[0][0] < 0) == (v < 0) and abs(g[0][0] - v) <= SENTINEL_SPREAD * abs(g[0][0]):
            g.append((v, n))
        else:
            groups.append([(v, n)])
    out = []
    for g in groups:
        lo, hi = min(v for v, _ in g), max(v for v, _ in g)
        slack = SENTINEL_SPREAD / 32 * max(abs(lo), abs(hi))
        inside = [c for c in known if lo - slack <= c <= hi + slack]
        value = inside[0] if inside else min(g, key=lambda vn: (-vn[1], -abs(vn[0])))[0]
        out.append((value, sum(n for _, n in g), lo, hi))
    return sorted(out, key=lambda t: (-t[1], t[0]))[:k]
