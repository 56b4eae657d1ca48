"""Row formulas over the float64 reference and a cell's probabilities: entropy, KL,
the softmax Jacobian norm, and the row reductions they are built from (any device)."""

from __future__ import annotations

import torch


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    return (-torch.special.xlogy(p, p).sum(dim=-1)).clamp_min(0) + 0.0  # no -0.0


def kl_divergence(ref: torch.Tensor, p: torch.Tensor, floor: float) -> torch.Tensor:
    """KL(ref || p) per row, in the generalised form sum(r log(r/q) - r + q), q = max(p, floor).

    It equals KL when both sum to 1 and stays >= 0 when rounding leaves p off
    sum 1. log(r/q) is taken as log1p(delta) with delta = (r - q) / q, so the
    second-order quantity survives float64 rounding even when p is within 1e-7 of r
    (fp32 cells), where r log r - r log q would cancel to noise; but as log r - log q
    where q > 2r, since delta rounds to -1 when r is far below q (a key the reference
    all but excludes, against a flushed p held at the floor).
    ``floor`` (the smallest subnormal of p's dtype) keeps a flushed key finite;
    flushes are counted on their own in ``flushed_frac``.
    """
    q = p.to(torch.float64).clamp_min(floor)
    delta = torch.sub(ref, q).div_(q)
    terms = torch.special.xlog1py(ref, delta)  # r log1p(delta); 0 where r = 0
    far = delta < -0.5  # q > 2r: log1p(delta) would lose r/q to the rounding of delta
    if bool(far.any()):
        r, qf = ref[far], q[far]
        terms[far] = torch.where(r > 0, r * (torch.log(r) - torch.log(qf)), 0.0)
    return (terms.sum(dim=-1) + torch.sub(q, ref).sum(dim=-1)).clamp_min(0)


def jacobian_frobenius(p: torch.Tensor) -> torch.Tensor:
    """||diag(p) - p p^T||_F per row without forming the T x T matrix.

    ||J||_F^2 = sum p_i^2 - 2 sum p_i^3 + (sum p_i^2)^2.
    """
    p = p.reshape(-1, p.shape[-1])
    return jacobian_from_moments(row_dot(p, p), row_dot(p * p, p))


def jacobian_from_moments(s2: torch.Tensor, s3: torch.Tensor) -> torch.Tensor:
    """||diag(p) - p p^T||_F from s2 = sum p^2 and s3 = sum p^3 per row."""
    return torch.sqrt((s2 - 2 * s3 + s2 * s2).clamp_min(0))


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(r, T) x (r, T) -> (r,) sum(a * b) per row, through BLAS (about twice linalg.vecdot's speed on CPU)."""
    return torch.einsum("ij,ij->i", a, b)


def row_abs_max(d: torch.Tensor) -> torch.Tensor:
    """max |d| per row without allocating |d|."""
    return torch.maximum(d.amax(dim=-1), d.amin(dim=-1).neg_())


def row_finite(x: torch.Tensor) -> torch.Tensor:
    """(rows,) True where every entry is finite, in one reduction: a float64 sum of
    fp16/bf16/fp32 values cannot overflow, so it is non-finite only through inf or NaN."""
    if x.dtype == torch.float64:
        return torch.isfinite(x).all(dim=-1)
    return torch.isfinite(x.sum(dim=-1, dtype=torch.float64))
