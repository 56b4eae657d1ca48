"""The audit of the inputs: what the mask and scale audit starts from (the spreads and largest values of
q and k), and the robust spread of the scores sampled as blocks go by (``AttentionAudit.scores_std``)."""

from __future__ import annotations

import torch

from attncheck.dtypes import dtype_label
from attncheck.numerics.inputs.prepare import AttentionInputs
from attncheck.numerics.precision import cast
from attncheck.results import AttentionAudit

SPREAD_SAMPLE = 1 << 17


class SpreadSample:
    """The first SPREAD_SAMPLE unmasked float64 scores (row-major order, so the same values
    whatever the chunking) and their robust spread, kept in ``audit.scores_std``."""

    def __init__(self, audit: AttentionAudit) -> None:
        self.audit = audit
        self._values: list[torch.Tensor] = []
        self._taken = 0

    @property
    def full(self) -> bool:
        return self._taken >= SPREAD_SAMPLE

    def add(self, values: torch.Tensor) -> None:
        take = min(values.numel(), SPREAD_SAMPLE - self._taken)
        if take <= 0:
            return
        self._values.append(values.reshape(-1)[:take].to("cpu", torch.float64))
        self._taken += take
        if self.full:
            self.finish()

    def finish(self) -> None:
        """Set ``audit.scores_std`` from what was taken (once full, or after the last block)."""
        if self._values:
            self.audit.scores_std = robust_std(torch.cat(self._values))
            self._values = [torch.cat(self._values)] if not self.full else []


def robust_std(values: torch.Tensor, sample: int | None = None) -> float:
    """1.4826 x median absolute deviation: the std of a normal sample, blind to a few outliers.
    ``sample``: at most this many values, taken at an even stride (a whole q of a long sequence
    costs a sort of millions for a number the audit prints to 3 digits)."""
    flat = values.reshape(-1)
    if sample is not None and flat.numel() > sample:
        flat = flat[:: -(-flat.numel() // sample)]
    v = flat[torch.isfinite(flat)].to(torch.float64)
    if v.numel() == 0:
        return 0.0
    med = v.median()
    return float(1.4826 * (v - med).abs().median())


def _finite_abs_max(t: torch.Tensor) -> float:
    fin = torch.isfinite(t)
    if not bool(fin.any()):
        return 0.0
    return float(torch.where(fin, t.abs(), 0).max())


def start_audit(inp: AttentionInputs, statistics: bool = True) -> AttentionAudit:
    """The audit blocks fill in; without ``statistics``, the spreads and maxima of q and k
    are left at 0 (for callers that only need the paths' numbers)."""
    if not statistics:
        return AttentionAudit(
            d=inp.d,
            heads=inp.heads,
            kv_heads=inp.k.shape[1],
            scale=inp.scale,
            scale_name=inp.scale_name,
            scale_order=inp.scale_order,
            mask_value=inp.mask_value,
            q_std=0.0,
            k_std=0.0,
            q_max_abs=0.0,
            k_max_abs=0.0,
            float_mask_looks_boolean=inp.float_mask_looks_boolean,
        )
    q64, k64 = inp.q.to(torch.float64), inp.k.to(torch.float64)
    audit = AttentionAudit(
        d=inp.d,
        heads=inp.heads,
        kv_heads=inp.k.shape[1],
        scale=inp.scale,
        scale_name=inp.scale_name,
        scale_order=inp.scale_order,
        mask_value=inp.mask_value
        if inp.masked is not None or inp.float_mask_value is None
        else repr(inp.float_mask_value),
        float_mask_value=inp.float_mask_value,
        q_std=robust_std(q64, SPREAD_SAMPLE),
        k_std=robust_std(k64, SPREAD_SAMPLE),
        q_max_abs=_finite_abs_max(q64),
        k_max_abs=_finite_abs_max(k64),
        float_mask_looks_boolean=inp.float_mask_looks_boolean,
        mask_summed_neginf=inp.mask_summed_neginf,
        mask_deep_sentinel=inp.mask_deep_sentinel,
    )
    if inp.v is not None:
        audit_v(audit, inp.v)
    return audit


V_EXAMPLES = 4  # V entries named per kind (non-finite, beyond a dtype's range)
V_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the casts a cell of V can go through


def audit_v(audit: AttentionAudit, v: torch.Tensor) -> None:
    """V's non-finite entries, its largest finite |v|, and per dtype the finite entries the cast turns to +-inf:
    what explains a NaN or inf row of the output whose softmax is finite (results.OUT_CAUSES)."""
    fin = torch.isfinite(v)
    audit.v_max_abs = _finite_abs_max(v)
    bad = ~fin
    audit.v_nonfinite = int(bad.sum())
    audit.v_nonfinite_at = _entries(v, bad)
    for dt in V_CAST_DTYPES:
        if dt == v.dtype or (v.dtype != torch.float64 and torch.finfo(v.dtype).max <= torch.finfo(dt).max):
            continue  # a cast to a wider range cannot overflow
        over = fin & torch.isinf(cast(v, dt))
        n = int(over.sum())
        if n:
            label = dtype_label(dt)
            audit.v_cast_overflow[label] = n
            audit.v_cast_overflow_at[label] = _entries(v, over)


def _entries(v: torch.Tensor, hit: torch.Tensor) -> list[tuple[tuple[int, ...], float]]:
    """The first V_EXAMPLES entries of ``v`` where ``hit``: (batch, kv head, key, dim) and the value."""
    idx = torch.nonzero(hit)[:V_EXAMPLES]
    return [(tuple(int(i) for i in row), float(v[tuple(row)])) for row in idx.tolist()]
