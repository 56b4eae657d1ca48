"""Per-head facts of one attention call: max |q| and |k|, and how many scores of Q@K^T overflow a
dtype when computed as the model rounds them. (The largest logit per head comes from the
diagnosis's own pass: ``cells.accumulate.HeadMax``.)

The head axis is ``q.shape[1]`` once the inputs are normalised to (B, H, T, d). A loop over heads
is fine; nothing loops over rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attncheck.numerics.inputs.scores import AttentionInputs


def _finite_abs_max(t: torch.Tensor, keep: int) -> torch.Tensor:
    """max |t| over finite values along every axis but ``keep``; float64 (H,), 0 where none."""
    a = torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype)).to(torch.float64)
    dims = [d for d in range(t.dim()) if d != keep]
    return a.amax(dim=dims) if dims else a


def qk_maxima(inp: "AttentionInputs") -> tuple[list[float], list[float]]:
    """(max |q| per query head, max |k| of the kv head each query head reads), finite values only."""
    heads = inp.q.shape[1]
    group = heads // inp.k.shape[1]
    q_max = _finite_abs_max(inp.q, 1).tolist()
    k_max = _finite_abs_max(inp.k, 1).tolist()
    return q_max, [k_max[h // group] for h in range(heads)]


def kv_heads(inp: "AttentionInputs") -> list[int]:
    """The kv head each query head reads: k's own heads under GQA (k has fewer heads than q), else groups of
    consecutive heads whose k is the same tensor (eager GQA code repeats k over a group before Q@K^T, as
    transformers' ``repeat_kv`` does), else each head its own."""
    hq, hk = inp.q.shape[1], inp.k.shape[1]
    if hk < hq:
        return [h // (hq // hk) for h in range(hq)]
    out = [0]
    for h in range(1, hq):
        out.append(out[-1] + (0 if torch.equal(inp.k[:, h], inp.k[:, h - 1]) else 1))
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
