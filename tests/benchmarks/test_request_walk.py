"""benchmarks/request_walk.py in a subprocess: the walks of a `run` on a capture, of `capture --out DIR -- script`
and of `attncheck.capture(diagnose=True)` (issue 35: "one walk of a run request on a capture crosses each room at
most twice and climbs back up at most 3 times; the capture and capture(diagnose=True) walks alike").

The counts are the script's (its docstring states the rules): a crossing is a distinct call site into a room, so a
loop over chunks or calls is one; the floor (modules that reach no room) is apart. What holds them:

- no call climbs from a computing layer (numerics, loaders, record) into the judgement, the report or the
  pipelines, apart from the recorder's sink, which judges each call as it comes under ``diagnose=True`` (that walk's
  climbs: the sink calling ``judge.diagnose_call`` and ``findings.apply_ignore``, the capture's close calling
  ``model.model_report``); at most 3 climbing call sites in any walk;
- no two rooms outside the recorder enter each other (control going from one to the other and back); the recorder's
  dispatch (``record.mode`` calling the SDPA interceptor, which records through the mode's recorder) is the one pair;
- the rooms of issue 35's count (``cells/diagnose.py`` 24 entries, ``inputs/scores.py`` 21, ``cells/calls.py`` 18 in
  the version it measured): diagnose and calls crossed at most twice; scores, whose QKBlock the diagnosis loop holds
  and asks for each chunk's facts, at most ``SCORES_CROSSINGS`` times;
- no room crossed more than ``MAX_CROSSINGS`` times (``cells/accumulate.py``, the loop's accumulators, is the most).
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
MAX_CROSSINGS = 13  # measured: cells.accumulate, entered from cells.diagnose alone (make, update, finish)
SCORES_CROSSINGS = 6  # measured: the diagnosis loop's five uses of its QKBlock, and the path reading its fp32 scores
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
        assert 1 <= rooms[room]["crossings"] <= 2, (room, rooms[room]["sites"])
    scores = rooms["attncheck.numerics.inputs.scores"]
    assert scores["crossings"] <= SCORES_CROSSINGS, scores["sites"]
    crowded = {m: r["crossings"] for m, r in rooms.items() if r["crossings"] > MAX_CROSSINGS}
    assert crowded == {}, crowded
