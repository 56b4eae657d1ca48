"""A plain PyTorch model for `attncheck capture`: no attncheck in it, nothing to change.

Its attention adds a causal plane and a padding plane (over padded keys and padded
queries), each filled with finfo(fp16).min. Where two planes meet the sum overflows to
-inf, so a padded query row is -inf everywhere: SDPA returns zeros for it, the eager
path below NaN. Run it under capture to see which layer, and why:

    attncheck capture --out dumps/plain-capture -- examples/plain_attention.py --pad 3
    python examples/plain_attention.py [OUTDIR] [--pad N]
"""

import argparse
import math

import torch
import torch.nn.functional as F


class Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int, eager: bool) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.heads, self.eager = heads, eager

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (
            z.view(b, t, self.heads, e // self.heads).transpose(1, 2) for z in self.qkv(x).split(e, dim=-1)
        )  # (B, H, T, d)
        low = torch.finfo(x.dtype).min
        causal = torch.zeros(t, t, dtype=x.dtype).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), low)
        keys = torch.zeros(b, 1, 1, t, dtype=x.dtype).masked_fill(pad[:, None, None, :], low)
        queries = torch.zeros(b, 1, t, 1, dtype=x.dtype).masked_fill(pad[:, None, :, None], low)
        mask = causal + keys + queries  # (B, 1, T, T): the bug, planes added instead of combined
        if self.eager:
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, dim=-1)  # (B, H, T, T)
            out = p @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, e)


class Model(torch.nn.Module):
    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(width, heads, eager=False), Attention(width, heads, eager=True)])

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, pad)
        return x


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", nargs="?")
    parser.add_argument("--pad", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model().half().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float16)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[0, : args.pad] = True  # left padding in the first sequence
    with torch.no_grad():
        y = model(x, pad)
    print(f"padded queries: {args.pad}; rows of the output holding NaN: {int(torch.isnan(y).any(dim=-1).sum())}")
