"""Dumps for the backward from the command line: q, k, v of one attention call and its output
gradient dO, once as is and once scaled by 2^16 (an fp16 loss scale):

    python examples/backward_dumps.py DIR
    attncheck run --q DIR/qkv.pt:q --k DIR/qkv.pt:k --v DIR/qkv.pt:v --grad-out DIR/do_scaled.pt --dtype fp16 --causal
"""

import torch
from _common import output_dir

out = output_dir()
g = torch.Generator().manual_seed(0)
q, k = (torch.randn(1, 2, 32, 64, generator=g) for _ in range(2))
v = torch.randn(1, 2, 32, 64, generator=g) * 4
dout = torch.randn(1, 2, 32, 64, generator=g) * 1e-2  # the gradient a mean loss sends back: small
torch.save({"q": q, "k": k, "v": v}, out / "qkv.pt")
torch.save({"grad_out": dout.half()}, out / "do.pt")
torch.save({"grad_out": (dout * 2**16).half()}, out / "do_scaled.pt")
print(f"wrote {out / 'qkv.pt'}, {out / 'do.pt'}, {out / 'do_scaled.pt'}")
