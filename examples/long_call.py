"""A long causal call as q, k, v dumps, with failures planted in two rows, for ``attncheck run --budget``.

2 heads x 4,096 tokens, head dim 64, fp32, causal. Planted: query 1,000 of head 1 points along key 0 with
|q.k| = 2,000 |k_0|^2 (past fp16's 65,504: the eager path's Q@K^T overflows in fp16), and query 3,000 of head 0
holds a NaN. The bound certifies the other rows free of overflow and NaN; ``--budget`` computes the two rows'
positions in full and samples the rest.

    python examples/long_call.py [OUTDIR]
"""

import torch
from _common import output_dir
from safetensors.torch import save_file

out = output_dir()
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 4096, 64, generator=g) for _ in range(3))
q[0, 1, 1000] = 2000.0 * k[0, 1, 0]
q[0, 0, 3000, 7] = float("nan")
for name, x in (("q", q), ("k", k), ("v", v)):
    save_file({name: x.contiguous()}, str(out / f"long_{name}.safetensors"))
print(f"wrote {out}/long_q.safetensors, long_k.safetensors, long_v.safetensors")
