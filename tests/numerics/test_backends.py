"""The fused CPU kernels and the torch code path compute the same diagnosis."""

import math

import numpy as np
import pytest
import torch

from attncheck.judge import diagnose
from attncheck.numerics.cells.diagnose import Options
from attncheck.numerics.rowmath import kl_divergence

from .cells.test_diagnose import problem_rows

numba = pytest.importorskip("numba")
K = pytest.importorskip("attncheck.numerics.backends.numba_kernels")


@numba.njit
def _map(f, xs):
    out = np.empty_like(xs)
    for i in range(xs.size):
        out[i] = f(xs[i])
    return out


@numba.njit
def _widen(bits):
    out = np.empty(bits.size)
    for i in range(bits.size):
        out[i] = K.to_f64(bits[i])
    return out


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the float64 spacing at want (subnormal spacing below 2^-1022)."""
    return np.abs(got - want) / np.spacing(np.abs(want))


def test_exp_neg_is_within_two_ulp_of_libm_exp_down_to_zero():
    rng = np.random.default_rng(0)
    z = np.concatenate(
        [
            -rng.uniform(0, 760, 200_000),
            -rng.uniform(700, 746, 20_000),  # results near and below the smallest normal, then 0
            -np.abs(rng.normal(0, 1e-3, 20_000)),
            [0.0, -0.0, -np.inf, -745.0, -745.13, -745.2, -746.0, -800.0, -1e300, -1e-300],
        ]
    )
    got, want = _map(K.exp_neg, z), np.exp(z)
    normal = want >= np.finfo(np.float64).tiny
    assert ulps(got[normal], want[normal]).max() <= 2
    assert np.abs(got[~normal] - want[~normal]).max() <= np.finfo(np.float64).smallest_subnormal  # one subnormal step
    assert got[z == 0].tolist() == [1.0, 1.0] and got[np.isneginf(z)].tolist() == [0.0]


def test_log_pos_is_within_a_few_ulp_of_libm_log():
    rng = np.random.default_rng(1)
    y = np.concatenate(
        [
            np.exp(rng.uniform(-700, 700, 200_000)),
            1 + rng.normal(0, 1e-6, 20_000),  # log near 0, where an absolute error would show
            [1.0, 2.0, 0.5, np.sqrt(0.5), np.sqrt(2.0), np.finfo(np.float64).tiny, np.finfo(np.float64).max],
        ]
    )
    got, want = _map(K.log_pos, y), np.log(y)
    assert got[y == 1.0].tolist() == [0.0]
    nz = want != 0
    assert ulps(got[nz], want[nz]).max() <= 4


@pytest.mark.parametrize("dtype, view", [(torch.float16, np.uint16), (torch.bfloat16, np.int16)])
def test_every_16_bit_pattern_widens_exactly(dtype, view):
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    got = _widen(bits.numpy().view(view))
    want = values.double().numpy()
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 and negative subnormals too


def kl_exact(r: float, q: float) -> float:
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    r, q = mpmath.mpf(r), mpmath.mpf(q)
    return float(q if r == 0 else r * mpmath.log(r / q) - r + q)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 14])
def test_estrin_evaluates_the_polynomial_horner_does(n):
    """_estrin (the KL series' evaluation order) against the exact value of the polynomial in
    rationals, for n coefficients of mixed signs at |x| < 0.1: within 2 ulp of the sum of the
    terms' magnitudes, as Horner is."""
    from fractions import Fraction

    rng = np.random.default_rng(n)
    coeffs = tuple(float(c) for c in rng.uniform(-1, 1, n))
    xs = np.concatenate([rng.uniform(-0.1, 0.1, 200), [0.0, 1e-12, -0.0999]])

    @numba.njit
    def both(xs):
        out = np.empty((2, xs.size))
        for i in range(xs.size):
            out[0, i] = K._estrin(xs[i], coeffs)
            out[1, i] = K._horner(xs[i], coeffs)
        return out

    got = both(xs)
    for x, e, h in zip(xs.tolist(), got[0].tolist(), got[1].tolist()):
        exact = sum(Fraction(c) * Fraction(x) ** (n - 1 - i) for i, c in enumerate(coeffs))
        scale = sum(abs(c * x ** (n - 1 - i)) for i, c in enumerate(coeffs))
        assert abs(Fraction(e) - exact) <= 2 * np.spacing(scale), (x, e, float(exact))
        assert abs(Fraction(h) - exact) <= 2 * np.spacing(scale), (x, h, float(exact))


@pytest.mark.parametrize("keys", [1, 7, 8, 13, 64, 1000])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_kl_rest_gather_keeps_exactly_the_flagged_keys_in_order(keys, density):
    """Both ways of gathering the KL terms left to log (word skipping for few, one pass for
    many) against numpy's boolean indexing, q floored as the metrics take it."""
    rng = np.random.default_rng(keys)
    floor = 1e-45
    pb = np.where(rng.uniform(size=keys) < 0.3, 0.0, rng.uniform(0, 1, keys))
    ref = rng.uniform(0, 1, keys)
    flags = np.zeros(-(-keys // 8) * 8, np.uint8)
    flags[:keys] = rng.uniform(size=keys) < density
    kb = np.full((2, keys + 1), np.nan)
    n = K._kl_rest_gather(pb, ref, floor, flags, int(flags.sum()), kb)
    keep = flags[:keys].astype(bool)
    assert n == keep.sum()
    assert np.array_equal(kb[0, :n], ref[keep])
    assert np.array_equal(kb[1, :n], np.maximum(pb[keep], floor))


@pytest.mark.parametrize("short", [False, True])
def test_kl_terms_on_both_sides_of_the_series_limit(short):
    """Each KL term of cell_rows, series (|delta| < 0.1, or the short one below 2^-10) or log
    (the rest), matches 50 digits."""
    rng = np.random.default_rng(2)
    t = 384
    r = rng.uniform(1e-4, 1e-2, (8, t))
    r /= r.sum(axis=1, keepdims=True)
    delta = np.concatenate(
        [
            np.geomspace(1e-9, 0.3, t // 3) * rng.choice([-1, 1], t // 3),
            K.SERIES_LIMIT * (1 + np.linspace(-1e-3, 1e-3, t // 3)) * rng.choice([-1, 1], t // 3),
            K.SHORT_LIMIT * (1 + np.linspace(-1e-3, 1e-3, t // 3)) * rng.choice([-1, 1], t // 3),
        ]
    )
    q = (r / (1 + delta)).astype(np.float32)  # r = q (1 + delta); q is what the cell output
    q[1, :10] = 0  # flushed keys: q = floor
    r[2, :5] = 0  # keys the reference gives no mass: term q
    r[3, :4], q[3, :4] = 1e-60, 0  # far below the floor: (r - q) / q rounds to -1, log1p(-1) = -inf
    floor = float(np.finfo(np.float32).smallest_subnormal)
    ok, top = np.ones(8, np.bool_), np.zeros(8, np.int64)
    like = np.zeros((1, 1), np.float32)
    addresses = np.array([q.ctypes.data], np.int64)  # q stays alive across the call
    out = K.cell_rows(addresses, like, np.zeros(0, np.int64), like, np.full(1, floor), r, False, ok, r, ok, top, short)
    kl = out[6][0]
    kl_torch = kl_divergence(torch.from_numpy(r), torch.from_numpy(q), floor)  # the torch path's formula
    for i in range(8):
        want = math.fsum(kl_exact(a, max(float(b), floor)) for a, b in zip(r[i], q[i]))
        assert kl[i] == pytest.approx(want, rel=1e-12), i
        assert kl_torch[i].item() == pytest.approx(want, rel=1e-9), i


def test_row_checks_route_nan_and_inf_rows_to_the_exact_path():
    x = np.zeros((5, 7), np.float32)
    x[0, 2] = np.nan
    x[1, 3] = np.inf
    x[2] = -np.inf
    x[3, :6] = -np.inf
    x[4] = np.arange(7)
    ref = np.empty(x.shape)
    out = K.reference_rows(x, 0.0, -1e4, ref)
    nan, posinf, neginf, masked, finite, fmax, fmin, umin, s1, s2, ssum, ent, jac, pos, top = out
    assert nan.tolist() == [1, 0, 0, 0, 0] and posinf.tolist() == [0, 1, 0, 0, 0] and neginf.tolist() == [0, 0, 7, 6, 0]
    assert finite.tolist() == [6, 6, 0, 1, 7] and top.tolist() == [0, 3, 0, 6, 6]
    assert np.isnan(ssum[:3]).all() and np.isnan(ref[:3]).all()
    assert ref[3].tolist() == [0.0] * 6 + [1.0] and ent[3] == 0.0
    want = np.exp(np.arange(7.0) - 6) / np.exp(np.arange(7.0) - 6).sum()
    assert np.allclose(ref[4], want, rtol=1e-15, atol=0)


def test_census_mins_leave_out_masked_keys_at_any_position():
    """reference_rows' min of finite scores and min of unmasked ones, against numpy, where
    the keys left out sit anywhere in rows longer than a vector; a finite score as large as
    float64 goes, and rows with no key to count (+inf)."""
    big = np.finfo(np.float64).max
    limit = -1e4
    rng = np.random.default_rng(4)
    x = rng.normal(0, 5, (8, 37))
    x[0, ::3] = -np.inf
    x[1, 20:] = -1e5  # sentinels: finite, masked
    x[2, :] = -np.inf
    x[3, :] = -1e5
    x[4, :] = -np.inf
    x[4, 36] = big  # the only finite key is the largest float64
    x[5, :] = -np.inf
    x[5, 0] = -1e5  # one finite key, masked
    x[6, 36] = -np.inf
    ref = np.empty(x.shape)
    out = K.reference_rows(x, 0.0, limit, ref)
    fmin, umin = out[6], out[7]
    finite = np.where(np.isfinite(x), x, np.inf)
    unmasked = np.where(np.isfinite(x) & (x > limit), x, np.inf)
    assert fmin.tolist() == finite.min(axis=1).tolist()
    assert umin.tolist() == unmasked.min(axis=1).tolist()
    assert fmin[4] == big and fmin[2] == np.inf and umin[3] == np.inf and umin[5] == np.inf and fmin[5] == -1e5


def both_paths(x, **opts):
    return diagnose("x", x, Options(kernels="fused", **opts)), diagnose("x", x, Options(kernels="torch", **opts))


def close(a, b, rel=1e-6):
    # The two float64 references use different exp implementations and differ by a few
    # float64 ulps (~1e-15); fp32 cells' errors are ~1e-7, so they agree to ~1e-8 relative.
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_fused_and_torch_paths_agree(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.cat([problem_rows(), torch.randn(40, 16, generator=g) * 6]).to(dtype)
    x[10, :4] = float("-inf")  # partly masked
    fused, plain = both_paths(x, chunk_elements=200)
    for a, b in zip(fused.cells, plain.cells):
        assert (a.nan_causes, a.zero_causes, a.overflow_rows, a.argmax_flips, a.compared_rows) == (
            b.nan_causes,
            b.zero_causes,
            b.overflow_rows,
            b.argmax_flips,
            b.compared_rows,
        ), a.name
        for field in (
            "max_abs_err",
            "rmse",
            "max_abs_err_algo",
            "rmse_algo",
            "max_row_sum_err",
            "kl_mean",
            "kl_max",
            "flushed_frac",
        ):
            assert close(getattr(a, field), getattr(b, field)), (a.name, field, getattr(a, field), getattr(b, field))
    ca, cb = fused.census, plain.census
    assert (ca.nan, ca.posinf, ca.neginf, ca.masked, ca.fully_masked_rows, ca.min, ca.max, ca.sentinels) == (
        cb.nan,
        cb.posinf,
        cb.neginf,
        cb.masked,
        cb.fully_masked_rows,
        cb.min,
        cb.max,
        cb.sentinels,
    )
    assert close(ca.mean, cb.mean, 1e-12) and close(ca.std, cb.std, 1e-12)
    assert ca.headroom == cb.headroom
    da, db = fused.distribution, plain.distribution
    for field in (
        "entropy_mean",
        "entropy_min",
        "entropy_max",
        "entropy_norm_mean",
        "max_prob_mean",
        "jacobian_norm_mean",
    ):
        # entropy = log S - sum(p z): ~1e-16 absolute error, ~1e-11 relative on a near one-hot row
        assert close(getattr(da, field), getattr(db, field), 1e-9), field
    assert da.collapsed_rows == db.collapsed_rows
    assert [f.code for f in fused.findings] == [f.code for f in plain.findings]


@pytest.mark.parametrize("methods", [("tiled",), ("torch", "tiled", "naive"), ("stable", "naive")])
@pytest.mark.parametrize("scale, keys", [(30.0, 300), (3.0, 1)])
def test_paths_agree_on_wide_rows_and_any_method_set(methods, scale, keys):
    """Rows wider than the vector loops, values that flush fp16 probabilities to subnormals
    and zeros (the KL terms taken through log), masked keys, and methods in any order."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, keys, generator=g) * scale
    x[::7, : keys // 2] = float("-inf")
    x[5, 0] = float("nan")
    fused, plain = both_paths(x, methods=methods, chunk_elements=4000)
    for a, b in zip(fused.cells, plain.cells):
        assert (a.name, a.nan_causes, a.overflow_rows, a.argmax_flips, a.compared_rows) == (
            b.name,
            b.nan_causes,
            b.overflow_rows,
            b.argmax_flips,
            b.compared_rows,
        )
        for field in (
            "max_abs_err",
            "rmse",
            "max_abs_err_algo",
            "rmse_algo",
            "max_row_sum_err",
            "kl_mean",
            "kl_max",
            "flushed_frac",
        ):
            assert close(getattr(a, field), getattr(b, field)), (a.name, field, getattr(a, field), getattr(b, field))


@pytest.mark.parametrize("use_kernels", ["fused", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_diagnose_never_modifies_its_input(use_kernels, dtype):
    x = problem_rows().to(dtype)
    before = x.clone()
    diagnose("x", x, Options(kernels=use_kernels))
    assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(x.isnan(), before.isnan())


# --------------------------------------------------------------------------- which backend runs


def test_the_backend_that_ran_is_recorded(monkeypatch):
    small = torch.randn(8, 32)
    assert diagnose("x", small, Options()).backend == "torch"  # below FUSED_MIN_ELEMENTS
    assert diagnose("x", small, Options(kernels="fused")).backend == "numba"
    assert diagnose("x", small, Options(kernels="torch")).backend == "torch"
    big = torch.randn(4096, 1024)  # 2^22 elements
    assert diagnose("x", big, Options(dtypes=("fp32",), methods=("torch",))).backend == "numba"
    monkeypatch.setenv("ATTNCHECK_KERNELS", "torch")  # switches 'auto' to torch
    assert diagnose("x", big, Options(dtypes=("fp32",), methods=("torch",))).backend == "torch"


def test_fused_without_numba_is_a_clear_error(monkeypatch):
    from attncheck.errors import AttncheckError
    from attncheck.numerics.backends import numba_rows, select_backend

    monkeypatch.setattr(numba_rows, "installed", lambda: False)
    with pytest.raises(AttncheckError, match=r"fused kernels need numba, which is not installed"):
        diagnose("x", torch.randn(4, 8), Options(kernels="fused"))
    assert (
        diagnose("x", torch.randn(4096, 1024), Options(dtypes=("fp32",), methods=("torch",))).backend == "torch"
    )  # auto falls back
    with pytest.raises(AttncheckError, match="fused kernels run on the CPU only"):
        select_backend("fused", torch.device("cuda"), 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_precise_hint_changes_no_number_beyond_rounding(dtype):
    """The short KL series that cell_metrics takes for fp32 cells gives the numbers the long one
    gives: maxima and counts bit for bit, sums (the KL included) to 1e-14 (the two variants of
    the loop may add in another order), on healthy rows, rows with failures, and cells of low
    precision whose terms mostly fall outside the short series."""
    from attncheck.numerics.backends.numba_rows import NumbaRows
    from attncheck.numerics.methods.softmax import run_method

    g = torch.Generator().manual_seed(3)
    x = torch.cat([problem_rows(), torch.randn(40, 16, generator=g) * 4, torch.randn(8, 16, generator=g) * 30])
    backend = NumbaRows()
    chunk = backend.chunk(x, 0, 0.0)
    xc = x.to(dtype)
    algo = backend.same_reference(chunk) if dtype == torch.float32 else backend.algo_reference(xc)
    probs = [run_method(m, xc).probs for m in ("naive", "stable", "torch", "tiled")]
    long = backend.cell_metrics(chunk, probs, algo, precise=False)
    short = backend.cell_metrics(chunk, probs, algo, precise=True)
    for a, b in zip(long, short):
        for name in ("pmax", "max_err", "flushed", "p_at_top"):
            assert torch.equal(getattr(a, name).nan_to_num(-1.0), getattr(b, name).nan_to_num(-1.0)), name
        for name in ("psum", "sq_err", "kl"):
            assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-14, atol=0), name
        assert bool((a.kl > 0).any())
