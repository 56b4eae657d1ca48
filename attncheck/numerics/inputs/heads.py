"""Per-head facts of one attention call: max |q| and |k|, the largest logit, and how many scores
of Q@K^T overflow the call's dtype when computed as the model rounds them.

The head axis is the one before the queries (``scores.shape[-3]``; ``q.shape[1]`` once the
inputs are normalised to (B, H, T, d)). A loop over heads is fine; nothing loops over rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attncheck.numerics.precision import MASK_SENTINEL_LIMIT
from attncheck.results import Cell, HeadStat

if TYPE_CHECKING:
    from attncheck.numerics.inputs.scores import AttentionInputs


def _finite_abs_max(t: torch.Tensor, keep: int) -> torch.Tensor:
    """max |t| over finite values along every axis but ``keep``; float64 (H,), 0 where none."""
    a = torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype)).to(torch.float64)
    dims = [d for d in range(t.dim()) if d != keep]
    return a.amax(dim=dims) if dims else a


def head_max_logits(scores: torch.Tensor) -> list[float | None]:
    """Largest finite score per head that is not a mask sentinel (> -1e4); None for a head with none."""
    s = scores.reshape(1, 1, *scores.shape) if scores.dim() == 2 else scores
    s = s.reshape(-1, *s.shape[-3:])  # (N, H, Tq, Tk)
    use = torch.isfinite(s) & (s > MASK_SENTINEL_LIMIT)
    v = torch.where(use, s, torch.full((), float("-inf"), dtype=s.dtype)).amax(dim=(0, 2, 3)).to(torch.float64)
    return [None if x == float("-inf") else x for x in v.tolist()]


def _input_max_logits(inp: "AttentionInputs") -> list[float | None]:
    """Largest finite unmasked float64 logit per head: scale * q.k plus the float mask."""
    b, hq = inp.q.shape[:2]
    group = hq // inp.k.shape[1]
    out: list[float | None] = []
    for h in range(hq):  # one head at a time keeps the float64 scores to (B, Tq, Tk)
        s = torch.matmul(inp.q[:, h].to(torch.float64), inp.k[:, h // group].to(torch.float64).transpose(-1, -2)) * inp.scale
        masked = torch.zeros_like(s, dtype=torch.bool)
        if inp.mask_float is not None:
            m = inp.mask_float[:, h]
            s = s + m
            masked |= m <= MASK_SENTINEL_LIMIT
        if inp.masked is not None:
            masked |= inp.masked[:, h]
        use = torch.isfinite(s) & ~masked
        out.append(float(s[use].max()) if bool(use.any()) else None)
    return out


def qk_overflow_per_head(inp: "AttentionInputs", dtype: torch.dtype) -> list[int]:
    """Scores of Q@K^T that are infinite in ``dtype`` although q and k are finite, per query head:
    q and k cast to the dtype, Q@K^T accumulated in float32 and rounded to the dtype, the scale
    applied to q first or to the scores after (as ``numerics.inputs.scores`` computes a model's scores)."""
    b, hq = inp.q.shape[:2]
    group = hq // inp.k.shape[1]
    out = []
    for h in range(hq):
        q, k = inp.q[:, h], inp.k[:, h // group]  # (B, Tq, d), (B, Tk, d)
        qd, kd = q.to(dtype), k.to(dtype)
        if inp.scale_order == "q":
            qd = qd * inp.scale
        s = torch.matmul(qd.float(), kd.float().transpose(-1, -2)).to(dtype)  # (B, Tq, Tk)
        if inp.scale_order == "scores":
            s = s * inp.scale
        valid = torch.isfinite(q).all(dim=-1)[:, :, None] & torch.isfinite(k).all(dim=-1)[:, None, :]
        out.append(int((torch.isinf(s) & valid).sum()))
    return out


def head_stats(
    inputs: "AttentionInputs | None",
    scores: torch.Tensor | None,
    dtype: torch.dtype | None,
    cell: Cell | None,
) -> list[HeadStat]:
    """One HeadStat per head of a call. ``inputs``: its normalised q/k/mask (None when only
    scores were recorded); ``scores``: what its softmax saw; ``dtype``: what the model computed
    Q@K^T in; ``cell``: the cell the model ran (its NaN rows per head)."""
    if inputs is not None:
        heads = inputs.q.shape[1]
        group = heads // inputs.k.shape[1]
        q_max = _finite_abs_max(inputs.q, 1).tolist()
        k_max = _finite_abs_max(inputs.k, 1).tolist()
        k_max = [k_max[h // group] for h in range(heads)]
        logits = head_max_logits(scores) if scores is not None and scores.shape[-3:-2] == (heads,) else _input_max_logits(inputs)
        overflow = qk_overflow_per_head(inputs, dtype) if dtype is not None and dtype.is_floating_point else [0] * heads
    elif scores is not None:
        heads = scores.shape[-3] if scores.dim() >= 3 else 1
        q_max = k_max = [None] * heads
        logits = head_max_logits(scores)
        overflow = [0] * heads
    else:
        return []
    nan = cell.nan_rows_per_head if cell is not None and len(cell.nan_rows_per_head) == heads else [0] * heads
    return [HeadStat(h, q_max[h], k_max[h], logits[h], overflow[h], nan[h]) for h in range(heads)]
