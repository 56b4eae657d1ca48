"""The KV cache's quantiser and attention against torch's float8 dtypes, torch.finfo and float64 written here."""

import math

import pytest
import torch

from attncheck.numerics import kvcache as kc

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def heads(values, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, 1, n): one kv head holding the values."""
    return torch.tensor(values, dtype=dtype).reshape(1, 1, 1, -1)


@pytest.mark.parametrize("fmt, fp8", [("fp8_e4m3", E4M3), ("fp8_e5m2", E5M2)])
def test_format_max_is_finfo(fmt, fp8):
    assert kc.format_max(fmt) == torch.finfo(fp8).max
    assert kc.format_max("fp8_e4m3") == 448.0 and kc.format_max("fp8_e5m2") == 57344.0


def test_e4m3_saturates_at_448_and_counts_what_a_plain_cast_would_lose():
    # 448 is e4m3's max; 464 is the tie with the next step (480, NaN in e4m3fn): round-to-nearest-even keeps 448
    x = heads([448.0, 460.0, 464.0, 472.0, 500.0, -1930.0, 1e6])
    q = kc.quantise(x, "fp8_e4m3", 1.0, torch.float32)
    assert q.values.tolist()[0][0][0] == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0]
    assert int(q.saturated[0]) == 4  # 472, 500, -1930, 1e6: beyond 448 + 16
    assert int(q.flushed[0]) == 0 and q.entries == 7


def test_e5m2_saturates_at_57344_where_a_plain_cast_gives_inf():
    x = heads([57344.0, 61439.0, 61440.0, 1e5])
    plain = x.to(E5M2).float().flatten().tolist()  # torch's own cast: not saturating in e5m2
    assert plain[:2] == [57344.0, 57344.0] and math.isinf(plain[2]) and math.isinf(plain[3])
    q = kc.quantise(x, "fp8_e5m2", 1.0, torch.float32)
    assert q.values.flatten().tolist() == [57344.0] * 4
    assert int(q.saturated[0]) == 2  # exactly the entries the plain cast made inf


@pytest.mark.parametrize("fmt, fp8", [("fp8_e4m3", E4M3), ("fp8_e5m2", E5M2)])
def test_subnormals_kept_and_below_half_the_smallest_flushed(fmt, fp8):
    tiny = torch.finfo(fp8).smallest_normal * torch.finfo(fp8).eps  # the smallest subnormal: 2^-9, 2^-16
    assert tiny == (2.0**-9 if fp8 is E4M3 else 2.0**-16)
    x = heads([tiny, 3 * tiny, tiny / 2, tiny * 0.51, tiny / 4, 0.0])
    q = kc.quantise(x, fmt, 1.0, torch.float32)
    # tiny/2 is a tie with 0 (even): 0; just above it rounds up to tiny
    assert q.values.flatten().tolist() == [tiny, 3 * tiny, 0.0, tiny, 0.0, 0.0]
    assert int(q.flushed[0]) == 2 and int(q.saturated[0]) == 0


def test_scale_divides_before_and_multiplies_after_per_head():
    x = torch.tensor([1000.0, 250.0, -3.0]).reshape(1, 1, 1, 3).expand(1, 2, 1, 3).contiguous()
    scale = torch.tensor([4.0, 0.5])  # head 0: 250, 62.5, -0.75 stored; head 1: 2000 (saturates), 500 (saturates)
    q = kc.quantise(x, "fp8_e4m3", scale, torch.float32)
    # independent: fp32 divide, clamp, torch's e4m3 cast, fp32 multiply
    want = torch.stack(
        [((x[0, h] / s).clamp(-448, 448).to(E4M3).float() * s) for h, s in enumerate(scale.tolist())]
    ).unsqueeze(0)
    assert torch.equal(q.values, want)
    assert q.values[0, 0, 0].tolist() == [1024.0, 256.0, -3.0]  # 250 -> 256 (e4m3's step is 16 there), -0.75 exact
    assert q.saturated.tolist() == [0, 2]


def test_dequantised_values_rounded_to_the_model_dtype():
    # 3 * 0.1 in fp32 is not a bf16 value: the read rounds the fp32 product once to bf16
    x = heads([3.0 * 0.1], torch.bfloat16)
    q = kc.quantise(x, "fp8_e4m3", 0.1, torch.bfloat16)
    stored = (x.float() / torch.tensor(0.1)).to(E4M3).float()
    assert q.values.dtype == torch.bfloat16
    assert torch.equal(q.values, (stored * torch.tensor(0.1)).to(torch.bfloat16))


def test_scale_from_amax_and_unit_where_zero():
    assert kc.scale_from(torch.tensor([896.0, 0.0]), 448.0).tolist() == [2.0, 1.0]
    assert kc.scale_from(2.0, kc.V_SCALE_CONSTANT).dtype == torch.float32


def test_amax_channel_names_the_outlier():
    x = torch.ones(1, 2, 5, 8)
    x[0, 1, 3, 6] = 100.0
    ch = kc.amax_channel(x, 1)
    assert (ch.channel, ch.token, ch.ratio, ch.amax) == (6, 3, 100.0, 100.0)
    assert kc.head_amax(x).tolist() == [1.0, 100.0]


def test_attention_from_the_cache_against_float64_written_here():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 16, generator=g).bfloat16()
    k = torch.randn(1, 2, 6, 16, generator=g).bfloat16()
    v = torch.randn(1, 2, 6, 16, generator=g).bfloat16() * 10
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    bias = kc.mask_bias(causal, None, (1, 4, 6, 6))
    scale = 16**-0.5
    ref = kc.reference_output(q, k, v, bias, scale)
    # float64 written out: GQA by repeating each kv head for its two query heads
    kk, vv = k.double().repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(causal, -math.inf)
    want = torch.softmax(s, dim=-1) @ vv
    assert torch.allclose(ref, want, rtol=1e-12, atol=1e-12)
    out = kc.kernel_output(q, k, v, bias, scale, torch.bfloat16)
    assert (out - want).abs().max() <= 2**-7 * want.abs().max()  # bf16 output: within its rounding
    err = kc.output_error(out, want, 2)
    assert err.cosine.min() > 0.9999 and err.rel_l2.max() < 1e-2
