"""The int4 KV cache (transformers' QuantizedCache with optimum-quanto: min-max per group of 64 consecutive values,
asymmetric, each operation in the model's dtype) against a re-computation written here in numpy: float64
arithmetic rounded to float32 then to bf16 (round to nearest even on the bits) after each operation, as torch's bf16
operations do on the CPU."""

import numpy as np
import pytest
import torch

from attncheck.numerics import kvcache as kc


def bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 -> bf16 (nearest even on the upper 16 bits) -> float64."""
    bits = np.asarray(x, dtype=np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def int4_read_f64(x: np.ndarray, group: int = 64, residual: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """x (B, Hk, T, d) float64 holding bf16 values through quanto's int4 cache: the tokens before the last
    ``residual`` in groups of ``group`` consecutive values, scale (max - min) / 15 and shift -min per group.
    -> (the values read back, each group's scale)."""
    kept = x.shape[2] - residual
    old = np.ascontiguousarray(x[:, :, :kept])
    g = old.reshape(-1, group)
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = bf16(bf16(hi - lo) / 15)
    shift = -lo
    with np.errstate(invalid="ignore", divide="ignore"):
        level = np.round(bf16(bf16(g + shift) / scale))  # np.round: half to even, as torch.round
    level = np.clip(np.where(scale == 0, 0, level), 0, 15)
    read = bf16(bf16(scale * level) - shift).reshape(old.shape)
    return np.concatenate([read, x[:, :, kept:]], axis=2), scale


def sample(t=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, t, d, generator=g)
    x[0, 1, 3, 5] = 300.0  # an outlier: its group's step grows 20-fold
    x[1, 0, 2] = 0.0  # a token of zeros
    x[1, 1, :4] = 1.5  # a constant group (scale 0): read back as itself
    return x.bfloat16()


@pytest.mark.parametrize("group, residual", [(64, 0), (16, 0), (32, 3), (64, 4)])
def test_int4_read_against_numpy(group, residual):
    x = sample()
    q = kc.quantise_groups(x, "int4", torch.bfloat16, group, residual)
    want, scale = int4_read_f64(x.double().numpy(), group, residual)
    assert q.values.dtype == torch.bfloat16
    assert np.array_equal(q.values.double().numpy(), want)
    assert torch.equal(q.values[:, :, 8 - residual :], x[:, :, 8 - residual :])  # the residual window: as given
    # each head's largest group scale (groups of 64 hold 4 tokens of one head here: 8 x 16 per head is 2 groups)
    per_value = np.repeat(scale, group, axis=1).reshape(2, 2, 8 - residual, 16)
    assert q.group_scale.tolist() == pytest.approx(per_value.max(axis=(0, 2, 3)).tolist(), rel=0, abs=0)
    flushed = ((x.double().numpy() != 0) & (want == 0)).sum(axis=(0, 2, 3))
    assert q.flushed.tolist() == flushed.tolist() and q.saturated.tolist() == [0, 0]


def test_int4_step_and_error_bounds_theorem():
    """Every value read back lies within half a step of the value written (plus its bf16 roundings), and the
    outlier's group is the one with the largest error."""
    x = sample()
    q = kc.quantise_groups(x, "int4", torch.bfloat16)
    xs, vs = x.double(), q.values.double()
    g = xs.reshape(-1, 64)
    step = (g.amax(dim=1) - g.amin(dim=1)) / 15
    err = (vs - xs).abs().reshape(-1, 64).amax(dim=1)
    assert (err <= step / 2 + 2**-7 * g.abs().amax(dim=1) * 2).all()
    assert int(err.argmax()) == int(step.argmax())  # the group holding the 300


def test_not_whole_groups_refused_as_quanto_does():
    x = sample(t=6, d=16)  # 2 heads x 6 tokens x 16 = 192 values per batch row: not groups of 128
    with pytest.raises(ValueError, match="192 values per batch row are not groups of 128"):
        kc.quantise_groups(x, "int4", torch.bfloat16, 128)
    assert kc.quantise_groups(x, "int4", torch.bfloat16, 64).values.shape == x.shape


def test_format_max_of_int4_is_its_largest_level():
    assert kc.format_max("int4") == 15.0
