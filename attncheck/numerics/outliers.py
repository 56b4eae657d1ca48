"""Outlier channels, kurtosis and the largest activations of a call's q, k and v (B, H, T, d).

Per head, each channel's max |x| over the batch and tokens against the median of the head's channel maxima: a
channel far above the rest is what clips first when K or V is quantised with one scale per head or tensor (KIVI
and KVQuant quantise K per channel for this reason). The kurtosis of a head's k says how heavy its tails are.
The largest entries of each tensor, beside the median magnitude of the whole tensor, are what arXiv 2402.17762's
criterion of a massive activation reads. Non-finite entries are left out. Vectorised over heads and channels.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from attncheck.results.activations import CallActivations, ChannelPeak, HeadActivations, KeyShares, LargeActivation
from attncheck.results.model import HeadStat

LARGEST_KEPT = 8  # per tensor: the largest activations kept (a massive one is among the very largest)


def magnitudes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(|x| in float32 (exact for fp16, bf16 and fp32 values; float64 stays float64) with non-finite entries as 0:
    they hold no magnitude to compare; the finite entries' mask, None where every entry is finite)."""
    a = x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32).abs()
    if not a.numel() or math.isfinite(float(a.amax())):  # the usual case (amax is NaN or inf otherwise): no mask
        return a, None
    fin = torch.isfinite(a)
    return torch.where(fin, a, 0.0), fin


def median(flat: torch.Tensor) -> float:
    """numpy's median of a 1-d tensor (the mean of the two middle values for an even count, in float64), by numpy's
    selection: ``torch.quantile`` refuses tensors of more than 2^24 entries, and two ``kthvalue`` take 10x longer."""
    return float(np.median(flat.detach().cpu().numpy().astype(np.float64, copy=False)))


def channel_peaks(x: torch.Tensor, a: torch.Tensor | None = None) -> list[ChannelPeak | None]:
    """Per head of ``x`` (B, H, T, d): its channel with the largest max |x|, the median of its channels' maxima
    (numpy's median: the mean of the two middle ones for an even d), and where that channel peaks. None for a
    head with no finite entry. ``a``: ``magnitudes(x)[0]`` where the caller has it."""
    b, h, t, d = x.shape
    if not x.numel():
        return [None] * h
    a = magnitudes(x)[0] if a is None else a
    per_channel = a.amax(dim=(0, 2)).to(torch.float64)  # (H, d); the median of two middle ones in float64, as numpy's
    peak, channel = per_channel.max(dim=-1)  # (H,)
    mid = torch.quantile(per_channel, 0.5, dim=-1)  # interpolated: numpy's median (d channels: small)
    heads = torch.arange(h, device=a.device)
    where = a[:, heads, :, channel].reshape(h, b * t).argmax(dim=-1)  # (H,): (batch, token) of each peak
    out: list[ChannelPeak | None] = []
    for p, c, m, w in zip(peak.tolist(), channel.tolist(), mid.tolist(), where.tolist()):
        out.append(None if p == 0 else ChannelPeak(c, p, m, p / m if m > 0 else None, w // t, w % t))
    return out


def kurtosis(x: torch.Tensor) -> list[float | None]:
    """Pearson's kurtosis E[(x - mean)^4] / var^2 (population moments, float64) of each head of ``x`` (B, H, T, d)
    over its batch, tokens and channels, finite entries only; None for a head of constant (or no) finite values."""
    x64 = x.detach().to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1)  # (H, B*T*d)
    total = x64.sum(dim=-1)
    if bool(torch.isfinite(total).all()):  # every entry finite (the usual case): plain moments
        c2 = (x64 - (total / x64.shape[-1])[:, None]).square_()
        m2, m4 = c2.mean(dim=-1), c2.square_().mean(dim=-1)
    else:
        ok = torch.isfinite(x64)
        n = ok.sum(dim=-1).clamp(min=1)
        mean = torch.where(ok, x64, 0.0).sum(dim=-1) / n
        c2 = torch.where(ok, x64 - mean[:, None], 0.0).square_()
        m2, m4 = c2.sum(dim=-1) / n, c2.square_().sum(dim=-1) / n
    return [m4_ / m2_**2 if m2_ > 0 else None for m2_, m4_ in zip(m2.tolist(), m4.tolist())]


def largest_activations(
    x: torch.Tensor, tensor: str, kept: int = LARGEST_KEPT, found: tuple | None = None
) -> list[LargeActivation]:
    """The ``kept`` largest |x| of ``x`` (B, H, T, d) with where they sit, beside the median |x| of the whole
    tensor (finite entries only). ``found``: ``magnitudes(x)`` where the caller has it."""
    if not x.numel():
        return []
    a, fin = magnitudes(x) if found is None else found
    median_abs = median(a.reshape(-1)) if fin is None else (median(a[fin]) if bool(fin.any()) else 0.0)
    top = a.reshape(-1).topk(min(kept, a.numel()))
    b, h, t, d = a.shape
    out = []
    for v, i in zip(top.values.tolist(), top.indices.tolist()):
        if v == 0:
            break
        bi, rest = divmod(i, h * t * d)
        hi, rest = divmod(rest, t * d)
        ti, ci = divmod(rest, d)
        out.append(LargeActivation(tensor, bi, hi, ti, ci, v, median_abs, v / median_abs if median_abs > 0 else None))
    return out


def call_activations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> CallActivations:
    """A call's activation facts from q (B, Hq, T, d), k and v (B, Hk, T, d): per query head its q's, and the
    k's and v's of the kv head it reads (GQA), k's kurtosis; the largest activations of each tensor."""
    hq, hk = q.shape[1], k.shape[1]
    group = hq // hk if hk and hq % hk == 0 else 1
    kv = [min(h // group, hk - 1) for h in range(hq)]
    mq, mk = magnitudes(q), magnitudes(k)  # one pass each, shared by the peaks and the largest
    qp, kp, kurt = channel_peaks(q, mq[0]), channel_peaks(k, mk[0]), kurtosis(k)
    largest = largest_activations(q, "q", found=mq) + largest_activations(k, "k", found=mk)
    vp: list[ChannelPeak | None] = [None] * hk
    if v is not None and v.dim() == 4:
        mv = magnitudes(v)
        vp = channel_peaks(v, mv[0]) if v.shape[1] == hk else vp
        largest += largest_activations(v, "v", found=mv)
    heads = [HeadActivations(qp[h], kp[kv[h]], vp[kv[h]], kurt[kv[h]]) for h in range(hq)]
    return CallActivations(heads, largest)


def annotate_heads(heads: list[HeadStat], shares: KeyShares | None, acts: CallActivations | None) -> None:
    """Each head's key shares (a diagnosis's ``key_shares``, where its heads are the call's) and activation facts."""
    if shares is not None and shares.heads == len(heads):
        for h, stat in enumerate(heads):
            stat.first_share, stat.top_key, stat.top_share = (
                shares.first_share[h],
                shares.top_key[h],
                shares.top_share[h],
            )
    if acts is not None and len(acts.heads) == len(heads):
        for stat, a in zip(heads, acts.heads):
            stat.activations = a
