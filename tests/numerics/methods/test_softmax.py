"""Every method x dtype against float64, known overflow/underflow facts, and properties.

Error bound used throughout (per probability, against float64 softmax of the
scores already cast to the dtype): rounding exp, the sum and the division costs
a few eps relative to p; in a stable softmax z = x - max is itself rounded to the
dtype, an absolute error of |z| eps / 2 in the exponent, so a relative error of
|z| eps / 2 in p. Subnormal results carry an absolute error of half the smallest
subnormal. Hence |p - r| <= eps r (4 + |z| / 2) + smallest_subnormal.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attncheck.errors import AttncheckError
from attncheck.numerics.methods.softmax import (
    _row_sum,
    naive_softmax,
    reference_softmax,
    run_method,
    stable_softmax,
    tiled_softmax,
    torch_softmax,
)
from attncheck.numerics.precision import smallest_subnormal

from ...conftest import DTYPE_IDS, DTYPES

METHODS = ["naive", "stable", "tiled", "torch"]


def error_bound(xc: torch.Tensor) -> torch.Tensor:
    """Per-entry bound on |p - float64 softmax(xc)| for scores xc in their dtype."""
    x64 = xc.double()
    r = reference_softmax(x64)
    z = (x64 - x64.amax(dim=-1, keepdim=True)).abs()
    eps = torch.finfo(xc.dtype).eps
    return eps * r * (4 + z / 2) + smallest_subnormal(xc.dtype)


@pytest.mark.parametrize("method", METHODS)
def test_method_matches_float64_within_bound(method, dtype, device):
    g = torch.Generator().manual_seed(1)
    # |x| < 8 keeps naive fp16 clear of overflow (11.09) and underflow (-17.33).
    x = (torch.randn(64, 200, generator=g) * 2).clamp(-8, 8).to(dtype).to(device)
    p = run_method(method, x, block=48).probs.double().cpu()
    r = reference_softmax(x.cpu())
    bound = error_bound(x.cpu())
    excess = (p - r).abs() - bound
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} at {divmod(int(excess.argmax()), 200)}"
    # The bound is not vacuous: the error is within a factor of ~100 of it somewhere.
    assert (p - r).abs().max() > bound.max() / 100 or dtype == torch.float32


def test_public_functions_agree_with_run_method(dtype):
    x = torch.randn(8, 33, dtype=torch.float64).to(dtype)
    assert torch.equal(naive_softmax(x), run_method("naive", x).probs)
    assert torch.equal(stable_softmax(x), run_method("stable", x).probs)
    assert torch.equal(torch_softmax(x), torch.softmax(x, dim=-1))
    assert torch.equal(tiled_softmax(x, block=7), run_method("tiled", x, block=7).probs)


# --------------------------------------------------------------------------- known facts


def test_fp16_naive_overflows_at_11_3_not_10_9():
    x = torch.tensor([[11.3, 0.0, 1.0], [10.9, 0.0, 1.0]], dtype=torch.float16)
    out = run_method("naive", x)
    assert torch.isnan(out.probs[0]).any()
    assert out.overflow_rows.tolist() == [True, False]
    r = reference_softmax(x)[1]
    assert torch.allclose(out.probs[1].double(), r, atol=4 * torch.finfo(torch.float16).eps)


@pytest.mark.parametrize(
    "dtype,safe,over", [(torch.bfloat16, 88.6, 88.9), (torch.float32, 88.7, 88.75)], ids=["bf16", "fp32"]
)
def test_naive_overflows_near_88_72(dtype, safe, over):
    x = torch.tensor([[safe, 0.0], [over, 0.0]], dtype=torch.float64).to(dtype)
    out = run_method("naive", x)
    assert torch.isfinite(out.probs[0]).all()
    assert torch.isnan(out.probs[1]).any()
    assert out.overflow_rows.tolist() == [False, True]


def test_fp16_naive_row_near_minus_30_is_zero_over_zero():
    x = torch.full((1, 16), -30.0, dtype=torch.float16) + torch.arange(16, dtype=torch.float16) / 16
    out = run_method("naive", x)
    assert torch.isnan(out.probs).all()
    assert out.underflow_rows.tolist() == [True]
    # exp(-30) = 9.4e-14 is far below fp16's smallest subnormal 6e-8: every exp is 0.
    assert math.exp(-29) < smallest_subnormal(torch.float16) / 2
    stable = run_method("stable", x).probs
    assert torch.isfinite(stable).all()


def test_sum_overflow_gives_zero_row_not_nan():
    # Each exp(11) = 59874 is finite in fp16, but two of them sum past 65504.
    x = torch.tensor([[11.0, 11.0, 0.0]], dtype=torch.float16)
    out = run_method("naive", x)
    assert out.overflow_rows.tolist() == [True]
    assert out.events["sum_overflow"].tolist() == [True] and out.events["exp_overflow"].tolist() == [False]
    assert (out.probs == 0).all()


def test_a_row_sum_overflow_is_named_as_such_not_as_an_exp_overflow():
    # 100 x 7.0 in fp16: exp(7) = 1097 is finite, their float32 sum 109,663 rounds to inf in fp16.
    x = torch.full((1, 100), 7.0, dtype=torch.float16)
    assert torch.isfinite(torch.exp(x)).all() and 100 * math.exp(7.0) > torch.finfo(torch.float16).max
    out = run_method("naive", x)
    assert out.events["sum_overflow"].tolist() == [True] and out.events["exp_overflow"].tolist() == [False]
    assert (out.probs == 0).all() and out.overflow_rows.tolist() == [True]
    # exp(12) = 162755 overflows fp16 itself: that is an exp overflow (and the sum is inf too).
    y = torch.tensor([[12.0, 0.0]], dtype=torch.float16)
    assert torch.isinf(torch.exp(y)).any()
    out = run_method("naive", y)
    assert out.events["exp_overflow"].tolist() == [True] and out.events["sum_overflow"].tolist() == [False]
    # stable: every exp is at most exp(0) = 1, so only the sum can overflow (70000 ones in fp16).
    z = torch.zeros(1, 70000, dtype=torch.float16)
    out = run_method("stable", z)
    assert set(out.events) == {"sum_overflow"} and out.events["sum_overflow"].tolist() == [True]


def _pairwise_fp32(values: list[float]) -> float:
    """A pairwise tree in float32 written out: pad to a power of two with zeros, add neighbours."""
    import numpy as np

    level = [np.float32(v) for v in values]
    level += [np.float32(0.0)] * ((1 << (len(level) - 1).bit_length()) - len(level))
    while len(level) > 1:
        level = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
    return float(level[0])


def test_accum_dtype_sums_pairwise_in_fp32_too():
    """--accum dtype is the pairwise tree in every dtype, fp32 included (not torch's own sum)."""
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))  # what stable rounds in fp32
    tree = torch.tensor([[_pairwise_fp32(row)] for row in e.tolist()], dtype=torch.float32)
    assert (tree != e.sum(dim=-1, keepdim=True)).any()  # the premise: torch's own sum differs
    assert torch.equal(_row_sum(e, "dtype"), tree)
    assert torch.equal(run_method("stable", x, accum="dtype").probs, e / tree)
    assert torch.equal(_row_sum(e, "fp32"), e.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("method", ["naive", "stable", "torch"])
def test_fully_masked_row_is_nan_for_plain_softmax(method, dtype):
    x = torch.full((1, 10), float("-inf"), dtype=dtype)
    assert torch.isnan(run_method(method, x).probs).all()


def test_fully_masked_row_is_zero_for_tiled(dtype):
    x = torch.full((2, 300), float("-inf"), dtype=dtype)
    p = tiled_softmax(x, block=128)
    assert (p == 0).all() and not torch.isnan(p).any()


def test_tiled_guards_leading_fully_masked_blocks(dtype):
    x = torch.zeros(1, 12, dtype=dtype)
    x[0, :8] = float("-inf")  # the first two blocks of 4 are fully masked
    p = tiled_softmax(x, block=4)
    assert torch.equal(p[0, :8], torch.zeros(8))
    assert torch.allclose(p[0, 8:], torch.full((4,), 0.25))


def test_tiled_rounds_relative_to_the_running_max():
    # fp16, one key per block: [-20, 0]. Forward: the first block is rounded against
    # its own max (exp(0) = 1), then rescaled by exp(-20) in float32 -> 2.06e-9.
    # Reverse: it is rounded against the final max, exp(-20) flushes to 0 in fp16.
    x = torch.tensor([[-20.0, 0.0]], dtype=torch.float16)
    fwd = tiled_softmax(x, block=1)
    rev = tiled_softmax(x, block=1, reverse=True)
    expected = math.exp(-20) / (1 + math.exp(-20))
    assert fwd[0, 0].item() == pytest.approx(expected, rel=1e-6)
    assert rev[0, 0].item() == 0.0
    assert stable_softmax(x)[0, 0].item() == 0.0


def test_pairwise_dtype_accumulation_rounds_each_partial_sum():
    # 1 + 2**-11 is a tie in fp16 and rounds to 1 (even); float32 keeps it.
    e = torch.tensor([[1.0, 2.0**-11, 2.0**-11]], dtype=torch.float16)
    assert _row_sum(e, "fp32").item() == 1 + 2.0**-10
    assert _row_sum(e, "dtype").item() == 1.0


def test_unknown_method_is_an_input_error():
    with pytest.raises(AttncheckError, match="unknown method 'fast'"):
        run_method("fast", torch.zeros(1, 2))


def test_online_is_an_alias_of_tiled():
    x = torch.randn(3, 17)
    assert torch.equal(run_method("online", x, block=5).probs, tiled_softmax(x, block=5))


# --------------------------------------------------------------------------- properties

# Grids on which x + c is exact in each dtype, so a shift changes no rounding:
# fp16 has 11 significant bits, bf16 8, fp32 24.
GRID = {torch.float16: (8, 128), torch.bfloat16: (2, 64), torch.float32: (8, 128)}


@st.composite
def exact_rows(draw, dtype):
    per_unit, bound = GRID[dtype]
    n = draw(st.integers(1, 40))
    ks = draw(st.lists(st.integers(-bound * per_unit // 2, bound * per_unit // 2), min_size=n, max_size=n))
    shift = draw(st.integers(-bound // 2, bound // 2))
    x = torch.tensor(ks, dtype=torch.float64) / per_unit
    return x.to(dtype).unsqueeze(0), shift


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stable_and_tiled_are_exactly_shift_invariant(dtype, data):
    x, c = data.draw(exact_rows(dtype))
    block = data.draw(st.integers(1, 45))
    assert torch.equal(stable_softmax(x + c), stable_softmax(x))
    assert torch.equal(tiled_softmax(x + c, block=block), tiled_softmax(x, block=block))
    assert torch.equal(tiled_softmax(x + c, block=block, reverse=True), tiled_softmax(x, block=block, reverse=True))


finite_rows = st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=1, max_size=300)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("method", ["stable", "tiled", "torch"])
@settings(max_examples=40, deadline=None)
@given(values=finite_rows, block=st.integers(1, 300))
def test_rows_sum_to_one_within_dtype_tolerance(dtype, method, values, block):
    # p_i = e_i / sum(e): the e_i roundings cancel in the sum; what is left is the
    # rounding of the sum and of each quotient (eps), float32 accumulation, and
    # subnormal flushes of small p (half the smallest subnormal each).
    x = torch.tensor([values], dtype=torch.float64).to(dtype)
    p = run_method(method, x, block=block).probs.double()
    n = x.shape[-1]
    bound = 1.01 * torch.finfo(dtype).eps + n * (2.0**-22 + smallest_subnormal(dtype))
    assert abs(p.sum().item() - 1) <= bound


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@settings(max_examples=40, deadline=None)
@given(values=finite_rows, block=st.integers(1, 320), reverse=st.booleans())
def test_tiled_equals_stable_for_every_block_size_and_order(dtype, values, block, reverse):
    x = torch.tensor([values], dtype=torch.float64).to(dtype)
    tiled = tiled_softmax(x, block=block, reverse=reverse).double()
    stable = stable_softmax(x).double()
    # Both sit within error_bound of the float64 softmax of x, so within twice it of each other.
    assert ((tiled - stable).abs() <= 2 * error_bound(x)).all()


def test_reference_is_float64_and_nan_for_undefined_rows():
    x = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")], [float("inf"), 0.0], [float("nan"), 0.0]])
    r = reference_softmax(x)
    assert r.dtype == torch.float64
    assert torch.allclose(r[0], torch.tensor([1 / (1 + math.e), math.e / (1 + math.e)], dtype=torch.float64))
    assert torch.isnan(r[1:]).any(dim=-1).all()


def _tiled_block_by_block(x: torch.Tensor, block: int, reverse: bool) -> torch.Tensor:
    """FlashAttention's forward pass as the kernels run it, one key block at a time: the
    running max m and sum l in float32, P_j = exp(S_j - m_j) rounded to x's dtype, and
    the output weight of a block-j key P_j exp(m_j - m_final) / l_final. Every exp is
    taken in float64 and rounded once to float32; a block's sum is a halving tree in
    float32 (the rounding points of ``attncheck.numerics.methods.online``)."""

    def exp32(z):
        return torch.exp(z.double()).float()

    def halving(e):
        width = 1
        while width < e.shape[-1]:
            width *= 2
        t = torch.cat([e, e.new_zeros(*e.shape[:-1], width - e.shape[-1])], dim=-1)
        while t.shape[-1] > 1:
            h = t.shape[-1] // 2
            t = t[..., :h] + t[..., h:]
        return t

    n = x.shape[-1]
    starts = list(range(0, n, block))[:: -1 if reverse else 1]
    rows = x.shape[:-1]
    m = torch.full((*rows, 1), float("-inf"))
    l = torch.zeros((*rows, 1))  # noqa: E741 - FlashAttention's name
    p, used = torch.empty_like(x), {}
    for s0 in starts:
        s = x[..., s0 : s0 + block].float()
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        e = exp32(s - m_safe)
        l = exp32(m - m_safe) * l + halving(e)  # noqa: E741
        p[..., s0 : s0 + block] = e.to(x.dtype)
        used[s0], m = m_new, m_new
    m_final = torch.where(m == float("-inf"), 0.0, m)
    inv_l = torch.where((l == 0) | torch.isnan(l), 1.0, 1.0 / l)
    out = torch.empty(x.shape)
    for s0 in starts:  # the block-by-block rescales telescope to exp(m_j - m_final); -inf m_j gives 0
        out[..., s0 : s0 + block] = p[..., s0 : s0 + block].float() * (exp32(used[s0] - m_final) * inv_l)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keys, block", [(1024, 128), (300, 7), (64, 128), (5, 1)])
@pytest.mark.parametrize("reverse", [False, True])
def test_tiled_is_bitwise_the_block_by_block_recurrence(dtype, keys, block, reverse):
    """tiled_softmax runs its block-wide ops on all blocks at once; the numbers must be
    those of the sequential kernel loop, bit for bit, masked and broken rows included."""
    g = torch.Generator().manual_seed(keys + block)
    x = (torch.randn(3, 6, keys, generator=g) * 6).to(dtype)
    x[0, 0] = float("-inf")
    x[0, 1, : min(block, keys)] = float("-inf")  # a leading fully masked block
    x[0, 2, 0] = float("nan")
    x[0, 3, -1] = float("inf")
    x[1, 0, :] = 60.0  # fp16: exp overflows, guarded by the running max
    want = _tiled_block_by_block(x, block, reverse)
    got = tiled_softmax(x, block=block, reverse=reverse)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)) and torch.equal(got.isnan(), want.isnan())


def _flash_forward_float64(row: list[float], block: int, reverse: bool) -> list[float]:
    """FlashAttention's forward pass for one row with V = identity, in float64 and plain
    Python, one key block at a time as the kernel runs it: m_j = max(m_{j-1}, max S_j);
    m_safe = 0 where m_j is -inf (the kernel's guard); P_j = exp(S_j - m_safe);
    l_j = exp(m_{j-1} - m_safe) l_{j-1} + sum P_j; the output accumulator is rescaled by
    the same factor before block j's P_j is added; at the end it is divided by l (a row
    with l = 0 gives zeros)."""
    n = len(row)
    starts = list(range(0, n, block))[:: -1 if reverse else 1]
    m, l, acc = -math.inf, 0.0, [0.0] * n  # noqa: E741 - FlashAttention's name
    for s0 in starts:
        keys = range(s0, min(s0 + block, n))
        m_new = max([m] + [row[i] for i in keys])
        m_safe = 0.0 if m_new == -math.inf else m_new
        alpha = math.exp(m - m_safe)  # exp(-inf) = 0 for the first block or while m is -inf
        acc = [a * alpha for a in acc]
        p = {i: math.exp(row[i] - m_safe) for i in keys}
        l = alpha * l + sum(p.values())  # noqa: E741
        for i, v in p.items():
            acc[i] += v
        m = m_new
    return [0.0] * n if l == 0 else [a / l for a in acc]


def _guard_rows(n: int, block: int) -> list[list[float]]:
    """Rows whose masked (-inf) keys fill whole key blocks first, last, in the middle, all but
    one key, and every key; finite keys far below -88.7 (so exp(-m) overflows float32) and
    near 0."""
    nb = -(-n // block)
    first = list(range(0, min(block, n)))
    last = list(range((nb - 1) * block, n))
    middle = list(range(block, min(2 * block, n))) if nb >= 3 else []
    rows = []
    for low in (-100.0, -1e4, 0.0, 30.0):
        for masked in (first, last, middle, first + last, list(range(n - 1)), list(range(1, n))):
            rows.append([-math.inf if i in masked else low + (i % 5) * 0.25 for i in range(n)])
    rows.append([-math.inf] * n)
    return rows


@pytest.mark.parametrize("n, block", [(256, 128), (10, 1), (10, 3), (10, 4), (11, 7), (9, 16), (300, 128)])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_tiled_guards_match_a_block_by_block_float64_emulation(n, block, reverse):
    """Every guard of the online recurrence against the kernel's loop in float64: whole
    -inf blocks first, last and in the middle, block 1, blocks that do not divide the row."""
    rows = _guard_rows(n, block)
    x = torch.tensor(rows, dtype=torch.float64)
    got = tiled_softmax(x.float(), block=block, reverse=reverse).double()
    want = torch.tensor([_flash_forward_float64(r, block, reverse) for r in rows], dtype=torch.float64)
    assert not torch.isnan(got).any()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-12), (got - want).abs().max()
    # Rows with any finite key are a softmax: the same as float64 stable softmax.
    defined = torch.isfinite(x).any(dim=-1)
    assert torch.allclose(got[defined], reference_softmax(x[defined]), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_tiled_whole_masked_block_before_low_scores_is_not_nan(dtype, reverse):
    # The audit's case: (2, 256), first (forward) or last (reverse) 128 keys -inf, the rest -100.
    x = torch.full((2, 256), -100.0)
    x[:, :128] = float("-inf")
    if reverse:
        x = x.flip(-1)
    p = tiled_softmax(x.to(dtype), block=128, reverse=reverse)
    keep = torch.isfinite(x)
    assert torch.equal(p[~keep], torch.zeros(256))
    assert torch.equal(p[keep], torch.full((256,), 1 / 128))


def test_tiled_block_wider_than_the_row_is_one_block():
    x = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiled_softmax(x, block=99999999999), tiled_softmax(x, block=20))


@pytest.mark.parametrize("method", ["naive", "stable", "torch"])
@pytest.mark.parametrize("accum", ["fp32", "dtype"])
def test_methods_into_reused_buffers_give_the_same_bits_and_events(method, accum, dtype):
    """The diagnosis hands naive, stable and torch a buffer to write into: the output must be
    bit for bit the fresh-tensor one (overflowing, underflowing and masked rows included),
    and a buffer taken again for a smaller or larger chunk must not carry the last one over."""
    from attncheck.numerics.methods.softmax import Buffers, MethodParams
    from attncheck.registry import METHODS as REGISTRY

    g = torch.Generator().manual_seed(5)
    pool = Buffers()
    fn = REGISTRY.get(method).function()
    for rows, keys in ((16, 77), (5, 77), (33, 130), (1, 9)):
        x = torch.randn(rows, keys, generator=g) * 4
        x[0, :3] = 200.0  # exp overflows in every dtype (naive); the sum too in fp16
        x[min(1, rows - 1), :] = float("-inf")  # fully masked
        x[-1, 1] = -300.0  # flushes
        xc = x.to(dtype)
        want = fn(xc, MethodParams(accum=accum))
        got = fn(xc, MethodParams(accum=accum, buffers=pool))
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        assert torch.equal(got.probs.view(bits), want.probs.view(bits))
        assert got.events.keys() == want.events.keys()
        assert all(torch.equal(got.events[k], want.events[k]) for k in want.events)
    assert pool.take(method, xc).data_ptr() == got.probs.data_ptr()  # the output is the buffer itself


@pytest.mark.parametrize("ordinary", [0, 100])  # the suspect rows many (one pass for their max) or few (gathered)
def test_naive_names_no_event_in_rows_whose_trouble_is_the_input(dtype, ordinary):
    """A fully masked row sums to 0 and a row holding +inf to inf, as an underflow and an
    overflow would; NaN and +inf inputs and full masks are reported as such, so naive must
    not name an event there, while real ones beside them are still named."""
    x = torch.zeros(6 + ordinary, 8)
    x[0] = float("-inf")  # fully masked: sum 0, not an underflow
    x[1, 3] = float("inf")  # +inf input: sum inf, not an exp overflow
    x[2, 1] = float("nan")
    x[3] = -200.0  # every exp flushes: a real underflow in every dtype
    x[4, 2] = 120.0  # exp(120) overflows every dtype: a real exp overflow
    out = run_method("naive", x.to(dtype))
    rest = [False] * ordinary
    assert out.events["underflow"].tolist() == [False, False, False, True, False, False] + rest
    assert out.events["exp_overflow"].tolist() == [False, False, False, False, True, False] + rest
    assert out.events["sum_overflow"].tolist() == [False] * 6 + rest
