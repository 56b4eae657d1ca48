"""Q@K^T itself overflows fp16 before any softmax: one query and one key with large
entries (max|q| = 576, max|k| = 382), as after a layer without normalisation.

576 x 382 = 220032 > 65504, so the fp16 score is inf; scaled by 1/sqrt(64) first,
q becomes 72 and the score 27504, which fits. attncheck reports `qk_overflow` and
says that `--scale-order q` would avoid it.

    python examples/qk_overflow_fp16.py [OUTDIR]
"""

import torch
from _common import diagnose_and_expect, output_dir

out = output_dir()
g = torch.Generator().manual_seed(0)
q = torch.randn(2, 4, 16, 64, generator=g)  # (B, H, T, d)
k = torch.randn(2, 4, 16, 64, generator=g)
q[0, 1, 5, 0] = 576.0
k[0, 1, 9, 0] = 382.0
path = out / "qk.pt"
torch.save({"q": q, "k": k}, path)

diagnose_and_expect(
    "",
    {"qk_overflow"},
    "--q",
    f"{path}:q",
    "--k",
    f"{path}:k",
    "--dtype",
    "fp16",
    "--method",
    "stable,torch",
    "--brief",
    report=str(out / "qk.report.json"),
)
