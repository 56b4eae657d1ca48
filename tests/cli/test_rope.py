"""``attncheck rope``: the synthetic RoPE audit as a user runs it; bad arguments exit 2 with one line."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()


def test_bf16_table_line_names_the_first_repeated_position():
    r = runner.invoke(app, ["rope", "--theta", "500000", "--head-dim", "128", "--dtype", "bf16", "--context", "4096"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("theta 500,000, d 128, bf16 table: positions stop being distinct at 257 ")
    # each position from 257 on repeats its predecessor unless it rounds to a new value (257 rounds onto 256)
    distinct_values = len(set(torch.arange(257, 4096).bfloat16().tolist()))  # rounded positions
    assert f"({4096 - 257 - distinct_values + 1:,} of 4,096 repeat the row before)" in r.stdout


def test_json_and_fp32_table_cast_to_bf16_stays_distinct():
    r = runner.invoke(app, ["rope", "--dtype", "fp32", "--table", "bf16", "--context", "1024,2048", "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == 1 and [p["context"] for p in doc["points"]] == [1024, 2048]
    assert all(p["first_indistinct"] is None and p["predicted_first_indistinct"] == 16_777_217 for p in doc["points"])
    assert all(p["compute"] == "fp32" and p["table"] == "bf16" for p in doc["points"])


def test_table_and_rotation_take_several_dtypes_a_line_each():
    """--table fp16,bf16 computes both (main used fp16 alone); --rotation the same."""
    r = runner.invoke(app, ["rope", "--dtype", "fp32", "--table", "fp16,bf16", "--context", "300", "--json", "-"])
    assert r.exit_code == 0, r.output
    points = json.loads(r.stdout)["points"]
    assert [(p["table"], p["rotation"]) for p in points] == [("fp16", None), ("bf16", None)]
    r = runner.invoke(app, ["rope", "--dtype", "fp32", "--rotation", "fp16,bf16", "--context", "300"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "rotated in fp16" in lines[0] and "rotated in bf16" in lines[1]
    # each line's angle error is its own dtype's: bf16's rounding of a unit vector is 8x fp16's
    errors = [float(line.split("angle error up to 299: ")[1].split(" rad")[0]) for line in lines]
    assert errors[1] > 4 * errors[0]


def test_a_context_ending_at_the_first_repeat_names_its_last_position():
    """--context 257 audits positions 0 .. 256, all distinct in bf16; 257 is the first repeat (main printed 'stay
    distinct up to 257 (the first repeat is at 257)')."""
    r = runner.invoke(app, ["rope", "--context", "257"])
    assert r.exit_code == 0, r.output
    assert "positions stay distinct up to 256 (the first repeat is at 257); angle error up to 256: " in r.stdout
    r = runner.invoke(app, ["rope", "--context", "258"])
    assert "positions stop being distinct at 257 (1 of 258 repeat the row before)" in r.stdout


def test_a_table_not_finite_is_reported_by_its_positions_not_a_finite_angle_error(tmp_path):
    """theta 1e-300 is 0 in fp32: every inverse frequency but the first is inf and no position has an angle (main
    printed an angle error of 4.13e-08 rad over the finite entries)."""
    r = runner.invoke(
        app, ["rope", "--theta", "1e-300", "--dtype", "fp32", "--context", "1000", "--json", str(tmp_path / "r.json")]
    )
    assert r.exit_code == 0, r.output
    assert "cos/sin not finite at 1,000 of 1,000 positions from 0 (no angle there: the angle error is undefined)" in (
        r.stdout
    )
    assert "rad" not in r.stdout
    (point,) = json.loads((tmp_path / "r.json").read_text())["points"]
    assert point["nonfinite_positions"] == 1000 and point["max_angle_error"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--head-dim", "7"], "--head-dim must be even"),
        (["--theta", "0"], "--theta must be a number > 0"),
        (["--dtype", "fp8"], "--dtype"),
        (["--context", "1"], "--context must be an integer >= 2"),
        (["--context", "100000000"], "--context: the grid computes"),
        (["--head-dim", "100000000", "--context", "10"], "--head-dim: the grid computes 5e+08 table entries"),
        (["--theta", ",".join(map(str, range(1, 40))), "--context", "131072"], "--theta: the grid computes"),
        (["--table", "fp16,fp8"], "--table"),
        (["--rotation", "fp7"], "--rotation"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    r = runner.invoke(app, ["rope", *args])
    assert r.exit_code == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # three audits of 131,072 positions, ~10 s
def test_the_long_context_page_shows_what_the_command_prints():
    """Every `attncheck rope` line of docs/long-context.md followed by output prints exactly that output."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "long-context.md").read_text()
    shown = 0
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("$ attncheck rope"):
                continue
            expected = []
            for out in lines[i + 1 :]:
                if out.startswith("$ "):
                    break
                expected.append(out)
            r = runner.invoke(app, shlex.split(line[2:])[1:])
            assert r.exit_code == 0, r.output
            if expected:
                assert r.stdout.splitlines() == expected
                shown += 1
    assert shown >= 2
