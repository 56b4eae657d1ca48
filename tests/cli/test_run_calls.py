"""`attncheck run` on capture directories and q/k files: the model report, --detail, --full,
--ignore, --partial, and one-line errors that name the call."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "100"})


class Layer(torch.nn.Module):
    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class EagerLayer(torch.nn.Module):
    def forward(self, q, k, v, mask=None):
        return torch.softmax((q @ k.transpose(-1, -2)) / 8**0.5, dim=-1) @ v


class Model(torch.nn.Module):
    """SDPA, then attention written by hand on q and k 200x larger (Q@K^T overflows fp16),
    then SDPA with a query row whose every key is masked."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), EagerLayer(), Layer()])

    def forward(self, q, k, v):
        keep = torch.ones(1, 1, 6, 6, dtype=torch.bool)
        out = [self.layers[0](q, k, v), self.layers[1](q * 200, k * 200, v)]
        keep[..., 2, :] = False
        out.append(self.layers[2](q, k, v, keep))
        return out


@pytest.fixture
def capdir(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g).half() for _ in range(3))
    with attncheck.capture(tmp_path / "cap"):
        Model()(q, k, v)
    return tmp_path / "cap"


def error_line(r):
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.output
    return lines


def test_capture_directory_gets_the_model_report(capdir, tmp_path):
    r = invoke("run", capdir, "--json", tmp_path / "r.json", "--dtype", "fp16")
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "first call that goes wrong: #1 layers.1 (softmax, torch/fp16)" in out and "first cause qk_overflow" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == "attncheck.run/3" and len(doc["tensors"]) == 3
    assert [c["module"] for c in doc["model"]["calls"]] == ["layers.0", "layers.1", "layers.2"]
    assert [c["verdict"] for c in doc["model"]["calls"]] == ["ok", "nan", "ok"]  # SDPA gives a fully masked row zeros
    assert doc["model"]["first_bad"]["module"] == "layers.1"


def test_detail_and_full(capdir):
    r = invoke("run", capdir, "--dtype", "fp16", "--detail", "layers.2", "--brief")
    assert r.exit_code == 0, r.output
    assert r.stdout.count(" x dtype (max |p - p_float64|)") == 1 and "0002-layers.2.safetensors" in r.stdout
    full = invoke("run", capdir, "--dtype", "fp16", "--full", "--brief")
    assert full.stdout.count(" x dtype (max |p - p_float64|)") == 3 and "Calls in order" not in full.stdout
    missing = invoke("run", capdir, "--detail", "nope*")
    assert missing.exit_code == 2 and error_line(missing) == [
        "attncheck: error: --detail: 'nope*' matches no call (calls: layers.0, layers.1, layers.2)"
    ]


