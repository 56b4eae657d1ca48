"""RoPE tables in a dtype against float64 and torch's own casts: the published facts (huggingface/candle PR 3520,
ml-explore/mlx-lm PR 1076) and the closed form of the first position a dtype no longer tells apart."""

from __future__ import annotations

import math

import pytest
import torch

from attncheck.numerics.rope import (
    angle_error,
    audit_table,
    first_inexact_position,
    first_infinite_position,
    inverse_frequencies,
    model_inverse_frequencies,
    model_table,
    predicted_first_indistinct,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def test_inverse_frequencies_are_theta_to_the_minus_2j_over_d():
    exact = inverse_frequencies(500_000, 128)
    assert exact.dtype == torch.float64 and exact.shape == (64,)
    assert [float(v) for v in exact[[0, 1, 63]]] == pytest.approx(
        [1.0, 500_000 ** (-2 / 128), 500_000 ** (-126 / 128)], rel=1e-15
    )
    # transformers' fp32 inverse frequencies are the exact ones to fp32's rounding (a few ulps: pow, then 1/x)
    assert torch.allclose(model_inverse_frequencies(500_000, 128).double(), exact, rtol=4 * 2.0**-24, atol=0)


def test_candle_3520_position_15962_in_a_bf16_table():
    """Positions cast to bf16 before the product (candle's qwen2 RotaryEmbedding before PR 3520): 15,962 rounds to
    15,936, torch's own cast agrees, and the highest frequency's row is cos(15936), not cos(15962).

    The PR also names 15,968 as a neighbour ("16-step granularity"); bf16's spacing in [8192, 16384) is 64, so the
    neighbours are 15,936 and 16,000, and 15,968 is not a bf16 value. Its cosines (-0.547, -0.882) are not float64's
    either: float64 gives cos(15962) = -0.908 and cos(15936) = -0.268."""
    assert torch.tensor(15962.0).bfloat16().item() == 15936.0
    assert torch.tensor(15968.0).bfloat16().item() != 15968.0
    assert torch.tensor([15936.0, 16000.0]).bfloat16().tolist() == [15936.0, 16000.0]
    inv = model_inverse_frequencies(10_000, 128)
    cos, sin = model_table(torch.tensor([15962]), inv, torch.bfloat16, torch.bfloat16)
    assert cos.dtype == torch.bfloat16
    assert cos[0, 0].item() == torch.tensor(math.cos(15936)).bfloat16().item()
    assert abs(cos[0, 0].item() - math.cos(15962)) > 0.6  # the table's cosine is unrelated to the position's
    err = angle_error(cos, sin, torch.tensor([[15962.0]], dtype=torch.float64) * inverse_frequencies(10_000, 128))
    assert abs(err[0, 0].item()) == pytest.approx(abs(math.remainder(15936 - 15962, 2 * math.pi)), abs=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_first_inexact_position_is_torchs_first_rounded_integer(dtype):
    n = first_inexact_position(dtype)
    below = torch.arange(max(0, n - 4096), n, dtype=torch.float64)
    assert torch.equal(below.to(dtype).double(), below)  # every integer below n is exact
    assert torch.tensor(float(n), dtype=torch.float64).to(dtype).item() == n - 1  # n rounds (to even) onto n - 1
    assert n == {torch.float16: 2049, torch.bfloat16: 257, torch.float32: 16_777_217}[dtype]


def test_fp16_positions_become_inf_from_65520():
    n = first_infinite_position(torch.float16)
    assert n == 65520
    assert math.isinf(torch.tensor(float(n)).half().item()) and torch.tensor(float(n - 1)).half().item() == 65504
    audit = audit_table(10_000, 64, torch.float16, torch.float16, context=65_530, start=65_500)
    assert audit.first_nonfinite == 65520


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("theta", "head_dim"), [(10_000, 128), (500_000, 128), (1_000_000, 64), (10_000, 8)])
def test_closed_form_first_indistinct_position_matches_the_table(compute, theta, head_dim):
    """The vectorised table over every position up to 4,096 finds the first repeated row where the closed form
    says (positions held in the dtype: 2^bits + 1)."""
    audit = audit_table(theta, head_dim, compute, compute, context=4096)
    assert audit.first_indistinct == predicted_first_indistinct(compute) == first_inexact_position(compute)
    assert audit.max_angle_error > 1.0  # whole radians off: positions rounded by up to half their spacing


def test_fp32_positions_repeat_first_at_2_to_the_24_plus_1():
    audit = audit_table(500_000, 128, torch.float32, torch.float32, context=(1 << 24) + 8, start=(1 << 24) - 8)
    assert audit.first_indistinct == (1 << 24) + 1 == predicted_first_indistinct(torch.float32)


@pytest.mark.parametrize("table", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_table_cast_to_16_bits_keeps_positions_and_bounds_the_angle(table):
    """transformers' recipe (fp32 angles, cos/sin cast to the activations' dtype): no position repeats, and the
    angle error is at most the rounding of a unit vector (each of cos, sin off by half an ulp of [0.5, 1): the angle
    by at most sqrt(2) of that) plus fp32's product (at most half an ulp of 4096, and inv_freq's few ulps)."""
    audit = audit_table(500_000, 128, torch.float32, table, context=4096)
    assert audit.first_indistinct is None and audit.indistinct_positions == 0
    half_ulp = torch.finfo(table).eps / 4  # half an ulp of values in [0.5, 1)
    bound = math.asin(math.sqrt(2) * half_ulp) + 4096 * 4 * 2.0**-24 + 2.0**-12
    assert 0 < audit.max_angle_error <= bound


def test_mlx_lm_1076_fp16_rotation_alone_keeps_positions_beyond_262k():
    """mlx-lm PR 1076 (closed) says that past 262k tokens fp16 rotation makes adjacent positions identical, with the
    frequencies in fp32. Rotating in fp16 rounds cos and sin to fp16, and the highest frequency still turns one radian
    per position: adjacent rows stay distinct there (qwen3-next: theta 1e7, 64 rotary dims). What does fail in fp16
    is holding the positions in it: they repeat from 2,049 and are inf from 65,520."""
    start = 262_144 - 64
    rotated = audit_table(
        1e7, 64, torch.float32, torch.float32, context=start + 128, start=start, rotation=torch.float16
    )
    assert rotated.first_indistinct is None and rotated.first_nonfinite is None
    held = audit_table(1e7, 64, torch.float16, torch.float16, context=start + 128, start=start)
    assert held.first_nonfinite == start and held.first_indistinct == start + 1


def test_angle_error_wraps_and_is_nan_where_not_finite():
    ref = torch.tensor([[0.0, 2 * math.pi - 0.1, 0.0]], dtype=torch.float64)
    cos = torch.tensor([[math.cos(0.2), 1.0, float("nan")]])
    sin = torch.tensor([[math.sin(0.2), 0.0, 0.0]])
    err = angle_error(cos, sin, ref)
    assert err[0, 0].item() == pytest.approx(0.2, abs=1e-7) and err[0, 1].item() == pytest.approx(0.1, abs=1e-7)
    assert math.isnan(err[0, 2].item())


def _layout(cos, sin):
    return torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # transformers' layout, (1, T, d)


def _true_angle_error(cos, sin, theta, positions):
    """The table's largest |angle error| against float64 angles of theta, written out here independently."""
    d = 2 * cos.shape[-1]
    inv = torch.tensor([theta ** (-2 * j / d) for j in range(d // 2)], dtype=torch.float64)
    ref = positions.double()[:, None] * inv[None, :]
    got = torch.atan2(sin.double(), cos.double())
    return float(((got - ref + math.pi) % (2 * math.pi) - math.pi).abs().max())


def test_check_table_fits_theta_and_judges_a_clean_table_clean():
    """No config recorded: theta fitted to the table; an fp32 table is judged within fp32's rounding."""
    from attncheck.numerics.rope import check_table

    inv = model_inverse_frequencies(500_000, 64)
    cos, sin = model_table(torch.arange(2048), inv, torch.float32, torch.float32)
    found = check_table(*_layout(cos, sin), positions=None, theta=None, tolerance=0.05)
    assert found["theta_from"] == "fitted" and found["theta"] == 500_000
    assert found["positions_from"] == "assumed" and found["first_affected"] is None
    assert found["first_indistinct"] is None and found["max_angle_error"] < 2048 * 2.0**-22
    assert found["theta_fit_last"] == 2047 and found["theta_fit_error"] == pytest.approx(
        _true_angle_error(cos, sin, 500_000, torch.arange(2048)), rel=1e-6
    )
    bf16 = model_table(torch.arange(2048), inv, torch.bfloat16, torch.bfloat16)
    bad = check_table(*_layout(*bf16), None, 500_000.0, 0.05)
    assert bad["first_indistinct"] == 257 and bad["theta_from"] == "config"


@pytest.mark.parametrize("table", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("theta", "head_dim"), [(10_000, 128), (500_000, 64), (1_000_000, 128), (75_000, 16)])
def test_fitted_theta_never_judges_transformers_recipe_wrong(table, theta, head_dim):
    """fp32 angles cast to bf16/fp16 (transformers' recipe), no config: the fit is theta itself (main fitted
    495,730 from one bf16 entry raised to d/2 for theta 500,000, d 64, and warned 0.483 rad on a table 0.00275 rad
    off), and the error judged is the table's own against float64 of the true theta."""
    from attncheck.numerics.rope import check_table

    positions = torch.arange(3000)
    cos, sin = model_table(positions, model_inverse_frequencies(theta, head_dim), torch.float32, table)
    found = check_table(*_layout(cos, sin), None, None, 0.05)
    assert found["theta"] == theta and found["theta_from"] == "fitted" and found["theta_fit_last"] == 2999
    true = _true_angle_error(cos, sin, theta, positions)
    assert found["first_affected"] is None and found["first_indistinct"] is None
    assert found["max_angle_error"] == pytest.approx(true, rel=1e-6) and true < 0.01


def test_fitted_theta_that_is_not_round_is_fitted_not_snapped():
    from attncheck.numerics.rope import fitted_theta

    positions = torch.arange(4096)
    cos, sin = model_table(positions, model_inverse_frequencies(12_345.6, 64), torch.float32, torch.bfloat16)
    fit = fitted_theta(cos, sin, positions)
    assert fit.theta == pytest.approx(12_345.6, rel=1e-5) and fit.theta != 12_300 and fit.last_position == 4095
    assert fit.residual == pytest.approx(_true_angle_error(cos, sin, fit.theta, positions), rel=1e-9)
    assert fit.residual < 0.01


def test_fitted_theta_does_not_absorb_a_planted_error():
    """A correct table whose frequency 3 is off by 0.2 rad from position 1,500: the fit stops before it (through
    1,024) and the finding names position 1,500 and the planted error."""
    from attncheck.numerics.rope import check_table

    theta, d, positions = 500_000, 64, torch.arange(4096)
    ref = positions.double()[:, None] * inverse_frequencies(theta, d)[None, :]
    ref[1500:, 3] += 0.2
    cos, sin = ref.cos().float().bfloat16(), ref.sin().float().bfloat16()
    found = check_table(*_layout(cos, sin), None, None, 0.05)
    assert found["theta"] == theta and found["theta_fit_last"] < 1500
    assert found["first_affected"] == 1500 and found["affected_positions"] == 4096 - 1500
    assert found["max_angle_error"] == pytest.approx(_true_angle_error(cos, sin, theta, positions), rel=1e-6)
    assert 0.19 < found["max_angle_error"] < 0.21


@pytest.mark.parametrize(("theta", "head_dim"), [(10_000, 64), (500_000, 128), (1_000_000, 64)])
def test_fitted_theta_on_candles_bf16_table_names_the_right_positions(theta, head_dim):
    """Everything in bf16 (candle's qwen2 before PR 3520), no config: 257 repeats 256, and the first position past
    the tolerance is the one float64 of the true theta gives."""
    from attncheck.numerics.rope import check_table

    positions = torch.arange(4096)
    inv = model_inverse_frequencies(theta, head_dim)
    cos, sin = model_table(positions, inv, torch.bfloat16, torch.bfloat16)
    found = check_table(*_layout(cos, sin), None, None, 0.05)
    d = head_dim
    ref = positions.double()[:, None] * torch.tensor([theta ** (-2 * j / d) for j in range(d // 2)]).double()
    err = ((torch.atan2(sin.double(), cos.double()) - ref + math.pi) % (2 * math.pi) - math.pi).abs()
    assert found["first_indistinct"] == 257
    assert found["first_affected"] == int((err.max(-1).values > 0.05).nonzero()[0, 0])
    assert found["theta"] == pytest.approx(theta, rel=0.01)


def test_a_table_not_finite_reports_the_positions_not_a_finite_angle_error():
    """cos/sin NaN from position 100 on: the audit names the non-finite positions and gives no angle error (main
    gave the error of the finite entries)."""
    from attncheck.numerics.rope import check_table

    positions = torch.arange(300)
    cos, sin = model_table(positions, model_inverse_frequencies(10_000, 32), torch.float32, torch.float32)
    cos[100:, 5] = float("nan")
    found = check_table(*_layout(cos, sin), None, 10_000.0, 0.05)
    assert found["first_nonfinite"] == 100 and found["nonfinite_positions"] == 200
    assert found["max_angle_error"] is None and found["first_affected"] == 100 and found["affected_positions"] == 200
    audit = audit_table(1e-300, 128, torch.float32, torch.float32, context=1000)
    # 1e-300 is 0 in fp32: every inverse frequency but the first is inf, so no position has an angle at all
    assert bool(torch.isinf(model_inverse_frequencies(1e-300, 128)[1:]).all())
    assert audit.first_nonfinite == 0 and audit.nonfinite_positions == 1000
    assert audit.max_angle_error is None and audit.rms_angle_error is None


def test_fitted_theta_of_a_table_that_is_no_thetas_is_finite_or_none():
    """Random unit vectors (no theta at all), and a first angle that would need theta = e^22,000: no crash, no NaN."""
    from attncheck.numerics.rope import check_table, fitted_theta

    angles = torch.rand(500, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 6
    fit = fitted_theta(angles.cos(), angles.sin(), torch.arange(500))
    assert fit is None or (math.isfinite(fit.theta) and fit.theta > 0 and fit.last_position >= 1)
    angles[1, 1] = 1e-300
    assert fitted_theta(angles.cos(), angles.sin(), torch.arange(500)) is None
    found = check_table(*_layout(angles.cos(), angles.sin()), None, None, 0.05)
    assert not found["judged"] and "theta unknown" in found["note"]
