"""The first cause of each row of a cell's output O = P@V that is NaN or inf (results.OUT_CAUSES): its P row is
itself NaN, V holds NaN/inf in the row's head, V's cast to the dtype overflows there, or P and V are finite in the
dtype and P@V passes the dtype's max. Numbers only: the judgement (findings.accuracy) says what they mean."""

from __future__ import annotations

from collections import Counter

import torch

from attncheck.numerics.precision import cast
from attncheck.numerics.reduce import Examples, Max, any_true, attribute, count
from attncheck.numerics.rowmath import row_finite


def out_causes(
    v: torch.Tensor, probs: torch.Tensor, out_bad: torch.Tensor, dt: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The output rows ``out_bad`` (r,) by first cause, and the float64 |P @ V| row maxima (r,) of the rows left to
    'pv_overflow' (0 elsewhere). ``v`` (n, Tk, dv) the block's V as given, per query head; ``probs`` (r, Tk) the
    cell's P, its rows n x tq; ``dt`` the dtype V is cast to (None: an FP8 path, which quantises V itself)."""
    n, tk = v.shape[0], v.shape[1]
    tq = probs.shape[0] // n
    fin = torch.isfinite(v)

    def per_row(head: torch.Tensor) -> torch.Tensor:  # (n,) per head -> (r,) per row
        return head.repeat_interleave(tq)

    v_bad = per_row(~fin.reshape(n, -1).all(dim=-1))
    vd = v if dt is None else cast(v, dt)
    over = per_row((torch.isinf(vd) & fin).reshape(n, -1).any(dim=-1))
    p_bad = ~row_finite(probs)
    causes = [("softmax", p_bad), ("v_nonfinite", v_bad), ("v_cast_overflow", over)]
    left = out_bad & ~(p_bad | v_bad | over)
    pv = torch.zeros(probs.shape[0], dtype=torch.float64, device=probs.device)
    if any_true(left):  # P and V finite in the dtype: how large is P@V in float64 (P as the cell holds it)?
        prod = torch.matmul(probs.to(torch.float64).reshape(n, tq, tk), vd.to(torch.float64)).reshape(-1, v.shape[-1])
        pv = torch.where(left, prod.abs().amax(dim=-1), 0.0)
    limit = torch.finfo(probs.dtype if dt is None else dt).max
    causes.append(("pv_overflow", pv > limit))
    return attribute(out_bad, causes), pv


class OutNanAcc:
    """A cell's NaN/inf output rows by first cause (with example rows), and the largest |P@V| of 'pv_overflow'."""

    def __init__(self, examples: Examples) -> None:
        self.causes: Counter[str] = Counter()
        self.examples = examples
        self.pv_max = Max()

    def update(self, v: torch.Tensor, probs: torch.Tensor, out: torch.Tensor, dt, offset: int) -> None:
        out_bad = ~row_finite(out)
        if not any_true(out_bad):
            return
        hits, pv = out_causes(v, probs, out_bad, dt)
        for cause, hit in hits.items():
            k = count(hit)
            if k:
                self.causes[cause] += k
                self.examples.add(f"out:{cause}", hit, offset)
        if self.causes.get("pv_overflow"):
            self.pv_max.add(pv[hits["pv_overflow"]])

    def fields(self) -> dict:
        return dict(out_nan_causes=dict(self.causes), out_pv_max=self.pv_max.value)
