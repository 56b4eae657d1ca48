"""Q/K/mask inputs: each known failure class reproduced, with the cause and code attncheck reports."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.errors import AttncheckError
from attncheck.judge import diagnose_attention
from attncheck.numerics.cells.diagnose import Options
from attncheck.numerics.inputs.scores import prepare_inputs, score_blocks, start_audit

FP16_MAX = torch.finfo(torch.float16).max
runner = CliRunner()

# a file given as a path that holds q and k: the flags take it by key
HINT = " (a file holding q, k and v: --q FILE:q --k FILE:k --v FILE:v)"


def codes(diag):
    return {f.code for f in diag.findings}


def run(q, k, mask=None, dtypes=("fp16", "fp32"), methods=("naive", "stable", "tiled", "torch"), **kw):
    return diagnose_attention("qk", prepare_inputs(q, k, mask, **kw), Options(dtypes=dtypes, methods=methods))


# --------------------------------------------------------------------------- Q@K^T overflow


def outlier_qk():
    """One query and one key whose product 576 x 382 = 220032 exceeds fp16's 65504;
    scaled by 1/sqrt(64) first it is 27504, which fits."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 64, generator=g) * 0.1
    k = torch.randn(1, 1, 8, 64, generator=g) * 0.1
    q[0, 0, 2] = 0
    q[0, 0, 2, 0] = 576.0
    k[0, 0, 5] = 0
    k[0, 0, 5, 0] = 382.0
    return q, k


def test_fp16_qk_overflow_is_found_and_gone_with_scale_order_q():
    assert 576 * 382 > FP16_MAX and 576 / 8 * 382 < FP16_MAX  # the premise, from finfo
    q, k = outlier_qk()
    d = run(q, k, scale_order="scores")
    for m in ("stable", "torch"):  # the eager path rounds Q@K^T to fp16
        assert d.cell(m, "fp16").nan_causes == {"qk_overflow": 1}
        assert d.cell(m, "fp16").examples["nan:qk_overflow"] == [(0, 0, 2)]
        assert d.cell(m, "fp32").nan_rows == 0
    for p in ("sdpa-math", "flash"):  # S stays in fp32 there: no overflow
        assert d.cell(p, "fp16").nan_rows == 0
    f = next(f for f in d.findings if f.code == "qk_overflow")
    assert "scaling q first (--scale-order q) would avoid it" in f.message
    assert d.attention.dtypes["fp16"].qk_overflow_values == 1
    assert d.attention.raw_max_abs == pytest.approx(576 * 382, rel=1e-3)

    fixed = run(q, k, scale_order="q")
    assert "qk_overflow" not in codes(fixed)
    assert fixed.cell("stable", "fp16").nan_rows == 0


def test_scores_per_dtype_match_an_independent_fp32_accumulation():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 16, generator=g) * 3
    k = torch.randn(1, 2, 7, 16, generator=g) * 3
    inp = prepare_inputs(q, k, scale="auto")
    block = next(score_blocks(inp, 1000, torch.device("cpu"), start_audit(inp)))
    s16, before, after = block.in_dtype(torch.float16)
    # numpy: round q, k to fp16, multiply-accumulate in float32, round to fp16, scale in fp16.
    qn = q.numpy().astype(np.float16).astype(np.float32)
    kn = k.numpy().astype(np.float16).astype(np.float32)
    expected = (np.matmul(qn, np.swapaxes(kn, -1, -2)).astype(np.float16) * np.float16(0.25)).astype(np.float16)
    assert np.array_equal(s16.numpy(), expected.reshape(-1, 7))
    assert after == []


def test_grouped_query_attention_repeats_kv_heads():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k = torch.randn(2, 2, 5, 8, generator=g)
    inp = prepare_inputs(q, k)
    block = next(score_blocks(inp, 1000, torch.device("cpu"), start_audit(inp)))
    expected = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) / math.sqrt(8)
    assert torch.allclose(block.given, expected.reshape(-1, 5), rtol=1e-12)
    assert inp.score_shape == (2, 4, 3, 5)


# --------------------------------------------------------------------------- mask sentinels


def negative_scores(b=1, h=1, t=8, d=64):
    """Every score is q.k/sqrt(d) = -2 x 2 x 64 / 8 = -32."""
    return torch.full((b, h, t, d), 2.0), torch.full((b, h, t, d), -2.0)


