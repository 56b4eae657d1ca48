"""Which CUDA kernel breaks a call: two captures as a GPU (an H100, sm90) writes them, judged here on a CPU.

- `fused/`: PyTorch issue 121558's input, bf16 Q, K, V every element 133120, run by PyTorch's flash backend.
  `--what-if kernels` shows it finite under fa2 (PyTorch builds FlashAttention-2 with UNFUSE_FMA) and NaN
  under fa2-fma, the flash-attn package's fused exponent.
- `padded/`: PyTorch issue 196678's construction, an explicit causal mask over 192 keys (192 % 128 == 64)
  and every logit near -120, run by cuDNN: its backward NaN (padded tile) is predicted for every row.

The captures are made here on the CPU and marked as a GPU capture records them (device cuda:0, compute
capability 9.0, the SDPA backend PyTorch chose: attncheck.testing.as_gpu_capture); a capture made on a GPU
needs no marking.

    python examples/gpu_kernels.py OUT
"""

import math

import torch
import torch.nn.functional as F
from _common import output_dir

import attncheck
from attncheck.testing import as_gpu_capture

out = output_dir()
q = torch.full((1, 1, 4, 64), 133120.0, dtype=torch.bfloat16)
with torch.no_grad(), attncheck.capture(out / "fused"):
    F.scaled_dot_product_attention(q, q, q)
as_gpu_capture(out / "fused", "flash_attention")

L, D = 192, 64
torch.manual_seed(0)
q = torch.randn(1, 1, L, D, dtype=torch.bfloat16) * 0.1
k = torch.randn(1, 1, L, D, dtype=torch.bfloat16) * 0.1
v = torch.randn(1, 1, L, D, dtype=torch.bfloat16)
q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)  # every logit about -120: each row's log-sum-exp below -88.7
keep = torch.ones(L, L, dtype=torch.bool).tril()
with torch.no_grad(), attncheck.capture(out / "padded"):
    F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
as_gpu_capture(out / "padded", "cudnn_attention")
print(f"wrote {out / 'fused'} and {out / 'padded'}")
