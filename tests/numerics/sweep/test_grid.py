"""The sweep's measurements against theory, seed 004's worked table and torch.finfo.

Variance bands. Let s = q . k with i.i.d. zero-mean entries, E[x^2] = v, E[x^4] = m4.
Pairing indices in E[s^4] = sum E[q_a q_b q_c q_e] E[k_a k_b k_c k_e] gives
E[s^4] = d m4^2 + 3 d (d - 1) v^4, so Var(s^2) = d m4^2 + (2 d^2 - 3 d) v^4
(normal entries: 2 d^2 + 6 d). Two logits of one row share q: they are
uncorrelated but E[s^2 s'^2] = v^2 E[|q|^4] = v^2 (d m4 + d (d - 1) v^2), so
Cov(s^2, s'^2) = d v^2 (m4 - v^2) (normal: 2 d); the same holds for two rows of a
head sharing a key. With heads of Q queries over S keys and N = rows * S logits,
Var(mean s^2) = (Var(s^2) + ((S - 1) + (Q - 1)) Cov) / N. The sample variance is
mean(s^2) up to O(1/N), so its standard error is the square root of that, and a
factor c scales it by c^2. Bands are 5 standard errors.
"""

import math

import pytest
import torch

from attncheck.cli.common import flag
from attncheck.config.sweep import SweepConfig
from attncheck.errors import AttncheckError
from attncheck.numerics.methods.softmax import reference_softmax
from attncheck.numerics.precision import exp_overflow_threshold
from attncheck.numerics.sweep.grid import row_stats, run_sweep
from attncheck.numerics.sweep.theory import naive_overflow_log_probability, naive_overflow_probability
from attncheck.params import Scale
from attncheck.params import scale as parse_scale

from ...conftest import DEVICES

SCALES = tuple(Scale(s) for s in ("none", "sqrt", "dk", "dk2"))
FP16_EXP_OVERFLOW = math.log(torch.finfo(torch.float16).max)  # ~11.09: exp(x) > 65504


def _point(result, dk, scale):
    return next(p for p in result.points if p.dk == dk and p.scale == scale)


def _cell(point, method, dtype):
    return next(c for c in point.cells if c.method == method and c.dtype == dtype)


# --------------------------------------------------------------------------- seed 004's table


# softmax([12, 8, 10] * factor) at d_k = 16, as printed in seed 004 (3 decimals).
SEED_004 = {
    "none": [0.867, 0.016, 0.117],
    "sqrt": [0.506, 0.186, 0.307],
    "dk": [0.376, 0.293, 0.332],
    "dk2": [0.336, 0.331, 0.333],
}


@pytest.mark.parametrize("name", list(SEED_004))
def test_scale_factors_reproduce_seed_004_table(name):
    factor = parse_scale(name).value(16)
    p = reference_softmax(torch.tensor([12.0, 8.0, 10.0], dtype=torch.float64) * factor)
    assert [round(v, 3) for v in p.tolist()] == SEED_004[name]


def test_row_stats_of_seed_004_rows():
    x = torch.tensor([[12.0, 8.0, 10.0]], dtype=torch.float64)
    for name, probs in SEED_004.items():
        stats = row_stats(reference_softmax(x * parse_scale(name).value(16)))
        assert stats.max_prob_mean == pytest.approx(probs[0], abs=6e-4)
    # Entropy of the unscaled row, from the seed's probabilities by hand: ~0.441 nats.
    stats = row_stats(reference_softmax(x))
    p = [math.exp(v) for v in (12, 8, 10)]
    p = [v / sum(p) for v in p]
    assert stats.entropy_mean == pytest.approx(-sum(v * math.log(v) for v in p), rel=1e-12)
    assert stats.entropy_norm_mean == pytest.approx(stats.entropy_mean / math.log(3), rel=1e-12)


def test_seed_004_variance_claims_at_dk_64():
    """Var after scaling = factor^2 * d_k. Seed 004 prints two slips here: 1/64^3 is 3.81e-6
    (it says 3.8e-5), and 3 sigma of the 1/d_k case is 3 * sqrt(1/64) = 0.375 (it says 0.9375)."""
    var = {s.name: s.value(64) ** 2 * 64 for s in SCALES}
    assert var["none"] == 64
    assert var["sqrt"] == pytest.approx(1.0, rel=1e-15)
    assert var["dk"] == pytest.approx(1 / 64, rel=1e-15)
    assert var["dk2"] == pytest.approx(3.81e-6, abs=0.005e-6)
    assert 3 * math.sqrt(var["dk"]) == pytest.approx(0.375)
    assert 3 * math.sqrt(var["dk2"]) == pytest.approx(0.00586, rel=1e-3)


