"""Padding queries that may attend to nothing: a fully masked row.

The scores of a padded batch are saved as a nested .pt dump (one entry per
layer). Rows whose every key is -inf give NaN in a plain softmax (naive, stable,
torch.softmax) and zeros in a FlashAttention-style tiled softmax.

    python examples/padding_fully_masked.py [OUTDIR]
"""

import torch
from _common import diagnose_and_expect, output_dir

out = output_dir()
g = torch.Generator().manual_seed(0)
layers = []
for _ in range(2):
    s = torch.randn(2, 4, 8, 8, generator=g)  # (B, H, T, T)
    s[1, :, 6:, :] = float("-inf")  # the last two queries of batch 1 are padding
    layers.append({"scores": s})
path = out / "padded.pt"
torch.save({"layers": layers, "step": 1200}, path)

diagnose_and_expect(str(path), {"fully_masked_rows"}, "--key", "layers.0.scores", "--brief")
