"""Capture's hostile-input leftovers: a --forward range costs nothing until used; a capture leaves
nothing of its own in the temporary directory; a gradients file of another call, and a flex call whose
score_mod's logits are missing, are refused with one line (exit 2), never judged."""

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.record import parse_forwards
from tests.record.sdpa_stack import Net

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_a_forward_range_is_kept_as_a_range():
    tracemalloc.start()
    try:
        forwards = parse_forwards("1-30000000")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # thirty million numbers as a set would be over a gigabyte
    assert forwards.spans == ((1, 30000000),) and str(forwards) == "1-30000000"
    assert 1 in forwards and 30000000 in forwards and 30000001 not in forwards and 0 not in forwards
    merged = parse_forwards("9,2-4,5,12-12")
    assert merged.spans == ((2, 5), (9, 9), (12, 12)) and [n for n in range(14) if n in merged] == [2, 3, 4, 5, 9, 12]


def test_capture_with_a_long_forward_range_records_from_its_start(tmp_path):
    cap = tmp_path / "cap"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    net = Net()
    with torch.no_grad(), attncheck.capture(cap, forwards="2-30000000"):
        for _ in range(3):
            net(q, k, v)
    doc = json.loads((cap / "manifest.json").read_text())
    assert doc["forwards"] == "2-30000000" and [c["forward"] for c in doc["calls"]] == [2, 2, 3, 3]
    assert invoke("run", cap).exit_code == 0


@pytest.mark.slow  # a fresh interpreter (the compiler may be loaded in this one), ~4 s
def test_a_capture_leaves_nothing_in_the_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (
        "import sys, torch, torch.nn.functional as F, attncheck\n"
        "q = torch.randn(1, 2, 4, 8)\n"
        f"with attncheck.capture({str(tmp_path / 'cap')!r}):\n"
        "    F.scaled_dot_product_attention(q, q, q)\n"
        "with attncheck.capture(diagnose=True):\n"
        "    F.scaled_dot_product_attention(q, q, q)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = dict(
        os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        list(tmp.iterdir()) == []
    )  # torch's compiler cache folder (torchinductor_USER) is made only where something compiles


def training_capture(cap: Path) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g).requires_grad_() for _ in range(3))
    with attncheck.capture(cap):
        Net()(q, k, v).sum().backward()


def test_a_gradients_file_of_another_call_is_refused(tmp_path):
    cap = tmp_path / "cap"
    training_capture(cap)
    assert invoke("run", cap, "--fail-on", "error").exit_code == 0
    mine, other = cap / "0000-layers.0.grads.safetensors", cap / "0001-layers.1.grads.safetensors"
    shutil.copyfile(other, mine)  # call 1's gradients (same shapes) in call 0's place
    r = invoke("run", cap)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert f"its gradients file {mine} belongs to another call (call '1' in it, '0' for this call)" in r.stderr
    assert "please report" not in r.output


def test_a_gradients_file_whose_shapes_are_not_the_calls_is_refused(tmp_path):
    cap = tmp_path / "cap"
    training_capture(cap)
    path = cap / "0000-layers.0.grads.safetensors"
    with safe_open(path, "pt") as f:
        tensors, meta = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
    tensors["grad_q"] = torch.zeros(1, 2, 4, 16)  # q is 1x2x4x8
    save_file(tensors, path, meta)
    r = invoke("run", cap)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "belongs to another call (grad_q has shape (1, 2, 4, 16); this call's is (1, 2, 4, 8))" in r.stderr


@pytest.mark.slow  # flex_attention's first call costs ~5 s
@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*:UserWarning")
def test_a_flex_call_whose_score_mod_logits_are_missing_is_refused(tmp_path):
    from torch.nn.attention.flex_attention import flex_attention

    def softcap(score, b, h, q_idx, kv_idx):
        return 5.0 * torch.tanh(score / 5.0)

    class Flex(torch.nn.Module):
        def forward(self, q, k, v):
            return flex_attention(q, k, v, score_mod=softcap)

    g = torch.Generator().manual_seed(0)
    q, k, v = (4 * torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    cap = tmp_path / "cap"
    with torch.no_grad(), attncheck.capture(cap):
        Flex()(q, k, v)
    assert invoke("run", cap).exit_code == 0
    path = next(cap.glob("0000-*.safetensors"))
    with safe_open(path, "pt") as f:
        tensors, meta = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
    assert meta["score_mod"] == "softcap" and "scores_mod" in tensors
    save_file({n: t for n, t in tensors.items() if n not in ("scores_mod", "scores_mod64")}, path, meta)
    doc = json.loads((cap / "manifest.json").read_text())
    for role in ("scores_mod", "scores_mod64"):
        doc["calls"][0]["tensors"].pop(role, None)
    (cap / "manifest.json").write_text(json.dumps(doc))
    r = invoke("run", cap)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    said = "the flex call's score_mod 'softcap' changed its logits, but the file holds no scores_mod or scores_mod64"
    assert said + " tensor" in r.stderr
