"""One capture per process: under torchrun (simulated here by its environment, RANK and WORLD_SIZE,
in this process) each rank writes DIR/rankN with its rank and world size in the manifest; `run` on DIR
reports every rank, merged and per rank, naming the rank that first goes wrong; one directory is never
written by two processes; a single process's capture is as it always was."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.record.ranks import OWNER
from tests.record.sdpa_stack import Net

runner = CliRunner()


def qkv(poison: bool = False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    if poison:
        q[0, 1, 3, 0] = float("nan")  # head 1, query 3: a NaN row of the first layer's scores
    return q, k, v


def as_rank(monkeypatch, rank: int, world: int = 2, job: str = "job-1"):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)


def capture_ranks(monkeypatch, cap, poisoned_rank: int = 1, world: int = 2, job: str = "job-1"):
    for rank in range(world):
        as_rank(monkeypatch, rank, world, job)
        with torch.no_grad(), attncheck.capture(cap):
            Net()(*qkv(poison=rank == poisoned_rank))


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_each_rank_writes_its_own_directory_and_run_names_the_rank_that_goes_wrong(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap)
    assert sorted(p.name for p in cap.iterdir()) == ["rank0", "rank1"]
    for rank in (0, 1):
        doc = json.loads((cap / f"rank{rank}" / "manifest.json").read_text())
        assert (doc["rank"], doc["world"], doc["run_id"], len(doc["calls"])) == (rank, 2, "job-1", 2)
        assert not (cap / f"rank{rank}" / OWNER).exists()  # given up when the capture ended
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    r = invoke("run", cap, "--json", "-", "--fail-on", "nan")
    assert r.exit_code == 1, r.output
    model = json.loads(r.stdout)["model"]
    assert [(c["index"], c["rank"]) for c in model["calls"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the NaN in rank 1's q row (head 1, query 3) is one NaN row of its first call: the reference says so
    ref = F.scaled_dot_product_attention(*(t.double() for t in qkv(poison=True)))
    assert int(torch.isnan(ref).any(-1).sum()) == 1
    assert (model["first_bad"]["index"], model["first_bad"]["rank"], model["first_bad"]["nan_rows"]) == (0, 1, 1)
    ranks = {r["rank"]: r for r in model["ranks"]}
    assert ranks[0]["first_bad"] is None and ranks[0]["errors"] == 0 and ranks[0]["calls"] == 2
    assert ranks[1]["first_bad"]["index"] == 0 and ranks[1]["errors"] >= 1
    text = invoke("run", cap)
    flat = " ".join(text.stdout.split())
    assert "rank 0: 2 call(s), 0 error(s), 0 warning(s); no call goes wrong" in flat
    closing = "4 call(s) of 2 ranks on cpu: 1 error(s), 0 warning(s); first call that goes wrong on rank 1: #0 r1"
    assert closing in flat


def test_one_rank_directory_reads_alone_with_its_rank(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap)
    r = invoke("run", cap / "rank1", "--json", "-")
    model = json.loads(r.stdout)["model"]
    assert {c["rank"] for c in model["calls"]} == {1} and model["first_bad"]["rank"] == 1


def test_a_single_process_capture_is_as_it_always_was(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: one process
    cap = tmp_path / "cap"
    with torch.no_grad(), attncheck.capture(cap):
        Net()(*qkv())
    assert sorted(p.name for p in cap.iterdir()) == [
        "0000-layers.0.safetensors",
        "0001-layers.1.safetensors",
        "manifest.json",
    ]
    doc = json.loads((cap / "manifest.json").read_text())
    assert "rank" not in doc and "world" not in doc
    r = invoke("run", cap, "--json", "-")
    assert r.exit_code == 0 and json.loads(r.stdout)["model"]["ranks"] == []


def test_ranks_of_different_jobs_or_a_missing_rank_are_refused(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap, job="job-1")
    as_rank(monkeypatch, 1, 2, "job-2")  # a later job's rank 1 only (its rank 0 failed before capturing)
    with torch.no_grad(), attncheck.capture(cap):
        Net()(*qkv())
    r = invoke("run", cap)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "its ranks come from different jobs (run ids job-1, job-2)" in r.stderr
    gone = tmp_path / "gone"
    capture_ranks(monkeypatch, gone, world=3)
    for p in (gone / "rank2").iterdir():
        p.unlink()
    (gone / "rank2").rmdir()
    r = invoke("run", gone)
    assert r.exit_code == 2 and f"a capture of 3 processes lacks rank 2 ({gone / 'rank2'})" in r.stderr
    assert f"attncheck run {gone / 'rank0'} {gone / 'rank1'}" in r.stderr  # how to read the ranks that are there


def test_ranks_of_two_jobs_named_one_by_one_are_refused_like_their_parents(tmp_path, monkeypatch):
    capture_ranks(monkeypatch, tmp_path / "a", job="job-a")
    capture_ranks(monkeypatch, tmp_path / "b", job="job-b")
    r = invoke("run", tmp_path / "a" / "rank0", tmp_path / "b" / "rank1")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "these ranks come from different jobs (run ids job-a, job-b)" in r.stderr
    capture_ranks(monkeypatch, tmp_path / "c", world=3, job="job-a")
    r = invoke("run", tmp_path / "a" / "rank0", tmp_path / "c" / "rank1")
    assert r.exit_code == 2 and "different jobs (world sizes [2, 3])" in r.stderr
    r = invoke("run", tmp_path / "a" / "rank0", tmp_path / "a" / "rank0")
    assert r.exit_code == 2 and "rank 0 is named twice" in r.stderr


def test_an_empty_rank_folder_is_no_rank_and_a_foreign_one_is_named_as_such(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap)
    (cap / "rank2").mkdir()  # made by hand: a 2-process job has no rank 2
    r = invoke("run", cap, "--json", "-")
    assert r.exit_code == 0, r.output
    assert [x["rank"] for x in json.loads(r.stdout)["model"]["ranks"]] == [0, 1]
    (cap / "rank2" / "notes.txt").write_text("x")
    r = invoke("run", cap)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "is not a rank of this capture of 2 processes (ranks 0 to 1)" in r.stderr


def test_a_killed_capture_is_refused_not_read_as_a_folder_of_tensors(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    script = tmp_path / "s.py"
    script.write_text(
        "import glob, os, sys, time, torch, torch.nn.functional as F\nq = torch.randn(1, 1, 4, 8)\n"
        "F.scaled_dot_product_attention(q, q, q)\n"
        "for _ in range(400):\n    if glob.glob(sys.argv[1] + '/0000-*.safetensors'):\n        break\n"
        "    time.sleep(0.025)\n"
        "os.kill(os.getpid(), 9)\n"  # killed once its first call is written
    )
    cap = tmp_path / "cap"
    p = subprocess.run(
        [sys.executable, "-m", "attncheck", "capture", "--out", str(cap), str(script), str(cap)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert p.returncode == -9
    names = sorted(q.name for q in cap.iterdir())
    assert names[0] == OWNER and names[1].startswith("0000-") and "manifest.json" not in names
    r = invoke("run", cap, "--fail-on", "error,warning,nan", "--summary")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "holds no manifest.json: its capture did not finish" in r.stderr and "killed?" in r.stderr
    (cap / OWNER).unlink()  # call files named as a capture's, no manifest: still unfinished
    r = invoke("run", cap)
    assert r.exit_code == 2 and "holds call files (0000-" in r.stderr and "its capture did not finish" in r.stderr
    r = invoke("run", *sorted(cap.glob("*.safetensors")), "--json", "-")  # named one by one: read as they are
    assert r.exit_code == 0 and len(json.loads(r.stdout)["model"]["calls"]) == 1, r.output
    with attncheck.capture(cap):  # capturing into it again replaces the unfinished capture
        F.scaled_dot_product_attention(*qkv())
    assert sorted(q.name for q in cap.iterdir()) == ["0000-global.safetensors", "manifest.json"]
    assert invoke("run", cap).exit_code == 0


def test_a_capture_still_being_written_is_refused_until_it_ends(tmp_path):
    import socket

    cap = tmp_path / "cap"
    cap.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (cap / OWNER).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "rank": None}))
        r = invoke("run", cap)
        assert r.exit_code == 2 and f"is a capture process {sleeper.pid} is writing still" in r.stderr, r.output
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_manifest_of_another_rank_is_refused(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap)
    doc = json.loads((cap / "rank1" / "manifest.json").read_text())
    doc["rank"] = 0
    (cap / "rank1" / "manifest.json").write_text(json.dumps(doc))
    r = invoke("run", cap)
    assert r.exit_code == 2 and "is rank 0's capture, not rank 1's" in r.stderr


def test_a_directory_another_live_process_writes_is_refused_with_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cap = tmp_path / "cap"
    cap.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (cap / OWNER).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "rank": 1}))
        script = tmp_path / "s.py"
        script.write_text(
            "import torch, torch.nn.functional as F\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "F.scaled_dot_product_attention(q, q, q)\n"
        )
        r = invoke("capture", "--out", cap, script)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
        assert f"is being written by process {sleeper.pid} (rank 1): two processes cannot write one capture" in r.stderr
        assert sorted(p.name for p in cap.iterdir()) == [OWNER]  # nothing written, the other's owner file kept
    finally:
        sleeper.kill()
        sleeper.wait()
    r = invoke("capture", "--out", cap, script)  # its owner is gone: the directory is taken over
    assert r.exit_code == 0, r.output
    assert not (cap / OWNER).exists() and (cap / "manifest.json").is_file()


def test_two_captures_of_one_process_into_one_directory_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with attncheck.capture(tmp_path / "cap"):
        with pytest.raises(attncheck.AttncheckError, match="this process is already capturing into it"):
            attncheck.capture(tmp_path / "cap").__enter__()
    assert os.listdir(tmp_path / "cap") == ["manifest.json"]  # the outer capture, its owner file given up


def test_cli_under_a_rank_writes_its_json_per_rank_and_says_one_line(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text(
        "import os, torch, torch.nn.functional as F\nq = torch.randn(1, 1, 4, 8)\n"
        "q[0, 0, 1, 0] = float('nan')\nclass M(torch.nn.Module):\n    def forward(self, q):\n"
        "        return F.scaled_dot_product_attention(q, q, q)\nM()(q)\n"
    )
    as_rank(monkeypatch, 1)
    r = invoke("capture", "--out", tmp_path / "cap", "--json", tmp_path / "report.json", "--fail-on", "nan", script)
    assert r.exit_code == 1, r.output
    assert r.stdout == ""  # rank 0 prints the report; the other ranks one line on stderr
    assert (
        "attncheck: rank 1 of 2: 1 call(s) on cpu:" in r.stderr and "first call that goes wrong on rank 1" in r.stderr
    )
    assert not (tmp_path / "report.json").exists()
    doc = json.loads((tmp_path / "report.rank1.json").read_text())
    assert doc["model"]["calls"][0]["rank"] == 1
    assert (tmp_path / "cap" / "rank1" / "manifest.json").is_file()


def test_a_smaller_job_into_the_same_folder_replaces_the_larger_ones_ranks(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap, world=3, job="big")
    capture_ranks(monkeypatch, cap, world=2, job="small")  # rank 0 removes rank2, which no rank of this job writes
    assert sorted(p.name for p in cap.iterdir()) == ["rank0", "rank1"]
    r = invoke("run", cap, "--json", "-")
    assert r.exit_code == 0, r.output
    assert [r["rank"] for r in json.loads(r.stdout)["model"]["ranks"]] == [0, 1]


def test_no_save_under_a_rank_names_the_rank_of_each_call(monkeypatch):
    as_rank(monkeypatch, 1)
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        Net()(*qkv(poison=True))
    assert [r.call.rank for r in cap.calls] == [1, 1]
    assert [(r.rank, r.calls) for r in cap.result.model.ranks] == [(1, 2)]


def test_folders_named_rank_n_without_a_capture_are_plain_folders(tmp_path):
    import numpy as np

    (tmp_path / "data" / "rank0").mkdir(parents=True)
    np.save(tmp_path / "data" / "rank0" / "scores.npy", np.zeros((2, 4, 4), dtype=np.float32))
    r = invoke("run", tmp_path / "data", "--json", "-")
    assert r.exit_code == 0, r.output
    assert [t["name"] for t in json.loads(r.stdout)["tensors"]] == [str(tmp_path / "data" / "rank0" / "scores.npy")]


def test_rank_directories_named_one_by_one_read_as_the_parent(tmp_path, monkeypatch):
    cap = tmp_path / "cap"
    capture_ranks(monkeypatch, cap)
    both = json.loads(invoke("run", cap / "rank1", cap / "rank0", "--json", "-").stdout)["model"]
    assert [(c["index"], c["rank"]) for c in both["calls"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (both["first_bad"]["index"], both["first_bad"]["rank"]) == (0, 1) and len(both["ranks"]) == 2


def test_calls_through_a_wrapper_are_named_as_the_model_names_them(monkeypatch):
    # DataParallel on the CPU runs its module as it is; DDP holds the model as ``module`` the same way
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    names = []
    for model in (Net(), torch.nn.DataParallel(Net())):
        with torch.no_grad(), attncheck.capture() as cap:
            model(*qkv())
        names.append([c.module for c in cap.calls])
    assert names == [["layers.0", "layers.1"], ["layers.0", "layers.1"]]
