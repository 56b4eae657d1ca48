"""attncheck run --q --k --v --grad-out: the backward of every path from dumps, and its bad inputs
(one line on stderr, exit 2)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from attncheck.cli import app


@pytest.fixture()
def dumps(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 32, 64, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 32, 64, generator=g) * 4
    do = torch.randn(1, 2, 32, 64, generator=g) * 1e-2
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "qkv.pt")
    torch.save({"grad_out": do.half()}, tmp_path / "do.pt")
    torch.save({"grad_out": (do * 2**16).half()}, tmp_path / "do_scaled.pt")
    torch.save({"grad_out": do[:, :, :5]}, tmp_path / "do_short.pt")
    return tmp_path


def run(dumps, *extra):
    qkv = str(dumps / "qkv.pt")
    return CliRunner().invoke(app, ["run", "--q", qkv + ":q", "--k", qkv + ":k", *extra], env={"COLUMNS": "100"})


def test_an_fp16_loss_scale_of_2_16_overflows_dp_in_eager_attention_and_names_the_safe_scale(dumps):
    ok = run(
        dumps,
        "--v",
        str(dumps / "qkv.pt") + ":v",
        "--grad-out",
        str(dumps / "do.pt"),
        "--dtype",
        "fp16",
        "--causal",
        "--fail-on",
        "error",
        "--json",
        "-",
    )
    assert ok.exit_code == 0, ok.output
    cells = {c["name"]: c for c in json.loads(ok.stdout)["tensors"][0]["cells"]}
    eager = cells["eager:torch/fp16"]["backward"]
    assert eager["headroom_at"] == "dP in fp16" and 2**15 <= eager["scale_headroom"] < 2**16
    assert cells["flash/fp16"]["backward"]["dq"]["rule_bound"] is not None
    bad = run(
        dumps,
        "--v",
        str(dumps / "qkv.pt") + ":v",
        "--grad-out",
        str(dumps / "do_scaled.pt"),
        "--dtype",
        "fp16",
        "--causal",
        "--fail-on",
        "error",
        "--json",
        "-",
    )
    assert bad.exit_code == 1
    found = [f for f in json.loads(bad.stdout)["tensors"][0]["findings"] if f["code"] == "grad_overflow"]
    assert [f["cells"] for f in found] == [["eager:torch/fp16"]]  # sdpa-math and flash hold dP in fp32
    assert (
        found[0]["message"].startswith("eager:torch/fp16 backward: dP in fp16 overflows")
        and "(2^-1)" in found[0]["message"]
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--grad-out", "DO"], "--grad-out needs --v (the backward of attention reads V)"),
        (["--v", "V", "--mask-op", "fill"], "--mask-op decides the eager path's backward: give --grad-out too"),
        (
            ["--v", "V", "--grad-out", "SHORT"],
            "--grad-out SHORT has shape (1, 2, 5, 64); the output gradient of these q and v has shape (1, 2, 32, 64)",
        ),
        (["--v", "V", "--grad-out", "DO", "--mask-op", "both"], "--mask-op"),
        (["--v", "V", "--grad-out", "MISSING"], "no such file"),
    ],
)
def test_bad_backward_inputs_are_one_line_and_exit_2(dumps, extra, message):
    names = {
        "DO": str(dumps / "do.pt"),
        "V": str(dumps / "qkv.pt") + ":v",
        "SHORT": str(dumps / "do_short.pt"),
        "MISSING": str(dumps / "nope.pt"),
    }
    extra = [names.get(x, x) for x in extra]
    r = run(dumps, *extra)
    assert r.exit_code == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.output
    assert message.replace("SHORT", names["SHORT"]) in err


def test_grad_out_with_score_files_is_refused(dumps):
    torch.save({"scores": torch.randn(1, 2, 32, 32)}, dumps / "s.pt")
    qkv = str(dumps / "qkv.pt")
    r = CliRunner().invoke(
        app,
        [
            "run",
            str(dumps / "s.pt"),
            "--q",
            qkv + ":q",
            "--k",
            qkv + ":k",
            "--v",
            qkv + ":v",
            "--grad-out",
            str(dumps / "do.pt"),
        ],
    )
    assert r.exit_code == 2 and "give no score files with it" in r.stderr