# --------------------------------------------------------------------------- scale parsing


@pytest.mark.parametrize(
    "text,dk,value",
    [
        ("none", 64, 1.0),
        ("sqrt", 64, 0.125),
        ("dk", 64, 1 / 64),
        ("dk2", 8, 1 / 64),
        ("0.3", 64, 0.3),
        (" SQRT ", 16, 0.25),
        ("2e-3", 4, 0.002),
    ],
)
def test_parse_scale(text, dk, value):
    assert parse_scale(text).value(dk) == pytest.approx(value, rel=1e-15)


def test_numeric_scale_keeps_its_name_as_given():
    assert parse_scale("0.125").name == "0.125"


HELP = "none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, dk2 = 1/d_k^2 or a positive number"


@pytest.mark.parametrize("text", ["foo", "-1", "0", "nan", "inf"])
def test_bad_scales_are_refused(text):
    with pytest.raises(AttncheckError) as e:
        parse_scale(text)
    assert (
        e.value.render(flag)
        == "--scale must be one of none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, dk2 = 1/d_k^2 or a "
        f"positive number, got {text!r}"
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dks=(16, 0)), "--dk must be an integer >= 1, got 0"),
        (dict(seqs=(1,)), "--seq must be an integer >= 2, got 1"),
        (dict(rows=1), "--rows must be an integer >= 2, got 1"),
        (dict(stds=(-1.0,)), "--std must be a number > 0, got -1.0"),
        (dict(dist="cauchy"), "--dist must be one of normal, outliers, got 'cauchy'"),
        (dict(dtypes=("fp8",)), "--dtype: unknown dtype 'fp8' (choose from fp16, bf16, fp32)"),
        # float64 q (R, d), k and v (R/Q heads x S, d each), 12 float64 (R, S) and 3 (R, d) working tensors:
        # 8 (3 * 1e8 * 512) + 96 * 1e8 * 128 + 24 * 1e8 * 512 bytes = 3.69e12 B = 3,433 GiB.
        (
            dict(rows=10**8),
            "a sweep point of 100000000 rows x 128 keys x d_k 512 needs about 3,433 GiB of memory, over the 2 GiB "
            "budget: lower --rows, --seq or --dk",
        ),
    ],
)
def test_config_refuses_bad_values(kwargs, message):
    """The library names parameters (dks, seqs); the command line shows them as its flags."""
    with pytest.raises(AttncheckError) as e:
        SweepConfig(**kwargs)
    assert e.value.render(flag) == message


# --------------------------------------------------------------------------- variance vs theory


def _stderr_of_variance(dk, rows, seq, v, m4):
    assert rows % seq == 0  # whole heads of `seq` queries: every logit has S - 1 and Q - 1 partners
    n = rows * seq
    var_s2 = dk * m4**2 + (2 * dk * dk - 3 * dk) * v**4
    cov = dk * v * v * (m4 - v * v)
    return math.sqrt((var_s2 + 2 * (seq - 1) * cov) / n)


@pytest.mark.parametrize(
    "dist,std,v,m4",
    [
        ("normal", 1.0, 1.0, 3.0),
        ("normal", 0.5, 0.25, 3 * 0.5**4),
        ("outliers", 1.0, 1.1, 3 * (0.999 + 0.001 * 101**2)),
    ],
    ids=["normal", "normal-std0.5", "outliers"],
)
def test_measured_variance_within_5_standard_errors_for_every_scale(dist, std, v, m4):
    rows, seq = 2048, 64
    config = SweepConfig(
        dks=(16, 128),
        scales=(*SCALES, Scale("0.3")),
        dtypes=("fp32",),
        methods=("torch",),
        seqs=(seq,),
        stds=(std,),
        rows=rows,
        dist=dist,
        seed=3,
    )
    points = run_sweep(config).points
    assert len(points) == 10
    for p in points:
        c = {"none": 1.0, "sqrt": p.dk**-0.5, "dk": 1 / p.dk, "dk2": p.dk**-2.0, "0.3": 0.3}[p.scale]
        theory = p.dk * v * v
        se = _stderr_of_variance(p.dk, rows, seq, v, m4)
        assert p.var_qk_stderr == pytest.approx(se, rel=1e-12)  # what the table's z divides by
        assert abs(p.var_qk - theory) <= 5 * se, (p.dk, p.var_qk, theory, se)
        assert abs(p.var_scaled - c * c * theory) <= 5 * c * c * se, (p.dk, p.scale, p.var_scaled)
        assert p.var_scaled_theory == pytest.approx(c * c * theory, rel=1e-12)
        if dist == "normal":  # the band is narrow enough to catch a wrong law (d_k vs d_k +- 10%)
            assert 5 * se < 0.1 * theory
        elif p.dk == 128:  # heavy tails widen it, yet it still tells the mixture from a plain N(0, 1)
            assert 5 * se < theory - p.dk * std**4