def test_opt_style_left_padding_causal_min_mask_in_fp16():
    # Left padding of 4 plus a causal mask: queries 0..3 may attend to nothing. With
    # finfo(fp16).min added to a score of -32, -65504 - 32 rounds past 65520 to -inf:
    # those rows become all -inf, NaN. In fp32 the sentinel holds: a finite uniform row.
    q, k = negative_scores()
    assert -FP16_MAX - 32 < -65520
    d = run(q, k, causal=True, pad_left=[4], mask_value="min")
    for m in ("stable", "torch"):
        assert d.cell(m, "fp16").nan_causes == {"mask_sentinel": 4}, m
        assert d.cell(m, "fp32").nan_rows == 0
    # naive fp16 also loses rows 4..7: their unmasked scores are all -32 < -17.33, exp flushes to 0.
    assert d.cell("naive", "fp16").nan_causes == {"mask_sentinel": 4, "underflow": 4}
    # sdpa-math and flash add the fp16 mask to fp32 scores: -65504 - 32 stays finite, a uniform row.
    for p in ("sdpa-math", "flash"):
        assert d.cell(p, "fp16").nan_rows == 0 and d.cell(p, "fp16").zero_rows == 0
    assert {"sentinel_overflow_on_add", "fully_masked_rows"} <= codes(d)
    assert d.census.fully_masked_rows == 4
    assert d.attention.dtypes["fp16"].mask_sentinel_rows == 4
    f = next(f for f in d.findings if f.code == "fully_masked_rows")
    assert "finite uniform row" in f.message and "FlashAttention" in f.message


def test_two_summed_min_planes_overflow():
    # A float padding mask of finfo(fp16).min on keys 0..3 plus a causal plane of the same
    # value: where both mask a key (key < 4 and key > query), min + min = -inf in fp16.
    q, k = torch.zeros(1, 1, 6, 16), torch.zeros(1, 1, 6, 16)
    pad = torch.zeros(1, 1, 1, 6)
    pad[..., :4] = torch.finfo(torch.float16).min
    d = run(q, k, pad, causal=True, mask_value="min", dtypes=("fp16",))
    expected = sum(1 for qi in range(6) for key in range(6) if key < 4 and key > qi)
    assert d.attention.dtypes["fp16"].summed_planes_overflow == expected == 6
    assert "summed_mask_planes" in codes(d)


def test_minus_1e9_is_not_representable_in_fp16():
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    d = run(q, k, causal=True, mask_value="-1e9")
    assert d.attention.dtypes["fp16"].sentinel_not_representable
    assert not d.attention.dtypes["fp32"].sentinel_not_representable
    f = next(f for f in d.findings if f.code == "sentinel_not_representable")
    assert "fp16" in f.message and "-1e9" in f.message.replace("-1000000000.0", "-1e9")


def test_minus_1e4_mask_leaks():
    # Unscaled scores: the masked key's score is 1e4 + 3, the others 0. Adding -1e4 leaves
    # 3, so the float64 softmax gives it e^3 / (e^3 + 3) of the mass.
    q = torch.zeros(1, 1, 1, 2)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 4, 2)
    k[0, 0, 0, 0] = 1e4 + 3
    mask = torch.tensor([False, True, True, True])  # True = attend: key 0 is masked
    d = run(q, k, mask, scale="none", mask_value="-1e4", dtypes=("fp32",))
    assert "mask_leak" in codes(d)
    assert d.attention.leak_max == pytest.approx(math.exp(3) / (math.exp(3) + 3), rel=1e-9)
    clean = run(q, k, mask, scale="none", mask_value="-inf", dtypes=("fp32",))
    assert "mask_leak" not in codes(clean) and clean.attention.leak_max == 0


@pytest.mark.parametrize("convention", ["attend", "ignore"])
def test_fully_masked_padding_rows_under_each_convention(convention):
    q, k = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    attend = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    attend[1, :, 2, :] = False  # batch 1, query 2: a padding query that may attend to nothing
    mask = attend if convention == "attend" else ~attend
    d = run(q, k, mask, mask_convention=convention, dtypes=("fp32",))
    assert d.cell("stable", "fp32").nan_causes == {"fully_masked": 1}
    assert d.cell("naive", "fp32").nan_causes == {"fully_masked": 1}
    for p in ("sdpa-math", "flash"):  # both give zeros for a query that may attend to nothing
        assert d.cell(p, "fp32").zero_causes == {"fully_masked": 1}
    assert d.cell("stable", "fp32").examples["nan:fully_masked"] == [(1, 0, 2)]
    finite = run(q, k, mask, mask_convention=convention, mask_value="min", dtypes=("fp32",))
    assert finite.cell("stable", "fp32").nan_rows == 0  # finfo.min: a finite uniform row


