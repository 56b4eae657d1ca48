"""The keys masked by index rules alone (PyTorch's ``is_causal``, left and right padding), described instead of held.

A causal plane over every score is tq x tk booleans: 4.3 GB at 65,536 tokens, more than the float64 work of the
rows a bounded diagnosis computes. The rules are functions of a row's query position, its batch and the key index,
so each block of rows makes its own part of the plane where it is sliced (``rows``), and a subset of the queries
keeps the rule with the positions it took (``at``). The planes are the booleans the whole plane would give there:
every result is the same as with the plane held.
"""

from __future__ import annotations

import torch


class IndexMask:
    """Keys masked by ``causal`` (key j of query position i where j > i: ``ones(L, S).tril(0)``, aligned at the top
    left) and padding (per batch, the first ``pad_left`` and the last ``pad_right`` keys); True = masked. ``shape``:
    the scores' (B, H, Tq, Tk) it stands for; ``queries`` (Tq,) int64: the query positions of its rows (None: 0..Tq-1,
    the whole call)."""

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        causal: bool,
        pad_left: torch.Tensor | None = None,
        pad_right: torch.Tensor | None = None,
        queries: torch.Tensor | None = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.causal = causal
        self.pad_left, self.pad_right = pad_left, pad_right  # (B,) int64 or None
        self.queries = queries

    def __repr__(self) -> str:
        pads = [
            f"pad_{s}={p.tolist()}" for s, p in (("left", self.pad_left), ("right", self.pad_right)) if p is not None
        ]
        return f"IndexMask(shape={tuple(self.shape)}, causal={self.causal}{''.join(', ' + p for p in pads)})"

    def positions(self) -> torch.Tensor:
        """(Tq,) int64: the query position of each row."""
        return torch.arange(self.shape[2]) if self.queries is None else self.queries

    def plane(self, batches: torch.Tensor | None = None, qs: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """(B' | 1, 1, n | 1, Tk) bool: the rows ``qs`` of the batches ``batches`` (None: every batch), at the shape
        the rules broadcast to: one plane for every batch without padding, one row for every query without the
        causal rule; broadcasts over heads."""
        tk = self.shape[3]
        key = torch.arange(tk).view(1, 1, 1, tk)
        out = torch.zeros(1, 1, 1, tk, dtype=torch.bool)
        if self.causal:
            out = key > self.positions()[qs].view(1, 1, -1, 1)  # (1, 1, n, Tk): key j past query position i
        nb = torch.arange(self.shape[0]) if batches is None else batches
        if self.pad_left is not None:
            out = out | (key < self.pad_left[nb].view(-1, 1, 1, 1))
        if self.pad_right is not None:
            out = out | (key >= tk - self.pad_right[nb].view(-1, 1, 1, 1))
        return out

    def rows(self, bh: slice, qs: slice | torch.Tensor) -> torch.Tensor:
        """(n, m, Tk) bool: the queries ``qs`` (m of them) of the (batch x head) planes ``bh`` (n), as a block of rows
        holds them (what ``QKBlock._slice4`` takes of a plane held whole)."""
        b, h = self.shape[:2]
        index = torch.arange(b * h)[bh]
        m = self.positions()[qs].numel()
        part = self.plane(index // h, qs)  # (n | 1, 1, m | 1, Tk)
        return part[:, 0].expand(index.numel(), m, self.shape[3]).contiguous()

    def at(self, positions: torch.Tensor | slice) -> "IndexMask":
        """The rule of the rows ``positions`` (indices into this mask's queries) alone."""
        queries = self.positions()[positions]
        return IndexMask(
            (*self.shape[:2], queries.numel(), self.shape[3]), self.causal, self.pad_left, self.pad_right, queries
        )

    def fully_masked(self) -> torch.Tensor:
        """(B | 1, 1, Tq) bool: rows whose every key is masked, from the rules (no plane made): a row sees the keys
        from pad_left to Tk - pad_right - 1, and under the causal rule none past its position."""
        tk = self.shape[3]
        pos = self.positions().view(1, 1, -1)
        first = torch.zeros(1, 1, 1, dtype=torch.int64) if self.pad_left is None else self.pad_left.view(-1, 1, 1)
        last = torch.full((1, 1, 1), tk - 1) if self.pad_right is None else (tk - 1 - self.pad_right).view(-1, 1, 1)
        if self.causal:
            last = torch.minimum(last, pos)
        out = last < first  # (B | 1, 1, Tq | 1)
        return out.expand(out.shape[0], 1, pos.shape[-1])

    # What a few callers and tests read of a mask tensor: the whole plane, made on request (small calls only).
    def dim(self) -> int:
        return 4

    def whole(self) -> torch.Tensor:
        """(B, H, Tq, Tk) bool: a broadcast view of the plane over every score (the plane is made: tq x tk)."""
        return torch.broadcast_to(self.plane(), self.shape)

    def expand(self, *shape) -> torch.Tensor:
        return self.whole().expand(*shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.whole()[index]