def test_ignore_drops_findings_and_their_rows_from_fail_on(capdir):
    # The model's SDPA kernel gives the fully masked row zeros: no NaN in the cell the model runs.
    r = invoke("run", capdir, "--dtype", "fp16", "--key", "layers.2", "--fail-on", "nan", "--method", "naive")
    assert r.exit_code == 0 and "fully_masked_rows" in r.stdout
    # The same call as eager attention with a naive softmax (asked by --dtype/--method): the row's every
    # score is finfo(fp16).min plus a score, every exp flushes to 0, and 0/0 is NaN.
    r = invoke("run", capdir, "--dtype", "fp16", "--key", "layers.2", "--fail-on", "what-if:nan", "--method", "naive")
    assert r.exit_code == 1 and "attncheck: --fail-on what-if:nan:" in r.stderr and "eager:naive/fp16" in r.stderr
    r = invoke(
        "run",
        capdir,
        "--dtype",
        "fp16",
        "--key",
        "layers.2",
        "--fail-on",
        "what-if:nan",
        "--method",
        "naive",
        "--ignore",
        "fully_masked_rows",
        "--json",
        "-",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert "fully_masked_rows" not in [f["code"] for t in doc["tensors"] for f in t["findings"]]
    assert "fully_masked_rows" not in [f["code"] for c in doc["model"]["calls"] for f in c["what_if"]["findings"]]
    assert doc["model"]["ignored"] == ["fully_masked_rows"]
    bad = invoke("run", capdir, "--ignore", "no_such_code")
    assert bad.exit_code == 2 and error_line(bad)[0].startswith(
        "attncheck: error: --ignore: unknown finding code 'no_such_code'"
    )


def test_missing_call_file_is_one_line_and_partial_diagnoses_the_rest(capdir):
    (capdir / "0001-layers.1.safetensors").unlink()
    r = invoke("run", capdir)
    assert r.exit_code == 2
    assert error_line(r) == [
        f"attncheck: error: {capdir / '0001-layers.1.safetensors'} (call 1, softmax in layers.1): listed in "
        f"{capdir / 'manifest.json'} but missing"
    ]
    p = invoke("run", capdir, "--partial", "--dtype", "fp16", "--json", "-")
    assert p.exit_code == 2
    doc = json.loads(p.stdout)
    assert [c["verdict"] for c in doc["model"]["calls"]][1] == "skipped" and len(doc["tensors"]) == 2
    assert len(error_line(p)) == 1 and "listed in" in error_line(p)[0]


def test_corrupt_call_file_names_the_call(capdir):
    p = capdir / "0002-layers.2.safetensors"
    p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    r = invoke("run", capdir)
    assert r.exit_code == 2 and error_line(r)[0].startswith(
        f"attncheck: error: {p} (call 2, sdpa in layers.2): not a valid .safetensors file"
    )


def test_sdpa_call_whose_mask_does_not_broadcast(tmp_path):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 8, generator=g)
    with attncheck.capture(tmp_path / "cap"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "cap" / "0000-global.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    t["attn_mask"] = torch.ones(5, 6, dtype=torch.bool)  # as a broken producer would write it
    save_file(t, str(path), metadata=meta)
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    doc["calls"][0]["tensors"]["attn_mask"]["shape"] = [5, 6]
    (tmp_path / "cap" / "manifest.json").write_text(json.dumps(doc))
    r = invoke("run", tmp_path / "cap")
    assert r.exit_code == 2
    assert error_line(r) == [
        f"attncheck: error: {path} (call 0, sdpa): mask of shape (5, 6) does not broadcast to the scores' shape "
        "(batch 1, heads 2, queries 6, keys 6)"
    ]


def test_q_k_mask_file_is_diagnosed_in_qk_mode(tmp_path):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 6, 8, generator=g)
    k = torch.randn(2, 2, 6, 8, generator=g)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, :, :, :2] = False  # left padding of 2 keys
    torch.save({"query": q, "key": k, "attention_mask": keep}, tmp_path / "layer.pt")
    r = invoke("run", tmp_path / "layer.pt", "--json", "-", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    (t,) = doc["tensors"]
    assert t["shape"] == [2, 2, 6, 6] and t["attention"]["d"] == 8  # one call from Q and K, not three score tensors
    assert t["census"]["masked"] == 2 * 2 * 6
    assert t["census"]["max"] == pytest.approx(
        float(((q.double() @ k.double().transpose(-1, -2)) / 8**0.5).masked_fill(~keep, -1e300).max())
    )


def test_files_and_calls_in_natural_order(tmp_path):
    for i in (10, 2, 1):
        np.save(tmp_path / f"layer_{i}.npy", np.random.default_rng(i).standard_normal((2, 4, 4)).astype(np.float32))
    r = invoke("run", tmp_path, "--json", "-")
    assert [t["name"] for t in json.loads(r.stdout)["tensors"]] == [
        str(tmp_path / f"layer_{i}.npy") for i in (1, 2, 10)
    ]


def test_capture_copied_elsewhere_still_reads(capdir, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(capdir, moved)
    assert invoke("run", moved, "--dtype", "fp16").exit_code == 0


def test_what_if_is_its_own_question(capdir, tmp_path):
    plain = invoke("run", capdir, "--json", tmp_path / "plain.json")
    doc = json.loads((tmp_path / "plain.json").read_text())
    assert plain.exit_code == 0 and doc["model"]["what_if"] == [] and doc["model"]["known_implementation"] is True
    assert [[c["role"] for c in t["cells"]] for t in doc["tensors"]] == [["model"]] * 3  # the model's cell alone
    r = invoke("run", capdir, "--what-if", "bf16", "--json", tmp_path / "w.json", "--fail-on", "nan")
    assert r.exit_code == 1  # layers.1's own fp16 NaN: the model's verdict, as without --what-if
    out = " ".join(r.stdout.split())
    assert "What if the model ran these instead" in out and "eager:torch/bf16" in out
    doc = json.loads((tmp_path / "w.json").read_text())
    answers = {a["cell"]: a for a in doc["model"]["what_if"]}
    # in bf16, layers.1's Q@K^T (q, k x 200) fits: the eager port is fine there; layers.2's fully masked row
    # is zeros in SDPA, and a finite row in eager attention (finfo(bf16).min added, as transformers does)
    assert answers["flash/bf16"]["bad_calls"] == 0 and answers["eager:torch/bf16"]["bad_calls"] == 0
    assert doc["model"]["calls"][0]["what_if"]["cells"][0]["role"] == "what-if"
    ok = invoke("run", capdir, "--key", "layers.0", "--what-if", "fp16,bf16", "--fail-on", "what-if:nan,nan")
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["--what-if", "fp64"],
            "--what-if: dtype 'fp64' cannot be used here (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, "
            "e5m2fnuz; or kernels, nosinks, fa4, all, kv:FORMAT[:SCALING])",
        ),
        (
            ["--what-if", "bogus"],
            "--what-if: unknown dtype 'bogus' (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz; or "
            "kernels, nosinks, fa4, all, kv:FORMAT[:SCALING])",
        ),
        (
            ["--what-if", ""],
            "--what-if is empty (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz; or kernels, nosinks, "
            "fa4, all, kv:FORMAT[:SCALING])",
        ),
        (
            ["--what-if", "kernels,bogus"],
            "--what-if: unknown dtype 'bogus' (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz; or "
            "kernels, nosinks, fa4, all, kv:FORMAT[:SCALING])",
        ),
        (
            ["--fail-on", "what-if:bogus"],
            "--fail-on: unknown condition 'what-if:bogus' (use nan, overflow, zero, flip, error, warning or a "
            "finding code, or what-if:CONDITION)",
        ),
    ],
)
def test_bad_what_if_values_are_one_line(capdir, args, expected):
    r = invoke("run", capdir, *args)
    assert r.exit_code == 2 and error_line(r) == [f"attncheck: error: {expected}"]


def test_what_if_with_q_and_k_says_what_to_use_instead(tmp_path):
    torch.save({"q": torch.randn(1, 2, 4, 8)}, tmp_path / "q.pt")
    r = invoke("run", "--q", tmp_path / "q.pt", "--k", tmp_path / "q.pt", "--what-if", "fp16")
    assert r.exit_code == 2 and error_line(r) == [
        "attncheck: error: --what-if asks about a captured model's calls; with --q/--k or --example every cell is "
        "computed already (choose them with --dtype, --method, --path; --what-if fa4 sweeps a kernel's settings on "
        "--q/--k without score files)"
    ]


def test_path_dtype_and_method_on_a_capture_name_what_if_cells(capdir):
    r = invoke("run", capdir, "--path", "flash,eager", "--dtype", "bf16", "--method", "naive", "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [t["cells"][0]["name"] for t in doc["tensors"]] == [
        "flash/fp16",
        "torch/fp16",
        "flash/fp16",
    ]  # the model's own
    assert [sorted(c["name"] for c in call["what_if"]["cells"]) for call in doc["model"]["calls"]] == [
        ["eager:naive/bf16", "flash/bf16"]
    ] * 3
