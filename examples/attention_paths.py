"""Which attention implementation breaks on these inputs? Q, K and V through eager
attention, PyTorch SDPA's math backend and FlashAttention, each with its own rounding.

1. The q and k of a layer without normalisation: one query row at 72 and one key row at
   47.75 (d = 64), so q.k = 220,032 before the 1/8 scale. Hand-written (eager) attention
   in fp16 rounds Q@K^T to fp16 first: inf, then NaN. SDPA's math backend scales q and k
   by sqrt(1/8) each before the matmul and FlashAttention keeps S in fp32: neither has a
   NaN. attncheck says so (`qk_overflow` ... by path) and measures each path's output
   O = P@V against float64.
2. Eight keys identical (a low-rank key cache) that dominate every query: the row max is
   shared, exp(s - max) is exactly 1 at each of those keys, and bf16 attention's output is
   biased there (`tied_max_bias`, Qiu and Yao 2025).

    python examples/attention_paths.py [OUTDIR]
"""

import json
import sys

import torch
from _common import diagnose_and_expect, output_dir

out = output_dir()
g = torch.Generator().manual_seed(0)

q = torch.randn(1, 2, 16, 64, generator=g)  # (B, H, T, d)
k = torch.randn(1, 2, 16, 64, generator=g)
v = torch.randn(1, 2, 16, 64, generator=g)
q[0, 0, 3] = 72.0
k[0, 0, 5] = 47.75
torch.save({"q": q, "k": k, "v": v}, out / "qkv_large.pt")
report = out / "qkv_large.report.json"
args = [
    "--q",
    f"{out}/qkv_large.pt:q",
    "--k",
    f"{out}/qkv_large.pt:k",
    "--v",
    f"{out}/qkv_large.pt:v",
    "--dtype",
    "fp16",
    "--method",
    "stable,torch",
    "--brief",
]
diagnose_and_expect("", {"qk_overflow"}, *args, report=str(report))
cells = {c["name"]: c for c in json.loads(report.read_text())["tensors"][0]["cells"]}
nan = {name: c["nan_rows"] for name, c in cells.items()}
if nan != {"eager:stable/fp16": 1, "eager:torch/fp16": 1, "sdpa-math/fp16": 0, "flash/fp16": 0}:
    sys.exit(f"expected NaN only on the eager path, got {nan}")
print("as expected: eager fp16 has a NaN row, sdpa-math and flash have none")

q = torch.randn(1, 4, 256, 64, generator=g)
k = torch.randn(1, 4, 256, 64, generator=g)
k[..., 1:8, :] = k[..., :1, :]  # eight identical keys per head
q = q + 2 * k[..., :1, :]  # that every query prefers
v = torch.randn(1, 4, 256, 64, generator=g) - 0.5
torch.save({"q": q, "k": k, "v": v}, out / "qkv_tied.pt")
args = [
    "--q",
    f"{out}/qkv_tied.pt:q",
    "--k",
    f"{out}/qkv_tied.pt:k",
    "--v",
    f"{out}/qkv_tied.pt:v",
    "--dtype",
    "bf16",
    "--method",
    "torch",
    "--brief",
]
diagnose_and_expect("", {"tied_max_bias"}, *args, report=str(out / "qkv_tied.report.json"))
