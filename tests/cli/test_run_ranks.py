"""`attncheck run CAPTURE` split over torchrun's ranks (gloo on the CPU): a 3-layer Llama captured in bf16 whose layer 1
has logits beyond fp16's range (its q projection scaled up), three calls over two ranks (an odd number: rank 0 takes
two). Rank 0's report, JSON and exit code under --fail-on are the single process's, byte for byte; the other rank
prints nothing; a call that cannot be read on one rank reaches every rank, which exits 2 with the one line a single
process prints; the KV-cache what-if (a layer's amax over every one of its calls) and a capture of a torchrun job
(rank<N> folders) come out the same; without a rendezvous in the environment, or with a world of one, a process runs
the whole capture as always.

The ranks are started with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which is
what torchrun gives its processes; one slow test runs torchrun itself."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.pipelines.ranks import assign

ROOT = str(Path(__file__).resolve().parents[2])
WIDTH = "100"  # the report's width, the same in and out of process (Rich reads COLUMNS)
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def capture_llama(out: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight *= 30000  # layer 1's q.k reach ~9e4 > fp16's 65504
        with attncheck.capture(out):
            model.eval()(input_ids=torch.randint(0, 128, (2, 32)))
    return out


@pytest.fixture(scope="module")
def cap(tmp_path_factory) -> Path:
    return capture_llama(tmp_path_factory.mktemp("ranks") / "cap")


def environment(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["COLUMNS"] = WIDTH
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(args: list[str], world: int = 2, command: tuple[str, ...] = ("-m", "attncheck", "run")):
    """`attncheck run ARGS` in ``world`` processes with the environment torchrun gives its ranks."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, *command, *args],
            env=environment(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def one_process(args: list[str], monkeypatch) -> tuple[int, str, str]:
    """The single-process run, in this process: (exit code, stdout, stderr)."""
    for name in JOB_ENV:
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(app, ["run", *args], env={"COLUMNS": WIDTH})
    return r.exit_code, r.stdout, r.stderr


def test_two_ranks_give_the_single_process_report_json_and_exit_code(cap, tmp_path, monkeypatch):
    args = [str(cap), "--what-if", "fp16", "--fail-on", "what-if:nan"]
    code, text, err = one_process([*args, "--json", str(tmp_path / "one.json")], monkeypatch)
    assert code == 1, err  # fp16's Q@K^T overflows in layer 1: what-if:nan holds
    assert "qk_overflow" in text and "1/3 #1" in " ".join(text.split())
    rank0, rank1 = ranks([*args, "--json", str(tmp_path / "two.json")])
    assert (rank0.returncode, rank1.returncode) == (1, 1), rank0.stderr + rank1.stderr
    assert rank0.stdout == text
    assert rank0.stderr == err  # the --fail-on line
    assert rank1.stdout == rank1.stderr == ""  # the other rank says nothing
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()  # no timing field in run's JSON
    assert [c["index"] for c in json.loads((tmp_path / "two.json").read_text())["model"]["calls"]] == [0, 1, 2]


@pytest.mark.slow  # torchrun's agent and two ranks, ~15 s
def test_torchrun_runs_the_ranks_and_fails_as_one_process(cap, tmp_path, monkeypatch):
    args = [str(cap), "--what-if", "fp16", "--fail-on", "what-if:nan", "--json"]
    code, text, _ = one_process([*args, str(tmp_path / "one.json")], monkeypatch)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "attncheck", "run", *args, str(tmp_path / "two.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment(),
    )
    assert code == proc.returncode == 1, proc.stderr[-3000:]  # torchrun fails when the ranks do
    assert proc.stdout == text  # rank 0's report alone: the other rank prints nothing
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()


@pytest.mark.slow  # two 2-rank jobs, ~20 s
def test_a_call_unreadable_on_one_rank_stops_every_rank_with_one_line(cap, tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in cap.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    files = sorted(bad.glob("000*.safetensors"))
    # call 1 is rank 1's (equal calls: 0 and 2 on rank 0): its data cut short, found only when rank 1 reads it
    with open(files[1], "r+b") as fh:
        fh.truncate(files[1].stat().st_size - 100)
    code, _, err = one_process([str(bad), "--quiet"], monkeypatch)
    assert code == 2 and "0001-model.layers.1" in err and "truncated" in err
    assert err.count("\n") == 1
    for proc in ranks([str(bad), "--quiet"]):
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr == err
    with open(files[2], "r+b") as fh:  # rank 0's call 2 too: the first in call order is the one said, as by one process
        fh.truncate(files[2].stat().st_size - 100)
    for proc in ranks([str(bad), "--quiet"]):
        assert proc.returncode == 2 and proc.stderr == err
    code, text, err = one_process([str(bad), "--partial", "--json", str(tmp_path / "one.json")], monkeypatch)
    rank0, rank1 = ranks([str(bad), "--partial", "--json", str(tmp_path / "two.json")])
    assert code == rank0.returncode == rank1.returncode == 2  # calls skipped
    assert (rank0.stdout, rank0.stderr, rank1.stdout, rank1.stderr) == (text, err, "", "")
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()


@pytest.mark.slow  # two ranks, ~10 s
def test_the_kv_cache_what_if_sees_every_call_of_a_layer(cap, tmp_path, monkeypatch):
    """tensor and head scales come from a layer's amax over all its calls, dynamic from its first: each layer's
    calls stay on one rank, and the heads come back in the capture's layer order."""
    args = [str(cap), "--what-if", "kv:fp8_e4m3,fp16", "--json"]
    code, text, _ = one_process([*args, str(tmp_path / "one.json")], monkeypatch)
    rank0, rank1 = ranks([*args, str(tmp_path / "two.json")])
    assert code == rank0.returncode == rank1.returncode == 0
    assert rank0.stdout == text and rank1.stdout == ""
    one = json.loads((tmp_path / "one.json").read_text())
    assert [c["scaling"] for c in one["kv_cache"]["caches"]] == ["unit", "tensor", "head", "dynamic"]
    assert len(one["kv_cache"]["caches"][1]["heads"]) == 6  # 3 layers x 2 kv heads
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()


@pytest.mark.slow  # two ranks, ~10 s
def test_a_torchrun_capture_read_by_two_ranks(cap, tmp_path, monkeypatch):
    """rank<N> folders (a capture of a 2-rank job) read by a 2-rank run: 6 calls, named with their ranks."""
    job = tmp_path / "job"
    for r in (0, 1):
        (job / f"rank{r}").mkdir(parents=True)
        for f in cap.iterdir():
            (job / f"rank{r}" / f.name).write_bytes(f.read_bytes())
        manifest = job / f"rank{r}" / "manifest.json"
        doc = json.loads(manifest.read_text())
        doc.update(rank=r, world=2, run_id="job-1")
        manifest.write_text(json.dumps(doc))
    args = [str(job), "--what-if", "fp16", "--json"]
    code, text, _ = one_process([*args, str(tmp_path / "one.json")], monkeypatch)
    rank0, rank1 = ranks([*args, str(tmp_path / "two.json")])
    assert code == rank0.returncode == rank1.returncode == 0
    assert rank0.stdout == text and "r1 1.self_attn" in text
    one = json.loads((tmp_path / "one.json").read_text())
    assert [(c["rank"], c["index"]) for c in one["model"]["calls"]] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()


RANK_SCRIPT = """
import json
import sys

import torch.distributed as dist

from attncheck.config.run import RunRequest
from attncheck.errors import AttncheckError
from attncheck.pipelines.ranks import exchange, split_job
from attncheck.pipelines.run import run
from attncheck.report.model import run_json

if sys.argv[1] == "library":  # the caller's own process group: used, and left as it was
    dist.init_process_group("gloo")
    result = run(RunRequest((sys.argv[2],), what_if=("fp16",)))
    print(json.dumps(run_json(result.tensors, result.device, [], result.model, result.calls)))
    assert dist.is_initialized()
    dist.destroy_process_group()
else:  # rank 1's work raises what no input explains
    job = split_job()

    def work():
        if job.rank == 1:
            raise ZeroDivisionError("planted")
        return job.rank

    try:
        exchange(job, work, lambda parts: parts, lambda: (1, job.rank))
    except AttncheckError as e:
        print(f"error: {e}")
        sys.exit(2)
"""


@pytest.mark.slow  # two 2-rank jobs, ~15 s
def test_the_library_call_returns_the_one_result_on_every_rank_and_a_crash_stops_every_rank(cap, tmp_path):
    from attncheck.config.run import RunRequest
    from attncheck.pipelines.run import run
    from attncheck.report.model import run_json

    script = tmp_path / "ranked.py"
    script.write_text(RANK_SCRIPT)
    one = run(RunRequest((str(cap),), what_if=("fp16",), split_ranks=False))
    want = json.loads(json.dumps(run_json(one.tensors, one.device, [], one.model, one.calls)))
    for proc in ranks(["library", str(cap)], command=(str(script),)):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout) == want  # rank 1 too: every rank gets the merged result
    rank0, rank1 = ranks(["crash"], command=(str(script),))
    assert rank0.returncode == 2, rank0.stderr[-2000:]
    assert rank0.stdout == "error: rank 1 of 2 stopped: ZeroDivisionError: planted (its traceback is on its stderr)\n"
    assert rank1.returncode == 1 and "Traceback" in rank1.stderr and "ZeroDivisionError: planted" in rank1.stderr


@pytest.mark.slow  # three runs of the capture, ~5 s on a busy 2-core machine
def test_without_a_rendezvous_or_with_one_rank_a_process_runs_every_call(cap, monkeypatch):
    """RANK and WORLD_SIZE alone (no MASTER_ADDR/PORT: no process group to join), or a world of one: the whole run,
    reported, as always; no process group is started."""
    import torch.distributed as dist

    code, text, _ = one_process([str(cap), "--quiet"], monkeypatch)
    for env in (
        {"RANK": "1", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    ):
        r = CliRunner().invoke(app, ["run", str(cap), "--quiet"], env={"COLUMNS": WIDTH, **env})
        assert (r.exit_code, r.stdout) == (code, text), r.output
        assert not dist.is_initialized()


def test_a_bad_rank_environment_is_one_line():
    env = {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "COLUMNS": WIDTH}
    r = CliRunner().invoke(app, ["run", "--example", "--quiet"], env=env)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "RANK='x'" in r.stderr


def test_calls_are_assigned_largest_first_to_the_least_loaded_rank():
    # equal calls alternate; an odd one out goes to rank 0
    assert assign([5, 5, 5], 2) == [0, 1, 0]
    # a prefill (100) and its decode steps (1): the prefill alone on one rank, the steps on the other
    assert assign([100, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    costs = [7, 3, 9, 1, 4, 4, 8, 2]
    owner = assign(costs, 3)
    loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(3)]
    assert sorted(owner) != owner and set(owner) == {0, 1, 2}
    assert max(loads) - min(loads) <= max(costs)  # LPT's bound: the spread is within one call
    assert sum(loads) == sum(costs)
