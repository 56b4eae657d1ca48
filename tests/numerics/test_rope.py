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


def test_check_table_fits_theta_from_position_1_and_judges_a_clean_table_clean():
    """No config recorded: theta from the angle of frequency 1 at position 1 (theta^(-2/d) radians)."""
    from attncheck.numerics.rope import check_table

    inv = model_inverse_frequencies(500_000, 64)
    cos, sin = model_table(torch.arange(2048), inv, torch.float32, torch.float32)
    table = (torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None])  # transformers' layout, (1, T, d)
    found = check_table(*table, positions=None, theta=None, tolerance=0.05)
    assert found["theta_from"] == "fitted" and found["theta"] == pytest.approx(500_000, rel=1e-4)
    assert found["positions_from"] == "assumed" and found["first_affected"] is None
    assert found["first_indistinct"] is None and found["max_angle_error"] < 2048 * 2.0**-22
    bf16 = model_table(torch.arange(2048), inv, torch.bfloat16, torch.bfloat16)
    bad = check_table(
        torch.cat((bf16[0], bf16[0]), -1)[None], torch.cat((bf16[1], bf16[1]), -1)[None], None, 500_000.0, 0.05
    )
    assert bad["first_indistinct"] == 257 and bad["theta_from"] == "config"
