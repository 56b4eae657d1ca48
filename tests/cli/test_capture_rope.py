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


FITTED_SCRIPT = """
import torch
import torch.nn.functional as F
{rotary}
T, d = 2048, 64
inv_freq = 1.0 / 500000 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
freqs = torch.arange(T).float()[:, None] * inv_freq  # fp32, as transformers does
emb = torch.cat((freqs, freqs), dim=-1)
{table}
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, T, d, generator=g).bfloat16() for _ in range(3))
with torch.no_grad():
    Net()(q, k, v, table)
"""


@pytest.mark.parametrize(
    "planted", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["transformers", "planted"]
)  # each ~8 s: a capture and its run; the planted table is also tested in numerics/test_rope.py
def test_a_correct_table_captured_without_config_is_clean_against_its_fitted_theta(tmp_path, planted):
    """The review's case (issue 37, defect 4): transformers' recipe cast to bf16, theta 500,000, d 64, no config.
    main fitted 495,730 from one bf16 entry raised to d/2 = 32 and warned rope_precision (0.483 rad) on a table
    float64 puts 0.00275 rad off theta 500,000. Planted: the same table with frequency 2 turned 0.2 rad further
    from position 1,500 on is still reported from 1,500."""
    plant = "emb[1500:, 2] += 0.2; emb[1500:, 34] += 0.2\n" if planted else ""
    table = plant + "table = (emb.cos().bfloat16()[None], emb.sin().bfloat16()[None])"
    script = tmp_path / "fit.py"
    script.write_text(FITTED_SCRIPT.format(rotary=ROTARY.split("def run(")[0], table=table))
    r = invoke("capture", "--out", tmp_path / "cap", "--quiet", "--json", tmp_path / "a.json", "--", script)
    (check,) = rope_of(tmp_path / "a.json")
    codes = [f["code"] for f in json.loads((tmp_path / "a.json").read_text())["model"]["findings"]]
    assert check["theta"] == 500_000 and check["theta_from"] == "fitted"
    freqs = torch.arange(2048).double()[:, None] * 500_000 ** (-torch.arange(0, 64, 2).double() / 64)
    if planted:
        freqs[1500:, 2] += 0.2
    emb = torch.cat((freqs, freqs), -1).float()  # the script's table, fp32 angles cast to bf16
    got = torch.atan2(emb.sin().bfloat16().double(), emb.cos().bfloat16().double())[:, :32]
    ref = torch.arange(2048).double()[:, None] * 500_000 ** (-torch.arange(0, 64, 2).double() / 64)
    true = float(((got - ref + torch.pi) % (2 * torch.pi) - torch.pi).abs().max())
    assert check["max_angle_error"] == pytest.approx(true, abs=1e-3)
    if planted:
        assert r.exit_code == 0 and codes == ["rope_precision"] and check["first_affected"] == 1500
        assert "theta 500000 (fitted: the table within" in r.stdout
    else:
        assert r.exit_code == 0 and codes == [] and check["first_affected"] is None and true < 0.003
        assert check["theta_fit_last"] == 2047 and check["theta_fit_error"] == pytest.approx(true, rel=1e-6)
        assert "theta 500000 (fitted: the table within 0.0027 rad of it through position 2,047)" in r.stdout
