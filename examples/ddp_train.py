"""A data-parallel training loop for `attncheck capture` under torchrun: two processes (gloo on the
CPU), DistributedDataParallel, AdamW. At its second step rank 1's batch holds one NaN (a corrupt
sample), so its loss is NaN; DDP averages the gradients of both ranks, so after that step every
weight on both ranks is NaN, and at the third step both ranks' attention is NaN everywhere. Rank 0
alone would point at its own step 3; the capture of both ranks names rank 1's step 2.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m attncheck capture --out ddp-capture -- examples/ddp_train.py
    attncheck run ddp-capture --fail-on nan            # exit 1: the first call that goes wrong is on rank 1
    python examples/ddp_train.py [OUTDIR]              (one process, no NaN; OUTDIR is ignored)
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Attention(torch.nn.Module):
    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (
            z.view(b, t, self.heads, e // self.heads).transpose(1, 2) for z in self.qkv(x).split(e, dim=-1)
        )  # (B, H, T, d)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, e)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(), Attention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def main() -> None:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun; else one process, no group
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)  # the same weights on every rank, as DDP expects
    model = Net()
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 4):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 2 and rank == 1:
            x[0, 3, 5] = float("nan")  # one corrupt sample on rank 1
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {rank} step {step}: loss {loss.item():.4f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