def test_a_minus_1e4_mask_given_three_ways_masks_the_same_rows():
    """Causal + left padding of 3 as an additive float mask of -1e4, as a boolean mask with
    --mask-value -1e4, and as --causal --pad-left: the float mask marks its masked keys from
    the mask (a score of +2 plus -1e4 sits above -1e4, and is still masked)."""
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 2, 6, 16, generator=g) * 2, torch.randn(2, 2, 6, 16, generator=g) * 2
    key, query = torch.arange(6).view(1, 6), torch.arange(6).view(6, 1)
    masked = (key > query) | (key < 3)  # (6, 6): True = masked, the same for each batch element and head
    expected_rows = 2 * 2 * int(masked.all(dim=-1).sum())  # queries 0..2 of each (batch, head): 12
    assert expected_rows == 12
    scores = (q.double() @ k.double().transpose(-1, -2)) / 4
    assert bool(
        (scores[..., :3, :][masked[:3].expand(2, 2, 3, 6)] > 0).any()
    )  # the case: masked keys above -1e4 after adding it
    float_mask = torch.where(masked, -1e4, 0.0)
    ways = {
        "float": run(q, k, float_mask),
        "bool": run(q, k, ~masked, mask_value="-1e4"),
        "flags": run(q, k, causal=True, pad_left=[3, 3], mask_value="-1e4"),
    }
    # The fp16 scores the model computes, in numpy: q, k rounded to fp16, float32 products rounded
    # to fp16, times 1/4 and plus -1e4 in fp16; their exps in float64 against fp16's limits.
    qn, kn = q.numpy().astype(np.float16).astype(np.float32), k.numpy().astype(np.float16).astype(np.float32)
    s16 = (np.matmul(qn, np.swapaxes(kn, -1, -2)).astype(np.float16) * np.float16(0.25)) + float_mask.numpy().astype(
        np.float16
    )
    e = np.exp(s16.astype(np.float64)).reshape(-1, 6)
    rows_over = int((e >= 65520).any(axis=-1).sum())
    rows_under = int((e <= 2.0**-25).all(axis=-1).sum())  # exps at or below half the smallest subnormal round to 0
    assert rows_under >= expected_rows
    for name, d in ways.items():
        fp16 = next(h for h in d.census.headroom if h.dtype == "fp16")
        assert (fp16.rows_over_exp_threshold, fp16.rows_all_underflow) == (rows_over, rows_under), name
        assert d.census.fully_masked_rows == expected_rows, name
        assert d.census.masked == 2 * 2 * int(masked.sum()), name
        assert d.cell("naive", "fp16").nan_causes.get("fully_masked") == expected_rows, name
        assert "underflow" not in d.cell("naive", "fp16").nan_causes, name
        assert d.cells == ways["float"].cells, name  # causes, counts and errors alike
        assert "fully_masked_rows" in codes(d), name


def test_causal_matches_sdpa_is_causal_alignment():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
    v = torch.eye(5, dtype=torch.float64).reshape(1, 1, 5, 5)  # output = attention probabilities
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    inp = prepare_inputs(q, k, causal=True)
    block = next(score_blocks(inp, 100, torch.device("cpu"), start_audit(inp)))
    ours = torch.softmax(block.given, dim=-1)
    assert torch.allclose(ours, expected.reshape(3, 5), atol=1e-12)


def test_float_mask_of_zeros_and_ones_is_flagged():
    q, k = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    d = run(q, k, torch.tensor([1.0, 1.0, 0.0]), dtypes=("fp32",))
    assert "float_mask_looks_boolean" in codes(d)


# --------------------------------------------------------------------------- scale


def iid_qk(d, rows=64, seed=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, rows, d, generator=g), torch.randn(1, 2, rows, d, generator=g)


