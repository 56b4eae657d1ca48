"""What the paths share: the block a path returns, and the products and softmax they reuse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attncheck.numerics.methods.softmax import MethodOutput


@dataclass
class PathBlock:
    """One block of rows of one path in one dtype."""

    scores: torch.Tensor  # (r, Tk) the scores the softmax ran on; their float64 softmax is the cells' algo reference
    before: list[tuple[str, torch.Tensor]]  # NaN causes before 'fully_masked', in pipeline order
    after: list[tuple[str, torch.Tensor]]  # ... and after it
    cells: list[tuple[str, MethodOutput]]  # (method, its probabilities, events and output)


def matmul_rows(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(r, Tk) rows of P (heads of v.shape[0]) times v (n, Tk, dv) -> (r, dv)."""
    n, tk = v.shape[0], v.shape[1]
    return torch.matmul(p.reshape(n, -1, tk), v).reshape(-1, v.shape[-1])


def safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """torch's _safe_softmax: softmax over the last axis, 0 where every score of a row is -inf."""
    p = torch.softmax(s, dim=-1)
    return torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)
