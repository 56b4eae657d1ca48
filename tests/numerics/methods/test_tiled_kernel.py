"""The fused ``tiled_rows`` kernel gives tiled's and the P cast's numbers bit for bit.

The torch implementations (``softmax.tiled_softmax``, ``fp8.pcast_softmax``) are checked on
their own against a sequential block-by-block loop and against closed forms
(test_softmax.py, test_fp8.py); here the kernel is held equal to them on every bit, on
masked, broken, short and long rows, every block size and both visiting orders, and its
rounding to each format is held equal to torch's own cast on every value of the format,
every midpoint between two of them and the values just beside each midpoint.
"""

import math

import numpy as np
import pytest
import torch

from attncheck.judge import diagnose
from attncheck.numerics.cells.diagnose import Options
from attncheck.numerics.methods.fp8 import pcast_softmax, to_fp8
from attncheck.numerics.methods.fp8_attention import Fp8Setup
from attncheck.numerics.methods.softmax import MethodParams, tiled_softmax
from attncheck.numerics.precision import rounding_limit
from attncheck.registry import METHODS

numba = pytest.importorskip("numba")
K = pytest.importorskip("attncheck.numerics.backends.numba_kernels")
from attncheck.numerics.backends.numba_rows import NumbaRows, format_of  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@numba.njit
def _round_all(xs, mb, emin, top):
    out = np.empty_like(xs)
    for i in range(xs.size):
        out[i] = K.round_to_format(xs[i], mb, emin, top)
    return out


def _values_and_midpoints(dt: torch.dtype) -> torch.Tensor:
    """Every finite value >= 0 of ``dt``, the midpoint of each neighbouring pair, the float32
    values one ulp either side of each midpoint, and values past the top (float32)."""
    bits = 8 * torch.empty(0, dtype=dt).element_size()
    ints = torch.arange(0, 1 << (bits - 1), dtype=torch.int32).to({8: torch.uint8, 16: torch.int16}[bits])
    v = ints.view(dt).float()
    v = v[torch.isfinite(v)].unique()  # sorted; drops NaN (and the fnuz formats' NaN pattern)
    mid = (v[:-1].double() + v[1:].double()) / 2
    mid32 = mid.float()
    assert torch.equal(mid32.double(), mid)  # a midpoint of these formats is a float32
    top = float(torch.finfo(dt).max)
    past = torch.tensor([top * 1.01, top * 1.5, top * 4, 3.0e38])
    return torch.cat([v, mid32, mid32.nextafter(torch.tensor(0.0)), mid32.nextafter(torch.tensor(math.inf)), past])


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, *FP8], ids=str)
def test_rounding_to_each_format_is_torchs_cast(dt):
    x = _values_and_midpoints(dt)
    mb, emin, top = format_of(dt)
    got = torch.from_numpy(_round_all(x.double().numpy(), mb, emin, top))
    if dt in FP8:
        want = to_fp8(x, dt).double()  # the kernels' conversion: nearest even, saturating
    else:
        keep = x <= top  # P <= 1 in tiled: fp16's overflow to inf is never reached
        x, got, want = x[keep], got[keep], x[keep].to(dt).double()
    bad = got != want
    assert not bool(bad.any()), (x[bad][:5], got[bad][:5], want[bad][:5])


def _problem_rows(dtype, rows, keys, block, g):
    x = (torch.randn(rows, keys, generator=g) * 6).to(dtype)
    x[0] = float("-inf")  # fully masked
    x[1, : min(block, keys)] = float("-inf")  # a leading fully masked block
    x[2, 0] = float("nan")  # left to the torch implementation
    x[3, -1] = float("inf")
    x[4] = 60.0  # ties
    x[5, ::3] = -1e4  # a sentinel mask
    x[6] = x[6] - 200  # exps of the first block all flush before the max arrives
    return x


def _tiled_by_kernel(x, block, reverse, fp8=None):
    backend = NumbaRows()
    algo = backend.algo_reference(x)
    out = backend.method(METHODS.get("tiled"), algo, MethodParams(block=block, reverse=reverse, fp8=fp8))
    return out, algo


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("keys, block", [(1024, 128), (300, 7), (64, 128), (5, 1), (1, 128), (257, 64)])
@pytest.mark.parametrize("reverse", [False, True])
def test_tiled_kernel_is_tiled_softmax_bit_for_bit(dtype, keys, block, reverse):
    g = torch.Generator().manual_seed(keys * 7 + block)
    x = _problem_rows(dtype, 40, keys, block, g)
    out, _ = _tiled_by_kernel(x, block, reverse)
    want = tiled_softmax(x, block=block, reverse=reverse)
    assert out.probs.dtype == torch.float32 and out.probs.shape == x.shape
    assert same(out.probs, want)


