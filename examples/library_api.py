"""attncheck as a library: diagnose a tensor in your own code, no files involved.

python examples/library_api.py
"""

import torch

from attncheck import Options, diagnose

g = torch.Generator().manual_seed(0)
scores = torch.randn(8, 128, generator=g) * 6  # (queries, keys): logits of std 6
scores[0, 0] = 40.0  # one very large logit

result = diagnose("my_layer.scores", scores, Options(dtypes=("fp16", "bf16"), methods=("naive", "stable", "tiled")))
for cell in result.cells:
    # Errors are measured over rows where the cell and the reference are finite:
    # None means no such row (every row of the cell is NaN).
    err = "n/a (no finite row)" if cell.max_abs_err is None else f"{cell.max_abs_err:.2e}"
    print(f"{cell.name:<12} NaN rows {cell.nan_rows}/{cell.rows}  max error {err}  causes {cell.nan_causes}")
for finding in result.findings:
    print(f"[{finding.severity}] {finding.code}: {finding.message}\n    fix: {finding.fix}")

naive16 = result.cell("naive", "fp16")
assert naive16.nan_causes.get("exp_overflow", 0) >= 1, "exp(40) overflows fp16: expected an exp_overflow NaN row"
assert result.cell("stable", "fp16").nan_rows == 0
