"""benchmarks/frontier_kernels.py: FlashAttention-4's published error figures against the ``fa4`` emulation.

The figures are facts from outside attncheck (Dao-AILab/flash-attention PR 2694, issue 2716 / PR 2717, PR 2067,
issue 2263; the script's docstring quotes them with their setups). The tolerances, stated where they are used:
each published figure within 25% (issue 34) on the full run; the orderings the threads claim on the quick one.
A figure that does not reproduce is marked so (xfail, strict) with the reason, not loosened."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "frontier_kernels.py"


@pytest.fixture(scope="module")
def fk():
    spec = importlib.util.spec_from_file_location("frontier_kernels_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    saved_path, saved = list(sys.path), sys.modules.get(spec.name)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(mod)  # it puts the repository first on sys.path
    finally:
        sys.path[:] = saved_path
    yield mod
    if saved is None:
        sys.modules.pop(spec.name, None)


def e4m3_rounding_rms() -> float:
    """The rms relative error of rounding to e4m3 (3 mantissa bits, to nearest) of values whose mantissa is
    log-uniform on [1, 2): (2^-3)^2 / 12 * E[1/m^2], E[1/m^2] = (1 - 1/4) / (2 ln 2). With near-uniform attention
    and i.i.d. V, ||O8 - O|| / ||O|| is this rms (each P_j's error weighs in with p_j v_j)."""
    return math.sqrt(2.0**-6 / 12 * (0.75 / (2 * math.log(2))))


# (d) issue 2263: 1.01% / 0.99% of bf16-rounded results differ; the fp32 difference reaches 1428 ulps


def test_d_exp2_emulation_differs_from_the_hardware_in_about_one_percent_of_bf16_results(fk):
    got = fk.measure_d(20_000)
    for (lo, hi), published in fk.D_PUBLISHED.items():
        m = got[f"[{lo:g}, {hi:g})"]
        # within 25% (issue 34); the sampling error of a share of 1% over 2e4 draws is 7% of it
        assert abs(m["share"] / published - 1) <= 0.25, (lo, m)
        assert m["one_ulp"]  # "all off by 1 BF16 ULP"
        # the polynomial's own error, against an exp2 modelled as correctly rounded: the issue's 1428 ulps (1e6
        # draws) was against ex2.approx, whose own error is at most 2 ulps (PTX ISA); fewer draws find less
        assert 1300 <= m["max_fp32_ulps"] <= fk.D_MAX_ULP + 4, m


# (c) PR 2067: at 128 keys (one key tile) every threshold gives the same result


def test_c_one_key_tile_gives_the_same_bits_under_every_threshold(fk):
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 128, generator=g).to(torch.bfloat16).double() for _ in range(3))
    scale = 1 / math.sqrt(128)
    outs = [fk.fa4_out(q, k, v, scale=scale, dt=torch.bfloat16, threshold=thr, seqlen_q=128) for thr in (8.0, 0.0, 4.0)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # no second tile for the lazy rescale
    # ... and two tiles do not: the threshold is live (the thread's 3.386784e-02 / 1.511154e-03 vs 1.474344e-03)
    # a second tile of keys before the first, with larger scores: the kernel visits it last, and its max is higher
    k2, v2 = (torch.cat([x.flip(1) * 1.5, x], dim=1) for x in (k, v))
    o8, o0 = (fk.fa4_out(q, k2, v2, scale=scale, dt=torch.bfloat16, threshold=thr, seqlen_q=128) for thr in (8.0, 0.0))
    assert not torch.equal(o8, o0)


# (a) PR 2694, quick: the orderings, and the offset-4 floor against the e4m3 rounding noise


@pytest.mark.slow  # 15 kernel calls over 8192 keys: 5-30 s on the shared 2 cores
def test_a_orderings_and_the_offset_4_floor(fk):
    got = fk.measure_a(32)
    for metric in ("rel_l2", "rel_mean_abs"):
        o8, o4 = got[8.0][metric], got[4.0][metric]
        assert all(x < y for x, y in zip(o8[1:], o8[2:])), o8  # offset 8 grows with the logit std from 0.5
        assert all(a <= b * 1.01 for a, b in zip(o4, o8)), (o4, o8)  # offset 4 never worse
        assert max(o4) / min(o4) < 1.5, o4  # offset 4 flat
        assert o8[-1] > 5 * o4[-1]  # the saturation: 0.361 against 0.022 published
    # at logit std 0.25 no P reaches e4m3's 448 and the error is P's rounding: the analytic rms, within 15% (32 rows)
    assert abs(got[4.0]["rel_l2"][0] / e4m3_rounding_rms() - 1) < 0.15, got[4.0]["rel_l2"][0]


# (b) issue 2716 / PR 2717, quick: after the fix e4m3 ~2x better than e5m2; before it, worse


def test_b_e4m3_about_twice_as_accurate_as_e5m2_after_the_fix(fk):
    got = fk.measure_b((256,), 1)
    for shape in fk.B_SHAPES:
        e = got[shape][256]
        fixed, before, e5 = (e[name] for name in fk.B_VARIANTS)
        assert 1.5 <= e5 / fixed <= 2.5, e  # "~2x": within 25% of 2
        assert before > e5, e  # issue 2716: e4m3 (offset 8, threshold 4) worse than e5m2


# the full figures, with issue 34's tolerance (each within 25%)


def judged(rows):
    return [r for r in rows if r.check != "info"]


@pytest.mark.slow
def test_a_full_pr2694_figures_within_25_percent(fk):
    rows, facts = fk.figure_a(False)
    bad = [r for r in judged(rows) if not r.ok]
    assert not bad, bad
    assert len([r for r in judged(rows) if r.check.startswith("within")]) == 20  # 2 offsets x 5 stds x 2 metrics


@pytest.mark.slow
def test_b_full_pr2717_ratio_at_every_key_length(fk):
    rows, facts = fk.figure_b(False)
    bad = [r for r in judged(rows) if not r.ok]
    assert not bad, bad
    assert facts["lengths"] == [256, 512, 1024, 2048, 4096]


@pytest.mark.slow
def test_d_full_issue2263_shares(fk):
    rows, facts = fk.figure_d(False)
    assert facts["n"] == 1_000_000
    bad = [r for r in judged(rows) if not r.ok]
    assert not bad, bad


@pytest.fixture(scope="module")
def full_c(fk):
    return fk.figure_c(False)


@pytest.mark.slow
def test_c_full_pr2067_structure(full_c):
    rows, facts = full_c
    structure = [r for r in rows if r.check == "order"]
    assert len(structure) == 2 * 3  # per logit std: same bits at 128 keys; thr 8 above thr 0 at 256 and 512 keys
    assert all(r.ok for r in structure), structure


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="PR 2067's inputs are not in its thread: N(0, 1) inputs at the default scale give MaxAbs 4-17x below "
    "its figures (the script's docstring, figure (c))",
)
def test_c_full_pr2067_maxabs_within_25_percent_at_the_default_scale(full_c):
    rows, facts = full_c
    maxabs = [r for r in rows if r.metric == "MaxAbs" and r.setup.startswith("logit std 1,")]
    assert len(maxabs) == 6
    assert all(r.ok for r in maxabs), maxabs


@pytest.mark.slow
def test_script_prints_and_writes_the_figures(tmp_path):
    out = tmp_path / "fk.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--only", "d", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["figures"]["d"]["rows"]
    assert [r["published"] for r in rows if r["metric"].startswith("share")] == [0.0101, 0.0099]
    assert "issue 2263" in proc.stdout and "PASS" in proc.stdout
    assert doc["meta"]["attncheck"] == str(ROOT / "attncheck")  # this checkout's, installed or not
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "x"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--only" in bad.stderr
