"""attncheck.numerics.methods.fp8: the kernels' FP8 conversion against every bit pattern, the P-cast
flush threshold at its exact boundary, and the sink construction of forward and reverse
key order against a count made here."""

import math

import numpy as np
import pytest
import torch

from attncheck.numerics.methods.fp8 import AFTER, AT, BEFORE, cast_overflow, flush_threshold, pcast_softmax, to_fp8

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
IDS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"]


def every_value(dt: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The 256 bit patterns of ``dt`` decoded by torch: (finite values sorted, their patterns)."""
    bits = torch.arange(256, dtype=torch.uint8)
    values = bits.view(dt).double().numpy()
    finite = np.isfinite(values)
    order = np.argsort(values[finite], kind="stable")
    return values[finite][order], bits.numpy()[finite][order]


def nearest_even(x: np.ndarray, values: np.ndarray, patterns: np.ndarray, top: float) -> np.ndarray:
    """Round-to-nearest-even onto the sorted ``values`` (ties to the even bit pattern), clamped to +-top."""
    uniq, first = np.unique(values, return_index=True)  # +0 and -0 decode alike
    pats = patterns[first]
    x = np.clip(x, -top, top)
    hi = np.clip(np.searchsorted(uniq, x), 1, len(uniq) - 1)
    lo = hi - 1
    d_lo, d_hi = x - uniq[lo], uniq[hi] - x
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(pats[lo] % 2 == 0, lo, hi)))
    out = uniq[pick]
    return np.where(out == 0, 0.0 * np.sign(x), out)


@pytest.mark.parametrize("dt", FORMATS, ids=IDS)
def test_to_fp8_rounds_every_value_and_midpoint_to_nearest_even(dt):
    values, patterns = every_value(dt)
    top = float(torch.finfo(dt).max)
    assert values.max() == top
    mids = (values[1:] + values[:-1]) / 2
    probes = np.concatenate(
        [values, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), [top * 1.01, -top * 4, 1e30]]
    )
    probes = probes.astype(np.float32).astype(np.float64)  # what an fp32 input can hold
    got = to_fp8(torch.from_numpy(probes).float(), dt).double().numpy()
    want = nearest_even(probes, values, patterns, top)
    bad = got != want
    assert not bad.any(), list(zip(probes[bad][:5], got[bad][:5], want[bad][:5]))
    # torch's own cast agrees wherever the value is in range (beyond it, it depends on format and version).
    inside = np.abs(probes) <= top
    assert np.array_equal(torch.from_numpy(probes[inside]).float().to(dt).double().numpy(), got[inside])


@pytest.mark.parametrize("dt", FORMATS, ids=IDS)
def test_to_fp8_keeps_nan_and_saturates_inf(dt):
    x = torch.tensor([float("nan"), float("inf"), float("-inf")])
    got = to_fp8(x, dt).float()
    top = torch.finfo(dt).max
    assert math.isnan(got[0]) and got[1] == top and got[2] == -top


def test_cast_overflow_is_half_an_ulp_past_the_top():
    # e4m3fn: max 448 = 1.75 * 2^8, ulp 32 at the top: 463.99 rounds down, 464 is beyond.
    x = torch.tensor([448.0, 463.0, 464.0, -500.0, float("inf"), float("nan")])
    assert cast_overflow(x, torch.float8_e4m3fn).tolist() == [False, False, True, True, False, False]


@pytest.mark.parametrize("p_scale", [1.0, 256.0, 448.0])
def test_flush_threshold_at_its_exact_boundary(p_scale):
    """exp(s - m) S below 2^-10 flushes to 0 in e4m3, above it survives as 2^-9."""
    thr = flush_threshold(torch.float8_e4m3fn, p_scale)
    assert thr == pytest.approx(10 * math.log(2) + math.log(p_scale), rel=1e-15)
    eps = 1e-3
    for factor, flushes in ((1 + eps, False), (1 - eps, True)):
        gap = math.log(p_scale) - math.log(2.0**-10 * factor)  # exp(-gap) S = 2^-10 factor
        row = torch.tensor([[0.0, -gap]])
        r = pcast_softmax(row, torch.float8_e4m3fn, p_scale, block=8)
        assert bool(r.flushed[0, 1]) is flushes and bool(r.probs[0, 1] == 0) is flushes
        if not flushes:  # it survives as the smallest subnormal, 2^-9, scaled back
            assert float(r.probs[0, 1]) == pytest.approx(2.0**-9 / p_scale / float(1 + math.exp(-gap)), rel=1e-6)


def test_e5m2_threshold_follows_its_smallest_subnormal():
    assert flush_threshold(torch.float8_e5m2, 256.0) == pytest.approx(17 * math.log(2) + math.log(256), rel=1e-15)


def sink_rows(rows: int, keys: int, gap: float, sinks: int = 4, seed: int = 0) -> torch.Tensor:
    """N(0,1) logits with ``sinks`` attention-sink keys first, raised by ``gap``."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, keys, generator=g)
    s[:, :sinks] += gap
    return s


@pytest.mark.parametrize("p_scale", [1.0, 256.0])
def test_forward_order_flushes_what_the_sink_max_predicts(p_scale):
    """Forward: every later key is cast against the sink's max m, so exactly the keys with
    s < m - threshold flush; their share follows Phi(m - threshold) (the paper's closed form
    with m = gap + delta_k)."""
    s = sink_rows(2048, 512, gap=8.0)
    r = pcast_softmax(s, torch.float8_e4m3fn, p_scale, block=128)
    thr = flush_threshold(torch.float8_e4m3fn, p_scale)
    m = s.amax(dim=-1, keepdim=True)
    expect = s[:, 4:] < m - thr
    near = (s[:, 4:] - (m - thr)).abs() < 1e-4  # fp32 rounding of exp at the boundary
    assert bool((r.flushed[:, 4:] == expect)[~near].all())
    phi = 0.5 * (1 + torch.erf((m.double() - thr) / math.sqrt(2)))  # per row, given its sink max
    share = r.flushed[:, 4:].double().mean()
    assert float(share) == pytest.approx(
        float(phi.mean()), abs=4 * math.sqrt(float(phi.mean()) / s[:, 4:].numel()) + 1e-4
    )
    assert bool((r.position[:, :128] == AT).all() and (r.position[:, 128:] == AFTER).all())


def test_reverse_order_leaves_only_the_sinks_block():
    """Reverse: the blocks after the sink are visited first, against their own running max, and
    with S = 256 none of their entries flushes; only keys sharing the sink's block can."""
    s = sink_rows(2048, 512, gap=8.0)
    fwd = pcast_softmax(s, torch.float8_e4m3fn, 256.0, block=128)
    rev = pcast_softmax(s, torch.float8_e4m3fn, 256.0, block=128, reverse=True)
    assert not bool(rev.flushed[:, 128:].any()) and bool(fwd.flushed[:, 128:].any())
    assert bool((rev.position[:, 128:] == BEFORE).all() and (rev.position[:, :128] == AT).all())
    assert torch.equal(rev.flushed[:, :128], fwd.flushed[:, :128])  # the sink's block sees the same max either way


def test_probabilities_sum_to_one_up_to_fp8_rounding_and_masked_rows_are_zero():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(64, 300, generator=g) * 2
    s[5] = float("-inf")
    r = pcast_softmax(s, torch.float8_e4m3fn, 256.0, block=64)
    ref = torch.softmax(s.double(), dim=-1)
    live = torch.arange(64) != 5
    # e4m3 keeps 3 mantissa bits: each P~ within 2^-4 relative, so each p within 2^-4 p (plus the smallest subnormal).
    assert bool(((r.probs.double() - ref).abs() <= ref * 2.0**-4 + 2.0**-10 / 256)[live].all())
    assert bool((r.probs[5] == 0).all())


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_counts_by_position_are_the_keys_counted_one_by_one(reverse):
    """Counted per block (the last cut short), then per position: the same as a count over
    keys with each key's position written out by hand from the running max."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(40, 300, generator=g) * 4
    s[:, 150] += 20  # the row max in the middle block (keys 128..255)
    r = pcast_softmax(s, torch.float8_e4m3fn, 1.0, block=128, reverse=reverse)
    block_of = torch.arange(300) // 128
    visit = (2 - block_of) if reverse else block_of  # visiting order of each key's block
    at = 1  # the max's block (block 1) is visited second either way
    want_pos = torch.where(visit < at, BEFORE, torch.where(visit == at, AT, AFTER)).expand(40, 300)
    assert torch.equal(r.position.long(), want_pos)
    mask = torch.rand(40, 300, generator=g) < 0.3
    counted = torch.stack([(mask & (want_pos == k)).sum() for k in (BEFORE, AT, AFTER)])
    assert torch.equal(r.counts_by_position(mask), counted)
