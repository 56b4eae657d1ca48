"""The GPU kernels' hazards as findings, each on its published trigger, run end to end (q/k files and
captures through the CLI): ``fused_max`` on PyTorch issue 121558's input (bf16 Q, K, V all 133120: NaN
from the flash-attn package's fused exponent, finite from PyTorch's unfused flash, efficient and math
kernels), ``padded_tile`` on PyTorch issue 196678's (explicit mask, Tk % 128 == 64, every LSE below
-ln(FLT_MAX): NaN dQ from cuDNN's backward) and cudnn-frontend issue 1072's (Sq = 1, Sk = 128, logits
shifted by -128: NaN dK, dV); healthy inputs give neither. The numbers the messages quote are checked
against numpy's fp32 spacing, torch.finfo and a float64 log-sum-exp."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.codes import REGISTRY
from attncheck.findings import CUDNN_KEY_TILE, CUDNN_Q_TILE, fused_max_threshold
from attncheck.numerics.paths import cudnn
from attncheck.numerics.precision import limits_of

runner = CliRunner()
KERNELS = ("fa2-fma", "fa2", "mem-efficient", "sdpa-math", "flash", "cudnn")
FLT_MAX = float(torch.finfo(torch.float32).max)


def run_file(tmp_path: Path, tensors: dict, paths=KERNELS, dtype: str = "bf16", extra=()):
    """``attncheck run`` on a q/k file of ``tensors``: (cells by name, findings, the CLI's result)."""
    f, out = tmp_path / "qk.safetensors", tmp_path / "out.json"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(f))
    r = runner.invoke(app, ["run", str(f), "--path", ",".join(paths), "--dtype", dtype, "--json", str(out), *extra])
    assert r.exit_code in (0, 1), r.output[-3000:]
    t = json.loads(out.read_text())["tensors"][0]
    return {c["name"]: c for c in t["cells"]}, t["findings"], r


def of(findings: list[dict], code: str) -> list[dict]:
    return [f for f in findings if f["code"] == code]


def issue_121558() -> dict:
    x = torch.full((1, 1, 1, 64), 133120.0, dtype=torch.bfloat16)
    return {"q": x, "k": x.clone(), "v": x.clone()}


def issue_196678(L: int = 192, shift: bool = True) -> dict:
    """The thread's construction, small: q, k = randn x 0.1, q[..., 0] = 1, k[..., 0] = -120 sqrt(D) (every logit
    about -120), a tril boolean mask tensor (True = attend)."""
    g = torch.Generator().manual_seed(0)
    D = 64
    q, k = (torch.randn(1, 1, L, D, generator=g) * 0.1 for _ in range(2))
    v = torch.randn(1, 1, L, D, generator=g)
    if shift:
        q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    return {"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), "mask": mask}


def issue_1072(sk: int = 128, shift: float = -128.0) -> dict:
    """Sq = 1, Sk = 128, D = 64, two heads, no mask, every scaled logit shift + q'.k'/8."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 64, generator=g)
    k, v = torch.randn(1, 2, sk, 64, generator=g), torch.randn(1, 2, sk, 64, generator=g)
    q[..., 0], k[..., 0] = 1.0, shift * 8.0
    return {"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16()}


def lse64(t: dict) -> torch.Tensor:
    """Every row's log-sum-exp in float64 of the scaled scores (q, k as the file holds them, the mask's -inf)."""
    q, k = t["q"].double(), t["k"].double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if "mask" in t:
        s = s.masked_fill(~t["mask"], -math.inf)
    return torch.logsumexp(s, dim=-1).flatten()


# ----------------------------------------------------------------------------------- fused_max


def log2_limit(d: torch.dtype) -> float:
    """log2 of the least value that rounds to inf in ``d``: torch.finfo's max plus half the top binade's ulp."""
    fi = torch.finfo(d)
    return math.log2(fi.max + fi.eps * 2.0 ** math.floor(math.log2(fi.max)) / 2)


def walked_threshold(dt: torch.dtype) -> int:
    """The least power of two 2^e where half numpy's fp32 spacing reaches log2 of fp32's or the P dtype's limit."""
    room = min(log2_limit(torch.float32), log2_limit(dt))
    return next(e for e in range(1, 64) if float(np.spacing(np.float32(2.0**e))) / 2 >= room)


@pytest.mark.parametrize("dt,expect", [(torch.float16, 28), (torch.bfloat16, 31), (torch.float32, 31)])
def test_fused_max_threshold_is_where_half_an_fp32_ulp_reaches_exp2s_overflow(dt, expect):
    assert walked_threshold(dt) == expect == fused_max_threshold(limits_of(torch.float32), limits_of(dt))


