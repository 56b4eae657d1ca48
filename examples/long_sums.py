"""Two attention layers over 4,096 keys, for `attncheck capture --accumulate` to ask how sums kept in 16 bits would
do on each of their calls.

Each layer is one SDPA call of 4 queries (a chunk of decode) over 4,096 keys, 2 heads of dim 16, in fp32. The logits
are all near 0, so every key weighs about 1 before the division: the softmax denominator is about 4,096 and P@V's
unnormalised accumulator about 4,096 times V's mean. ``layers.0``'s V is N(0, 1); ``layers.1``'s is shifted to
64 + N(0, 1), so its accumulator reaches fp16's 65,520 after about a thousand keys.

    attncheck capture --out sums-cap --accumulate fp16-seq,fp16-pairwise,fp16-online -- examples/long_sums.py
"""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, v_shift: float) -> None:
        super().__init__()
        self.v_shift = v_shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x[:, :, -4:] * 0.05  # the last 4 positions ask; logits ~ 0.0025 N(0, 1): every weight near 1
        return F.scaled_dot_product_attention(q, x * 0.05, x + self.v_shift)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(0.0), Attention(64.0)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers]


x = torch.randn(1, 2, 4096, 16, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    Model().eval()(x)
