"""Per-head health statistics of one attention call, cheap enough to take every training step.

No float64 reference and no tensor is kept: each statistic is a small tensor on the call's device
(one value per head), read back once per step by the watch. Two samples of query rows per head keep
the cost near a tenth of the call's own Q@K^T:

- the largest logit is taken over the ``TOP_ROWS`` query rows with the largest |q|, and is
  certified exact where it is at least |q_(TOP_ROWS+1)| max|k| |scale| (Cauchy-Schwarz: no other
  row can hold a larger q.k), which it is whenever one head's logits grow through its q and k;
  where the bound does not hold the value is a lower bound and ``exact`` says so. An eager call's
  scores are given: there the maximum is over every row;
- entropy (nats), its minimum and mean, and the share of collapsed rows (top probability above
  ``COLLAPSE_P``) are taken over ``SAMPLE_ROWS`` evenly spaced query rows that may attend to two
  keys or more (a row with one key is one-hot by construction).

Scores are computed in fp32 from q and k as the call holds them: these are statistics of the
logits, not a replay of the kernel's rounding (``attncheck run`` on a capture does that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attncheck.params import MASK_SENTINEL_LIMIT

TOP_ROWS = 16
SAMPLE_ROWS = 16
COLLAPSE_P = 0.99


@dataclass
class CallStats:
    """One value per head (tensors on the call's device, read back at the end of the step)."""

    max_logit: torch.Tensor  # (H,) largest unmasked logit, scaled as the softmax sees it
    exact: torch.Tensor  # (H,) bool: max_logit is the largest of every row (else a lower bound)
    entropy_min: torch.Tensor  # (H,) nats, over the sampled rows; NaN where no row has two keys
    entropy_mean: torch.Tensor  # (H,)
    collapsed: torch.Tensor  # (H,) share of the sampled rows whose top probability is above COLLAPSE_P
    q_max: torch.Tensor | None  # (H,) max |q| per head
    k_max: torch.Tensor | None  # (H,) max |k| of the kv head each query head reads
    nonfinite_rows: torch.Tensor  # () rows of the call's output (or of its softmax) holding NaN or inf


def _heads4(t: torch.Tensor) -> torch.Tensor:
    """(..., H, T, d) -> (B, H, T, d)."""
    return t.reshape(-1, *t.shape[-3:]) if t.dim() >= 3 else t.reshape(1, 1, *t.shape)


def _sample_rows(t: int, device) -> torch.Tensor:
    return torch.linspace(0, t - 1, min(SAMPLE_ROWS, t), device=device).round().long()


def _entropy(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, R, Tk) fp32 scores of sampled rows (masked keys at -inf or at most the sentinel limit)
    -> per head: entropy min, mean (rows with two keys or more) and the share of collapsed rows.
    -sum p log p from the probabilities themselves (xlogy: 0 where p is 0), so that logits of 1e5
    lose nothing to a cancellation against their logsumexp."""
    keys = s > MASK_SENTINEL_LIMIT
    valid = keys.sum(dim=-1) >= 2  # (B, H, R)
    p = torch.softmax(s.masked_fill(~keys, float("-inf")), dim=-1)
    ent = -torch.special.xlogy(p, p).sum(dim=-1)  # NaN only in rows with no key, which are not valid
    top = p.amax(dim=-1)
    count = valid.sum(dim=(0, 2))  # (H,)
    ent_min = ent.masked_fill(~valid, float("inf")).amin(dim=(0, 2))
    ent_mean = ent.masked_fill(~valid, 0.0).sum(dim=(0, 2)) / count
    collapsed = ((top > COLLAPSE_P) & valid).sum(dim=(0, 2)) / count
    none = count == 0
    return ent_min.masked_fill(none, float("nan")), ent_mean.masked_fill(none, float("nan")), collapsed.masked_fill(none, float("nan"))


def sdpa_stats(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor | None, mask: torch.Tensor | None, scale: float | None,
               is_causal: bool) -> CallStats:
    """Statistics of one ``scaled_dot_product_attention`` call from its q, k, mask and output."""
    with torch.no_grad():
        q4, k4 = _heads4(q.detach()), _heads4(k.detach())
        b, h, tq, d = q4.shape
        hk, tk = k4.shape[1], k4.shape[2]
        sc = scale if scale is not None else 1.0 / math.sqrt(d)
        qf, kf = q4.float(), k4.float()
        if hk != h:
            kf = kf.repeat_interleave(h // hk, dim=1)
        qn, kn = qf.norm(dim=-1), kf.norm(dim=-1)  # (B, H, Tq), (B, H, Tk)
        r = min(TOP_ROWS, tq)
        ranked = qn.topk(min(r + 1, tq), dim=-1)
        rows = torch.cat([ranked.indices[..., :r], _sample_rows(tq, q4.device).expand(b, h, -1)], dim=-1)  # (B, H, R')
        qs = qf.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, d))
        s = torch.matmul(qs, kf.transpose(-1, -2)) * sc  # (B, H, R', Tk) fp32
        if mask is not None:
            m = mask.detach()
            m = m.reshape(1, 1, *m.shape) if m.dim() == 2 else (m.unsqueeze(1) if m.dim() == 3 else m.reshape(-1, *m.shape[-3:]))
            mg = m.expand(b, h, tq, tk).gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, tk))
            s = s.masked_fill(~mg, float("-inf")) if mg.dtype == torch.bool else s + mg.float()
        if is_causal:
            s = s.masked_fill(rows.unsqueeze(-1) < torch.arange(tk, device=s.device), float("-inf"))
        top = s[..., :r, :].amax(dim=-1)  # (B, H, r)
        found = torch.where(top > MASK_SENTINEL_LIMIT, top, float("-inf")).amax(dim=-1)  # (B, H): rows with no key left out
        if tq > r:
            bound = ranked.values[..., r] * kn.amax(dim=-1) * abs(sc)
            exact = (found >= bound).all(dim=0)
        else:
            exact = torch.ones(h, dtype=torch.bool, device=s.device)
        e_min, e_mean, collapsed = _entropy(s[..., r:, :])
        kmax = _abs_max(k4)
        bad = (~torch.isfinite(out.sum(dim=-1, dtype=torch.float32))).sum() if out is not None else torch.zeros((), dtype=torch.int64)
        return CallStats(found.amax(dim=0), exact, e_min, e_mean, collapsed, _abs_max(q4), kmax.repeat_interleave(h // hk) if hk != h else kmax, bad)


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |x| per head of (B, H, T, d): two reductions and no copy (vector_norm with ord=inf, and
    abs followed by amax, are several times slower on a CPU)."""
    return torch.maximum(t.amax(dim=(0, 2, 3)), -t.amin(dim=(0, 2, 3))).float()


def scores_stats(scores: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor | None) -> CallStats:
    """Statistics of one eager softmax call from the scores it saw (B, H, Tq, Tk) and the q, k traced
    around it (GQA already expanded by the model)."""
    with torch.no_grad():
        s4 = _heads4(scores.detach())
        b, h, tq, tk = s4.shape
        rowmax = s4.amax(dim=-1).float()  # (B, H, Tq): one pass over the scores
        unmasked = rowmax > MASK_SENTINEL_LIMIT
        top = torch.where(unmasked, rowmax, float("-inf")).amax(dim=(0, 2))
        bad = (torch.isnan(rowmax) | torch.isposinf(rowmax) | torch.isneginf(rowmax)).sum()  # NaN, +inf or every key -inf: torch.softmax gives NaN
        sample = s4[:, :, _sample_rows(tq, s4.device)].float()
        e_min, e_mean, collapsed = _entropy(sample)
        q_max = k_max = None
        if q is not None and k is not None and q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] == h and k.shape[-3] == h:
            q_max, k_max = _abs_max(_heads4(q.detach())), _abs_max(_heads4(k.detach()))
        return CallStats(top, torch.ones(h, dtype=torch.bool, device=s4.device), e_min, e_mean, collapsed, q_max, k_max, bad)


@dataclass
class GradCounts:
    """A call's gradients as its kernel produced them (dq, dk, dv together)."""

    nonfinite: torch.Tensor  # () how many of dq, dk, dv hold NaN or inf
    zeros: torch.Tensor  # () entries exactly 0
    total: int
    max_abs: torch.Tensor  # () largest |g| over the gradients without NaN or inf


def grad_counts(grads: dict[str, torch.Tensor]) -> GradCounts:
    """Two passes per gradient, no copy: its largest |g| (NaN or inf where it holds them) and its
    entries that are not 0."""
    with torch.no_grad():
        ts = [g.detach() for role, g in grads.items() if role in ("grad_q", "grad_k", "grad_v")]
        if not ts:
            zero = torch.zeros((), dtype=torch.int64)
            return GradCounts(zero, zero, 0, torch.zeros(()))
        total = sum(t.numel() for t in ts)
        nonzero = torch.stack([torch.count_nonzero(t) for t in ts]).sum()
        peaks = torch.stack([t.abs().amax().float() for t in ts])
        ok = torch.isfinite(peaks)
        return GradCounts((~ok).sum(), total - nonzero, total, torch.where(ok, peaks, 0.0).amax())
