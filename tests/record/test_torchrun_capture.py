"""Two ranks under torchrun (gloo on the CPU, DistributedDataParallel training, rank 1's second batch
holds a NaN): `attncheck capture` run by torchrun, and `attncheck.capture()` inside the script, each
give one directory per rank, and `attncheck run` on the parent names rank 1's call as the first that
goes wrong while rank 0's calls stay clean."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from tests.torchrun_preamble import DDP_PREAMBLE

SCRIPT = (
    DDP_PREAMBLE
    + """

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(), Attention()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
inside = "--inside" in sys.argv
with attncheck.capture(sys.argv[-1]) if inside else torch.enable_grad():
    for step in range(2):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 1 and rank == 1:
            x[0, 3, 5] = float("nan")  # rank 1's second batch: NaN in one token
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
"""
)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def environment() -> dict:
    """This checkout first on the children's path (torchrun's processes import attncheck themselves)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def check_ranks(cap: Path) -> None:
    assert sorted(p.name for p in cap.iterdir()) == ["rank0", "rank1"]
    for rank in (0, 1):
        doc = json.loads((cap / f"rank{rank}" / "manifest.json").read_text())
        assert (doc["rank"], doc["world"]) == (rank, 2)
        assert [c["index"] for c in doc["calls"]] == [
            0,
            1,
            2,
            3,
        ]  # each rank's own 2 steps x 2 layers, none of the other's
        assert all(c.get("grads") for c in doc["calls"])
    r = CliRunner().invoke(app, ["run", str(cap), "--json", "-", "--fail-on", "nan"])
    assert r.exit_code == 1, r.output
    model = json.loads(r.stdout)["model"]
    first = model["first_bad"]
    assert (first["rank"], first["index"], first["module"], first["first_cause"]) == (
        1,
        2,
        "layers.0",  # DDP's ``module.`` left out, as the watch names it
        "input_nan",
    )
    ranks = {r["rank"]: r for r in model["ranks"]}
    assert ranks[0]["calls"] == ranks[1]["calls"] == 4
    assert ranks[0]["first_bad"] is None and ranks[0]["errors"] == 0
    assert ranks[1]["first_bad"]["index"] == 2


def test_torchrun_attncheck_capture_writes_one_directory_per_rank(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = subprocess.run(
        [*TORCHRUN, "-m", "attncheck", "capture", "--out", "cap", "--fail-on", "nan", "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environment(),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # rank 1's own --fail-on nan holds: torchrun fails
    assert "capture: rank 0 of 2: this rank's calls" in proc.stdout  # rank 0 prints its own rank's report, labelled
    assert "all ranks: attncheck run" in proc.stdout
    assert "no call goes wrong in the cells the model runs" in " ".join(proc.stdout.split())
    assert (
        "attncheck: rank 1 of 2: 4 call(s) on cpu:" in proc.stderr
        and "first call that goes wrong on rank 1: #2" in proc.stderr
    )
    check_ranks(tmp_path / "cap")


@pytest.mark.slow  # a second 2-rank job, ~15 s
def test_attncheck_capture_inside_a_torchrun_script_writes_one_directory_per_rank(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = subprocess.run(
        [*TORCHRUN, "train.py", "--inside", "cap"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environment(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_ranks(tmp_path / "cap")