# --------------------------------------------------------------------------- collapse and gradient


@pytest.fixture(scope="module")
def shape_sweep():
    return run_sweep(SweepConfig(dks=(16, 256), seqs=(128,), rows=512, seed=1))


def test_max_prob_falls_and_entropy_rises_from_none_to_dk2(shape_sweep):
    for dk in (16, 256):
        pts = [_point(shape_sweep, dk, s.name) for s in SCALES]
        max_p = [p.max_prob_mean for p in pts]
        ent = [p.entropy_mean for p in pts]
        assert all(a > b for a, b in zip(max_p, max_p[1:])), (dk, max_p)
        assert all(a < b for a, b in zip(ent, ent[1:])), (dk, ent)


def test_dk2_is_nearly_uniform_and_none_collapses_at_large_dk(shape_sweep):
    seq = 128
    # Uniform over S keys: max p = 1/S, entropy = log S, and ||diag(p) - p p^T||_F built explicitly.
    u = torch.full((seq,), 1.0 / seq, dtype=torch.float64)
    j_uniform = float(torch.linalg.matrix_norm(torch.diag(u) - torch.outer(u, u)))
    flat = _point(shape_sweep, 256, "dk2")
    assert flat.max_prob_mean == pytest.approx(1 / seq, rel=0.02)
    assert flat.entropy_norm_mean == pytest.approx(1.0, abs=1e-4)
    assert flat.jacobian_norm_mean == pytest.approx(j_uniform, rel=1e-3)
    sharp = _point(shape_sweep, 256, "none")
    assert sharp.collapsed_rate > 0.3 and sharp.max_prob_mean > 0.8


def test_collapsed_rows_have_a_smaller_jacobian_than_sqrt_scaled_rows(shape_sweep):
    """With p_max = 1 - e, every entry of diag(p) - p p^T is bounded by e-terms:
    ||J||_F^2 <= e^2 + 2 e^2 + e^2 + e^4, so ||J||_F <= ~2 e = 0.02 for p_max >= 0.99."""
    for dk in (16, 256):
        collapsed = _point(shape_sweep, dk, "none").jacobian_norm_collapsed_mean
        healthy = _point(shape_sweep, dk, "sqrt").jacobian_norm_mean
        assert collapsed is not None
        assert collapsed <= 2.0001 * 0.01
        assert collapsed < healthy / 5


def test_row_stats_of_one_hot_rows():
    p = torch.zeros(4, 16, dtype=torch.float64)
    p[:, 3] = 1.0
    s = row_stats(p)
    assert (s.max_prob_mean, s.entropy_mean, s.jacobian_norm_mean, s.collapsed_rate) == (1.0, 0.0, 0.0, 1.0)


# --------------------------------------------------------------------------- overflow and NaN


def test_naive_fp16_overflows_unscaled_dk256_and_not_sqrt_scaled(shape_sweep):
    """Unscaled d_k = 256: x ~ N(0, 256), each of 128 keys exceeds ln(65504) ~ 11.09 with
    probability ~0.24, so every row overflows. Scaled by 1/16: x ~ N(0, ~1), P(x > 11.09) ~ 1e-28."""
    assert FP16_EXP_OVERFLOW == pytest.approx(11.09, abs=0.01)
    hot = _cell(_point(shape_sweep, 256, "none"), "naive", "fp16")
    assert hot.exp_overflow_rate == 1.0 and hot.overflow_rate == 1.0 and hot.nan_rate == 1.0
    assert hot.max_abs_err is None  # no row left to compare
    cool = _cell(_point(shape_sweep, 256, "sqrt"), "naive", "fp16")
    assert cool.exp_overflow_rate == 0.0 and cool.overflow_rate == 0.0 and cool.nan_rate == 0.0
    assert cool.exp_overflow_rate_theory < 1e-20


