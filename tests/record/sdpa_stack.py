"""A two-layer stack of plain SDPA calls, each layer's output the next one's q: the smallest model whose
calls have module names (layers.0, layers.1), shared by the capture tests."""

import torch
import torch.nn.functional as F


class Layer(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, q, k, v):
        for layer in self.layers:
            q = layer(q, k, v)
        return q
