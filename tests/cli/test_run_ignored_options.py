"""Options that used to be silently ignored: each is refused with one line and exit 2 where nothing can act on it
(--what-if rope:DTYPE without a capture, --rows/--budget on scores alone, an empty 'rope:'), or answered with a
notice where the question is legitimate and its answer is 'none' (a capture of a model without RoPE)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()


def one_line_exit_2(args: list[str], *words: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attncheck: error: "), result.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.fixture
def scores(tmp_path):
    path = tmp_path / "scores.npy"
    np.save(path, np.random.default_rng(0).standard_normal((2, 64, 64)).astype(np.float32))
    return str(path)


@pytest.fixture
def qk(tmp_path):
    path = tmp_path / "qk.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"q": torch.randn(1, 1, 64, 16, generator=g), "k": torch.randn(1, 1, 64, 16, generator=g)}, str(path))
    return ["--q", f"{path}:q", "--k", f"{path}:k"]


def test_what_if_rope_on_a_scores_file_is_refused(scores):
    one_line_exit_2(["run", scores, "--what-if", "rope:bf16"], "--what-if rope:DTYPE", "no capture")


def test_what_if_rope_on_q_k_dumps_and_the_example_is_refused(qk):
    one_line_exit_2(["run", *qk, "--what-if", "rope:bf16"], "--what-if rope:DTYPE", "--q/--k carry no rotary table")
    one_line_exit_2(["run", "--example", "--what-if", "rope:bf16"], "--example carries no rotary table")


@pytest.mark.parametrize("option, value", [("--rows", "10"), ("--budget", "1")])
def test_rows_and_budget_on_a_scores_file_are_refused(scores, option, value):
    one_line_exit_2(["run", scores, option, value], f"{option} bounds", "scores only")


@pytest.mark.parametrize("value", ["rope:bf16,rope:", "rope:"])
def test_an_empty_rope_what_if_is_refused(scores, value):
    one_line_exit_2(["run", scores, "--what-if", value], "'rope:' without a dtype")


def test_a_capture_without_rotary_tables_says_so(tmp_path):
    from tests.record.conftest import VOCAB, gpt2

    model = gpt2("sdpa")
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        model(torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0)))
    out = tmp_path / "r.json"
    args = ["run", str(tmp_path / "cap"), "--what-if", "rope:bf16", "--brief", "--json", str(out)]
    result = runner.invoke(app, [*args, "--fail-on", "error,warning,nan"])
    assert result.exit_code == 0, result.output  # a question about no table is no failure of the model
    assert "no rotary tables in this capture: rope:bf16 has nothing to recompute" in " ".join(result.stdout.split())
    capture = json.loads(out.read_text())["model"]["capture"]
    assert capture["rope_what_if_unanswered"] == ["bf16"] and "rope" not in capture