@pytest.mark.parametrize("p_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("keys, block", [(1024, 128), (300, 7), (1, 128)])
@pytest.mark.parametrize("reverse", [False, True])
def test_flash_online_softmax_of_fp32_scores_is_the_torch_implementation_bit_for_bit(p_dtype, keys, block, reverse):
    """The flash path's softmax: fp32 S, P rounded to the cell's dtype (the fused backend's
    ``online`` against ``methods.online.online_softmax``)."""
    from attncheck.numerics.methods.online import online_softmax

    x = _problem_rows(torch.float32, 40, keys, block, torch.Generator().manual_seed(keys + block))
    got = NumbaRows().online(x, p_dtype, block, reverse)
    assert same(got, online_softmax(x, p_dtype, min(block, keys), reverse))


@pytest.mark.parametrize("fmt", FP8, ids=str)
@pytest.mark.parametrize("p_scale", [1.0, 256.0, 448.0, 1000.0])
@pytest.mark.parametrize("reverse", [False, True])
def test_pcast_kernel_is_pcast_softmax_bit_for_bit(fmt, p_scale, reverse):
    """Probabilities, the overflow of S past the format's top, and the counts by block
    position (live keys, flushed keys, flushed mass) as the torch implementation gives them."""
    g = torch.Generator().manual_seed(int(p_scale) + 3 * reverse)
    x = _problem_rows(torch.float32, 48, 300, 64, g)
    x[7:20, :4] += 30.0  # attention sinks in the first block: forward order flushes what follows
    out, algo = _tiled_by_kernel(x, 64, reverse, Fp8Setup(fmt=fmt, p_scale=p_scale))
    want = pcast_softmax(x, fmt, p_scale, 64, reverse)
    assert same(out.probs, want.probs)
    assert torch.equal(out.pcast.overflow, want.overflow) and bool(want.overflow[8:].any()) is (
        p_scale >= rounding_limit(fmt)
    )
    rows = algo.ok & ~torch.isnan(out.probs).any(dim=-1)
    a, b = out.pcast.tally(algo.ref, rows), want.tally(algo.ref, rows)
    assert torch.equal(a.live, b.live) and torch.equal(a.flushed, b.flushed)
    assert a.mass.shape == b.mass.shape and torch.allclose(a.mass, b.mass, rtol=1e-12, atol=0)
    assert int(a.flushed.sum()) > 0  # the check sees flushed keys


def test_fp8_cells_agree_between_the_fused_and_torch_backends():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 512, generator=g) * 3
    x[:16, :2] += 25.0
    opts = dict(dtypes=("fp32", "e4m3", "e5m2"), methods=("tiled",), chunk_elements=5000)
    fused = diagnose("x", x, Options(kernels="fused", **opts))
    plain = diagnose("x", x, Options(kernels="torch", **opts))
    for a, b in zip(fused.cells, plain.cells):
        assert a.name == b.name
        for f in (
            "pcast_flushed_frac",
            "pcast_flushed_by_position",
            "pcast_rows",
            "pcast_mass_rows",
            "nan_rows",
            "zero_rows",
        ):
            assert getattr(a, f) == getattr(b, f), (a.name, f)
        for f in ("rmse", "max_abs_err", "kl_mean"):  # the two float64 references differ by a few ulp
            assert math.isclose(getattr(a, f), getattr(b, f), rel_tol=1e-6), (a.name, f)
        if a.pcast_mass_max is not None:
            assert math.isclose(a.pcast_mass_max, b.pcast_mass_max, rel_tol=1e-12)
    assert fused.cell("tiled", "e4m3").pcast_rows > 0


def test_rows_the_kernel_leaves_are_the_torch_implementations():
    """A chunk of NaN and +inf rows only: every row goes to the torch implementation."""
    x = torch.full((4, 8), float("nan"))
    x[2:] = float("inf")
    out, _ = _tiled_by_kernel(x, 4, False)
    assert same(out.probs, tiled_softmax(x, block=4))