def test_the_fused_max_page_states_the_thresholds_torch_finfo_gives():
    """The reference page's numbers (typed there: codes.py is torch-free) against the walk above."""
    code = REGISTRY["fused_max"]
    text = code.threshold + " " + code.fix
    for dt in (torch.float32, torch.float16):
        e = walked_threshold(dt)
        logit = 2.0**e * math.log(2)  # |S x scale| at |S x scale x log2e| = 2^e
        stated = {f"{logit:.4g}".replace("e+0", "e"), f"{logit:.3g}".replace("e+0", "e")}  # 1.489e9 and 1.49e9
        assert f"2^{e}" in text and all(number in text for number in stated)
    assert f"log2(65520) = {log2_limit(torch.float16):.6g}" in text and "128 for fp32's exp2" in text
    assert f"{log2_limit(torch.bfloat16):.6g} for bf16's P" in text
    assert round(min(log2_limit(torch.float32), log2_limit(torch.bfloat16))) == 128


def test_pytorch_121558_is_fused_max_under_fa2_fma_and_finite_under_the_others(tmp_path):
    cells, findings, r = run_file(tmp_path, issue_121558(), extra=("--fail-on", "fused_max"))
    assert r.exit_code == 1 and "attncheck: --fail-on fused_max: " in r.output
    (f,) = of(findings, "fused_max")
    assert f["severity"] == "error" and f["cells"] == ["fa2-fma/bf16"] and f["rows"] == 1
    assert cells["fa2-fma/bf16"]["nan_rows"] == 1 and cells["fa2-fma/bf16"]["nan_causes"] == {"fused_max": 1}
    for name in ("fa2/bf16", "mem-efficient/bf16", "sdpa-math/bf16", "flash/bf16"):
        assert cells[name]["nan_rows"] == 0 and not cells[name]["events"], name  # the thread: finite there
    assert "cudnn/bf16" not in cells  # one key: cuDNN would not run it (a notice says so)
    # the numbers it quotes: the largest scaled score, half an fp32 ulp of it times log2e, the threshold
    logit = 64 * 133120.0**2 / 8
    half_ulp = float(np.spacing(np.float32(logit / math.log(2)))) / 2
    assert half_ulp == 8192.0
    msg = f["message"]
    assert f"{logit:.4g}" in msg and f"half an fp32 ulp is {half_ulp:.6g}" in msg
    assert "2^31" in msg and f"{2.0**31 * math.log(2):.4g}" in msg and "UNFUSE_FMA" in msg and "121558" in msg
    assert not of(findings, "padded_tile")


def test_fused_max_not_below_the_threshold(tmp_path):
    """bf16 q = k = 2^13 x (1, 1, ...) with d 64: |S x scale x log2e| = 2^26 x 8 x log2e < 2^31, so the
    residue stays below 128 (half an ulp is 2^5 there): every path finite, no finding."""
    x = torch.full((1, 1, 2, 64), 2.0**13, dtype=torch.bfloat16)
    assert 64 * 2.0**26 / 8 / math.log(2) < 2.0**31
    cells, findings, _ = run_file(tmp_path, {"q": x, "k": x.clone(), "v": x.clone()}, paths=("fa2-fma", "fa2"))
    assert not of(findings, "fused_max") and all(c["nan_rows"] == 0 for c in cells.values())


# ----------------------------------------------------------------------------------- padded_tile


def test_the_finding_names_the_tiles_the_cudnn_path_assumes():
    assert (CUDNN_KEY_TILE, CUDNN_Q_TILE) == (cudnn.KEY_TILE, cudnn.Q_TILE)


def test_pytorch_196678_is_padded_tile_under_cudnn_only(tmp_path):
    t = issue_196678()
    cells, findings, r = run_file(tmp_path, t, extra=("--fail-on", "padded_tile"))
    assert r.exit_code == 1
    lse = lse64(t)
    assert (lse < -math.log(FLT_MAX)).all()  # every row: exp(0 - LSE) overflows fp32
    (f,) = of(findings, "padded_tile")
    assert f["severity"] == "warning" and f["cells"] == ["cudnn/bf16"] and f["rows"] == lse.numel() == 192
    assert all(c["nan_rows"] == 0 for c in cells.values())  # the forward is finite everywhere ("forward ... fine")
    low = cells["cudnn/bf16"]["event_values"]["padded_tile"]
    assert abs(low - float(lse.min())) < 0.05, (low, float(lse.min()))
    msg = f["message"]
    assert f"-ln(FLT_MAX) = {-math.log(FLT_MAX):.2f}" in msg and "-88.72" in msg and f"lowest LSE {low:.4g}" in msg
    assert "key tile" in msg and "dQ" in msg and "Tk = 192" in msg and "9.26" in msg
    assert not of(findings, "fused_max")


def test_cudnn_frontend_1072_is_padded_tile_in_dk_dv_under_cudnn_only(tmp_path):
    t = issue_1072()
    cells, findings, _ = run_file(tmp_path, t)
    (f,) = of(findings, "padded_tile")
    assert f["cells"] == ["cudnn/bf16"] and f["rows"] == 2 and (lse64(t) < -math.log(FLT_MAX)).all()
    assert "query tile" in f["message"] and "dK and dV" in f["message"] and "Tq = 1" in f["message"]
    assert all(c["nan_rows"] == 0 for c in cells.values())


