"""The row backend as torch ops: any device, and the reference for the fused kernels."""

from __future__ import annotations

from typing import Sequence

import torch

from attncheck.numerics.backends.base import AlgoReference, ChunkFacts, RowBackend, RowMetrics
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, smallest_subnormal
from attncheck.numerics.rowmath import jacobian_frobenius, kl_divergence, row_abs_max, row_dot, row_finite, row_sum

NEG_INF = float("-inf")


class TorchRows(RowBackend):
    name = "torch"

    def chunk(self, x: torch.Tensor, offset: int, shift: float) -> ChunkFacts:
        keys = x.shape[-1]
        bad = ~row_finite(x)
        x64 = x.to(torch.float64, copy=True)  # (r, T): this chunk's own float64 copy, reused in place
        zero = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        nan, posinf, neginf = zero.clone(), zero.clone(), zero.clone()
        n_finite = torch.full_like(zero, keys)
        max_f = x64.amax(dim=-1)
        min_f = x64.amin(dim=-1)
        xs = x64 - shift  # (r, T)
        if bool(bad.any()):
            idx = torch.nonzero(bad).flatten()
            xb = x64[idx]
            fin = torch.isfinite(xb)
            nan[idx] = torch.isnan(xb).sum(dim=-1)
            posinf[idx] = torch.isposinf(xb).sum(dim=-1)
            neginf[idx] = torch.isneginf(xb).sum(dim=-1)
            n_finite[idx] = fin.sum(dim=-1)
            max_f[idx] = torch.where(fin, xb, NEG_INF).amax(dim=-1)
            min_f[idx] = torch.where(fin, xb, float("inf")).amin(dim=-1)
            xs[idx] = torch.where(fin, xs[idx], 0.0)
        s1 = row_sum(xs)
        s2 = row_dot(xs, xs)
        del xs
        masked = (x64 <= MASK_SENTINEL_LIMIT).sum(dim=-1)
        unmasked_min = (
            torch.where(torch.isfinite(x64) & (x64 > MASK_SENTINEL_LIMIT), x64, float("inf")).amin(dim=-1)
            if bool((masked > 0).any())
            else min_f.clone()
        )
        top = x.argmax(dim=-1, keepdim=True)  # the reference's most likely key (softmax is monotonic)
        ref, ssum, ent = _reference_in_place(x64, bad)
        ref_ok = torch.isfinite(ssum)
        jac = torch.where(ref_ok, jacobian_frobenius(ref, top), 0.0)
        pos = torch.where(ref_ok, torch.count_nonzero(ref > 0, dim=-1), 0)
        return ChunkFacts(
            x,
            offset,
            nan,
            posinf,
            neginf,
            masked,
            n_finite,
            max_f,
            min_f,
            unmasked_min,
            s1,
            s2,
            ref,
            ssum,
            ent,
            jac,
            pos,
            top,
        )

    def algo_reference(self, xc: torch.Tensor) -> AlgoReference:
        ref = torch.softmax(xc.to(torch.float64), dim=-1)
        return AlgoReference(xc, torch.isfinite(ref.sum(dim=-1)), ref, same=False)

    def cell_metrics(
        self, c: ChunkFacts, probs: Sequence[torch.Tensor], algo: AlgoReference, precise: bool = False
    ) -> list[RowMetrics]:
        return [_metrics(c, p, algo, smallest_subnormal(p.dtype)) for p in probs]


def _metrics(c: ChunkFacts, probs: torch.Tensor, algo: AlgoReference, floor: float) -> RowMetrics:
    pmax = probs.amax(dim=-1).to(torch.float64)
    p64 = probs.to(torch.float64)  # (r, T): one conversion, then float64 throughout
    psum = row_sum(p64)
    sqa = mxa = None
    if not algo.same:
        da = p64 - algo.ref
        sqa, mxa = row_dot(da, da), row_abs_max(da)
        del da
    d = p64 - c.ref
    sq, mx = row_dot(d, d), row_abs_max(d)
    del d
    kl = kl_divergence(c.ref, p64, floor)
    del p64
    flushed = torch.count_nonzero((probs == 0) & (c.ref > 0), dim=-1)
    attop = probs.gather(-1, c.ref_top).squeeze(-1).to(torch.float64)
    return RowMetrics(pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop)


def _reference_in_place(x64: torch.Tensor, bad: torch.Tensor):
    """float64 max-subtracted softmax, overwriting ``x64`` with z = x - max.

    Returns the reference, S = sum(exp(z)) (NaN where the softmax is undefined)
    and the entropy log S - sum(p z) (no log per entry).
    """
    z = x64.sub_(x64.amax(dim=-1, keepdim=True))  # (r, T); NaN rows: NaN, -inf keys: -inf
    p = torch.exp(z)
    s = row_sum(p, keepdim=True)
    p.div_(s)
    s = s.squeeze(-1)
    if bool(bad.any()):
        z.clamp_(min=torch.finfo(torch.float64).min)  # -inf keys have p = 0; keep 0 * z finite
    h = (torch.log(s) - row_dot(p, z)).clamp_min(0) + 0.0
    return p, s, h
