"""The FP8 accumulator model against a write-out in exact rational arithmetic (python Fractions, one
element at a time), and its theorems: 23 bits with a flush every step is fp32 accumulation of exact
partial sums; without a flush the error grows with K, with a flush every step it stays near fp32's."""

import math
import struct
from fractions import Fraction

import pytest
import torch

from attncheck.numerics.methods.fp8_accum import mma_accumulate_fp8, truncate_mantissa

E4M3 = torch.float8_e4m3fn


def trunc_frac(x: Fraction, bits: int) -> Fraction:
    """x truncated toward zero to ``bits`` bits after its leading one, in exact arithmetic."""
    if x == 0:
        return x
    sign, ax = (1 if x > 0 else -1), abs(x)
    e = math.floor(math.log2(ax))  # the leading one's position, corrected for log2's rounding below
    while Fraction(2) ** e > ax:
        e -= 1
    while Fraction(2) ** (e + 1) <= ax:
        e += 1
    unit = Fraction(2) ** (e - bits)
    return sign * (ax // unit) * unit


def fp32_nearest(x: Fraction) -> Fraction:
    return Fraction(struct.unpack("f", struct.pack("f", float(x)))[0]) if abs(x) < 2**100 else x


def written_out(acc, a, b, bits, flush, k_step=32):
    """acc + a @ b element by element: per step the exact partial sum added exactly, then truncated
    (or rounded to nearest fp32 for bits None); with a flush, a fresh accumulator added in fp32."""
    m, kdim = a.shape
    n = b.shape[1]
    out = [[0.0] * n for _ in range(m)]
    for i in range(m):
        for j in range(n):
            outer = Fraction(float(acc[i, j])) if acc is not None else Fraction(0)
            work = outer if flush is None else Fraction(0)
            steps = list(range(0, kdim, k_step))
            for s, k0 in enumerate(steps):
                part = sum(
                    Fraction(float(a[i, k])) * Fraction(float(b[k, j])) for k in range(k0, min(k0 + k_step, kdim))
                )
                work = fp32_nearest(work + part) if bits is None else trunc_frac(work + part, bits)
                if flush is not None and ((s + 1) % flush == 0 or s == len(steps) - 1):
                    outer = fp32_nearest(outer + work)
                    work = Fraction(0)
            out[i][j] = float(work if flush is None else outer)
    return torch.tensor(out, dtype=torch.float64)


def fp8_matrix(shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).clamp(-448, 448).to(E4M3).double()


@pytest.mark.parametrize("bits", [13, 7, 23, None])
@pytest.mark.parametrize("flush", [None, 1, 3])
def test_matches_the_exact_write_out(bits, flush):
    a = fp8_matrix((3, 150), 30.0, 1)  # K = 150: four full steps and one of 22
    b = fp8_matrix((150, 4), 2.0, 2)
    acc = (torch.randn(3, 4, generator=torch.Generator().manual_seed(3)) * 1e4).float()
    mine = mma_accumulate_fp8(acc, a, b, mantissa_bits=bits, flush_every=flush)
    assert mine.dtype == torch.float32
    ref = written_out(acc, a, b, bits, flush)
    assert torch.equal(mine.double(), ref)


def test_batched_and_no_initial_accumulator():
    a = fp8_matrix((2, 3, 64), 100.0, 4)
    b = fp8_matrix((2, 64, 5), 1.0, 5)
    mine = mma_accumulate_fp8(None, a, b, mantissa_bits=13)
    for h in range(2):
        assert torch.equal(mine[h].double(), written_out(None, a[h], b[h], 13, None))


def test_truncation_keeps_exactly_the_leading_bits():
    # 1 + 2^-13 + 2^-14 keeps 2^-13 with 13 bits; negative values truncate toward zero
    x = torch.tensor([1 + 2**-13 + 2**-14, -(3 + 2**-12 + 2**-20), 0.0, 2**-130 * 1.75], dtype=torch.float64)
    got = truncate_mantissa(x, 13)
    assert got.tolist() == [1 + 2**-13, -(3 + 2**-12), 0.0, 2**-130 * 1.75]
    # a value already on the 13-bit grid passes unchanged (SageAttention's C = A B + C with A = B = 0)
    grid = torch.tensor([1.0 + k * 2**-13 for k in range(0, 8192, 97)], dtype=torch.float64)
    assert torch.equal(truncate_mantissa(grid, 13), grid)
    assert torch.equal(truncate_mantissa(grid + 2**-15, 13), grid)


def test_23_bits_with_a_flush_every_step_is_fp32_accumulation():
    """With partial sums exact in fp32 (small integers), truncating them to 23 bits is the identity and
    the flush is the fp32 add: the same numbers as mantissa_bits=None, fp32 accumulation."""
    g = torch.Generator().manual_seed(7)
    a = torch.randint(-16, 17, (4, 300), generator=g).double()  # integers up to 16 are e4m3 values
    b = torch.randint(-16, 17, (300, 6), generator=g).double()
    acc = (torch.randn(4, 6, generator=g) * 1e6).float()
    one = mma_accumulate_fp8(acc, a, b, mantissa_bits=23, flush_every=1)
    fp32 = mma_accumulate_fp8(acc, a, b, mantissa_bits=None)
    assert torch.equal(one, fp32)
    # and fp32 accumulation is the running fp32 sum of the exact step sums
    run = acc.double()
    for k0 in range(0, 300, 32):
        run = (run + a[:, k0 : k0 + 32] @ b[k0 : k0 + 32]).float().double()
    assert torch.equal(fp32.double(), run)


def test_error_grows_with_k_without_a_flush_and_stays_near_fp32_with_one():
    """Positive P times positive V, as in P@V: without a flush every step truncates the growing sum, each by
    up to 2^-13 of it, so the relative error grows with the number of steps; with a flush every step only
    each step's own sum is truncated: the relative error stays below 2^-13 (plus fp32's), whatever K."""
    errs = {}
    for kdim in (256, 8192):
        p = fp8_matrix((16, kdim), 1.0, 8).abs()
        v = fp8_matrix((kdim, 8), 1.0, 9).abs()
        exact = p @ v
        for name, bits, flush in (("none", 13, None), ("one", 13, 1), ("fp32", None, None)):
            got = mma_accumulate_fp8(None, p, v, mantissa_bits=bits, flush_every=flush).double()
            errs[name, kdim] = float(((got - exact).abs() / exact).max())
    assert errs["none", 8192] > 8 * errs["none", 256]
    assert errs["none", 8192] > 100 * errs["fp32", 8192]
    for kdim in (256, 8192):
        assert errs["one", kdim] <= 2**-13 + 2 * errs["fp32", kdim]
    assert errs["one", 8192] < 2 * errs["one", 256]
    assert errs["one", 8192] < errs["none", 8192] / 20


def test_bad_settings_are_refused():
    a = torch.zeros(1, 32, dtype=torch.float64)
    b = torch.zeros(32, 1, dtype=torch.float64)
    with pytest.raises(ValueError):
        mma_accumulate_fp8(None, a, b, flush_every=0)
    with pytest.raises(ValueError):
        truncate_mantissa(a, 60)


# --------------------------------------------------------------------------- P@V in the online softmax


def trunc_bits64(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 values truncated toward zero to ``bits`` mantissa bits through their frexp decomposition
    (the module clears encoding bits instead)."""
    mant, e = torch.frexp(x)  # x = mant 2^e, |mant| in [0.5, 1): 2^(bits + 1) mant keeps bits + 1 bits
    return torch.trunc(mant * 2.0 ** (bits + 1)) * torch.pow(2.0, (e - bits - 1).double())


def pv_written_out(s, v8, block, p_scale, reverse, bits, flush):
    """The online softmax's O over key blocks, written out: e = exp(s - m) in fp32, alpha = exp(m_old - m),
    l = l alpha + sum e, P8 = e4m3(e p_scale); O rescaled in fp32, then per 32 keys the exact P8 V8 sum added
    and the result truncated to ``bits``. With ``flush``: a working accumulator,
    rescaled with O, added to O in fp32 after every ``flush`` blocks and after the last."""
    r, t = s.shape
    starts = list(range(0, t, block))[:: -1 if reverse else 1]
    m = torch.full((r, 1), float("-inf"))
    l = torch.zeros(r, 1)
    o = torch.zeros(r, v8.shape[-1])
    w = torch.zeros_like(o)
    for i, j in enumerate(starts):
        sj = s[:, j : j + block]
        m_new = torch.maximum(m, sj.amax(dim=-1, keepdim=True))
        e = torch.exp(sj - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + e.sum(dim=-1, keepdim=True)
        p8 = (e * p_scale).to(E4M3).double()
        target = o if flush is None else w
        target = (target * alpha).double()
        o = o * alpha
        for k0 in range(0, sj.shape[1], 32):
            part = p8[:, k0 : k0 + 32] @ v8[j + k0 : j + min(k0 + 32, sj.shape[1])].double()
            target = target + part
            target = trunc_bits64(target, bits)
        if flush is None:
            o = target.float()
        else:
            w = target.float()
            if (i + 1) % flush == 0 or i == len(starts) - 1:
                o, w = o + w, torch.zeros_like(w)
        m = m_new
    return o * (1 / (l * p_scale))  # the finalize multiplies by the reciprocal of the scaled sum


@pytest.mark.parametrize("bits,flush,reverse", [(13, None, True), (13, 2, True), (9, 1, False), (13, None, False)])
def test_online_p_at_v_is_the_accumulator_written_out(bits, flush, reverse):
    from attncheck.numerics.methods.fp8_attention import online_pcast_out

    g = torch.Generator().manual_seed(11)
    s = torch.randn(2, 24, 450, generator=g) * 2  # 450 keys: blocks of 160 (FA3, d = 64) and a partial one
    v8 = (torch.randn(2, 450, 16, generator=g) * 40).to(E4M3).float()
    _, o = online_pcast_out(s, v8, E4M3, 256.0, 160, reverse, accum_bits=bits, accum_flush=flush)
    for h in range(2):
        assert torch.equal(o[h], pv_written_out(s[h], v8[h], 160, 256.0, reverse, bits, flush))
