"""`attncheck capture --what-if rope:DTYPE` (saved, and --no-save) gives the rotary tables' what-ifs that `attncheck run
--what-if rope:DTYPE` gives on the same capture; a dtype not known is one line and exit 2, before the script runs.
A torchrun capture's rank folders have their tables read and judged, each named by its rank: the folders written
by the recorder itself under torchrun's environment (RANK, WORLD_SIZE), one rank computing its table in bf16; and
(slow) a capture made by torchrun itself, 2 CPU ranks over gloo (test_torchrun_capture's launcher and preamble)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from tests.record.test_rope_capture import first_repeated_bf16_position, force_bf16_table, llama
from tests.record.test_torchrun_capture import TORCHRUN, environment
from tests.torchrun_preamble import DDP_PREAMBLE

JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def rope_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["model"]["capture"]["rope"]


ROTARY = """
class Rotary(torch.nn.Module):
    def forward(self, q, k, v, position_embeddings):
        cos, sin = position_embeddings  # (1, T, d), as transformers passes them

        def rotate(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin

        return F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Rotary()

    def forward(self, q, k, v, table):
        return self.attn(q, k, v, position_embeddings=table)


def run(freqs, seed):
    emb = torch.cat((freqs, freqs), dim=-1).float()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, len(freqs), 16, generator=g) for _ in range(3))
    with torch.no_grad():
        Net()(q, k, v, (emb.cos()[None], emb.sin()[None]))


inv = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)
pos = torch.arange(300)
"""
# one process: the table as transformers computes it (fp32)
SCRIPT = "import torch\nimport torch.nn.functional as F\n" + ROTARY + "run(pos.float()[:, None] * inv, 0)\n"
# two ranks: rank 1 computes its table in bf16 (candle's recipe before PR 3520)
TORCHRUN_SCRIPT = (
    DDP_PREAMBLE
    + ROTARY
    + """
freqs = pos.bfloat16()[:, None] * inv.bfloat16() if rank == 1 else pos.float()[:, None] * inv
run(freqs, rank)
dist.destroy_process_group()
"""
)


@pytest.fixture
def script(tmp_path) -> Path:
    p = tmp_path / "rotary.py"
    p.write_text(SCRIPT)
    return p


def test_capture_what_if_rope_is_runs(script, tmp_path):
    cap = tmp_path / "cap"
    saved = invoke(
        "capture",
        "--out",
        cap,
        "--quiet",
        "--what-if",
        "rope:bf16,rope:fp16",
        "--json",
        tmp_path / "a.json",
        "--fail-on",
        "error,warning,nan",
        "--",
        script,
    )
    assert saved.exit_code == 0, saved.output
    again = invoke("run", cap, "--what-if", "rope:bf16,rope:fp16", "--json", tmp_path / "b.json")
    assert again.exit_code == 0, again.output
    unsaved = invoke(
        "capture",
        "--no-save",
        "--quiet",
        "--what-if",
        "rope:bf16,rope:fp16",
        "--json",
        tmp_path / "c.json",
        "--",
        script,
    )
    assert unsaved.exit_code == 0, unsaved.output
    a, b, c = (rope_of(tmp_path / f"{n}.json") for n in "abc")
    assert a == b == c and [w["dtype"] for w in a[0]["what_if"]] == ["bf16", "fp16"]
    assert a[0]["what_if"][0]["first_indistinct"] == first_repeated_bf16_position(300) == 257
    line = "rope table 0 computed in bf16 (positions 0 .. 299): positions stop being distinct at 257"
    assert line in saved.stdout and line in again.stdout and line in unsaved.stdout


def test_capture_what_if_rope_with_a_dtype_not_known_is_one_line(script, tmp_path):
    for word in ("rope:fp7", "rope:fp8", "rope:"):
        r = invoke("capture", "--out", tmp_path / "cap", "--what-if", word, "--", script)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "--what-if" in r.stderr, r.output
    assert not (tmp_path / "cap").exists()  # refused before the script ran


def capture_rank(model, job: Path, rank: int, monkeypatch) -> None:
    """The capture one rank of a 2-rank torchrun job makes: the recorder writes job/rank<N> itself."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attncheck.capture(job):
        model(ids)
    for name in JOB_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def job(tmp_path, monkeypatch) -> Path:
    """rank 0 computes its table as transformers does, rank 1 in bf16."""
    for name in JOB_ENV:
        monkeypatch.delenv(name, raising=False)
    capture_rank(llama(), tmp_path / "job", 0, monkeypatch)
    bad = llama()
    force_bf16_table(bad)
    capture_rank(bad, tmp_path / "job", 1, monkeypatch)
    return tmp_path / "job"


def test_the_tables_of_each_rank_are_judged_and_named_by_rank(job, tmp_path):
    assert sorted(p.name for p in (job / "rank1").iterdir() if p.name.startswith("rope-")) == ["rope-0000.safetensors"]
    r = invoke("run", job, "--json", tmp_path / "r.json", "--what-if", "rope:bf16", "--fail-on", "error,warning,nan")
    assert r.exit_code == 1, r.output
    said = " ".join(r.stdout.split())
    assert "rank 1 rope table 0 (fp32 1x300x16, theta 10000 (config)" in said
    assert "positions stop being distinct at 257" in said and "rank 0 rope table 0 (fp32" not in said
    assert "rank 0 rope table 0 computed in bf16" in said and "rank 1 rope table 0 computed in bf16" in said
    doc = json.loads((tmp_path / "r.json").read_text())["model"]
    rope = doc["capture"]["rope"]
    assert [(c["rank"], c["first_indistinct"]) for c in rope] == [(0, None), (1, 257)]
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert ranks[0]["errors"] == 0 and ranks[1]["errors"] == 1  # the finding counted on rank 1's account
    one = invoke("run", job / "rank1", "--json", tmp_path / "one.json")  # a rank read alone: its tables too
    assert one.exit_code == 0 and rope_of(tmp_path / "one.json")[0]["rank"] == 1


@pytest.mark.slow  # a 2-rank torchrun job, ~15 s
def test_a_torchrun_capture_judges_each_ranks_tables(tmp_path):
    (tmp_path / "train.py").write_text(TORCHRUN_SCRIPT)
    args = ["-m", "attncheck", "capture", "--out", "cap", "--what-if", "rope:fp16", "--fail-on", "error"]
    proc = subprocess.run(
        [*TORCHRUN, *args, "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environment(),
    )
    assert proc.returncode != 0, proc.stderr[-3000:]  # rank 1's own --fail-on error holds (its table)
    said = " ".join(proc.stdout.split())  # rank 0's report: its own table, clean, and its what-if
    assert "rank 0 rope table 0 computed in fp16 (positions 0 .. 299): positions stay distinct" in said
    assert "rope_precision" not in said
    assert "attncheck: rank 1 of 2: 1 call(s) on cpu: 1 error(s)" in proc.stderr, proc.stderr[-3000:]
    r = invoke("run", tmp_path / "cap", "--json", tmp_path / "r.json", "--fail-on", "error")
    assert r.exit_code == 1, r.output
    rope = rope_of(tmp_path / "r.json")
    assert [(c["rank"], c["theta_from"], c["first_indistinct"]) for c in rope] == [
        (0, "fitted", None),
        (1, "fitted", 257),
    ]
    assert "rank 1 rope table 0 (fp32 1x300x16, theta" in " ".join(r.stdout.split())
