"""benchmarks/gpu_kernels.py cannot rot without a GPU: its ``--cpu-only --quick`` run (every path on every
case of the reduced grid) and its ``--device cpu`` plumbing (the GPU side against PyTorch's CPU kernels)
run in subprocesses, and their JSON is checked against facts from outside the paths: float64, the
threads of the hazards (PyTorch issues 121558, 196678, cudnn-frontend issue 1072), PyTorch's own CPU
flash kernel. It exits 1 when an emulation crashes or gives NaN where float64 is finite."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_kernels.py"
PATHS = {"fa2", "fa2-fma", "fa3", "mem-efficient", "cudnn", "flash", "sdpa-math"}
# O against float64, over u * sum_j p_j |v_j| (u the dtype's unit roundoff): P rounded to the dtype (<= 1) and O
# rounded to it (<= 1), plus S's fp32 rounding at scores of ~1e4 (about 2^-24 * 1e4 relative in p: <= 1.2 in fp16)
BOUND_U = 3.0


def run_script(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "gk.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}  # the script puts its repo first
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert proc.stdout.splitlines()[-1].startswith(doc["cases"][-1]["name"] + " ")  # the table is printed last
    assert doc["meta"]["attncheck"] == str(ROOT / "attncheck")  # this checkout's, installed or not
    assert doc["meta"]["imported_outside_the_image"] == []  # no msgspec, typer, rich: a bare GPU image has none
    return doc


@pytest.fixture(scope="module")
def cpu_only(tmp_path_factory) -> dict:
    return run_script(tmp_path_factory.mktemp("gk"), "--cpu-only", "--quick")


def by_label(doc: dict) -> dict:
    return {c["name"]: c for c in doc["cases"]}


@pytest.mark.slow
def test_cpu_only_runs_every_path_on_every_case(cpu_only):
    meta, cases = cpu_only["meta"], cpu_only["cases"]
    assert meta["mode"] == "cpu-only" and meta["emulations_sound"] and meta["device"] == "cpu"
    names = {c["name"] for c in cases}
    assert {"random", "large-logits", "bool-mask", "float-mask", "fully-masked", "causal", "121558", "1072"} <= names
    for c in cases:
        assert set(c["paths"]) == PATHS, c["label"]
        assert c["backends"] == {}
        for name, f in c["paths"].items():
            assert "error" not in f, (c["label"], name, f)
            assert f["nonfinite_rows_unexplained"] == 0, (c["label"], name)
            assert f["ms"] > 0


@pytest.mark.slow
def test_cpu_only_emulations_are_within_the_dtypes_rounding_of_float64(cpu_only):
    """Every path's O within BOUND_U of the float64 attention on the same inputs (the script's reference is
    plain float64 softmax @ V), except fa2's float-mask case (below)."""
    for c in cpu_only["cases"]:
        for name, f in c["paths"].items():
            if name in ("fa2", "fa2-fma") and c["mask"] == "float":
                continue
            assert f["max_err_vs_float64_u"] <= BOUND_U, (c["label"], name, f["max_err_vs_float64_u"])


@pytest.mark.slow
def test_fa2_with_a_float_mask_is_within_the_dtypes_rounding_of_float64(cpu_only):
    c = by_label(cpu_only)["float-mask"]
    assert c["paths"]["fa2"]["max_err_vs_float64_u"] <= BOUND_U


@pytest.mark.slow
def test_cpu_only_hazard_repros_as_the_threads_report_them(cpu_only):
    cases = by_label(cpu_only)
    # PyTorch issue 121558: bf16 q, k, v all 133120: NaN from the fused-FMA flash kernels (fa2-fma, and
    # FlashAttention-3, whose exponent is fused too), finite from PyTorch's UNFUSE_FMA build, the efficient and the
    # math kernels
    c = cases["121558"]
    rows = c["hq"] * c["tq"]
    for name in ("fa2-fma", "fa3"):
        assert c["paths"][name]["finite_where_reference_is"] is False
        assert c["paths"][name]["events"]["fused_max"] == rows
        assert c["paths"][name]["nonfinite_rows_explained_by_events"] == rows
    for name in PATHS - {"fa2-fma", "fa3"}:
        assert c["paths"][name]["finite_where_reference_is"] is True, name
    # PyTorch issue 196678: L % 128 == 64 (192 is among the failing lengths), an explicit mask, every LSE < -88.7:
    # every row's dQ; L = 256 (a multiple of 128) clean
    c = cases["196678"]
    assert c["tk"] % 128 == 64 and c["mask"] == "bool"
    assert c["paths"]["cudnn"]["events"]["padded_key_tile"] == c["tq"]
    assert c["paths"]["cudnn"]["events"]["padded_query_tile"] == 0
    assert cases["196678-ctl-256"]["paths"]["cudnn"]["event_rows"] == 0
    # cudnn-frontend issue 1072: Sq = 1, Sk = 128, logits shifted by -128: NaN in dK, dV of both heads; Sk = 97 clean
    c = cases["1072"]
    assert c["paths"]["cudnn"]["events"]["padded_query_tile"] == c["hq"] * c["tq"] == 2
    assert cases["1072-ctl-sk97"]["paths"]["cudnn"]["event_rows"] == 0
    assert cases["1072-ctl-shift0"]["paths"]["cudnn"]["event_rows"] == 0
    # the hazards are cudnn's alone: no other path flags a row of these repros, and every forward is finite
    for name in ("196678", "196678-ctl-256", "1072", "1072-ctl-sk97", "1072-ctl-shift0"):
        for path, f in cases[name]["paths"].items():
            assert f["finite_where_reference_is"] is True, (name, path)
            assert path == "cudnn" or f["event_rows"] == 0, (name, path)


