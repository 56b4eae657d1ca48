"""Under torchrun (2 processes, gloo on the CPU, DistributedDataParallel) each rank writes its own
watch log. The model is watched before it is wrapped (the usual order: build, watch, wrap) and every
call of every step is recorded on both ranks. Rank 1 scales one head's query weights by 1000 after
the wrap (DDP synchronises gradients, not weights: the ranks now differ) and later gets a NaN in
another head's: `attncheck watch` over both logs names rank 1 for both, rank_divergence from step 1
against rank 0, nonfinite at step 3, and claims no growth."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from tests.torchrun_preamble import DDP_PREAMBLE

SCRIPT = (
    DDP_PREAMBLE
    + """

bare = Attention()
x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(rank))
with attncheck.watch(bare, log=sys.argv[1]) as w:
    model = torch.nn.parallel.DistributedDataParallel(bare)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if rank == 1:
        with torch.no_grad():
            bare.qkv.weight[12:16] *= 1000  # head 3's q on rank 1 only, after the wrap
    for step in range(4):
        if step == 2 and rank == 1:
            with torch.no_grad():
                bare.qkv.weight[4, 0] = float("nan")  # head 1's q on rank 1 only
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        w.step()
dist.destroy_process_group()
"""
)


@pytest.mark.slow
def test_two_ranks_each_log_and_the_report_names_the_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log = tmp_path / "w.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), str(log)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [tmp_path / "w.rank0.jsonl", tmp_path / "w.rank1.jsonl"]
    assert all(p.is_file() for p in logs) and not log.exists()
    records = [[json.loads(line) for line in p.read_text().splitlines()] for p in logs]
    assert [(r["rank"], r["world"]) for r in (records[0][0], records[1][0])] == [(0, 2), (1, 2)]
    for rank_records in records:  # every step, its one call, named as the bare model names it
        assert [(r["step"], r["forwards"], [c["module"] for c in r["calls"]]) for r in rank_records] == [
            (s, 1, ["Attention"]) for s in range(1, 5)
        ]
    r = CliRunner().invoke(app, ["watch", *map(str, logs), "--fail-on", "nan", "--json", "-"])
    assert r.exit_code == 1, r.output
    alerts = [(a["code"], a["rank"], a["other_rank"], a["head"], a["step"]) for a in json.loads(r.stdout)["alerts"]]
    assert ("rank_divergence", 1, 0, 3, 1) in alerts and ("nonfinite", 1, None, None, 3) in alerts
    assert not any(code in ("logit_growth", "headroom_low") for code, *_ in alerts)
