"""`attncheck capture -- SCRIPT ARGS`: runs the script unchanged, diagnoses what it recorded,
exit codes as `run`; a failing script is shown once, with what it recorded kept."""

import json
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def forward(self, q, k, v, mask=None):
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            return F.softmax(s, dim=-1) @ v

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, q, k, v, mask):
            return self.blocks[1](self.blocks[0](q, k, v), k, v, mask)

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool)
    if "--masked-row" in sys.argv:
        mask[3] = False  # a query that may attend to nothing: NaN in the softmax
    out = Net()(q, k, v, mask)
    print("nan in output:", bool(torch.isnan(out).any()))
    if "--fail" in sys.argv:
        raise RuntimeError("boom after the forward")
""")


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return p


def invoke(*args, cwd=None):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "100"})


def test_capture_runs_the_script_with_its_arguments_and_reports(script, tmp_path):
    out = tmp_path / "cap"
    r = invoke("capture", "--out", out, "--", script, "--masked-row")
    assert r.exit_code == 0, r.output
    assert "nan in output: True" in r.stdout
    assert "first call that goes wrong: #1 blocks.1" in " ".join(r.stdout.split())
    doc = json.loads((out / "manifest.json").read_text())
    assert [c["module"] for c in doc["calls"]] == ["blocks.0", "blocks.1"] and doc["script"]["argv"][1:] == [
        "--masked-row"
    ]
    assert doc["complete"] and doc["script"]["error"] is None
    again = invoke("run", out, "--fail-on", "nan", "--method", "torch")
    assert again.exit_code == 1


def test_fail_on_and_ignore(script, tmp_path):
    r = invoke("capture", "--out", tmp_path / "cap", "--fail-on", "nan", "--method", "torch", script, "--masked-row")
    assert r.exit_code == 1 and "--fail-on nan" in r.stderr
    r = invoke(
        "capture",
        "--out",
        tmp_path / "cap",
        "--fail-on",
        "nan",
        "--method",
        "torch",
        "--ignore",
        "fully_masked_rows",
        script,
        "--masked-row",
    )
    assert r.exit_code == 0, r.output


def test_no_save_writes_nothing(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("capture", "--no-save", "--json", "-", script)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # what the script printed went to stderr
    assert "nan in output: False" in r.stderr
    assert [c["module"] for c in doc["model"]["calls"]] == ["blocks.0", "blocks.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_module_and_forward_filters(script, tmp_path):
    r = invoke("capture", "--out", tmp_path / "cap", "--module", "*.1", script)
    assert r.exit_code == 0, r.output
    assert [c["module"] for c in json.loads((tmp_path / "cap" / "manifest.json").read_text())["calls"]] == ["blocks.1"]
    r = invoke("capture", "--out", tmp_path / "cap2", "--forward", "2", script)  # the script runs 1 forward
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert (
        f"--forward 2 matched none of {script}'s 1 forward pass (of its top module): give numbers from 1 to 1"
        in r.stderr
        and "replaced" not in r.stderr
    )
    r = invoke("capture", "--out", tmp_path / "cap", "--forward", "3-4", script)  # cap held a capture: now empty
    assert r.exit_code == 2 and "matched none of" in r.stderr
    assert f"{tmp_path / 'cap'} now holds an empty capture (the one it held before was replaced)" in r.stderr
    assert json.loads((tmp_path / "cap" / "manifest.json").read_text())["calls"] == []


def test_max_calls_says_it_stopped(script, tmp_path):
    r = invoke("capture", "--out", tmp_path / "cap", "--max-calls", "1", script)
    assert r.exit_code == 0, r.output
    assert "recording stopped: max_calls 1 reached at call 1" in r.stderr
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert len(doc["calls"]) == 1 and not doc["complete"]


def test_a_failing_script_is_shown_once_and_its_calls_are_kept(script, tmp_path):
    out = tmp_path / "cap"
    proc = subprocess.run(
        [sys.executable, "-m", "attncheck", "capture", "--out", str(out), str(script), "--fail"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    err = proc.stderr
    assert err.count("Traceback") == 1 and err.count("RuntimeError: boom after the forward") == 1
    assert "attncheck/" not in err.replace("attncheck: error", "") and "runpy" not in err
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "boom after the forward" in text)
    assert (
        err.strip().splitlines()[-1]
        == f"attncheck: error: {script} failed (RuntimeError at line {line}, traceback above); 2 call(s) recorded in "
        f"{out} (manifest written)"
    )
    doc = json.loads((out / "manifest.json").read_text())
    assert (
        len(doc["calls"]) == 2
        and doc["script"]["error"] == "RuntimeError: boom after the forward"
        and not doc["complete"]
    )


def test_an_unusable_directory_is_refused_before_the_script_runs(script, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    r = invoke("capture", "--out", busy, script)
    assert r.exit_code == 2 and "nan in output" not in r.stdout
    assert (
        r.stderr.strip()
        == f"attncheck: error: --out: capture directory {busy} is not empty and holds no capture (manifest.json); "
        "give a new or empty folder"
    )


def test_a_script_that_exits_non_zero(tmp_path):
    p = tmp_path / "quit.py"
    p.write_text("import sys\nsys.exit(3)\n")
    r = invoke("capture", "--out", tmp_path / "cap", p)
    assert (
        r.exit_code == 2
        and r.stderr.strip()
        == f"attncheck: error: {p} failed (exit status 3); 0 call(s) recorded in {tmp_path / 'cap'} (manifest written)"
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (["nope.py"], "attncheck: error: SCRIPT: nope.py: no such file (give the Python script to run)"),
        (
            ["--forward", "0", "x.py"],
            "attncheck: error: --forward: '0' is not a forward pass number or range (e.g. 1, 2-4)",
        ),
        (
            ["--max-bytes", "lots", "x.py"],
            "attncheck: error: --max-bytes: 'lots' is not a size (e.g. 1GiB, 512MiB, 2G)",
        ),
    ],
)
def test_bad_arguments(args, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    r = invoke("capture", *args)
    assert r.exit_code == 2 and r.stderr.strip() == expected