def test_stable_never_nan_on_finite_logits(shape_sweep):
    for p in shape_sweep.points:
        for c in p.cells:
            if c.method == "stable":
                assert c.nan_rate == 0.0 and c.overflow_rate == 0.0, (p.dk, p.scale, c.dtype)


def test_stable_never_nan_with_outliers_unscaled():
    config = SweepConfig(
        dks=(512,), scales=(Scale("none"),), methods=("stable", "naive"), seqs=(128,), rows=256, dist="outliers", seed=2
    )
    point = run_sweep(config).points[0]
    # The logits are finite in every dtype (|x| well below fp16's 65504), so stable has no excuse.
    assert point.var_scaled < (torch.finfo(torch.float16).max / 50) ** 2
    for dtype in ("fp16", "bf16", "fp32"):
        assert _cell(point, "stable", dtype).nan_rate == 0.0
    assert _cell(point, "naive", "fp16").nan_rate == 1.0


def test_errors_within_rounding_bound_when_nothing_overflows(shape_sweep):
    """Sqrt-scaled logits stay within |x| < ~6: casting x costs |x| eps/2 in the exponent and
    the softmax a few eps more, so |p - p_float64| <= 20 eps (a loose, independent bound)."""
    for dk in (16, 256):
        for c in _point(shape_sweep, dk, "sqrt").cells:
            eps = torch.finfo(getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[c.dtype])).eps
            assert c.max_abs_err is not None and 0 < c.max_abs_err <= 20 * eps, (dk, c)


def test_gaussian_tail_prediction_matches_measured_overflow():
    """d_k = 16 unscaled in fp16 sits on the edge: about a third of the rows overflow."""
    config = SweepConfig(
        dks=(16,), scales=(Scale("none"),), dtypes=("fp16",), methods=("naive",), seqs=(128,), rows=4096, seed=4
    )
    c = run_sweep(config).points[0].cells[0]
    assert 0.1 < c.exp_overflow_rate_theory < 0.9
    # Binomial standard error over 4096 rows is ~0.0074; rows of a head share keys, so allow 0.04.
    assert abs(c.exp_overflow_rate - c.exp_overflow_rate_theory) < 0.04
    # `run` also counts rows whose row sum alone overflows, so its share is at least as large.
    assert c.overflow_rate >= c.exp_overflow_rate
    assert c.nan_rate == c.exp_overflow_rate  # each exp overflow gives inf / inf


def test_overflow_probability_reduces_to_the_plain_gaussian_tail_for_huge_dk():
    """For d_k = 1e6, |q|/sqrt(d_k) is 1 to within 1e-3, so x_j ~ N(0, 1) and
    P(row overflows) = 1 - (1 - Q(t))^S exactly, Q the normal tail."""
    dk, seq, t = 10**6, 128, 3.0
    q_tail = 0.5 * math.erfc(t / math.sqrt(2))
    expected = 1 - (1 - q_tail) ** seq
    got = naive_overflow_probability(t, dk**-0.5, dk, seq, 1.0, 1.0)
    assert got == pytest.approx(expected, rel=2e-3)
    assert naive_overflow_probability(t, dk**-0.5, dk, seq, 4.0, 1.0) > got  # larger q variance overflows more


@pytest.mark.parametrize("device", DEVICES)
def test_sweep_runs_on_device(device):
    config = SweepConfig(dks=(32,), scales=(Scale("sqrt"),), seqs=(64,), rows=128, device=device)
    result = run_sweep(config)
    assert result.device.startswith(device)
    assert all(c.nan_rate == 0 for c in result.points[0].cells)


# --------------------------------------------------------------------------- the Gaussian tail, deep


