"""Sums kept in 16 bits: the softmax denominator and P@V accumulated in fp16/bf16 as CPU engines keep them.

1. 4,096 equal logits (every exp(s - max) is 1): a sequential fp16 sum sticks at 2,048, fp16's spacing being 2
   there (sonos/tract PR 2586): the row's probabilities sum to 2 (`lowsum_error`).
2. One query over 65,536 keys of equal logits with V = 1: the unnormalised P@V accumulator holds k after k keys;
   in blocks of 64 (fp32 inside, fp16 between) it reaches 65,536 >= 65,520 at the last key and is inf
   (`accumulator_overflow`), the 64k-context NaN of ikawrakow/ik_llama.cpp PR 1196.
3. The growth of the denominator's error with the row length, per order, on N(0,1) logits (printed).
4. The same for P@V with V ~ N(0, 1), fp16-online (llama.cpp's CPU flash attention) beside the others (printed).

    python examples/lowsum_fp16.py [OUTDIR]
"""

import numpy as np
import torch
from _common import diagnose_and_expect, output_dir

from attncheck.numerics.methods.lowsum import row_sums
from attncheck.params import sum_specs

out = output_dir()
np.save(out / "equal.npy", np.zeros((4, 4096), dtype=np.float32))
diagnose_and_expect(
    str(out / "equal.npy"), {"lowsum_error"}, "--dtype", "fp16", "--method", "stable", "--accumulate", "fp16-seq"
)

n = 65536
torch.save(
    {"q": torch.zeros(1, 1, 1, 8), "k": torch.zeros(1, 1, n, 8), "v": torch.ones(1, 1, n, 4)}, out / "qkv_64k.pt"
)
qkv = [f"--{name}={out / 'qkv_64k.pt'}:{name}" for name in "qkv"]
diagnose_and_expect(
    "",
    {"accumulator_overflow"},
    *qkv,
    "--path",
    "eager",
    "--dtype",
    "fp32",
    "--method",
    "torch",
    "--accumulate",
    "fp16-block:64",
    "--brief",
    report=str(out / "qkv_64k.report.json"),
)

specs = sum_specs("fp16-seq,fp16-pairwise,fp16-block:64,bf16-seq,bf16-pairwise,bf16-block:64")
g = torch.Generator().manual_seed(0)
print("mean relative error of the denominator against float64, 4 rows of N(0,1) logits")
print("keys    " + "".join(f"{s.label:>15}" for s in specs))
for keys in (1024, 4096, 16384, 65536):
    x = torch.randn(4, keys, generator=g, dtype=torch.float64)
    errs = [float(row_sums(x, s).denom_err.mean()) for s in specs]
    print(f"{keys:<8}" + "".join(f"{e:>15.2e}" for e in errs))

# 4. P@V: the output's relative error (max over the head dim, against max |O64|) with V ~ N(0, 1) in fp16, head dim
#    16; fp16-online is llama.cpp's CPU flash attention (f16 VKQ16 rescaled at each new max, fp32 S)
specs = sum_specs("fp16-seq,fp16-pairwise,fp16-block:64,fp16-online")
print("mean relative error of P@V against float64, 4 rows of N(0,1) logits, V N(0,1) in fp16, head dim 16")
print("keys    " + "".join(f"{s.label:>15}" for s in specs))
for keys in (1024, 4096, 16384, 65536):
    x = torch.randn(4, keys, generator=g, dtype=torch.float64)
    v = torch.randn(4, keys, 16, generator=g).half()
    errs = [float(row_sums(x, s, v).out_err.mean()) for s in specs]
    print(f"{keys:<8}" + "".join(f"{e:>15.2e}" for e in errs))
