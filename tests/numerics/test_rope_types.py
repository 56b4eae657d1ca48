"""The inverse frequencies of transformers' RoPE types: the float64 references, written from each type's definition,
against transformers' own fp32 ``_compute_*_parameters`` to fp32 precision (and against the definitions transcribed
once more here, loop by loop, in Python floats); the fp32 recipes against transformers bit for bit; the types not
modelled named as not judged."""

from __future__ import annotations

import math

import pytest
import torch

from attncheck.numerics.rope import check_table, model_table
from attncheck.numerics.rope_types import (
    JUDGED_ROPE_TYPES,
    model_frequencies,
    reference_frequencies,
    why_not_judged,
    yarn_attention_factor,
)
from attncheck.params import ROPE_TYPES

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

FP32_RTOL = 2.0**-21  # a few fp32 roundings (the power, the divisions, the smoothing) of numbers near 1

LLAMA31 = {  # Llama 3.1's rope_scaling (meta-llama/Llama-3.1-8B config.json)
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def config(head_dim: int, theta: float, **rope) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": theta, **rope},
    )


def recorded(cfg) -> dict:
    """The parameters as the recorder keeps them (numbers as floats, and max_position_embeddings)."""
    rp = cfg.rope_parameters
    out = {k: float(v) for k, v in rp.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.update({k: v for k, v in rp.items() if isinstance(v, bool)})
    out["max_position_embeddings"] = float(cfg.max_position_embeddings)
    return out


def meta_apply_scaling(theta: float, dim: int, factor, low, high, length) -> list[float]:
    """Llama 3.1's ``apply_scaling`` (meta-llama/llama-models) in Python floats, one frequency at a time."""
    out = []
    for j in range(dim // 2):
        freq = theta ** (-2 * j / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < length / high:
            out.append(freq)
        elif wavelen > length / low:
            out.append(freq / factor)
        else:
            smooth = (length / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("head_dim, theta", [(128, 500_000.0), (16, 500_000.0), (64, 10_000.0)])
def test_llama3_reference_is_transformers_fp32_to_fp32_precision(head_dim, theta):
    cfg = config(head_dim, theta, **LLAMA31)
    theirs, factor = rope_utils._compute_llama3_parameters(cfg)
    ref, scale = reference_frequencies("llama3", theta, head_dim, recorded(cfg))
    assert ref.dtype == torch.float64 and scale == factor == 1.0
    torch.testing.assert_close(theirs.double(), ref, rtol=FP32_RTOL, atol=0)
    meta = torch.tensor(meta_apply_scaling(theta, head_dim, 8.0, 1.0, 4.0, 8192), dtype=torch.float64)
    torch.testing.assert_close(ref, meta, rtol=1e-13, atol=0)
    assert torch.equal(model_frequencies("llama3", theta, head_dim, recorded(cfg)), theirs)  # the fp32 recipe
    # every branch taken: unchanged (high frequencies), divided by the factor (low), smoothed (between)
    default = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ratio = ref / default
    assert bool((ratio == 1).any()) and bool((ratio == 1 / 8).any())
    assert bool(((ratio > 1 / 8) & (ratio < 1)).any())


@pytest.mark.parametrize("factor", [2.0, 4.0, 32.0])
def test_linear_reference_is_transformers_fp32(factor):
    cfg = config(64, 10_000.0, rope_type="linear", factor=factor)
    theirs, _ = rope_utils._compute_linear_scaling_rope_parameters(cfg)
    ref, scale = reference_frequencies("linear", 10_000.0, 64, recorded(cfg))
    exact = torch.tensor([10_000.0 ** (-2 * j / 64) / factor for j in range(32)], dtype=torch.float64)
    torch.testing.assert_close(ref, exact, rtol=1e-14, atol=0)
    torch.testing.assert_close(theirs.double(), ref, rtol=FP32_RTOL, atol=0)
    assert scale == 1.0 and torch.equal(model_frequencies("linear", 10_000.0, 64, recorded(cfg)), theirs)


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 4096},
        {"factor": 16.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
        {"factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.25},
    ],
)
def test_yarn_reference_and_attention_factor_are_transformers(rope):
    cfg = config(128, 1_000_000.0, rope_type="yarn", **rope)
    theirs, factor = rope_utils._compute_yarn_parameters(cfg)
    ref, scale = reference_frequencies("yarn", 1_000_000.0, 128, recorded(cfg))
    torch.testing.assert_close(theirs.double(), ref, rtol=FP32_RTOL, atol=0)
    assert torch.equal(model_frequencies("yarn", 1_000_000.0, 128, recorded(cfg)), theirs)
    s = rope["factor"]
    if "attention_factor" in rope:
        expected = rope["attention_factor"]
    elif "mscale" in rope:
        expected = (0.1 * rope["mscale"] * math.log(s) + 1) / (0.1 * rope["mscale_all_dim"] * math.log(s) + 1)
    else:
        expected = 0.1 * math.log(s) + 1  # the paper's sqrt(1/t) = 0.1 ln(s) + 1
    assert scale == pytest.approx(expected, rel=1e-15) and factor == pytest.approx(expected, rel=1e-15)
    assert yarn_attention_factor(recorded(cfg)) == scale
    # both ends of the ramp: the first frequency extrapolated (theta^0 = 1), the last interpolated (divided by s)
    assert ref[0] == 1.0 and ref[-1] == pytest.approx(1_000_000.0 ** (-126 / 128) / s, rel=1e-14)


def test_yarn_without_factor_takes_the_ratio_of_the_lengths():
    p = {"original_max_position_embeddings": 4096.0, "max_position_embeddings": 32768.0}
    assert why_not_judged("yarn", p) is None
    assert yarn_attention_factor(p) == pytest.approx(0.1 * math.log(8) + 1, rel=1e-15)


@pytest.mark.parametrize("kind", sorted(set(ROPE_TYPES) - set(JUDGED_ROPE_TYPES)))
def test_types_not_modelled_are_not_judged_and_named(kind):
    cos = torch.ones(1, 8, 4)
    found = check_table(cos, torch.zeros(1, 8, 4), None, 10_000.0, 0.05, kind, parameters={"factor": 2.0})
    assert found["judged"] is False and f"rope_type {kind}: not judged" in found["note"]


def test_a_judged_type_missing_its_parameters_is_not_judged():
    found = check_table(torch.ones(1, 8, 4), torch.zeros(1, 8, 4), None, 10_000.0, 0.05, "llama3", parameters={})
    assert found["judged"] is False
    assert "factor, low_freq_factor, high_freq_factor, original_max_position_embeddings" in found["note"]


def halves(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t, t), -1)[None]  # transformers' layout, (1, T, d)


def test_a_llama3_table_is_judged_against_llama3_frequencies_not_the_default():
    """The fp32 llama3 table is clean against its own frequencies, and far off theta^(-2j/d): the type matters."""
    cfg = config(16, 500_000.0, **LLAMA31)
    inv, _ = rope_utils._compute_llama3_parameters(cfg)
    pos = torch.arange(2048)
    cos, sin = model_table(pos, inv, torch.float32, torch.float32)
    own = check_table(halves(cos), halves(sin), pos[None], 500_000.0, 0.05, "llama3", parameters=recorded(cfg))
    assert own["judged"] and own["first_affected"] is None and own["max_angle_error"] < 2048 * 2.0**-20
    as_default = check_table(halves(cos), halves(sin), pos[None], 500_000.0, 0.05, "default")
    assert as_default["first_affected"] is not None and as_default["max_angle_error"] > 1.0


def test_a_yarn_table_is_judged_on_its_attention_factor_too():
    cfg = config(32, 10_000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=256)
    inv, factor = rope_utils._compute_yarn_parameters(cfg)
    pos = torch.arange(1024)
    cos, sin = model_table(pos, inv, torch.float32, torch.bfloat16, scale=factor)
    good = check_table(halves(cos), halves(sin), pos[None], 10_000.0, 0.05, "yarn", parameters=recorded(cfg))
    assert good["judged"] and good["attention_factor"] == pytest.approx(factor, rel=1e-15)
    # bf16 cos and sin: each within half an ulp (2^-9 relative), so the radius within about 2^-8
    assert good["max_magnitude_error"] < 2.0**-8 and good["first_affected"] is None
    plain = model_table(pos, inv, torch.float32, torch.bfloat16)  # the factor left out
    off = check_table(halves(plain[0]), halves(plain[1]), pos[None], 10_000.0, 0.05, "yarn", parameters=recorded(cfg))
    assert off["max_magnitude_error"] == pytest.approx(1 - 1 / factor, abs=2.0**-8)


LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]  # longrope's factors, one per frequency of a 16-wide head
SHORT = [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0]


@pytest.mark.parametrize("longest", [256, 257, 4096])
def test_longrope_reference_is_transformers_fp32_for_the_forwards_length(longest):
    cfg = config(
        16, 10_000.0, rope_type="longrope", long_factor=LONG, short_factor=SHORT, original_max_position_embeddings=256
    )
    theirs, factor = rope_utils._compute_longrope_parameters(cfg, seq_len=longest)
    p = {**recorded(cfg), "long_factor": LONG, "short_factor": SHORT}
    ref, scale = reference_frequencies("longrope", 10_000.0, 16, p, longest)
    chosen = LONG if longest > 256 else SHORT  # transformers: long factors once max(position_ids) + 1 passes L
    exact = torch.tensor([10_000.0 ** (-2 * j / 16) / chosen[j] for j in range(8)], dtype=torch.float64)
    torch.testing.assert_close(ref, exact, rtol=1e-14, atol=0)
    torch.testing.assert_close(theirs.double(), ref, rtol=FP32_RTOL, atol=0)
    assert torch.equal(model_frequencies("longrope", 10_000.0, 16, p, longest), theirs)
    s = 131072 / 256  # no factor in the config: max_position_embeddings / original_max_position_embeddings
    assert scale == pytest.approx(math.sqrt(1 + math.log(s) / math.log(256)), rel=1e-15) == factor


def test_longrope_factor_lists_of_another_length_are_not_judged():
    p = {"original_max_position_embeddings": 256.0, "factor": 4.0, "long_factor": [1.0] * 4, "short_factor": [1.0] * 8}
    found = check_table(torch.ones(1, 8, 16), torch.zeros(1, 8, 16), None, 10_000.0, 0.05, "longrope", parameters=p)
    assert found["judged"] is False and "long_factor (a list of d/2 = 8 numbers)" in found["note"]
