"""`attncheck capture --what-if rope:DTYPE` (saved, and --no-save) gives the rotary tables' what-ifs that `attncheck run
--what-if rope:DTYPE` gives on the same capture; a dtype not known is one line and exit 2, before the script runs.
A torchrun capture's rank folders have their tables read and judged, each named by its rank: the folders written
by the recorder itself under torchrun's environment (RANK, WORLD_SIZE), one rank computing its table in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from tests.record.test_rope_capture import first_repeated_bf16_position, force_bf16_table, llama

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rope_table.py"
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def rope_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["model"]["capture"]["rope"]


def test_capture_what_if_rope_is_runs(tmp_path):
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
        EXAMPLE,
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
        EXAMPLE,
    )
    assert unsaved.exit_code == 0, unsaved.output
    a, b, c = (rope_of(tmp_path / f"{n}.json") for n in "abc")
    assert a == b == c and [w["dtype"] for w in a[0]["what_if"]] == ["bf16", "fp16"]
    assert a[0]["what_if"][0]["first_indistinct"] == first_repeated_bf16_position(512) == 257  # the example's 512
    line = "rope table 0 computed in bf16 (positions 0 .. 511): positions stop being distinct at 257"
    assert line in saved.stdout and line in again.stdout and line in unsaved.stdout


def test_capture_what_if_rope_with_a_dtype_not_known_is_one_line(tmp_path):
    for word in ("rope:fp7", "rope:fp8", "rope:"):
        r = invoke("capture", "--out", tmp_path / "cap", "--what-if", word, "--", EXAMPLE)
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
