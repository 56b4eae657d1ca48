"""FP8 attention: the P cast that flushes probabilities after an attention sink, and Q/K/V
cast to e4m3 without a descale.

1. Scores with an attention sink: the first 4 keys sit 9 above N(0,1) logits. A kernel
   that visits the key blocks first to last and casts P to e4m3 unscaled (S = 1) meets the
   sink first; every later probability below 2^-10 of the sink's flushes to 0
   (`p_cast_underflow`). FlashAttention-3's choices, S = 256 and reverse order, keep them.
2. Q of a layer where one query row reached 1000, cast to e4m3 without a descale: the
   satfinite cast clips it at 448 (`fp8_overflow`, `fp8_unscaled`); with per-head
   descales (FlashAttention-3's q_descale/k_descale/v_descale) nothing is clipped.

    python examples/fp8_attention.py [OUTDIR]
"""

import numpy as np
import torch
from _common import diagnose_and_expect, output_dir

out = output_dir()
rng = np.random.default_rng(0)
scores = rng.standard_normal((4, 256, 1024)).astype(np.float32)  # (heads, queries, keys)
scores[..., :4] += 9.0  # the sink
np.save(out / "sink.npy", scores)
diagnose_and_expect(
    str(out / "sink.npy"), {"p_cast_underflow"}, "--dtype", "e4m3", "--method", "tiled", "--p-scale", "1", "--brief"
)

g = torch.Generator().manual_seed(0)
q = torch.randn(1, 4, 128, 64, generator=g)  # (B, H, T, d)
k = torch.randn(1, 4, 128, 64, generator=g)
v = torch.randn(1, 4, 128, 64, generator=g)
q[0, 2, 7, :4] = 1000.0  # one query row of a layer whose activations blew up
torch.save({"q": q, "k": k, "v": v}, out / "qkv_fp8.pt")
qkv = [f"--{name}={out / 'qkv_fp8.pt'}:{name}" for name in "qkv"]
diagnose_and_expect(
    "",
    {"fp8_overflow", "fp8_unscaled"},
    *qkv,
    "--dtype",
    "bf16,e4m3",
    "--method",
    "torch",
    "--fp8-scaling",
    "none",
    "--brief",
    report=str(out / "qkv_fp8.report.json"),
)
