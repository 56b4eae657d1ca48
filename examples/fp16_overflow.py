"""An attention head that forgot the 1/sqrt(d_k) scaling, run in fp16.

With d_k = 128 and unit-variance q and k, q.k has variance 128 (std ~11.3), so
logits pass ln(65504) ~ 11.09 and a naive exp(x) / sum(exp(x)) in fp16 overflows.
The dump is saved in fp16, as a model running in half precision would save it.

    python examples/fp16_overflow.py [OUTDIR]
"""

import torch
from _common import diagnose_and_expect, output_dir
from safetensors.torch import save_file

out = output_dir()
g = torch.Generator().manual_seed(0)
q = torch.randn(1, 2, 32, 128, generator=g)  # (B, H, T, d_k)
k = torch.randn(1, 2, 32, 128, generator=g)
scores = (q @ k.transpose(-1, -2)).half()  # no 1/sqrt(d_k): (B, H, T, T)
path = out / "unscaled_fp16.safetensors"
save_file({"layer0.attn.scores": scores}, str(path))

diagnose_and_expect(str(path), {"exp_overflow"}, "--dtype", "fp16", "--brief")
