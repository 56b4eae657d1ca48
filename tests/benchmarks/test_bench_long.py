"""benchmarks/bench_long.py at a small size: every planted fault is found under --budget, and the long call is
diagnosed by a sample with no row computed in full (its bound certifies every row)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_long_finds_every_planted_fault(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # budgets far below any call's time: every call is sampled however fast the machine (2 s once let a quiet CI
    # machine compute every row, and nothing was sampled)
    argv = [
        "--seq",
        "512",
        "--layers",
        "2",
        "--budget",
        "0.01",
        "--long",
        "2048",
        "--long-budget",
        "0.01",
        "--out",
        tmp_path,
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_long.py"), *map(str, argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    model, long = result["model"], result["long"]
    assert model["planted_qk_overflow_found"] and model["planted_nan_found"] and model["planted_rope_bf16_found"]
    assert model["sampled_calls"] >= 1
    assert long["sampled_rows"] and long["exact_rows"] == 0
