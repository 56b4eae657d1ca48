"""Register a softmax of your own and diagnose it beside the built-in methods.

    python examples/custom_method.py

A stable softmax that multiplies by the reciprocal of the row sum (itself rounded to
the dtype) rounds every probability twice; attncheck measures what that costs in fp16
against float64, next to torch.softmax, on scores with a fully masked row.
"""

import numpy as np
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def stable_reciprocal(x, params):  # x: the scores in the cell's dtype; params: block, reverse, accum
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return MethodOutput(e * e.sum(-1, keepdim=True).reciprocal())


METHODS.register(MethodSpec("stable_recip", "stable, times the rounded reciprocal of the sum", stable_reciprocal))

g = torch.Generator().manual_seed(0)
scores = torch.randn(4, 64, 256, generator=g) * 3  # (heads, queries, keys)
scores[2, 5] = float("-inf")  # one query that may attend to nothing

result = diagnose("layer0.scores", scores, Options(dtypes=("fp16",), methods=("stable_recip", "stable", "torch")))
for cell in result.cells:
    # Against float64 of the scores as given, and of the scores after the cast to fp16 (algo):
    # the cast costs every method the same; the algorithmic error tells them apart.
    print(
        f"{cell.name:<18} NaN rows {cell.nan_rows} {cell.nan_causes}  max error {cell.max_abs_err:.2e}, algo "
        f"{cell.max_abs_err_algo:.2e}, RMSE algo {cell.rmse_algo:.2e}"
    )

# The reported error is the method's own, measured here independently with numpy.
x = scores.numpy().astype(np.float64).reshape(-1, 256)
with np.errstate(invalid="ignore"):  # the fully masked row: -inf - (-inf)
    ref = np.exp(x - x.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
p = stable_reciprocal(scores.half(), None).probs.double().numpy().reshape(-1, 256)
ok = np.isfinite(ref).all(-1) & np.isfinite(p).all(-1)
assert result.cell("stable_recip", "fp16").nan_causes == {"fully_masked": 1}
assert np.isclose(result.cell("stable_recip", "fp16").max_abs_err, np.abs(p[ok] - ref[ok]).max(), rtol=1e-12)
