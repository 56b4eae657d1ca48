"""attncheck.findings on hand-made results: no tensors, no torch. Each code fires on its
condition (and only then), with its severity, its fix and the numbers that explain it."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from attncheck.codes import FIX, SEVERITY
from attncheck.config.run import Options
from attncheck.findings import failed_conditions, findings_for
from attncheck.results import (
    AttentionAudit,
    Cell,
    Census,
    Distribution,
    DtypeAudit,
    DtypeHeadroom,
    DtypeLimits,
    TensorDiagnosis,
)

# fp16 and fp32 limits as torch.finfo gives them (tests/numerics/test_precision.py checks the derivation).
LIMITS = {
    "fp16": DtypeLimits("fp16", 65504.0, 2**-14, 2**-24, 2**-10, 65520.0, "inf", math.log(65520.0), math.log(2**-25)),
    "fp32": DtypeLimits(
        "fp32",
        3.4028234663852886e38,
        2**-126,
        2**-149,
        2**-23,
        3.4028235677973366e38,
        "inf",
        88.72283935546875,
        math.log(2**-150),
    ),
}


def cell(method: str, dtype: str = "fp16", **changes) -> Cell:
    healthy = Cell(
        method=method,
        dtype=dtype,
        rows=64,
        nan_rows=0,
        nan_causes={},
        overflow_rows=0,
        underflow_rows=0,
        zero_rows=0,
        zero_causes={},
        compared_rows=64,
        max_abs_err=1e-3,
        rmse=1e-4,
        max_abs_err_algo=5e-4,
        rmse_algo=5e-5,
        max_row_sum_err=1e-3,
        kl_mean=1e-6,
        kl_max=1e-5,
        flushed_frac=0.0,
        argmax_flips=0,
    )
    return replace(healthy, **changes)


def headroom(dtype: str = "fp16", **changes) -> DtypeHeadroom:
    lim = LIMITS[dtype]
    h = DtypeHeadroom(
        dtype=dtype,
        max_finite=lim.max,
        exp_overflow_threshold=lim.exp_overflow,
        exp_underflow_threshold=lim.exp_underflow,
        headroom=5.0,
        rows_over_exp_threshold=0,
        rows_all_underflow=0,
        rows_spread_beyond_underflow=0,
        cast_posinf_values=0,
        cast_neginf_values=0,
        cast_overflow_rows=0,
        cast_overflow_examples=[],
    )
    return replace(h, **changes)


def diagnosis(cells=None, census=None, attention=None, distribution=None, dtypes=("fp16",)) -> TensorDiagnosis:
    census = census or Census(
        shape=(2, 32, 16),
        dtype="fp32",
        rows=64,
        keys=16,
        finite=1024,
        min=-3.0,
        max=6.0,
        mean=0.0,
        std=1.0,
        nan=0,
        posinf=0,
        neginf=0,
        masked=0,
        sentinels=[],
        fully_masked_rows=0,
        neginf_rows=0,
        nan_input_rows=0,
        posinf_input_rows=0,
        headroom=[headroom(d) for d in dtypes],
    )
    distribution = distribution or Distribution(
        rows=64,
        entropy_mean=2.0,
        entropy_min=1.0,
        entropy_max=2.7,
        entropy_norm_mean=0.7,
        max_prob_mean=0.3,
        collapsed_rows=0,
        collapsed_frac=0.0,
        collapse_threshold=0.99,
        jacobian_norm_mean=0.3,
    )
    cells = cells if cells is not None else [cell(m, d) for m in ("naive", "stable", "tiled", "torch") for d in dtypes]
    d = TensorDiagnosis(
        "t",
        (2, 32, 16),
        "fp32",
        census,
        distribution,
        cells,
        [],
        Options(dtypes=dtypes),
        attention,
        limits={name: LIMITS[name] for name in dtypes},
    )
    d.findings = findings_for(d)
    return d


def audit(**changes) -> AttentionAudit:
    a = AttentionAudit(
        d=64,
        heads=4,
        kv_heads=4,
        scale=0.125,
        scale_name="auto",
        scale_order="scores",
        mask_value="-inf",
        q_std=1.0,
        k_std=1.0,
        q_max_abs=4.0,
        k_max_abs=4.0,
        float_mask_looks_boolean=False,
        raw_max_abs=30.0,
        scores_std=1.0,
        dtypes={"fp16": DtypeAudit("fp16")},
    )
    return replace(a, **changes)


def only(d: TensorDiagnosis, code: str):
    hits = [f for f in d.findings if f.code == code]
    assert len(hits) == 1, [f.code for f in d.findings]
    f = hits[0]
    assert f.fix == FIX[code] and f.severity == SEVERITY[code]
    return f


def test_healthy_results_have_no_findings():
    assert diagnosis().findings == []
    assert diagnosis(attention=audit()).findings == []


def test_input_nan_and_inf_input_name_rows_values_and_cells():
    census = replace(diagnosis().census, nan=3, nan_input_rows=2, posinf=1, posinf_input_rows=1)
    cells = [
        cell(
            "naive",
            nan_rows=3,
            nan_causes={"input_nan": 2, "inf_input": 1},
            examples={"nan:input_nan": [(0, 1)], "nan:inf_input": [(1, 4)]},
        )
    ]
    d = diagnosis(cells, census)
    f = only(d, "input_nan")
    assert f.rows == 2 and f.cells == ["naive/fp16"] and f.examples == [(0, 1)] and "(3 value(s))" in f.message
    g = only(d, "inf_input")
    assert g.rows == 1 and g.examples == [(1, 4)] and "(1 value(s))" in g.message


def test_fully_masked_rows_says_what_each_cell_returns():
    census = replace(diagnosis().census, fully_masked_rows=4, neginf_rows=4)
    cells = [
        cell("naive", nan_rows=4, nan_causes={"fully_masked": 4}),
        cell("tiled", zero_rows=4, zero_causes={"fully_masked": 4}),
    ]
    f = only(diagnosis(cells, census), "fully_masked_rows")
    assert f.rows == 4 and f.cells == ["naive/fp16", "tiled/fp16"]
    assert "4 all -inf" in f.message and "NaN in naive" in f.message and "zeros in tiled" in f.message


def test_fully_masked_rows_with_a_finite_sentinel_is_consistent():
    # stable and torch return a finite uniform row: the message must not also say they return NaN.
    census = replace(
        diagnosis().census,
        fully_masked_rows=2,
        neginf_rows=0,
        sentinels=[(-65504.0, 2)],
        sentinel_spans=[(-65504.0, -65152.0)],
    )
    cells = [cell("naive", nan_rows=2, nan_causes={"fully_masked": 2}), cell("stable"), cell("torch")]
    f = only(diagnosis(cells, census), "fully_masked_rows")
    assert "2 with a finite sentinel, e.g. -65504" in f.message
    assert (
        "a finite uniform row over the masked keys in stable/fp16, torch/fp16" in f.message
        and "NaN in naive" in f.message
    )
    assert "stable softmax return NaN" not in f.message and "naive/stable" not in f.message
    # From Q/K inputs the sentinel is the mask's own value, not a score plus it.
    a = audit(mask_value="-65504.0", float_mask_value=-65504.0)
    census = replace(census, sentinels=[(-75000.0, 2)])
    assert (
        "2 with a finite sentinel, mask value -65504"
        in only(diagnosis(cells, census, attention=a), "fully_masked_rows").message
    )


def test_cast_overflow_and_an_unrepresentable_sentinel():
    h = headroom(cast_posinf_values=3, cast_neginf_values=0, cast_overflow_rows=1, cast_overflow_examples=[70000.0])
    census = replace(diagnosis().census, headroom=[h])
    cells = [cell("naive", nan_rows=1, nan_causes={"cast_overflow": 1})]
    f = only(diagnosis(cells, census), "cast_overflow")
    assert "turns 3 finite score(s) into +-inf" in f.message and "e.g. 7e+04" in f.message and f.rows == 1

    h = headroom(cast_neginf_values=10, cast_overflow_examples=[-1e9])
    census = replace(diagnosis().census, headroom=[h])
    f = only(diagnosis(None, census), "sentinel_not_representable")
    assert "mask value -1e+09 is not representable in fp16 (max 65504)" in f.message and f.severity == "warning"


def test_exp_overflow_versus_sum_overflow():
    d = diagnosis(
        [
            cell(
                "naive",
                nan_rows=5,
                overflow_rows=5,
                nan_causes={"exp_overflow": 5},
                events={"exp_overflow": 5},
                examples={"event:exp_overflow": [(0, 3)]},
            )
        ]
    )
    f = only(d, "exp_overflow")
    assert f.rows == 5 and f.examples == [(0, 3)] and "exp(x) = inf for x > 11.09" in f.message
    # The cause that happened is named: finite exps whose row sum overflows are a sum_overflow,
    # in naive as in stable, and never called an exp overflow.
    for method in ("naive", "stable"):
        d = diagnosis(
            [cell(method, overflow_rows=2, zero_rows=2, zero_causes={"sum_overflow": 2}, events={"sum_overflow": 2})]
        )
        f = only(d, "sum_overflow")
        assert (
            f.rows == 2
            and "2 all-zero row(s)" in f.message
            and "every exp is finite but the row sum overflows" in f.message
        )
        assert "the largest fp16 is 65504" in f.message
        assert not [g for g in d.findings if g.code in ("exp_overflow", "zero_rows")]
    # naive can have both, each row under what overflowed in it
    d = diagnosis(
        [
            cell(
                "naive",
                nan_rows=3,
                overflow_rows=5,
                events={"exp_overflow": 3, "sum_overflow": 2},
                nan_causes={"exp_overflow": 3},
                zero_rows=2,
                zero_causes={"sum_overflow": 2},
                examples={"event:exp_overflow": [(0, 1)], "event:sum_overflow": [(1, 0)]},
            )
        ]
    )
    f, g = only(d, "exp_overflow"), only(d, "sum_overflow")
    assert f.rows == 3 and "in 3 row(s)" in f.message and "-> 3 NaN row(s)" in f.message and f.examples == [(0, 1)]
    assert (
        g.rows == 2
        and "in 2 row(s) (the largest fp16 is 65504) -> 2 all-zero row(s)" in g.message
        and g.examples == [(1, 0)]
    )
    assert not [x for x in d.findings if x.code == "zero_rows"]


def test_underflow_zero_rows_and_unexplained_nan():
    d = diagnosis([cell("naive", nan_rows=3, underflow_rows=3, nan_causes={"underflow": 3})])
    assert "all scores below -17.33" in only(d, "underflow").message
    d = diagnosis([cell("naive", zero_rows=2, zero_causes={"unexplained": 2})])
    assert only(d, "zero_rows").rows == 2
    d = diagnosis([cell("naive", nan_rows=1, nan_causes={"unexplained": 1})])
    assert only(d, "unexplained_nan").rows == 1


def test_accuracy_findings():
    d = diagnosis([cell("stable", argmax_flips=3, examples={"flip": [(1, 2)]}), cell("torch")])
    assert only(d, "argmax_flip").rows == 3
    # FlashAttention's rule: more than 2x the same-dtype torch.softmax's error against float64 of
    # the cast scores, for methods that reproduce a kernel models run (the registry's kernel):
    # tiled is FlashAttention's online softmax; hand-written naive/stable are not judged.
    d = diagnosis(
        [
            cell("stable", max_abs_err_algo=3e-3),
            cell("naive", max_abs_err_algo=5e-3),
            cell("tiled", max_abs_err_algo=1.9e-3),
            cell("torch", max_abs_err_algo=1e-3),
        ]
    )
    assert not [f for f in d.findings if f.code == "worse_than_torch"]
    d = diagnosis(
        [
            cell("stable", max_abs_err_algo=3e-3),
            cell("tiled", max_abs_err_algo=2.5e-3),
            cell("torch", max_abs_err_algo=1e-3),
        ]
    )
    f = only(d, "worse_than_torch")
    assert "tiled/fp16 (FlashAttention's online softmax) 2.5x" in f.message and "stable" not in f.message
    assert f.cells == ["tiled/fp16"]
    # Path cells: the flash path is FlashAttention-2's forward, judged against the eager path's
    # torch.softmax cell; sdpa-math (PyTorch's own math backend) is not a kernel to judge.
    d = diagnosis(
        [
            cell("torch", path="eager", max_abs_err_algo=1e-3),
            cell("sdpa-math", path="sdpa-math", max_abs_err_algo=9e-3),
            cell("flash", path="flash", max_abs_err_algo=2.5e-3),
        ]
    )
    f = only(d, "worse_than_torch")
    assert "flash/fp16 (FlashAttention-2's forward) 2.5x" in f.message and "sdpa-math" not in f.message
    d = diagnosis([cell("tiled", flushed_frac=0.05)])
    assert "tiled/fp16 (5.0%)" in only(d, "probability_flush").message
    dist = replace(diagnosis().distribution, collapsed_rows=60, collapsed_frac=60 / 64)
    assert only(diagnosis(distribution=dist), "entropy_collapse").rows == 60


def test_qk_overflow_says_whether_scaling_q_first_helps():
    a = audit(
        raw_max_abs=220_000.0,
        q_max_abs=72.0,
        dtypes={"fp16": DtypeAudit("fp16", qk_overflow_values=3, qk_overflow_rows=2)},
    )
    cells = [cell("stable", nan_rows=2, nan_causes={"qk_overflow": 2})]
    f = only(diagnosis(cells, attention=a), "qk_overflow")
    # 220000 * 0.125 = 27500 < 65520: scaling q first keeps the scores in range.
    assert "scaling q first (--scale-order q) would avoid it" in f.message and f.rows == 2
    a = replace(a, raw_max_abs=1e6)  # 125000 > 65520 even scaled first
    assert "would not avoid it" in only(diagnosis(cells, attention=a), "qk_overflow").message


def only_with(d: TensorDiagnosis, code: str, severity: str):
    hits = [f for f in d.findings if f.code == code]
    assert len(hits) == 1 and hits[0].severity == severity and hits[0].fix == FIX[code], [
        (f.code, f.severity) for f in d.findings
    ]
    return hits[0]


def test_mask_findings():
    a = audit(
        dtypes={
            "fp16": DtypeAudit(
                "fp16", overflow_on_add=6, sentinel_value=-65504.0, mask_values=[-65504.0], summed_planes_overflow=4
            )
        }
    )
    d = diagnosis(attention=a)
    # No row broke: the keys stay masked, so these are warnings, and they say so.
    f = only_with(d, "sentinel_overflow_on_add", "warning")
    assert "at 6 position(s) (mask value -65504 plus a negative score); no row became all -inf" in f.message
    assert "at 4 position(s)" in only_with(d, "summed_mask_planes", "warning").message
    broken = [cell("stable", nan_rows=3, nan_causes={"mask_sentinel": 3}, examples={"nan:mask_sentinel": [(0, 2)]})]
    d = diagnosis(broken, attention=a)
    f = only_with(d, "sentinel_overflow_on_add", "error")
    assert "; 3 row(s) become all -inf -> NaN in stable/fp16" in f.message and f.rows == 3 and f.examples == [(0, 2)]
    a2 = audit(
        mask_value="-1000000000.0",
        float_mask_value=-1e9,
        dtypes={
            "fp16": DtypeAudit("fp16", mask_not_representable=8, sentinel_value=-math.inf, mask_values=[-math.inf])
        },
    )
    assert (
        "8 float-mask value(s) cannot be held by fp16"
        in only_with(diagnosis(attention=a2), "sentinel_not_representable", "warning").message
    )
    assert only_with(diagnosis(broken, attention=a2), "sentinel_not_representable", "error").rows == 3
    d = diagnosis(attention=audit(leak_rows=5, leak_max=0.87, mask_value="-10000.0"))
    assert "up to 0.87" in only(d, "mask_leak").message
    assert only(diagnosis(attention=audit(float_mask_looks_boolean=True)), "float_mask_looks_boolean")


def test_scale_findings():
    # From the scale the scores carry (d = 64: 1/sqrt(d) = 0.125), not from their spread.
    f = only(diagnosis(attention=audit(scale=1.0, scale_name="none")), "missing_scale")
    assert (
        "q.k times 1 (the scale applied, --scale none on the scores): 8 x 1/sqrt(d_k)" in f.message
        and "unscaled" in f.message
    )
    assert "scaled twice" in only(diagnosis(attention=audit(scale=1 / 64, scale_name="dk")), "double_scale").message
    for spread in (8.0, 0.125, 1e4):  # the robust spread of the scores says nothing about their scale
        assert not {f.code for f in diagnosis(attention=audit(scores_std=spread)).findings} & {
            "missing_scale",
            "double_scale",
        }
    d = diagnosis(attention=audit(fitted_scale=1.0))
    f = only(d, "missing_scale")  # scores given: the fitted scale
    assert "least squares against q.k, from the scores given" in f.message
    assert "scale_mismatch" not in {g.code for g in d.findings}  # one finding says it, not two
    f = only(diagnosis(attention=audit(fitted_scale=1 / math.sqrt(256))), "scale_mismatch")
    assert "closest to 1/sqrt(d_model)" in f.message


def test_fail_on_conditions_read_the_same_results():
    d = diagnosis(
        [cell("naive", nan_rows=5, overflow_rows=5, nan_causes={"exp_overflow": 5}, events={"exp_overflow": 5})]
    )
    assert failed_conditions([d], ["nan", "overflow", "error", "flip", "exp_overflow"]) == [
        "nan: t: naive/fp16",
        "overflow: t: naive/fp16",
        "error: t: exp_overflow",
        "exp_overflow: t: exp_overflow",
    ]


def test_every_severity_has_a_fix():
    assert set(SEVERITY) == set(FIX)


def test_findings_import_no_torch():
    code = "import sys, attncheck.findings, attncheck.results; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize("code", sorted(FIX))
def test_every_code_has_a_section_in_the_findings_reference(code):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "findings.md").read_text()
    assert f"\n### {code}\n" in page and f"](#{code})" in page


def out_cell(method: str, path: str, dtype: str = "bf16", **changes) -> Cell:
    """A cell of an attention path that computed O = P@V."""
    out = dict(
        path=path,
        out_rows=64,
        out_nan_rows=0,
        out_max_abs_err=4e-3,
        out_rmse=1e-3,
        out_rel_l1=2e-3,
        out_cos_min=0.9999,
        out_cos_mean=0.99999,
        out_bias=1e-6,
    )
    return cell(method, dtype, **{**out, **changes})


def test_output_error_applies_flashattentions_rule_to_o():
    eager = out_cell("torch", "eager")
    ok = out_cell("flash", "flash", out_max_abs_err=8e-3)  # exactly 2x: within the rule
    bad = out_cell("sdpa-math", "sdpa-math", out_max_abs_err=8.1e-3)
    d = diagnosis([eager, ok, bad], dtypes=("fp32",))
    f = only(d, "output_error")
    assert f.cells == ["sdpa-math/bf16"] and "sdpa-math/bf16 2.0x (0.0081)" in f.message
    assert not [f for f in diagnosis([eager, ok], dtypes=("fp32",)).findings if f.code == "output_error"]
    # Without the eager torch.softmax cell there is nothing to compare with.
    assert not [f for f in diagnosis([bad], dtypes=("fp32",)).findings if f.code == "output_error"]


def test_tied_max_bias_needs_enough_tied_rows_and_a_significant_mean():
    biased = out_cell("flash", "flash", tied_rows=64, out_bias_tied=-5e-5, out_bias_tied_z=-11.3)
    f = only(diagnosis([biased], dtypes=("fp32",)), "tied_max_bias")
    assert "flash/bf16 64 tied row(s), mean error -5e-05 (11.3 standard errors from 0; all rows 1e-06)" in f.message
    assert f.rows == 64 and f.cells == ["flash/bf16"]
    for quiet in (
        replace(biased, out_bias_tied_z=3.9),
        replace(biased, tied_rows=15),
        replace(biased, out_bias_tied_z=None),
    ):
        assert not [f for f in diagnosis([quiet], dtypes=("fp32",)).findings if f.code == "tied_max_bias"]