def test_missing_scale_at_d_256():
    q, k = iid_qk(256)
    assert "missing_scale" in codes(run(q, k, scale="none", dtypes=("fp32",)))
    assert not {"missing_scale", "double_scale"} & codes(run(q, k, scale="auto", dtypes=("fp32",)))
    assert "double_scale" in codes(run(q, k, scale="dk", dtypes=("fp32",)))


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (rotate-half form, base 10000) over the token axis."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64).view(-1, 1) * inv  # (t, d/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def real_shaped_qk(kind: str, d: int = 256, t: int = 64):
    """q and k the way real layers make them, not i.i.d.: low rank, outlier channels, RoPE, ReLU zeros."""
    g = torch.Generator().manual_seed(8)
    if kind in ("low_rank", "rope"):  # N(0, 1)^(t x 8) @ W^T, W (d x 8); RoPE rotates them by position
        w = torch.randn(d, 8, generator=g)
        q, k = torch.randn(1, 2, t, 8, generator=g) @ w.T, torch.randn(1, 2, t, 8, generator=g) @ w.T
        return (rope(q), rope(k)) if kind == "rope" else (q, k)
    q, k = torch.randn(1, 2, t, d, generator=g), torch.randn(1, 2, t, d, generator=g)
    if kind == "outlier_channels":
        q[..., :4] *= 30
        k[..., :4] *= 30
    elif kind == "sparse":  # about half the entries exact zeros (ReLU-like)
        q = q.masked_fill(torch.rand(q.shape, generator=g) < 0.48, 0.0)
        k = k.masked_fill(torch.rand(k.shape, generator=g) < 0.48, 0.0)
    return q, k


@pytest.mark.parametrize("kind", ["low_rank", "outlier_channels", "rope", "sparse"])
def test_scale_findings_follow_the_scale_applied_not_the_shape_of_q_and_k(kind):
    q, k = real_shaped_qk(kind)
    d = run(q, k, dtypes=("fp32",), methods=("torch",))  # the default scale, 1/sqrt(256) = 1/16
    # The scores are q.k / 16 exactly: the independent float64 product and the pipeline's agree.
    block = next(score_blocks(d_inp := prepare_inputs(q, k), 1 << 20, torch.device("cpu"), start_audit(d_inp)))
    assert torch.allclose(
        block.given, ((q.double() @ k.double().transpose(-1, -2)) / 16).reshape(-1, 64), rtol=1e-12, atol=0
    )
    assert not {"missing_scale", "double_scale"} & codes(d), [f.message for f in d.findings]
    f = next(
        f for f in run(q, k, scale="none", dtypes=("fp32",), methods=("torch",)).findings if f.code == "missing_scale"
    )
    assert "q.k times 1 (the scale applied, --scale none on the scores): 16 x 1/sqrt(d_k)" in f.message
    assert "double_scale" in codes(run(q, k, scale="dk", dtypes=("fp32",), methods=("torch",)))


def test_float_mask_of_fp16_min_is_reported_as_the_mask_holds_it():
    # An explicit additive mask of finfo(fp16).min: "mask value -65504" (not -inf), in the JSON
    # fields too, its overflow on add with a negative score named by that value, and fully
    # masked rows quoting -65504, not a score plus it.
    q, k = negative_scores()
    mask = torch.zeros(8, 8)
    mask[~torch.ones(8, 8, dtype=torch.bool).tril()] = -FP16_MAX
    mask[0] = -FP16_MAX  # query 0 attends to nothing
    d = run(q, k, mask, dtypes=("fp16", "fp32"))
    a = d.attention
    assert a.mask_value == "-65504.0" and a.float_mask_value == -65504.0
    assert a.dtypes["fp16"].sentinel_value == -65504.0 and a.dtypes["fp16"].mask_values == [-65504.0]
    assert a.dtypes["fp32"].mask_values == [-65504.0]
    f = next(f for f in d.findings if f.code == "sentinel_overflow_on_add")
    assert "mask value -65504 plus a negative score" in f.message and "-inf plus" not in f.message
    g = next(f for f in d.findings if f.code == "fully_masked_rows")
    assert "with a finite sentinel, mask value -65504" in g.message


