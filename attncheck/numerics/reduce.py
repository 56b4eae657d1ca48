"""Aggregation across row chunks that gives the same bits whatever the chunking."""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

import numpy as np
import torch

from attncheck.results.common import UNEXPLAINED

ROW_BLOCK = 64  # rows per exact-sum block; chunk sizes do not change any result


COMPRESS_AT = 4096  # block sums held before they are folded into the exact integer total
_SHIFT = 1127  # every float64 is an integer times 2^-1126 (53-bit mantissa, exponent >= -1074)


def exact_scaled_sum(v: np.ndarray) -> int:
    """The exact sum of the finite float64 values ``v``, times 2^_SHIFT, as a Python int.

    Each value is m 2^e with a 53-bit integer m, split as hi 2^27 + lo; the his and the los
    are summed per exponent in float64, exactly (|hi| < 2^26, 0 <= lo < 2^27, and fewer
    than 2^26 values), and the per-exponent sums are added as integers: a loop over the
    exponents present (at most 2,098), not over the values."""
    if not v.size:
        return 0
    m, e = np.frexp(v)  # v = m 2^e, 0.5 <= |m| < 1 (0 for 0)
    mi = (m * 2.0**53).astype(np.int64)  # exact
    hi = mi >> 27
    lo = mi - (hi << 27)
    shift = e.astype(np.int64) - 53 + _SHIFT  # >= 0
    his = np.bincount(shift, weights=hi.astype(np.float64))
    los = np.bincount(shift, weights=lo.astype(np.float64))
    present = np.flatnonzero((his != 0) | (los != 0))
    return sum((int(his[x]) << (int(x) + 27)) + (int(los[x]) << int(x)) for x in present)


def count(mask: torch.Tensor) -> int:
    """How many entries of the bool tensor ``mask`` are True.

    The per-row bookkeeping asks this thousands of times per run, of vectors with one
    entry per row. On the CPU numpy counts them directly (65,536 rows: ~3 us on one
    thread, against ~20 us for torch's ``sum`` of a bool tensor)."""
    if mask.device.type == "cpu":
        return int(np.count_nonzero(mask.detach().numpy()))
    return int(mask.sum())


def row_counts(mask: torch.Tensor) -> torch.Tensor:
    """(r,) int64: how many entries of each row of the bool (r, T) ``mask`` are True. Summed as
    bytes into int32 (2,730 x 1,024 on two threads: ~0.5 ms, against ~3 ms for a bool sum, which
    widens every entry to int64 first)."""
    return mask.view(torch.uint8).sum(dim=-1, dtype=torch.int32).to(torch.int64)


def any_true(mask: torch.Tensor) -> bool:
    """Whether any entry of the bool tensor ``mask`` is True (numpy on the CPU: ~1 us for
    65,536 rows against ~55 us for torch's ``any``)."""
    if mask.device.type == "cpu":
        return bool(mask.detach().numpy().any())
    return bool(mask.any())


_NUMPY_FLOATS = (torch.float64, torch.float32, torch.float16)


def _elementwise(t: torch.Tensor, by_numpy, by_torch) -> torch.Tensor:
    if t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS:
        return torch.from_numpy(by_numpy(t.detach().numpy()))
    return by_torch(t)


def finite(t: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(t)``; by numpy for CPU tensors of a dtype numpy has (~11 us for
    65,536 float64 rows against ~125 us on one thread, more on threads woken per op)."""
    return _elementwise(t, np.isfinite, torch.isfinite)


def infinite(t: torch.Tensor) -> torch.Tensor:
    """``torch.isinf(t)``, by numpy where ``finite`` uses it."""
    return _elementwise(t, np.isinf, torch.isinf)


_NUMPY_ROWS = (torch.float64, torch.float32, torch.int64, torch.int32, torch.bool)


def take_rows(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t[mask]`` for a bool ``mask`` over t's first axis: numpy's indexing on the CPU
    (65,536 rows: ~45 us on one thread, against ~330 us for torch's), and ``t`` itself
    when the mask keeps every row. The result may share memory with ``t``: read it only."""
    if t.device.type == "cpu" and mask.device.type == "cpu" and t.dtype in _NUMPY_ROWS:
        keep = mask.detach().numpy()
        if np.count_nonzero(keep) == keep.size:
            return t
        return torch.from_numpy(t.detach().numpy()[keep])
    return t[mask]


class ExactSum:
    """Sum of per-row values that does not depend on how rows are chunked.

    Rows are summed by torch in fixed global blocks of ROW_BLOCK; the block sums are
    added exactly (as integers: ``exact_scaled_sum``), every COMPRESS_AT of them, so
    memory stays bounded however many rows there are; the total is that exact sum
    rounded once to float64, which is what math.fsum of the block sums gives, so any
    chunking gives the same bits. inf and NaN block sums follow fsum's rules.
    """

    def __init__(self) -> None:
        self.pending: list[float] = []
        self.exact = 0  # the sum of the folded block sums, times 2^_SHIFT
        self.special: list[float] = []  # inf or NaN block sums, each kind once
        self.carry = torch.zeros(0, dtype=torch.float64)

    def add(self, values: torch.Tensor) -> None:
        v = values.detach().to("cpu", torch.float64)
        if self.carry.numel():  # rows left over from the last chunk's partial block come first
            v = torch.cat([self.carry, v])
        full = v.numel() - v.numel() % ROW_BLOCK
        if full:
            # Python floats, not small arrays: thousands of small long-lived allocations between
            # the chunks' large transient ones fragment the heap (+40 MiB on a 64 MiB file at 8MiB)
            self.pending.extend(v[:full].reshape(-1, ROW_BLOCK).sum(dim=-1).tolist())
            if self.held >= COMPRESS_AT:
                self._fold(np.array(self.pending))
                self.pending = []
        self.carry = v[full:].clone()  # not a view of the caller's tensor, which may be a reused buffer

    @property
    def held(self) -> int:
        """Block sums not folded yet."""
        return len(self.pending)

    def _fold(self, blocks: np.ndarray) -> None:
        finite = np.isfinite(blocks)
        if not finite.all():
            for b in blocks[~finite].tolist():
                if not any(b == s or (b != b and s != s) for s in self.special):
                    self.special.append(b)
            blocks = blocks[finite]
        self.exact += exact_scaled_sum(blocks)

    def total(self) -> float:
        rest = self.pending + ([float(self.carry.sum())] if self.carry.numel() else [])
        exact, special = self.exact, list(self.special)
        if rest:
            blocks = np.array(rest)
            finite = np.isfinite(blocks)
            special += blocks[~finite].tolist()
            exact += exact_scaled_sum(blocks[finite])
        if special:
            return math.fsum(special)  # inf, -inf or NaN decide it, as in fsum
        try:
            return exact / (1 << _SHIFT)  # int / int: correctly rounded
        except OverflowError:
            return math.inf if exact > 0 else -math.inf


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
        if len(have) >= self.limit or not any_true(mask):
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


def group_mask_values(
    counter: Counter, known: tuple[float, ...] = (), k: int = 3
) -> list[tuple[float, int, float, float]]:
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