def _mp_log_tail(threshold: float, scale: float, dk: int) -> float:
    """log P(x > threshold) for x = scale q.k, q and k N(0, I_dk): q.k has the variance-gamma
    density |x|^n K_n(|x|) / (2^n sqrt(pi) Gamma(n + 1/2)), n = (dk - 1) / 2, integrated
    with mpmath at 40 digits (an independent route: no chi quadrature, no erfc)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    a, n = mpmath.mpf(threshold) / mpmath.mpf(scale), mpmath.mpf(dk - 1) / 2
    norm = 2**n * mpmath.sqrt(mpmath.pi) * mpmath.gamma(n + mpmath.mpf(1) / 2)
    pts = [a + s for s in (0, 0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 100, 200)] + [mpmath.inf]
    return float(mpmath.log(mpmath.quad(lambda x: x**n * mpmath.besselk(n, x), pts) / norm))


def _mp_log_chi_integral(threshold: float, scale: float, dk: int, seq: int) -> float:
    """log E_w[1 - (1 - Q(a / w))^seq] over the chi_dk density, with mpmath at 40 digits."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    a = mpmath.mpf(threshold) / mpmath.mpf(scale)
    log_norm = (mpmath.mpf(dk) / 2 - 1) * mpmath.log(2) + mpmath.loggamma(mpmath.mpf(dk) / 2)

    def f(w):
        if w == 0:
            return mpmath.mpf(0)
        tail = mpmath.erfc(a / w / mpmath.sqrt(2)) / 2
        return mpmath.exp((dk - 1) * mpmath.log(w) - w * w / 2 - log_norm) * (1 - (1 - tail) ** seq)

    c = math.sqrt(dk)
    pts = sorted({0.0, *(max(0.01, c + s) for s in (-12, -6, -3, -1, 0, 1, 3, 6, 12, 25))})
    return float(mpmath.log(mpmath.quad(f, pts + [mpmath.inf])))


DEEP_TAIL = [  # (dtype, d_k, scale): predictions from 1e-29 down to 1e-10,099,592
    ("bf16", 16, "none"),
    ("fp16", 32, "dk"),
    ("fp32", 16, "sqrt"),
    ("bf16", 64, "sqrt"),
    ("fp16", 64, "dk"),
    ("bf16", 128, "sqrt"),
    ("fp32", 512, "dk2"),
]


@pytest.mark.parametrize("dtype, dk, scale", DEEP_TAIL)
def test_overflow_prediction_deep_in_the_tail_matches_mpmath(dtype, dk, scale):
    """Where seq P(x > t) < 1e-28 the row probability is seq P(x > t) to 28 digits, so
    log P = log seq + log of the variance-gamma tail. The old quadrature (|q| in sqrt(d) +- 12,
    erfc underflowing) gave 5e-324 at d_k = 64, 1/sqrt(d_k), bf16, where the answer is 1.04e-261."""
    t = exp_overflow_threshold(getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[dtype]))
    c = parse_scale(scale).value(dk)
    exact = math.log(128) + _mp_log_tail(t, c, dk)
    assert exact < math.log(1e-28)
    got = naive_overflow_log_probability(t, c, dk, 128, 1.0, 1.0)
    assert got == pytest.approx(exact, rel=1e-12, abs=1e-9)
    assert naive_overflow_probability(t, c, dk, 128, 1.0, 1.0) == (
        pytest.approx(math.exp(exact), rel=1e-9) if exact > -708 else 0.0
    )


@pytest.mark.parametrize(
    "t, dk, seq", [(11.09, 16, 128), (3.0, 1, 128), (3.0, 2, 16), (88.72, 256, 128), (11.09, 64, 128), (30.0, 4, 1000)]
)
def test_overflow_prediction_in_the_bulk_matches_mpmath(t, dk, seq):
    """Unscaled logits, where most of the chance comes from typical |q| and 1 - (1 - Q)^seq is not seq Q."""
    exact = _mp_log_chi_integral(t, 1.0, dk, seq)
    assert naive_overflow_log_probability(t, 1.0, dk, seq, 1.0, 1.0) == pytest.approx(exact, rel=1e-12, abs=1e-12)


def test_sweep_reports_deep_tail_predictions_in_range_and_their_log10():
    config = SweepConfig(
        dks=(64,), scales=(Scale("sqrt"), Scale("dk2")), dtypes=("bf16",), methods=("naive",), seqs=(128,), rows=64
    )
    sqrt_cell, dk2_cell = (_cell(p, "naive", "bf16") for p in run_sweep(config).points)
    t = exp_overflow_threshold(torch.bfloat16)
    exact = (math.log(128) + _mp_log_tail(t, 1 / 8, 64)) / math.log(10)
    assert exact == pytest.approx(-260.982, abs=1e-3)  # 1.04e-261
    assert sqrt_cell.exp_overflow_rate_theory == pytest.approx(10**exact, rel=1e-9)
    assert sqrt_cell.exp_overflow_rate_theory_log10 == pytest.approx(exact, rel=1e-12)
    # 1/d_k^2: ~1e-157,692, below float64's range: 0.0, and the exponent in the log10 field.
    exact = (math.log(128) + _mp_log_tail(t, 1 / 64**2, 64)) / math.log(10)
    assert dk2_cell.exp_overflow_rate_theory == 0.0
    assert dk2_cell.exp_overflow_rate_theory_log10 == pytest.approx(exact, rel=1e-12)
