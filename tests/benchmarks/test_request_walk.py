"""benchmarks/request_walk.py in a subprocess: a run on a capture exits 0, and no call climbs from a computing
layer (numerics, loaders, record) up into the judgement, the report or the pipelines (issue 35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_no_climb_from_the_computing_layers(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "walk.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script puts its repo first
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "request_walk.py"), "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    walk = json.loads(out.read_text())
    assert walk["exit_code"] == 0 and walk["rooms"] > 10
    computing = ("attncheck.numerics", "attncheck.loaders", "attncheck.record")
    upper = ("attncheck.judge", "attncheck.findings", "attncheck.model", "attncheck.report", "attncheck.pipelines")
    bad = [e for e in walk["climbs"] if e.startswith(computing) and e.split(" -> ")[1].startswith(upper)]
    assert bad == [], bad
