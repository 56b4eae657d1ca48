"""The start of the training scripts the torchrun tests run (gloo on the CPU, two processes): the
process group, this process's rank, and a one-layer causal attention over (2, 8, 16) inputs, 4 heads."""

DDP_PREAMBLE = """
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attncheck

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (z.view(2, 8, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16)
"""
