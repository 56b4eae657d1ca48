"""Under torchrun (2 processes, gloo on the CPU, DistributedDataParallel) each rank writes its own
watch log; one rank's attention gets a NaN in one head's query weights after the first step, and
`attncheck watch` over both logs names that rank, step and module as the first alert."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attncheck.cli import app

SCRIPT = """
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


model = torch.nn.parallel.DistributedDataParallel(Attention())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(rank))
with attncheck.watch(model, log=sys.argv[1]) as w:
    for step in range(4):
        if step == 2 and rank == 1:
            with torch.no_grad():
                model.module.qkv.weight[4, 0] = float("nan")  # head 1's q on rank 1 only
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        w.step()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_each_log_and_the_report_names_the_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log = tmp_path / "w.jsonl"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), str(log)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [tmp_path / "w.rank0.jsonl", tmp_path / "w.rank1.jsonl"]
    assert all(p.is_file() for p in logs) and not log.exists()
    first = [json.loads(p.read_text().splitlines()[0]) for p in logs]
    assert [(r["rank"], r["world"]) for r in first] == [(0, 2), (1, 2)]
    r = CliRunner().invoke(app, ["watch", *map(str, logs), "--fail-on", "nan", "--json", "-"])
    assert r.exit_code == 1, r.output
    alert = json.loads(r.stdout)["first_alert"]
    assert (alert["code"], alert["rank"], alert["step"]) == ("nonfinite", 1, 3)