@pytest.mark.slow
def test_backend_plumbing_on_the_cpu(tmp_path):
    """--device cpu: the GPU side's code against PyTorch's CPU kernels. The CPU flash kernel runs every case
    (it is not fa2: figures close, not bits), its LSE from its own aten op within 1e-3 of fa2's on random
    inputs; the efficient and cuDNN backends refuse with torch's reason; the backward runs on the repros."""
    doc = run_script(tmp_path, "--device", "cpu", "--quick")
    assert doc["meta"]["mode"] == "backends on cpu"
    assert doc["meta"]["fa3_skipped"] == "no CUDA device"  # FlashAttention-3 needs sm90 and flash_attn_interface
    for c in doc["cases"]:
        assert set(c["backends"]) == {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"}
        fl = c["backends"]["FLASH_ATTENTION"]
        assert fl["status"] == "ran" and fl["path"] == "fa2", (c["label"], fl)
        assert fl["op_out_identical"] is True  # the aten op is the kernel SDPA ran
        for b in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            assert c["backends"][b]["status"] == "refused" and c["backends"][b]["torch_reason"]
        if c["backward"]:
            assert set(fl["backward"]) == {"dq_nonfinite", "dk_nonfinite", "dv_nonfinite"}
            assert fl["backward_predicted"] == {"nan_dq_rows": 0, "nan_dkdv": False}
    fl = by_label(doc)["random"]["backends"]["FLASH_ATTENTION"]
    assert fl["lse_max_diff"] < 1e-3 and fl["nan_pattern_equal"] and fl["identical_pct"] > 50
    assert fl["max_err_u"] <= 2 * BOUND_U


def load_script(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_kernels_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up while it loads
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the repository first on sys.path
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["crash", "nan"])
def test_cpu_only_exits_1_when_an_emulation_breaks(fault, tmp_path, monkeypatch, capsys):
    gk = load_script(monkeypatch)
    monkeypatch.setattr(gk, "grid", lambda quick: [gk.Case("random", "bf16", 64, 4, 16)])
    real = gk.run_path

    def broken(mod, *args):
        res = real(mod, *args)
        if mod is not gk.cudnn:
            return res
        if fault == "crash":
            raise RuntimeError("broken kernel")
        res.out = torch.full_like(res.out, float("nan"))
        return res

    monkeypatch.setattr(gk, "run_path", broken)
    out = tmp_path / "gk.json"
    assert gk.main(["--cpu-only", "--json", str(out)]) == 1
    f = json.loads(out.read_text())["cases"][0]["paths"]["cudnn"]
    assert ("broken kernel" in f["error"]) if fault == "crash" else f["nonfinite_rows_unexplained"] == 8
    assert "an emulation crashed" in capsys.readouterr().err


@pytest.mark.parametrize("case", [("random", "none", 2, 40, 40), ("causal-rect", "causal", 4, 24, 70)])
def test_fa3_figures_plumbing_with_a_stand_in_interface(monkeypatch, case):
    """FlashAttention-3's side of the script without a GPU: a stand-in ``flash_attn_interface`` in the package's
    layout ((b, t, h, d) in and out, LSE (b, h, t)) computing with float64 softmax and FlashAttention-3's causal
    mask (bottom right); the script's transposes, its bottom-right emulation and its comparison must line up: O
    within the dtype's rounding of the emulation (not bits: the stand-in is float64), LSE close; explicit masks
    are refused (the kernel takes none)."""
    gk = load_script(monkeypatch)
    name, mask, hq, tq, tk = case

    class StandIn:
        @staticmethod
        def flash_attn_func(q, k, v, causal=False, num_splits=1, return_attn_probs=False):
            assert num_splits == 1 and return_attn_probs
            q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
            k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            if causal:
                i, j = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
                s = s.masked_fill(j > i + s.shape[-1] - s.shape[-2], float("-inf"))
            o = torch.softmax(s, dim=-1) @ v
            return o.transpose(1, 2).to(torch.bfloat16), torch.logsumexp(s, dim=-1).float()

    c = gk.Case(name, "bf16", 64, tq, tk, hq=hq, hkv=2, mask=mask)
    x = gk.make_inputs(c)
    rows = gk.as_rows(c, x)
    ref, mag = gk.reference(rows)
    fig = gk.fa3_figures(StandIn(), c, x, rows, mag, ref, torch.device("cpu"), None)
    assert fig["status"] == "ran" and fig["path"] == "fa3", fig
    assert fig["nan_pattern_equal"] and fig["lse_inf_pattern_equal"] and fig["lse_max_diff"] < 1e-4
    assert fig["max_err_u"] <= 2 * BOUND_U and fig["identical_pct"] > 50
    cm = gk.Case("bool-mask", "bf16", 64, 8, 16, mask="bool")
    xm = gk.make_inputs(cm)
    rm = gk.as_rows(cm, xm)
    refused = gk.fa3_figures(StandIn(), cm, xm, rm, *gk.reference(rm)[::-1], torch.device("cpu"), None)
    assert refused["status"] == "refused" and refused["refusal_agrees_with_path"]