def test_scores_given_with_q_and_k_get_the_pipeline_audit():
    # The same scores, from a file beside --q/--k: the Q/K pipeline table, max|q.k|, masked
    # keys and the qk_overflow finding are those of the Q/K run.
    q, k = outlier_qk()
    alone = run(q, k, causal=True, dtypes=("fp16",), methods=("stable",))
    scores = torch.where(
        torch.ones(8, 8, dtype=torch.bool).tril(), (q.double() @ k.double().transpose(-1, -2)) / 8, -math.inf
    )
    given = diagnose_attention(
        "s", prepare_inputs(q, k, causal=True), Options(dtypes=("fp16",), methods=("stable",)), scores=scores
    )
    a, b = alone.attention, given.attention
    assert b.raw_max_abs == a.raw_max_abs == 576.0 * 382.0
    assert b.masked_keys == a.masked_keys == 28
    assert b.dtypes["fp16"].qk_overflow_values == a.dtypes["fp16"].qk_overflow_values == 1
    assert "qk_overflow" in codes(given)
    assert given.cell("stable", "fp16").nan_rows == 0  # the given scores themselves are finite in fp16 after scaling


def test_scale_mismatch_fits_the_scale_of_given_scores():
    q, k = iid_qk(64)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(64 * 2)  # divided by sqrt(d_model)
    d = diagnose_attention(
        "s", prepare_inputs(q, k), Options(dtypes=("fp32",), methods=("stable",)), scores=scores.float()
    )
    assert d.attention.fitted_scale == pytest.approx(1 / math.sqrt(128), rel=1e-5)
    f = next(f for f in d.findings if f.code == "scale_mismatch")
    assert "1/sqrt(d_model)" in f.message
    right = (q.double() @ k.double().transpose(-1, -2)) / 8
    ok = diagnose_attention(
        "s", prepare_inputs(q, k), Options(dtypes=("fp32",), methods=("stable",)), scores=right.float()
    )
    assert "scale_mismatch" not in codes(ok)


def test_fitted_scale_reads_the_scores_in_row_blocks():
    """Blocks of 3 rows (not dividing 8 queries per head), GQA, a masked and a noisy score:
    the fit equals least squares over every usable score, computed here in one go."""
    from attncheck.loaders import memory_source
    from attncheck.numerics.inputs.scores import fit_scale

    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 4, 8, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    raw = q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)  # (2, 4, 8, 5)
    scores = raw * 0.3 + 0.01 * torch.randn(raw.shape, generator=g, dtype=torch.float64)
    scores[0, 1, 2, 3] = -1e9  # a mask sentinel: left out of the fit
    scores[1, 3, 7, 0] = float("-inf")
    use = torch.isfinite(scores) & (scores > -1e4)
    want = float((scores[use] * raw[use]).sum() / (raw[use] ** 2).sum())
    inputs = prepare_inputs(q, k)
    for rows in (1, 3, 8, 64):
        assert fit_scale(memory_source("s", scores), inputs, rows) == pytest.approx(want, rel=1e-13), rows


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "q_shape,k_shape,mask,message",
    [
        ((1, 2, 4, 8), (1, 2, 4, 16), None, "q and k have different head dims"),
        ((1, 3, 4, 8), (1, 2, 4, 8), None, "k has 2 heads, which does not divide q's 3 heads"),
        ((1, 2, 4, 8), (1, 2, 4, 8), torch.ones(3, 5, dtype=torch.bool), r"mask of shape \(3, 5\) does not broadcast"),
        ((1, 2, 4, 8), (1, 2, 4, 8), torch.ones(4, 4, dtype=torch.int64), "mask has dtype int64; use a boolean mask"),
    ],
)
def test_bad_inputs(q_shape, k_shape, mask, message):
    with pytest.raises(AttncheckError, match=message):
        prepare_inputs(torch.zeros(q_shape), torch.zeros(k_shape), mask)


