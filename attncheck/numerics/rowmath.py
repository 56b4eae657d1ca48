"""Row formulas over the float64 reference and a cell's probabilities: entropy, KL,
the softmax Jacobian norm, and the row reductions they are built from (any device)."""

from __future__ import annotations

import math

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
    return (row_sum(terms) + row_sum(torch.sub(q, ref))).clamp_min(0)


def jacobian_frobenius(p: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """||diag(p) - p p^T||_F per row without forming the T x T matrix, and without cancellation.

    With m the most likely key, e = 1 - p_m = sum of the other p_i (taken from them, not
    from 1 - p_m) and a_k = sum over i != m of p_i^k:

        ||J||_F^2 = sum_i p_i^2 (1 - p_i)^2 + sum_{i != j} p_i^2 p_j^2
                  = p_m^2 (e^2 + 2 a_2) + sum_{i != m} p_i^2 (1 - p_i)^2 + (a_2^2 - a_4),

    every term >= 0 and 1 - p_i >= 1/2 for i != m. The textbook form
    sum p^2 - 2 sum p^3 + (sum p^2)^2 loses everything to cancellation when p_m is near 1
    (the row [0, -17] came out 8.16e-8 for 8.28e-8, [0, -23] 0 for 2.05e-10).
    ``top`` (r, 1): the index of the most likely key of each row, when known.
    """
    p = p.reshape(-1, p.shape[-1])  # (r, T)
    if top is None:
        top = p.argmax(dim=-1, keepdim=True)
    pm = p.gather(-1, top).squeeze(-1)  # (r,)
    rest = p.scatter(-1, top, 0.0)  # (r, T): the other keys
    e = row_sum(rest)
    a2 = row_dot(rest, rest)
    rest2 = rest * rest
    a4 = row_dot(rest2, rest2)
    u = rest.sub_(rest2)  # p_i (1 - p_i); rest is not used after this
    b = row_dot(u, u)
    return jacobian_from_sums(pm, e, a2, a4, b)


def jacobian_from_sums(
    pm: torch.Tensor, e: torch.Tensor, a2: torch.Tensor, a4: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """||diag(p) - p p^T||_F from the largest probability ``pm`` and the sums over the other
    keys: ``e`` = sum p_i (= 1 - pm), ``a2`` = sum p_i^2, ``a4`` = sum p_i^4, ``b`` = sum (p_i (1 - p_i))^2."""
    return torch.sqrt((pm * pm * (e * e + 2 * a2) + b + (a2 * a2 - a4)).clamp_min(0))


def _two_rows(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A lone (1, T) row as two rows, both itself (a view, no copy). torch reduces a tensor
    of one row differently from a row among others: it splits the row across threads when
    it is long, and einsum takes another BLAS path; with two or more rows every row is
    reduced by one thread in one order. So a row's sums do not depend on the chunking."""
    return tuple(t.expand(2, t.shape[-1]) for t in ts)


def row_sum(t: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last axis, in t's dtype (float32 inside for fp16/bf16, as torch sums), with
    the same bits for a row whether it is reduced alone or among others (see ``_two_rows``)."""
    lead = t.shape[:-1]
    if math.prod(lead) != 1:
        return t.sum(dim=-1, keepdim=keepdim)
    (two,) = _two_rows(t.reshape(1, t.shape[-1]))
    s = two.sum(dim=-1)[:1]
    return s.reshape(*lead, 1) if keepdim else s.reshape(lead)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(r, T) x (r, T) -> (r,) sum(a * b) per row, through BLAS (about twice linalg.vecdot's
    speed on CPU), with the same bits for a row alone or among others (see ``_two_rows``)."""
    if a.shape[0] == 1:
        return torch.einsum("ij,ij->i", *_two_rows(a, b))[:1]
    return torch.einsum("ij,ij->i", a, b)


def row_abs_max(d: torch.Tensor) -> torch.Tensor:
    """max |d| per row without allocating |d| (+ 0.0: the max of 0 and -0 may be -0)."""
    return torch.maximum(d.amax(dim=-1), d.amin(dim=-1).neg_()).add_(0.0)


def row_finite(x: torch.Tensor) -> torch.Tensor:
    """(rows,) True where every entry is finite, in one reduction: a float64 sum of
    fp16/bf16/fp32 values cannot overflow, so it is non-finite only through inf or NaN."""
    if x.dtype == torch.float64:
        return torch.isfinite(x).all(dim=-1)
    return torch.isfinite(x.sum(dim=-1, dtype=torch.float64))
