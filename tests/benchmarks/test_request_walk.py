"""benchmarks/request_walk.py in a subprocess: the walks of a `run` on a capture, of `capture --out DIR -- script`
and of `attncheck.capture(diagnose=True)` (issue 35: "one walk of a run request on a capture crosses each room at
most twice and climbs back up at most 3 times; the capture and capture(diagnose=True) walks alike").

The counts are the script's (its docstring states the rules): a crossing is a distinct call site into a room, so a
loop over chunks or calls is one; reads of a value (properties, dataclass methods) and the floor (modules that reach
no room) are apart. What holds them:

- no call climbs from a computing layer (numerics, loaders, record) into the judgement, the report or the
  pipelines, apart from the recorder's sink, which judges each call as it comes under ``diagnose=True`` (that walk's
  climbs: the sink calling ``judge.diagnose_call`` and ``findings.apply_ignore``, the capture's close calling
  ``model.model_report``); at most 3 climbing call sites in any walk, none in the run and capture walks;
- no two rooms outside the recorder enter each other (control going from one to the other and back); the recorder's
  dispatch (``record.mode`` calling the SDPA interceptor, which records through the mode's recorder) is the one pair;
- every room is crossed at most twice, apart from those ``CROSSINGS`` lists with the figure measured (each in every
  walk) and why. None of them is back and forth: each is one owner using an object or a table of helpers from
  several lines (``from`` in the script's figures). Issue 35's rooms (``cells/diagnose.py`` 24 entries,
  ``inputs/scores.py`` 21, ``cells/calls.py`` 18 in the version it measured): diagnose and calls are crossed once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WALKS = ("run", "capture", "diagnose")
# Rooms crossed more than twice: the figure measured, the most of the three walks (a site is a caller's line).
CROSSINGS = {
    # the diagnosis loop's accumulators (census, distribution, head maxima, one CellAcc per cell and its output's
    # errors), each made, updated per chunk and finished by cells.diagnose alone; they never call back
    "attncheck.numerics.cells.accumulate": 13,
    # the QKBlock the loop holds: each chunk's block made (the generator resumed), its masked keys, its reference's
    # audit, its reference output (P64 @ V64, and the path's own), and the path reading its fp32 scores
    "attncheck.numerics.inputs.scores": 6,
    # which cells a call computes: calls asks four questions of one call (its model cell, whether its implementation
    # is known, the path that judges it, its dtype's name), cells.inputs its kernel facts, the loop its stages
    "attncheck.numerics.cells.plan": 6,
    # the Q/K audit: started by the diagnosis; its spread sample made, fed and finished by the score blocks
    "attncheck.numerics.inputs.audit": 4,
    # AttentionInputs: built by cells.inputs, asked its kernel facts by the loop and whether S can overflow by a block
    "attncheck.numerics.inputs.prepare": 3,
    # the torch row backend: each chunk's facts, the reference of a cast, the metrics of the cells it serves
    "attncheck.numerics.backends.torch_rows": 3,
    # a call's inputs (normalised, as the model built them, the scale's source) asked by cells.calls alone
    "attncheck.numerics.cells.inputs": 3,
    # the output's NaN causes (issue 37's review, output_nan): an accumulator made and finished by a cell's
    # accumulator, fed each chunk by the diagnosis loop
    "attncheck.numerics.cells.outnan": 3,
    # the RoPE table helpers (frequency columns, the fitted theta) the rotated q/k check uses, and the table checks
    "attncheck.numerics.rope": 3,
    # the rotated q/k check (RotatedQK): made per table, fed each call, its result read once
    "attncheck.numerics.rope_qk": 3,
    # the capture's rotary tables read (pipelines.rope), each call's q and k for their check, the file names written
    "attncheck.loaders.rope": 3,
    # the other layers' rooms, each entered from its own layer's modules (or the policy every holder of findings
    # applies); none enters back the module that enters it
    "attncheck.report.model_calls": 11,
    "attncheck.findings.policy": 7,
    "attncheck.model": 5,
    "attncheck.cli.run_checks": 5,
    "attncheck.loaders.manifest": 5,
    "attncheck.loaders.call_files": 4,
    "attncheck.loaders.call_info": 4,
    "attncheck.report.model_heads": 4,
    "attncheck.findings.accuracy": 4,  # four detectors the diagnosis findings ask of it (output_nan the fourth)
    "attncheck.findings.activations": 3,
    "attncheck.loaders.paths": 3,
    "attncheck.report.kernels": 3,
    "attncheck.config.run": 3,
    "attncheck.cli.options": 3,
    # the recorder: its mode dispatches each intercepted op and reads the per-thread state at each
    "attncheck.record.threads": 6,
    "attncheck.record.rope": 5,
    "attncheck.record.modules": 4,
    "attncheck.record.mode": 4,
    "attncheck.record.store": 4,
    "attncheck.record.bounds": 3,
    "attncheck.record.kvdedup": 3,
    "attncheck.record.ranks": 3,
}
MAX_CLIMB_SITES = 3
COMPUTING = ("attncheck.numerics", "attncheck.loaders", "attncheck.record")
UPPER = ("attncheck.judge", "attncheck.findings", "attncheck.model", "attncheck.report", "attncheck.pipelines")
SINK_CLIMBS = {  # the recorder's sink judges each call as it comes (diagnose=True); the capture's close reports
    "attncheck.record.store -> attncheck.judge",
    "attncheck.record.store -> attncheck.findings.policy",
    "attncheck.record -> attncheck.model",
}


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("walk")
    out = tmp / "walk.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script puts its repo first
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "request_walk.py"), "--json", str(out)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", WALKS)
def test_climbs(walks, name):
    walk = walks[name]
    assert walk["exit_code"] == 0 and len(walk["rooms"]) > 10
    allowed = SINK_CLIMBS if name == "diagnose" else set()
    bad = [e for e in walk["climbs"] if e.startswith(COMPUTING) and e.split(" -> ")[1].startswith(UPPER)]
    assert set(bad) <= allowed, bad
    assert len(walk["climb_sites"]) <= MAX_CLIMB_SITES, walk["climb_sites"]
    if name != "diagnose":
        assert walk["climbs"] == {}, walk["climbs"]


@pytest.mark.slow
@pytest.mark.parametrize("name", WALKS)
def test_crossings(walks, name):
    walk = walks[name]
    rooms = walk["rooms"]
    pairs = [p for p in walk["back_and_forth"] if not all(m.startswith("attncheck.record") for m in p)]
    assert pairs == [], pairs
    for room in ("attncheck.numerics.cells.diagnose", "attncheck.numerics.cells.calls"):
        assert rooms[room]["crossings"] == 1, (room, rooms[room]["sites"])
    over = {m: r["crossings"] for m, r in rooms.items() if r["crossings"] > CROSSINGS.get(m, 2)}
    assert over == {}, {m: rooms[m]["sites"] for m in over}