def test_cli_qk_end_to_end_and_bad_inputs(tmp_path):
    q, k = outlier_qk()
    torch.save({"q": q, "k": k, "k16": torch.zeros(1, 1, 8, 16)}, tmp_path / "qk.pt")
    vs = tmp_path / "v.pt"
    torch.save(
        {
            "v": torch.randn(1, 1, 8, 32),
            "v7": torch.randn(1, 1, 7, 64),
            "v2h": torch.randn(1, 2, 8, 64),
            "vint": torch.ones(1, 1, 8, 64, dtype=torch.int32),
        },
        vs,
    )
    torch.save(torch.ones(8, 8, dtype=torch.int64), tmp_path / "intmask.pt")
    torch.save(torch.randn(2, 8, 8), tmp_path / "scores.pt")
    p = tmp_path / "qk.pt"
    r = runner.invoke(
        app, ["run", "--q", f"{p}:q", "--k", f"{p}:k", "--dtype", "fp16", "--fail-on", "qk_overflow", "--brief"]
    )
    assert r.exit_code == 1, r.output
    assert "qk_overflow" in r.stdout
    r = runner.invoke(
        app,
        [
            "run",
            "--q",
            f"{p}:q",
            "--k",
            f"{p}:k",
            "--dtype",
            "fp16",
            "--scale-order",
            "q",
            "--method",
            "stable,tiled,torch",
            "--fail-on",
            "nan,qk_overflow",
            "--brief",
        ],
    )
    assert r.exit_code == 0, r.output
    for args, line in [
        (
            ["--q", f"{p}:q", "--k", f"{p}:k16"],
            "q and k have different head dims: q (1, 1, 8, 64) has d = 64, k (1, 1, 8, 16) has d = 16",
        ),
        (["--q", f"{p}:q"], "--q and --k go together: give both"),
        (["--causal", str(p)], "--causal applies to scores computed from --q and --k, which are not given" + HINT),
        (
            ["--mask", str(p), "--pad-left", "1", str(p)],
            "--mask, --pad-left apply to scores computed from --q and --k, which are not given" + HINT,
        ),
        (
            [str(p), "--mask-value", "garbage"],
            "--mask-value: unknown value 'garbage' (use -inf, min or a negative number)",
        ),
        (
            [str(p), "--scale", "garbage"],
            "--scale must be one of none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, dk2 = 1/d_k^2 or a "
            "positive number, got 'garbage'",
        ),
        (
            [str(p), "--scale", "0.125", "--mask-value", "min"],
            "--scale, --mask-value apply to scores computed from --q and --k, which are not given" + HINT,
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--mask-value", "min"],
            "--mask-value is what keys masked by a boolean --mask, --causal or --pad-left/--pad-right become; none "
            "is given",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--mask-convention", "ignore"],
            "--mask-convention applies to a boolean --mask, which is not given",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--key", "q"],
            "--key selects tensors inside score files, and none is given; pick q and k inside files with --q PATH:KEY",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--mask", str(tmp_path / "intmask.pt")],
            f"{tmp_path / 'intmask.pt'} has dtype int64; use a boolean mask (True = attend; --mask-convention ignore "
            "for True = masked) or an additive float mask",
        ),
        (
            ["--q", str(p), "--k", f"{p}:k"],
            f"--q {p} selects 3 tensors ({p}:q, {p}:k, {p}:k16); pick one with --q PATH:KEY",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--scale", "fast"],
            "--scale must be one of none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, dk2 = 1/d_k^2 or a "
            "positive number, got 'fast'",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--mask-value", "5"],
            "--mask-value must be negative (a mask lowers the masked scores), got '5'",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--pad-left", "2,x"],
            "--pad-left: 'x' is not a non-negative integer (give one length per batch element, e.g. 3,0)",
        ),
        (["--q", f"{p}:q", "--k", f"{p}:k", "--pad-left", "2,1"], "--pad-left gives 2 lengths for a batch of 1"),
        (["--v", f"{vs}:v", str(p)], "--v applies to attention computed from --q and --k"),
        (
            ["--path", "flash", "--example"],
            "--path applies to attention calls (a capture, q/k files) and to --q/--k, not to the built-in example's "
            "scores",
        ),
        (
            ["--path", "flash", str(tmp_path / "scores.pt")],
            f"--path applies to attention calls (a capture, q/k files) and to --q/--k; {tmp_path / 'scores.pt'} "
            "holds scores only",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--path", "flash,xformers"],
            "--path: unknown path 'xformers' (choose from eager, sdpa-math, flash, fa2, fa2-fma, fa3, mem-efficient, "
            "cudnn, flash-fp8, fa4, sage, flex, flex-math)",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--path", ""],
            "--path is empty (choose from eager, sdpa-math, flash, fa2, fa2-fma, fa3, mem-efficient, cudnn, flash-fp8, "
            "fa4, sage, flex, flex-math)",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--v", f"{vs}:v7"],
            "v (1, 1, 7, 64) does not match k (1, 1, 8, 64): v needs k's batch and head axes and its 8 tokens (the "
            "last axis, the value dimension, may differ)",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--v", f"{vs}:v2h"],
            "v (1, 2, 8, 64) does not match k (1, 1, 8, 64): v needs k's batch and head axes and its 8 tokens (the "
            "last axis, the value dimension, may differ)",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--v", f"{vs}:vint"],
            f"{vs}:vint has dtype int32; attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)",
        ),
        (
            ["--q", f"{p}:q", "--k", f"{p}:k", "--v", f"{tmp_path / 'missing.pt'}"],
            f"{tmp_path / 'missing.pt'}: no such file or directory",
        ),
    ]:
        r = runner.invoke(app, ["run", *args])
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr.strip() == f"attncheck: error: {line}", args


