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
    # (H,) key 0's probability averaged over the sampled rows that see it: the first-token share (attention sinks)
    first_share: torch.Tensor | None = None


def _heads4(t: torch.Tensor) -> torch.Tensor:
    """(..., H, T, d) -> (B, H, T, d)."""
    return t.reshape(-1, *t.shape[-3:]) if t.dim() >= 3 else t.reshape(1, 1, *t.shape)


def _sample_rows(t: int, device) -> torch.Tensor:
    return torch.linspace(0, t - 1, min(SAMPLE_ROWS, t), device=device).round().long()


def _entropy(s: torch.Tensor, layers: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L*B, H, R, Tk) fp32 scores of sampled rows (masked keys at -inf or at most the sentinel limit)
    -> per layer and head (L, H): entropy min, mean (rows with two keys or more), the share of
    collapsed rows, and key 0's probability averaged over the sampled rows that see it (NaN where none does).
    -sum p log p from the probabilities themselves (xlogy: 0 where p is 0), so that
    logits of 1e5 lose nothing to a cancellation against their logsumexp."""
    keys = s > MASK_SENTINEL_LIMIT
    valid = _layer_first(keys.sum(dim=-1) >= 2, layers)  # (L, B, H, R)
    p = torch.softmax(s.masked_fill(~keys, float("-inf")), dim=-1)
    ent = _layer_first(
        -torch.special.xlogy(p, p).sum(dim=-1), layers
    )  # NaN only in rows with no key, which are not valid
    top = _layer_first(p.amax(dim=-1), layers)
    count = valid.sum(dim=(1, 3))  # (L, H)
    ent_min = ent.masked_fill(~valid, float("inf")).amin(dim=(1, 3))
    ent_mean = ent.masked_fill(~valid, 0.0).sum(dim=(1, 3)) / count
    collapsed = ((top > COLLAPSE_P) & valid).sum(dim=(1, 3)) / count
    none = count == 0
    sees = _layer_first(keys[..., 0], layers)  # (L, B, H, R): rows that may attend to key 0
    first = _layer_first(p[..., 0], layers).masked_fill(~sees, 0.0).sum(dim=(1, 3)) / sees.sum(dim=(1, 3))
    first = first.clamp(0.0, 1.0)  # a share, as the log's reader checks it (fp32 rounding aside); NaN stays
    return (
        ent_min.masked_fill(none, float("nan")),
        ent_mean.masked_fill(none, float("nan")),
        collapsed.masked_fill(none, float("nan")),
        first,
    )


def _layer_first(t: torch.Tensor, layers: int) -> torch.Tensor:
    """(L*B, ...) -> (L, B, ...): the calls of a batch of layers apart, each with its own batch."""
    return t.reshape(layers, -1, *t.shape[1:])


def _mask4(mask: torch.Tensor) -> torch.Tensor:
    m = mask.detach()
    return (
        m.reshape(1, 1, *m.shape)
        if m.dim() == 2
        else (m.unsqueeze(1) if m.dim() == 3 else m.reshape(-1, *m.shape[-3:]))
    )


def sdpa_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    out: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
) -> CallStats:
    """Statistics of one ``scaled_dot_product_attention`` call from its q, k, mask and output."""
    return sdpa_stats_many([(q, k, out, mask, scale, is_causal)])[0]


def sdpa_stats_many(calls: list[tuple]) -> list[CallStats]:
    """Statistics of several SDPA calls, each (q, k, out, mask, scale, is_causal). The passes over a
    call's whole q, k and output are its own (no copy); the many small ops on the sampled rows run
    once for the calls that share their shapes, dtype, device, mask and scale (a model's layers), so
    that their count does not grow with the layers."""
    groups: dict[tuple, list[int]] = {}
    for i, (q, k, out, mask, scale, causal) in enumerate(calls):
        key = (
            tuple(q.shape),
            tuple(k.shape),
            q.dtype,
            k.dtype,
            q.device,
            out is None,
            None if mask is None else id(mask),
            scale,
            bool(causal),
        )
        groups.setdefault(key, []).append(i)
    results: list[CallStats | None] = [None] * len(calls)
    with torch.no_grad():
        for members in groups.values():
            q, k, out, mask, scale, causal = calls[members[0]]
            stats = _sdpa_layers([calls[i] for i in members], mask, scale, causal)
            for j, i in enumerate(members):
                results[i] = CallStats(
                    *(
                        None if t is None else t[j]
                        for t in (
                            stats.max_logit,
                            stats.exact,
                            stats.entropy_min,
                            stats.entropy_mean,
                            stats.collapsed,
                            stats.q_max,
                            stats.k_max,
                            stats.nonfinite_rows,
                            stats.first_share,
                        )
                    )
                )
    return results  # type: ignore[return-value]


def _sdpa_layers(calls: list[tuple], mask: torch.Tensor | None, scale: float | None, is_causal: bool) -> CallStats:
    """Calls of one shape (L of them) -> CallStats of (L, H) tensors."""
    layers = len(calls)
    q0 = _heads4(calls[0][0])
    b, h, tq, d = q0.shape
    k0 = _heads4(calls[0][1])
    hk, tk = k0.shape[1], k0.shape[2]
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    r = min(TOP_ROWS, tq)
    sample = _sample_rows(tq, q0.device)
    s_parts, row_parts, ranked_next, k_norm_max, q_max, k_max, bad = [], [], [], [], [], [], []
    for q, k, out, *_ in calls:  # a call's whole tensors, once each: its norms, maxima and broken rows
        q4, k4 = _heads4(q.detach()), _heads4(k.detach())
        qf, kf = q4.float(), k4.float()
        if hk != h:
            kf = kf.repeat_interleave(h // hk, dim=1)
        ranked = torch.linalg.vector_norm(qf, dim=-1).topk(min(r + 1, tq), dim=-1)
        rows = torch.cat([ranked.indices[..., :r], sample.expand(b, h, -1)], dim=-1)  # (B, H, R')
        s_parts.append(
            torch.matmul(qf.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, d)) * sc, kf.transpose(-1, -2))
        )  # (B, H, R', Tk)
        row_parts.append(rows)
        ranked_next.append(ranked.values[..., r] if tq > r else None)
        k_norm_max.append(torch.linalg.vector_norm(kf, dim=-1).amax(dim=-1))
        q_max.append(_abs_max(q4)[0])
        k_max.append(_abs_max(k4)[0])
        if out is not None:
            o = out.detach()
            rowsum = o.sum(dim=-1) if o.dtype in (torch.float32, torch.float64) else o.float().sum(dim=-1)
            bad.append((~torch.isfinite(rowsum)).sum())
        else:
            bad.append(torch.zeros((), dtype=torch.int64, device=q0.device))
    s = torch.cat(s_parts)  # (L*B, H, R', Tk): the small part, all layers at once
    row_index = torch.cat(row_parts)  # (L*B, H, R')
    if mask is not None:
        m = _mask4(mask)
        if m.shape[0] > 1 and layers > 1:  # a mask per batch element: the same for every layer
            m = m.repeat(layers, 1, 1, 1)
        mg = m.expand(b * layers, h, tq, tk).gather(2, row_index.unsqueeze(-1).expand(-1, -1, -1, tk))
        s = s.masked_fill(~mg, float("-inf")) if mg.dtype == torch.bool else s + mg.float()
    if is_causal:
        s = s.masked_fill(row_index.unsqueeze(-1) < torch.arange(tk, device=s.device), float("-inf"))
    top = s[..., :r, :].amax(dim=-1)  # (L*B, H, r)
    found = top.masked_fill(top <= MASK_SENTINEL_LIMIT, float("-inf")).amax(
        dim=-1
    )  # (L*B, H): rows with no key left out
    if tq > r:
        bound = torch.cat(ranked_next) * torch.cat(k_norm_max) * abs(sc)
        exact = _layer_first(found >= bound, layers).all(dim=1)
    else:
        exact = torch.ones(layers, h, dtype=torch.bool, device=s.device)
    e_min, e_mean, collapsed, first = _entropy(s[..., r:, :], layers)
    kmax = torch.stack(k_max)
    return CallStats(
        _layer_first(found, layers).amax(dim=1),
        exact,
        e_min,
        e_mean,
        collapsed,
        torch.stack(q_max),
        kmax.repeat_interleave(h // hk, dim=-1) if hk != h else kmax,
        torch.stack(bad),
        first,
    )


def _abs_max(t: torch.Tensor, layers: int = 1) -> torch.Tensor:
    """max |x| per layer and head of (L*B, H, T, d) -> (L, H): two reductions and no copy (vector_norm
    with ord=inf, and abs followed by amax, are several times slower on a CPU)."""
    t = _layer_first(t, layers)
    return torch.maximum(t.amax(dim=(1, 3, 4)), -t.amin(dim=(1, 3, 4))).float()


def scores_stats(scores: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor | None) -> CallStats:
    """Statistics of one eager softmax call from the scores it saw (B, H, Tq, Tk) and the q, k traced
    around it (GQA already expanded by the model)."""
    with torch.no_grad():
        s4 = _heads4(scores.detach())
        b, h, tq, tk = s4.shape
        rowmax = s4.amax(dim=-1).float()  # (B, H, Tq): one pass over the scores
        unmasked = rowmax > MASK_SENTINEL_LIMIT
        top = torch.where(unmasked, rowmax, float("-inf")).amax(dim=(0, 2))
        bad = (
            torch.isnan(rowmax) | torch.isposinf(rowmax) | torch.isneginf(rowmax)
        ).sum()  # NaN, +inf or every key -inf: torch.softmax gives NaN
        sample = s4[:, :, _sample_rows(tq, s4.device)].float()
        e_min, e_mean, collapsed, first = (t[0] for t in _entropy(sample))
        q_max = k_max = None
        if q is not None and k is not None and q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] == h and k.shape[-3] == h:
            q_max, k_max = _abs_max(_heads4(q.detach()))[0], _abs_max(_heads4(k.detach()))[0]
        return CallStats(
            top, torch.ones(h, dtype=torch.bool, device=s4.device), e_min, e_mean, collapsed, q_max, k_max, bad, first
        )


@dataclass
class GradCounts:
    """A call's gradients as its kernel produced them (dq, dk, dv together)."""

    nonfinite: torch.Tensor  # () how many of dq, dk, dv hold NaN or inf
    zeros: torch.Tensor  # () entries exactly 0
    total: int
    max_abs: torch.Tensor  # () largest |g| over the gradients without NaN or inf


def grad_counts(grads: dict[str, torch.Tensor]) -> GradCounts:
    return grad_counts_many([grads])[0]


def grad_counts_many(calls: list[dict[str, torch.Tensor]]) -> list[GradCounts]:
    """The gradients of several calls (dicts of grad_q, grad_k, grad_v), each gradient read twice and
    never copied: its entries that are not 0, and its largest |g| (NaN or inf where it holds them)."""
    out = []
    with torch.no_grad():
        for c in calls:
            ts = [c[r].detach() for r in ("grad_q", "grad_k", "grad_v") if isinstance(c.get(r), torch.Tensor)]
            if not ts:
                zero = torch.zeros((), dtype=torch.int64)
                out.append(GradCounts(zero, zero, 0, torch.zeros(())))
                continue
            total = sum(t.numel() for t in ts)
            nonzero = torch.stack([torch.count_nonzero(t) for t in ts]).sum()
            peaks = torch.stack([torch.maximum(t.amax(), -t.amin()).float() for t in ts])
            ok = torch.isfinite(peaks)
            out.append(GradCounts((~ok).sum(), total - nonzero, total, torch.where(ok, peaks, 0.0).amax()))
    return out