@pytest.mark.parametrize("case", ["random_masked_192", "random_128_one_query", "196678_at_256", "1072_shift_0"])
def test_healthy_inputs_give_neither_finding(tmp_path, case):
    """Tk % 128 == 64 with an explicit mask and LSE near 0, a padded query tile with LSE near log 128, the
    196678 logits at a whole number of tiles (the thread: clean at multiples of 128), 1072 without the shift."""
    g = torch.Generator().manual_seed(1)
    if case == "random_masked_192":
        q, k, v = (torch.randn(1, 2, 192, 64, generator=g).bfloat16() for _ in range(3))
        t = {"q": q, "k": k, "v": v, "mask": torch.ones(192, 192, dtype=torch.bool).tril()}
    elif case == "random_128_one_query":
        q = torch.randn(1, 2, 1, 64, generator=g).bfloat16()
        k, v = (torch.randn(1, 2, 128, 64, generator=g).bfloat16() for _ in range(2))
        t = {"q": q, "k": k, "v": v}
    elif case == "196678_at_256":
        t = issue_196678(256)
    else:
        t = issue_1072(shift=0.0)
    cells, findings, _ = run_file(tmp_path, t)
    assert not of(findings, "padded_tile") and not of(findings, "fused_max")
    assert all(c["nan_rows"] == 0 and not c["events"] for c in cells.values())


# ----------------------------------------------------------------------------------- captured calls


def captured(tmp_path: Path, t: dict, **meta) -> Path:
    """A CPU capture of one SDPA call, its metadata then marked as run on a GPU (``meta``), as a CUDA capture
    says it (CI has no GPU)."""
    mask = t.get("mask")
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=mask)
    (path,) = (tmp_path / "cap").glob("*.safetensors")
    if meta:
        with safe_open(path, "pt") as f:
            old = f.metadata()
        save_file(load_file(path), path, metadata={**old, **meta})
    return tmp_path / "cap"


def run_capture(cap: Path, *args: str):
    out = cap.parent / "out.json"
    r = runner.invoke(app, ["run", str(cap), "--json", str(out), *args])
    assert r.exit_code in (0, 1), r.output[-3000:]
    return json.loads(out.read_text()), r


@pytest.mark.parametrize("capability,hit", [("9.0", True), ("8.0", False)])
def test_a_cudnn_call_captured_on_sm90_is_judged_by_cudnn_with_the_finding(tmp_path, capability, hit):
    """The model's cell is cudnn's (sdpa_backend cudnn_attention on CUDA); both threads saw the hazard on sm90 only."""
    cap = captured(tmp_path, issue_196678(), device="cuda:0", capability=capability, sdpa_backend="cudnn_attention")
    doc, r = run_capture(cap, "--fail-on", "padded_tile")
    (t,) = doc["tensors"]
    assert [c["name"] for c in t["cells"]] == ["cudnn/bf16"]
    assert bool(of(t["findings"], "padded_tile")) is hit and (r.exit_code == 1) is hit


def test_what_if_cells_get_their_own_fused_max_finding(tmp_path):
    """The 121558 call captured on the CPU (the model's cell: the CPU flash kernel, finite) with the GPU kernels
    as what-ifs: fa2-fma's cell carries the finding, fa2's and mem-efficient's none; --fail-on what-if:fused_max."""
    cap = captured(tmp_path, issue_121558())
    doc, r = run_capture(
        cap, "--path", "fa2-fma,fa2,mem-efficient", "--dtype", "bf16", "--fail-on", "what-if:fused_max"
    )
    assert r.exit_code == 1
    assert not of(doc["tensors"][0]["findings"], "fused_max")  # the model's own cell
    answers = {a["cell"]: a for a in doc["model"]["what_if"]}
    assert answers["fa2-fma/bf16"]["findings"].get("fused_max") == 1 and answers["fa2-fma/bf16"]["verdict"] == "nan"
    for name in ("fa2/bf16", "mem-efficient/bf16"):
        assert "fused_max" not in answers[name]["findings"] and answers[name]["nan_rows"] == 0


def test_what_if_cells_get_their_own_padded_tile_finding(tmp_path):
    """The 196678 call captured on the CPU (explicit mask recorded): cudnn as a what-if carries the warning,
    mem-efficient none, the model's own cell none."""
    cap = captured(tmp_path, issue_196678())
    doc, r = run_capture(cap, "--path", "cudnn,mem-efficient", "--dtype", "bf16", "--fail-on", "what-if:padded_tile")
    assert r.exit_code == 1
    assert not of(doc["tensors"][0]["findings"], "padded_tile")
    answers = {a["cell"]: a for a in doc["model"]["what_if"]}
    assert answers["cudnn/bf16"]["findings"].get("padded_tile") == 1 and answers["cudnn/bf16"]["nan_rows"] == 0
    assert "padded_tile" not in answers["mem-efficient/bf16"]["findings"]
