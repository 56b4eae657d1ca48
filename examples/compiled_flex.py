"""A torch.compile'd model whose attention is FlexAttention with a causal block mask and a Gemma-2
style soft cap, in fp16, with one head whose logits are far past what fp16 holds:

    python examples/compiled_flex.py
    attncheck capture --what-if fp16 --out cf examples/compiled_flex.py

Under capture the compiled code runs as its eager code (the report says so), the flex call is
recorded with its block mask and its logits after the cap, and judged by the flex kernel on them:
no overflow, the headroom the cap's, while hand-written fp16 attention on the same q and k (the
what-if) overflows. (The example compiles with the aot_eager backend: the same dynamo tracing as
inductor, without a C++ build.)
"""

import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def softcap(score, b, h, q_idx, kv_idx):
    return 50.0 * torch.tanh(score / 50.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Block(torch.nn.Module):
    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width, dtype=torch.float16)

    def forward(self, x, block_mask):
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in self.qkv(x).split(w, -1))
        q = q.clone()
        q[:, 1] = q[:, 1] * 50 + 60  # head 1: q.k near 60 * 60 * 16 = 57600, past 65504 at its largest (k grown alike)
        k = k.clone()
        k[:, 1] = k[:, 1] * 50 + 60
        o = flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask, scale=1e-3)
        return x + o.transpose(1, 2).reshape(b, t, w)


torch.manual_seed(0)
model = torch.compile(Block(), backend="aot_eager")
x = torch.randn(2, 64, 64, dtype=torch.float16)
mask = create_block_mask(causal, None, None, 64, 64, device="cpu")
with torch.no_grad():  # FlexAttention has no backward on a CPU
    out = model(x, mask)
print(f"output finite: {bool(torch.isfinite(out).all())}")
