"""A training step whose gradients go NaN while its loss looks fine (PyTorch issue 41508):
nn.MultiheadAttention with a key padding mask and a band attn_mask that leave one query row
with no key at all. Its output row is NaN, so it is left out of the loss, yet the backward makes
the whole batch's weights NaN. Through SDPA (need_weights=False) the same step is finite.

    attncheck capture --out masked-row -- examples/train_masked_row.py
    attncheck run masked-row --fail-on nan              # exit 1: grad_nan_masked_row, with the row and the fix
    python examples/train_masked_row.py [OUTDIR] [--sdpa]   (OUTDIR is ignored)
"""

import sys

import torch

torch.manual_seed(0)
attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
optimizer = torch.optim.SGD(attention.parameters(), lr=0.1)
x = torch.randn(2, 6, 16)
padding = torch.zeros(2, 6, dtype=torch.bool)
padding[1, 4:] = True  # batch 1: its last two keys are padding
band = torch.zeros(6, 6, dtype=torch.bool)
band[2, :4] = True  # query 2 may not see keys 0-3: in batch 1 it sees nothing
out, _ = attention(x, x, x, key_padding_mask=padding, attn_mask=band, need_weights="--sdpa" not in sys.argv)
loss = out.nan_to_num().pow(2).mean()  # the NaN row is left out of the loss
loss.backward()
optimizer.step()
print(f"loss {loss.item():.4f}; NaN in the weights after the step: {int(attention.in_proj_weight.isnan().sum())}")