def test_cli_v_adds_the_output_table_and_json(tmp_path):
    q, k = outlier_qk()
    v = torch.randn(1, 1, 8, 32)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "qkv.pt")
    p = tmp_path / "qkv.pt"
    r = runner.invoke(
        app,
        [
            "run",
            "--q",
            f"{p}:q",
            "--k",
            f"{p}:k",
            "--v",
            f"{p}:v",
            "--dtype",
            "bf16",
            "--method",
            "torch",
            "--json",
            "-",
        ],
    )
    assert r.exit_code == 0, r.output
    cells = {c["name"]: c for c in json.loads(r.stdout)["tensors"][0]["cells"]}
    assert list(cells) == ["eager:torch/bf16", "sdpa-math/bf16", "flash/bf16"]
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, dim=-1) @ v.double()
    with sdpa_kernel([SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).double()
    c = cells["sdpa-math/bf16"]
    assert c["path"] == "sdpa-math" and c["out_rows"] == 8 and c["out_nan_rows"] == 0
    assert c["out_rmse"] == pytest.approx(float((o - exact).pow(2).mean().sqrt()), rel=1e-9)
    r = runner.invoke(
        app,
        [
            "run",
            "--q",
            f"{p}:q",
            "--k",
            f"{p}:k",
            "--v",
            f"{p}:v",
            "--dtype",
            "bf16",
            "--method",
            "torch",
            "--path",
            "flash",
            "--brief",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "Output O = P@V against float64" in r.stdout and "flash/bf16" in r.stdout and "eager:" not in r.stdout


def test_masks_are_held_at_their_own_size_and_read_the_same_as_expanded():
    """A (T, T) boolean mask over many heads, a causal mask and padding stay planes of their own size
    (broadcast views stand for the planes over every score): the diagnosis equals the one of the same
    masks expanded over every score, and what is held does not grow with the heads."""
    g = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 4, 24, 8
    q, k = torch.randn(b, h, t, d, generator=g) * 3, torch.randn(b, h, t, d, generator=g) * 3
    keep = torch.rand(t, t, generator=g) > 0.3
    keep[:, 0] = True
    inp = prepare_inputs(q, k, keep, causal=True, pad_left=[3, 0])
    assert inp.masked.shape == (b, h, t, t) and inp.masked.untyped_storage().nbytes() <= b * t * t  # not b * h * t * t
    expanded = prepare_inputs(q, k, keep.expand(b, h, t, t).contiguous(), causal=True, pad_left=[3, 0])
    opts = Options(
        dtypes=("fp16", "fp32"), methods=("stable", "torch"), chunk_elements=40 * t
    )  # blocks of 27 rows: cut across heads
    a, e = diagnose_attention("m", inp, opts), diagnose_attention("m", expanded, opts)
    assert a.census == e.census and [c.max_abs_err for c in a.cells] == [c.max_abs_err for c in e.cells]
    assert a.attention.masked_keys == e.attention.masked_keys > 0
    floats = torch.where(keep, 0.0, -1e4).to(torch.float16)
    inp_f = prepare_inputs(q, k, floats)
    assert inp_f.mask_float.untyped_storage().nbytes() <= 8 * t * t
    assert (
        diagnose_attention("f", inp_f, opts).census
        == diagnose_attention("f", prepare_inputs(q, k, floats.expand(b, h, t, t).contiguous()), opts).census
    )


def test_what_the_inputs_hold_is_measured_at_the_masks_own_size():
    q = torch.ones(1, 64, 256, 4)
    prepare_inputs(
        q, q, torch.ones(256, 256, dtype=torch.bool), causal=True, max_bytes=2 << 20
    )  # 1 MiB of q, k and two 64 KiB planes
    with pytest.raises(AttncheckError, match=r"need 1.125 MiB in float64, over max_memory 1 MiB"):
        prepare_inputs(q, q, torch.ones(256, 256, dtype=torch.bool), causal=True, max_bytes=1 << 20)
