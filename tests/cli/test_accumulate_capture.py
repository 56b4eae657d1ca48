"""``--accumulate`` on a capture: per call, grouped per layer, the findings naming the layer and the call, a what-if
that only ``--fail-on what-if:COND`` fails on; SDPA calls (q/k/v) and recorded softmax scores both. The keys and
partial sums are computed here: with equal logits every key weighs exp(0) = 1, so the exact running total of V = c
is c j after j keys, exact in fp16 while it stays below the rounding limit 65,520."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()


class Sdpa(nn.Module):
    def forward(self, v: torch.Tensor) -> torch.Tensor:
        q = torch.zeros(1, 1, 4, 8)  # equal logits
        return F.scaled_dot_product_attention(q, torch.zeros(1, 1, v.shape[2], 8), v)


class Probs(nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)  # a recorded softmax: its scores alone, no V


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quiet, self.loud, self.probs = Sdpa(), Sdpa(), Probs()

    def forward(self) -> None:
        self.quiet(torch.ones(1, 1, 32, 4))  # call 0: V = 1, 32 keys: partial sums <= 32, exact
        self.loud(torch.full((1, 1, 32, 4), 4096.0))  # call 1: 4,096 j reaches 65,536 at j = 16
        self.loud(torch.full((1, 1, 32, 4), 2048.0))  # call 2: 2,048 j reaches 65,536 at j = 32
        self.probs(torch.zeros(1, 1, 2, 4096))  # call 3: 4,096 equal logits: fp16-seq's denominator sticks at 2,048


@pytest.fixture(scope="module")
def cap(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("acc") / "cap"
    with attncheck.capture(path), torch.no_grad():
        Model()()
    return str(path)


def _run(cap: str, tmp_path, *args: str):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["run", cap, "--accumulate", "fp16-seq,fp16-online", "--json", str(out), *args])
    return result, (json.loads(out.read_text()) if out.exists() else None)


def test_capture_sums_per_call_and_layer(cap: str, tmp_path) -> None:
    result, doc = _run(cap, tmp_path, "--fail-on", "error,warning,nan")
    assert result.exit_code == 0, result.output  # a what-if: the model's own cells are fine
    acc = doc["accumulate"]
    assert acc["sums"] == ["fp16-seq", "fp16-online"]
    assert [(c["index"], c["module"]) for c in acc["calls"]] == [(0, "quiet"), (1, "loud"), (2, "loud"), (3, "probs")]
    layers = {(x["module"], x["label"]): x for x in acc["layers"]}
    assert [(x["module"], x["label"]) for x in acc["layers"]] == [
        (m, s) for m in ("quiet", "loud", "probs") for s in ("fp16-seq", "fp16-online")
    ]
    for label in ("fp16-seq", "fp16-online"):  # equal logits: online never rescales after key 0, so it is seq
        quiet, loud, probs = (layers[(m, label)] for m in ("quiet", "loud", "probs"))
        assert quiet["stats"]["out_overflow_rows"] == 0 and quiet["stats"]["out_err_max"] == 0.0
        st = loud["stats"]
        assert loud["calls"] == [1, 2] and loud["first_call"] == 1 and st["rows"] == 8
        assert st["out_overflow_rows"] == 8 and st["out_first"]["key"] == 15 and st["out_first"]["partial"] == 61440.0
        assert probs["stats"]["out_rows"] == 0 and probs["keys"] == 4096
    assert layers[("probs", "fp16-seq")]["stats"]["denom_err_max"] == 0.5  # 2,048 for 4,096
    assert layers[("probs", "fp16-online")]["stats"]["denom_err_max"] == 0.0  # S is fp32: 4,096 exactly
    found = [(f["code"], f["message"].split(":")[0]) for f in acc["findings"]]
    assert ("accumulator_overflow", "loud (2 calls, call #1)") in found
    assert ("lowsum_error", "probs (call #3)") in found
    assert not [m for code, m in found if m.startswith("quiet")]
    for tensor in doc["tensors"]:  # apart from the calls' own diagnoses
        assert not [f for f in tensor["findings"] if f["code"] in ("accumulator_overflow", "lowsum_error")]
    assert "Sums kept in 16 bits per layer" in result.output


def test_capture_sums_fail_only_what_if_conditions(cap: str, tmp_path) -> None:
    result, _ = _run(cap, tmp_path, "--fail-on", "what-if:accumulator_overflow")
    assert result.exit_code == 1, result.output
    result, _ = _run(cap, tmp_path, "--fail-on", "what-if:accumulator_overflow", "--ignore", "accumulator_overflow")
    assert result.exit_code == 0, result.output


def test_capture_command_takes_accumulate_and_refuses_no_save(tmp_path) -> None:
    script = tmp_path / "s.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, v):\n"
        "        return F.scaled_dot_product_attention(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 32, 8), v)\n"
        "M()(torch.full((1, 1, 32, 4), 4096.0))\n"
    )
    out = tmp_path / "r.json"
    result = runner.invoke(
        app,
        ["capture", "--out", str(tmp_path / "c"), "--quiet", "--accumulate", "fp16-online", "--json", str(out),
         "--fail-on", "what-if:error", "--", str(script)],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    (layer,) = json.loads(out.read_text())["accumulate"]["layers"]
    assert layer["label"] == "fp16-online" and layer["stats"]["out_first"]["key"] == 15
    result = runner.invoke(app, ["capture", "--no-save", "--accumulate", "fp16-seq", "--", str(script)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--accumulate" in lines[0] and "--no-save" in lines[0], lines
