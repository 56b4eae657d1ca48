"""The rotated q and k of a recorded table's calls against float64, checked against vectors built by hand: turned by
float64 angles as transformers' apply_rotary_pos_emb (rotate_half) or GPT-J's rotate_every_two turns them, then
rounded, or turned by a table shifted by a known angle."""

from __future__ import annotations

import math

import pytest
import torch

from attncheck.findings.rope import ROPE_ANGLE_TOLERANCE, rope_findings
from attncheck.numerics.rope import table_checks
from attncheck.numerics.rope_qk import SCORE_SAMPLE, RotatedQK, implied_angle, relative_tolerance

THETA = 10_000.0


def angles_of(positions: torch.Tensor, r: int, theta: float = THETA) -> torch.Tensor:
    """(T, r/2) float64: p x theta^(-2j/r), the frequencies from Python's own pow."""
    inv = torch.tensor([theta ** (-2 * j / r) for j in range(r // 2)], dtype=torch.float64)
    return positions.to(torch.float64)[:, None] * inv


def table_of(angles: torch.Tensor, layout: str = "halves") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (1, T, r) as a model passes them: frequencies repeated in both halves, or in pairs."""
    emb = torch.cat((angles, angles), dim=-1) if layout == "halves" else angles.repeat_interleave(2, dim=-1)
    return emb.cos()[None], emb.sin()[None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "halves") -> torch.Tensor:
    """x (B, H, T, d) turned on its first r = cos.shape[-1] entries: x * cos + rotate_half(x) * sin (transformers),
    or with rotate_every_two (GPT-J); the rest passes through."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    if layout == "halves":
        turned = torch.cat((-xr[..., r // 2 :], xr[..., : r // 2]), dim=-1)
    else:
        turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((xr * cos[:, None] + turned * sin[:, None], rest), dim=-1)


def relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| / |want| per vector (B, H, T), in float64."""
    got, want = got.double(), want.double()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def draw(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def check(cos, sin, positions, q, k, theta=THETA):
    qk = RotatedQK(cos, sin, positions, theta)
    qk.add(0, q, k)
    return qk.result(ROPE_ANGLE_TOLERANCE)


@pytest.mark.parametrize("table_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("qk_dtype", [torch.bfloat16, torch.float16])
def test_exact_rotation_rounded_to_the_dtype_is_not_rope_error(table_dtype, qk_dtype):
    """q and k turned by float64 angles, then rounded to bf16 (fp16): the rounding is there (about 2^-9 of each
    vector against the exact rotation) and is not counted: it cancels in the comparison."""
    pos = torch.arange(100_000, 100_050)  # large angles: 1e5 radians at the highest frequency
    cos, sin = table_of(angles_of(pos, 16))
    q_un, k_un = draw(2, 4, 50, 16), draw(2, 2, 50, 16, seed=1)
    q_exact, k_exact = rotate(q_un, cos, sin), rotate(k_un, cos, sin)
    q, k = q_exact.to(qk_dtype), k_exact.to(qk_dtype)
    assert float(relative(q, q_exact).max()) > torch.finfo(qk_dtype).eps / 8  # rounded, visibly
    found = check(cos.to(table_dtype), sin.to(table_dtype), pos[None], q, k)
    floor = 1e-12 if table_dtype == torch.float64 else 4 * 2.0**-24  # the table's own rounding of cos and sin
    assert found.q.max_relative_error < floor and found.k.max_relative_error < floor
    assert found.q.first_affected is None and found.k.first_affected is None
    assert found.score_error < 2 * floor and found.q.rounding == torch.finfo(qk_dtype).eps / 2
    assert found.q.vectors == 2 * 4 * 50 and found.k.vectors == 2 * 2 * 50
    assert found.q.dtype == {torch.bfloat16: "bf16", torch.float16: "fp16"}[qk_dtype]


@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_a_table_shifted_by_a_known_angle_gives_that_angle_back(layout):
    """Every angle from position 40 on is off by 0.2 rad: the vectors are off by 2 sin(0.1) there and the check
    reads 0.2 rad back, from position 40; the scores of pairs on one side of 40 are unchanged (RoPE depends on the
    difference of the angles), those across it are off, as the same scores computed here say (keys at or before their
    query: the pairs every model sees)."""
    pos, shift, start = torch.arange(64), 0.2, 40
    exact = angles_of(pos, 16)
    off = exact + shift * (pos >= start).to(torch.float64)[:, None]
    cos, sin = table_of(off, layout)
    q_un, k_un = draw(1, 4, 64, 16), draw(1, 2, 64, 16, seed=1)
    q, k = rotate(q_un, cos, sin, layout), rotate(k_un, cos, sin, layout)
    found = check(cos, sin, pos[None], q, k)
    for v in (found.q, found.k):
        assert v.first_affected == start and v.affected_positions == 64 - start
        assert v.max_relative_error == pytest.approx(2 * math.sin(shift / 2), rel=1e-9)
        assert v.max_angle == pytest.approx(shift, rel=1e-9)
    # the scores: all 64 x 64 pairs are in the sample; the same scores with the exact angles, computed here
    ce, se = table_of(exact, layout)
    q_ref, k_ref = rotate(q_un, ce, se, layout), rotate(k_un, ce, se, layout).repeat_interleave(2, dim=1)
    delta = (q @ k.repeat_interleave(2, dim=1).mT - q_ref @ k_ref.mT).abs()
    rel = delta / (q_ref.norm(dim=-1)[..., :, None] * k_ref.norm(dim=-1)[..., None, :])
    seen = rel[..., torch.ones(64, 64, dtype=torch.bool).tril()]  # keys at or before their query
    assert 64 <= SCORE_SAMPLE and found.score_pairs == seen.numel() == 4 * 64 * 65 // 2
    assert found.score_error == pytest.approx(float(seen.max()), rel=1e-9)
    i, j = found.score_positions
    assert i >= start > j  # the worst pair straddles the shift
    assert float(rel[..., :start, :start].max()) < 1e-12 and float(rel[..., start:, start:].max()) < 1e-12
    assert found.score_error <= found.score_bound == pytest.approx(2 * (2 * math.sin(0.1)) + (2 * math.sin(0.1)) ** 2)
    assert implied_angle(relative_tolerance(ROPE_ANGLE_TOLERANCE)) == pytest.approx(ROPE_ANGLE_TOLERANCE)


def test_partial_rotary_turns_the_first_entries_and_weighs_the_rest():
    """A table of 16 entries on heads of 24 (GPT-NeoX's partial rotary): the last 8 pass through, and the relative
    error is over the whole head, as the scores see it."""
    pos = torch.arange(30)
    cos, sin = table_of(angles_of(pos, 16) + 0.3)
    q_un = draw(1, 2, 30, 24)
    q = rotate(q_un, cos, sin)
    ce, se = table_of(angles_of(pos, 16))
    want = relative(q, rotate(q_un, ce, se))
    found = check(cos, sin, pos[None], q, None)
    assert found.q.max_relative_error == pytest.approx(float(want.max()), rel=1e-9)
    assert found.q.max_relative_error < 2 * math.sin(0.15)  # the pass-through entries carry no error
    assert found.k is None and "k not judged: no k recorded" in found.note


def test_a_bf16_cast_of_fp32_angles_stays_within_its_chord():
    """transformers' recipe in bf16 (fp32 angles, cos and sin cast): each vector is off by no more than the largest
    distance between a recorded (cos, sin) and the exact one, far inside the tolerance; no finding."""
    pos = torch.arange(0, 4096, 7)
    exact = angles_of(pos, 32)
    inv32 = 1.0 / (THETA ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    f32 = pos.float()[:, None] * inv32
    cos, sin = table_of(f32.double())
    cos, sin = cos.float().bfloat16(), sin.float().bfloat16()
    chord = torch.sqrt((cos[0, :, :16].double() - exact.cos()) ** 2 + (sin[0, :, :16].double() - exact.sin()) ** 2)
    q_un = draw(1, 4, len(pos), 32)
    q = rotate(q_un, cos.double(), sin.double()).bfloat16()
    found = check(cos, sin, pos[None], q, q[:, :2])
    assert (
        0 < found.q.max_relative_error <= float(chord.max()) * (1 + 2.0**-6) < relative_tolerance(ROPE_ANGLE_TOLERANCE)
    )
    assert found.q.first_affected is None and found.k.first_affected is None


def test_calls_that_do_not_fit_the_table_are_named_and_nonfinite_vectors_left_out():
    pos = torch.arange(20)
    cos, sin = table_of(angles_of(pos, 8))
    q = rotate(draw(1, 2, 20, 8), cos, sin)
    q[0, 1, 5, 3] = math.nan  # the model's own NaN: the diagnosis reports it, RoPE does not
    qk = RotatedQK(cos, sin, pos[None], THETA)
    qk.add(3, q, torch.cat((draw(1, 2, 30, 8), q), dim=-2))  # k with 30 cached keys before these 20
    qk.add(4, q[..., :10, :], None)  # another length than the table's
    qk.add(5, q[..., :4], q)  # a head narrower than the table
    found = qk.result(ROPE_ANGLE_TOLERANCE)
    assert found.calls == 1 and found.q.nonfinite == 1 and found.q.vectors == 2 * 20 - 1
    assert found.q.first_affected is None and found.q.max_relative_error < 1e-12 and found.k is None
    assert found.note == (
        "k not judged: k holds 50 positions and the table 20 (keys of a KV cache) (call #3); "
        "q holds 10 positions and the table 20 (call #4); q's head dim 4 is narrower than the table's 8 (call #5)"
    )


def test_the_finding_names_the_first_position_of_the_rotated_q_and_k():
    """A table whose angles are right (so the table alone passes) but whose rows are 10% long: the vectors are off by
    10% from position 12 on, and rope_precision says so."""
    pos = torch.arange(32)
    cos, sin = table_of(angles_of(pos, 8))
    scale = torch.where(pos >= 12, torch.tensor(1.1, dtype=torch.float64), 1.0)[None, :, None]
    cos, sin = cos * scale, sin * scale
    q, k = rotate(draw(1, 2, 32, 8), cos, sin), rotate(draw(1, 2, 32, 8, seed=1), cos, sin)
    qk = RotatedQK(cos, sin, pos[None], THETA)
    qk.add(0, q, k)
    table = {"index": 0, "cos": cos, "sin": sin, "positions": pos[None], "theta": THETA, "rope_type": "default"}
    (checked,) = table_checks(
        [{**table, "calls": [0], "modules": ["attn"], "qk": qk.result(ROPE_ANGLE_TOLERANCE)}], ROPE_ANGLE_TOLERANCE
    )
    assert checked.first_affected is None and checked.qk.q.first_affected == 12
    assert checked.qk.q.max_relative_error == pytest.approx(0.1, rel=1e-9)
    (finding,) = rope_findings([checked])
    assert finding.severity == "warning"
    assert "rotated q goes wrong from position 12 (relative error up to 0.1 at position" in finding.message
    assert "rotated k goes wrong from position 12" in finding.message


def test_a_vector_the_model_did_not_turn_reads_the_tables_error_alone():
    """The error depends on a vector only through its pairs' lengths: q never rotated reads nothing against an exact
    table, and 2 sin(d/2) against one whose every angle is off by d, as a rotated q would."""
    pos = torch.arange(40)
    q = draw(1, 2, 40, 16)
    cos, sin = table_of(angles_of(pos, 16))
    assert check(cos, sin, pos[None], q, None).q.max_relative_error < 1e-12
    cos, sin = table_of(angles_of(pos, 16) + 0.3)
    found = check(cos, sin, pos[None], q, None).q
    assert found.max_relative_error == pytest.approx(2 * math.sin(0.15), rel=1e-12) and found.first_affected == 0
