"""Diagnosis: census, causes, metrics and distribution, each against an independent
numpy / float64 computation or a hand-derived expectation."""

import math

import numpy as np
import pytest
import torch

from attncheck.errors import AttncheckError
from attncheck.judge import diagnose
from attncheck.numerics.backends.numba_rows import NumbaRows
from attncheck.numerics.backends.torch_rows import TorchRows
from attncheck.numerics.cells.accumulate import CellAcc
from attncheck.numerics.cells.diagnose import Options
from attncheck.numerics.methods.softmax import run_method
from attncheck.numerics.rowmath import entropy, jacobian_frobenius, kl_divergence

from ..rounding import nearest

NEG = float("-inf")


def np_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        z = x - x.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)


def problem_rows() -> torch.Tensor:
    """One row per failure class (float32, 16 keys), in a known order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    x[0, 3] = float("nan")  # input_nan
    x[1, 5] = float("inf")  # inf_input
    x[2] = NEG  # fully masked with -inf
    x[3, 0] = 70000.0  # finite in fp32, +inf in fp16
    x[4, 7] = 12.0  # naive fp16 exp overflow only
    x[5] = -30.0 + torch.arange(16) / 16  # naive fp16: every exp flushes to 0
    x[6] = -1e9  # fully masked with a finite sentinel
    return x  # row 7 is healthy


@pytest.fixture(scope="module")
def problems():
    return diagnose("problems", problem_rows())


EXPECTED_NAN_CAUSES = {
    # naive: row 3 in bf16/fp32 overflows exp (70000 > 88.7); -1e9 flushes to 0/0.
    ("naive", "fp16"): {
        "input_nan": 1,
        "inf_input": 1,
        "fully_masked": 2,
        "cast_overflow": 1,
        "exp_overflow": 1,
        "underflow": 1,
    },
    ("naive", "bf16"): {"input_nan": 1, "inf_input": 1, "fully_masked": 2, "exp_overflow": 1},
    ("naive", "fp32"): {"input_nan": 1, "inf_input": 1, "fully_masked": 2, "exp_overflow": 1},
    # stable/torch: -1e9 is held by bf16/fp32 (uniform row), becomes -inf in fp16 (NaN).
    ("stable", "fp16"): {"input_nan": 1, "inf_input": 1, "fully_masked": 2, "cast_overflow": 1},
    ("stable", "bf16"): {"input_nan": 1, "inf_input": 1, "fully_masked": 1},
    ("stable", "fp32"): {"input_nan": 1, "inf_input": 1, "fully_masked": 1},
    ("torch", "fp16"): {"input_nan": 1, "inf_input": 1, "fully_masked": 2, "cast_overflow": 1},
    ("torch", "bf16"): {"input_nan": 1, "inf_input": 1, "fully_masked": 1},
    ("torch", "fp32"): {"input_nan": 1, "inf_input": 1, "fully_masked": 1},
    # tiled: fully masked rows give zeros, not NaN.
    ("tiled", "fp16"): {"input_nan": 1, "inf_input": 1, "cast_overflow": 1},
    ("tiled", "bf16"): {"input_nan": 1, "inf_input": 1},
    ("tiled", "fp32"): {"input_nan": 1, "inf_input": 1},
}


@pytest.mark.parametrize("cell", sorted(EXPECTED_NAN_CAUSES), ids=lambda c: f"{c[0]}-{c[1]}")
def test_nan_causes_per_cell(problems, cell):
    c = problems.cell(*cell)
    assert c.nan_causes == EXPECTED_NAN_CAUSES[cell]
    assert c.nan_rows == sum(EXPECTED_NAN_CAUSES[cell].values())


def test_tiled_fully_masked_rows_are_zero_rows(problems):
    assert problems.cell("tiled", "fp16").zero_causes == {"fully_masked": 2}
    assert problems.cell("tiled", "fp32").zero_causes == {"fully_masked": 1}
    assert problems.cell("tiled", "fp32").verdict == "nan"  # rows 0 and 1 are NaN


def test_overflow_rows(problems):
    # naive fp16: row 4 (12 > 11.09); row 3 is +inf after the cast, an input not an overflow.
    assert problems.cell("naive", "fp16").overflow_rows == 1
    assert problems.cell("naive", "fp32").overflow_rows == 1  # 70000 > 88.72
    assert problems.cell("stable", "fp16").overflow_rows == 0


def test_examples_name_the_rows(problems):
    c = problems.cell("naive", "fp16")
    assert c.examples["nan:input_nan"] == [(0,)]
    assert c.examples["nan:underflow"] == [(5,)]
    assert c.examples["nan:fully_masked"] == [(2,), (6,)]


@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_census_against_numpy(kernels):
    x = problem_rows()
    d = diagnose("p", x, Options(methods=("stable",), dtypes=("fp32",), kernels=kernels))
    a = x.numpy().astype(np.float64)
    finite = a[np.isfinite(a)]
    c = d.census
    assert (c.nan, c.posinf, c.neginf) == (1, 1, 16)
    assert c.min == finite.min() and c.max == finite.max()
    assert c.mean == pytest.approx(finite.mean(), rel=1e-12)
    assert c.std == pytest.approx(finite.std(), rel=1e-12)
    assert c.masked == 32  # row 2 (-inf) and row 6 (-1e9)
    assert c.sentinels == [(-1e9, 1)]  # the minimum of one row
    assert (c.fully_masked_rows, c.neginf_rows, c.nan_input_rows, c.posinf_input_rows) == (2, 1, 1, 1)


def test_headroom_counts_against_thresholds():
    x = problem_rows()
    d = diagnose("p", x, Options(methods=("stable",)))
    fp16 = next(h for h in d.census.headroom if h.dtype == "fp16")
    # Rows whose finite max exceeds 11.09: row 3 (70000) and row 4 (12).
    assert fp16.rows_over_exp_threshold == 2
    # Row max below -17.33: row 5 (-29.06) and row 6 (-1e9).
    assert fp16.rows_all_underflow == 2
    assert fp16.cast_posinf_values == 1 and fp16.cast_neginf_values == 16
    assert fp16.headroom == pytest.approx(math.log(65520) - 70000.0)
    fp32 = next(h for h in d.census.headroom if h.dtype == "fp32")
    assert fp32.cast_posinf_values == fp32.cast_neginf_values == 0


FP16_MID = 11.08984375  # halfway between fp16's 11.0859375 and 11.09375, on each side of ln(65520) = 11.0901


def headroom_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows whose maximum (or all of whose values) sit a rounding away from an exp threshold."""
    x = torch.zeros(6, 4, dtype=torch.float64)
    x[0] = torch.tensor([11.0899, 0, -1, -2], dtype=torch.float64)  # fp16: rounds up to 11.09375, exp overflows
    x[1] = torch.tensor(
        [88.73, 0, 0, 0], dtype=torch.float64
    )  # above 88.72, but bf16 rounds it down to 88.5 (fp16: 88.75, inf)
    x[2] = torch.tensor(
        [-17.33, -20, -30, -40], dtype=torch.float64
    )  # below ln(2^-25) = -17.3287; fp16 rounds it up to -17.328125
    x[3] = torch.tensor(
        [FP16_MID - 2.0**-40, 0, 0, 0], dtype=torch.float64
    )  # fp32 rounds it to the midpoint, fp16 that to even, up
    x[4] = torch.tensor(
        [-100.0, -200, -300, -400], dtype=torch.float64
    )  # every exp flushes in bf16 (-92.9), not in fp32 (-103.97)
    x[5] = torch.tensor([1.0, 2, 3, 4], dtype=torch.float64)
    return torch.cat([x, x[3:4].repeat(15, 1)]).to(dtype)  # 16 rows of the double-rounding row


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.parametrize("given", [torch.float32, torch.float64])
def test_headroom_counts_what_the_cast_scores_do(given, kernels):
    """The headroom counts rows by the scores the cells compute with: the scores as given rounded
    once to the dtype (numpy's float64 -> float16 cast here; torch's would round twice, through
    fp32), then torch's exp in the dtype."""
    x = headroom_rows(given)
    if given == torch.float64:  # the premise: torch rounds twice where a direct rounding does not overflow
        assert float(np.float16(x[3, 0].item())) == 11.0859375 and x[3:4, :1].to(torch.float16).item() == 11.09375
    d = diagnose("h", x, Options(methods=("naive",), kernels=kernels))
    for h in d.census.headroom:
        xc = x.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[h.dtype]))
        if h.dtype == "fp16":
            xc = torch.from_numpy(x.double().numpy().astype(np.float16))
        e = torch.exp(xc)
        over = int(torch.isinf(e).any(dim=-1).sum())
        under = int((e == 0).all(dim=-1).sum())
        assert (h.rows_over_exp_threshold, h.rows_all_underflow) == (over, under), h.dtype
        assert d.cell("naive", h.dtype).overflow_rows == over  # what the naive cell sees
        assert h.headroom == h.exp_overflow_threshold - float(xc.double().max())
    fp16 = next(h for h in d.census.headroom if h.dtype == "fp16")
    bf16 = next(h for h in d.census.headroom if h.dtype == "bf16")
    # rows 0, 1, and from float32 the 16 rows at the midpoint (ties to even: up); row 4, not row 2
    assert fp16.rows_over_exp_threshold == (18 if given == torch.float32 else 2) and fp16.rows_all_underflow == 1
    assert bf16.rows_over_exp_threshold == 0 and bf16.rows_all_underflow == 1  # not row 1 (88.5); row 4


@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_cell_metrics_against_numpy(kernels):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 50, generator=g) * 4
    x[0, 0, :10] = NEG  # partly masked
    d = diagnose("m", x, Options(methods=("stable",), dtypes=("bf16",), kernels=kernels))
    c = d.cell("stable", "bf16")
    p = run_method("stable", x.to(torch.bfloat16)).probs.double().numpy().reshape(-1, 50)
    r = np_softmax64(x.numpy().reshape(-1, 50))
    r_cast = np_softmax64(x.to(torch.bfloat16).double().numpy().reshape(-1, 50))
    diff = p - r
    assert c.compared_rows == 24
    assert c.max_abs_err == pytest.approx(np.abs(diff).max(), rel=1e-12)
    assert c.rmse == pytest.approx(np.sqrt((diff**2).mean()), rel=1e-12)
    assert c.max_abs_err_algo == pytest.approx(np.abs(p - r_cast).max(), rel=1e-12)
    assert c.max_row_sum_err == pytest.approx(np.abs(p.sum(-1) - 1).max(), rel=1e-9)
    floor = 2.0**-133
    q = np.maximum(p, floor)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(r > 0, r * np.log(r / q), 0.0) - r + q
    kl = np.maximum(terms.sum(-1), 0)
    assert c.kl_max == pytest.approx(kl.max(), rel=1e-9)
    assert c.kl_mean == pytest.approx(kl.mean(), rel=1e-9)
    nz = r > 0
    assert c.flushed_frac == pytest.approx(((p == 0) & nz).sum() / nz.sum())


@pytest.mark.parametrize("fused", [False, True])
def test_argmax_flip_counts_strict_losses_not_ties(fused):
    acc = CellAcc("stable", "fp32", max_examples=4)
    probs = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.2, 0.8]], dtype=torch.float32)
    # Logits whose softmax is [[0.4, 0.6], [0.5, 0.5], [0.3, 0.7]].
    backend = NumbaRows() if fused else TorchRows()
    chunk = backend.chunk(torch.tensor([[0.4, 0.6], [0.5, 0.5], [0.3, 0.7]]).log(), 0, 0.0)
    algo = backend.same_reference(chunk)
    (metrics,) = backend.cell_metrics(chunk, [probs], algo)
    acc.update(chunk, probs, {}, algo, [], metrics)
    cell = acc.finish((3,))
    assert cell.argmax_flips == 1
    assert cell.examples["flip"] == [(0,)]


@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_distribution_against_explicit_formulas(kernels):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 40, generator=g) * 3
    x[1, 2, 30:] = -1e9  # 30 unmasked keys in that row
    d = diagnose("dist", x, Options(methods=("stable",), dtypes=("fp32",), collapse_threshold=0.5, kernels=kernels))
    r = np_softmax64(x.numpy().reshape(-1, 40))
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(r > 0, r * np.log(r), 0.0).sum(-1)
    n_keys = np.full(21, 40.0)
    n_keys[1 * 7 + 2] = 30
    jac = np.array([np.linalg.norm(np.diag(row) - np.outer(row, row)) for row in r])
    s = d.distribution
    assert s.rows == 21
    assert s.entropy_mean == pytest.approx(h.mean(), rel=1e-12)
    assert s.entropy_min == pytest.approx(h.min(), rel=1e-12)
    assert s.entropy_norm_mean == pytest.approx((h / np.log(n_keys)).mean(), rel=1e-12)
    assert s.max_prob_mean == pytest.approx(r.max(-1).mean(), rel=1e-12)
    assert s.collapsed_rows == int((r.max(-1) >= 0.5).sum())
    assert s.jacobian_norm_mean == pytest.approx(jac.mean(), rel=1e-9)


def test_helpers_on_known_distributions():
    uniform = torch.full((1, 8), 1 / 8, dtype=torch.float64)
    one_hot = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    assert entropy(uniform).item() == pytest.approx(math.log(8))
    assert entropy(one_hot).item() == 0.0
    # The softmax Jacobian vanishes at a one-hot row (seed 003: the gradient dies).
    assert jacobian_frobenius(one_hot).item() == 0.0
    # Uniform over n: J = I/n - 11^T/n^2, ||J||_F^2 = (n - 1) / n^2.
    assert jacobian_frobenius(uniform).item() == pytest.approx(math.sqrt(7) / 8)
    assert kl_divergence(uniform, uniform, 1e-45).item() == 0.0
    half = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    skew = torch.tensor([[0.25, 0.75]], dtype=torch.float64)
    assert kl_divergence(half, skew, 1e-45).item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))


def jacobian_exact(x: list[float]) -> float:
    """||diag(p) - p p^T||_F of softmax(x), every entry of the matrix in 60-digit arithmetic."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    e = [mpmath.exp(mpmath.mpf(v)) for v in x]
    s = mpmath.fsum(e)
    p = [v / s for v in e]
    return float(
        mpmath.sqrt(
            mpmath.fsum(((pi if i == j else 0) - pi * pj) ** 2 for i, pi in enumerate(p) for j, pj in enumerate(p))
        )
    )


JACOBIAN_ROWS = [
    [0.0, -17.0],
    [0.0, -23.0],
    [0.0, -40.0, -41.0],
    [-3.0, 0.0, -30.0, -0.5],
    [0.0] * 7,
    [0.0, 0.0, -36.0],
    [5.0, -2.0, 1.0, 0.5, -40.0, 4.9],
]


def test_jacobian_norm_has_no_cancellation():
    """The textbook s2 - 2 s3 + s2^2 gave 8.16e-8 for [0, -17] (exact 8.28e-8) and 0 for [0, -23]."""
    assert jacobian_exact([0.0, -17.0]) == pytest.approx(8.28e-8, rel=1e-3)
    assert jacobian_exact([0.0, -23.0]) == pytest.approx(2.05e-10, rel=1e-3)
    g = torch.Generator().manual_seed(5)
    rows = [torch.tensor(r, dtype=torch.float64) for r in JACOBIAN_ROWS] + [
        torch.randn(40, generator=g, dtype=torch.float64) * s for s in (1, 10, 40)
    ]
    for x in rows:
        got = jacobian_frobenius(torch.softmax(x, dim=-1).unsqueeze(0)).item()
        assert got == pytest.approx(jacobian_exact(x.tolist()), rel=1e-12), x.tolist()


@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_mean_jacobian_norm_of_the_distribution_has_no_cancellation(kernels):
    for row in JACOBIAN_ROWS:
        x = torch.tensor([row], dtype=torch.float64)
        got = diagnose(
            "j", x, Options(methods=("torch",), dtypes=("fp32",), kernels=kernels)
        ).distribution.jacobian_norm_mean
        assert got == pytest.approx(jacobian_exact(row), rel=1e-12), row


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.parametrize(
    "shape, chunk_rows", [((3, 7, 1000), (1, 3, 20)), ((2, 40_000), (1,))], ids=["1000-keys", "40000-keys"]
)
def test_any_chunking_of_wide_rows_gives_the_same_bits(shape, chunk_rows, kernels):
    """Chunks of 1, 3 and 20 rows against the whole tensor, bit for bit: a row reduced alone
    takes other code paths in torch (a BLAS dot from 1000 keys; a split across threads
    from 32768 elements) unless guarded."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=g) * 4
    x[..., :7] = NEG
    keys = shape[-1]
    whole = diagnose("w", x, Options(dtypes=("fp16", "fp32"), chunk_elements=1 << 30, kernels=kernels))
    for rows in chunk_rows:
        part = diagnose("w", x, Options(dtypes=("fp16", "fp32"), chunk_elements=rows * keys, kernels=kernels))
        assert part.census == whole.census, rows  # std included
        assert part.distribution == whole.distribution, rows  # min entropy included
        assert part.cells == whole.cells, rows  # RMSE included


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.parametrize("chunk_elements", [1, 50, 333, 10_000])
def test_chunked_equals_unchunked_exactly(chunk_elements, kernels):
    # 72 rows of 16 keys; chunks of 1, 3, 20 and all rows split heads at every place.
    x = problem_rows().repeat(9, 1).reshape(2, 36, 16) * 1.5
    x[1, 5, 2] = 30.0
    whole = diagnose("w", x, Options(chunk_elements=1 << 30, kernels=kernels))
    part = diagnose("p", x, Options(chunk_elements=chunk_elements, kernels=kernels))
    assert part.census == whole.census  # std and mean included, bit for bit
    assert part.distribution == whole.distribution
    assert part.cells == whole.cells  # counts, maxima, RMSE, KL mean, examples
    assert part.findings == whole.findings


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.parametrize("method,dtype,scale", [("torch", "fp32", 3.0), ("stable", "fp16", 8.0)])
def test_kl_matches_extended_precision(method, dtype, scale, kernels):
    # fp32: KL ~1e-14, where the naive r log r - r log q form cancels to noise.
    # fp16 with wide logits: many keys flush to 0 and count as the smallest subnormal.
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2)) * scale
    cell = diagnose("kl", x, Options(methods=(method,), dtypes=(dtype,), kernels=kernels)).cell(method, dtype)
    dt = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    p = run_method(method, x.to(dt)).probs.double()
    floor = mpmath.mpf(2) ** (-149 if dtype == "fp32" else -24)
    r = torch.softmax(x.double(), dim=-1)
    exact = []
    for rr, pp in zip(r.tolist(), p.tolist()):
        total = mpmath.mpf(0)
        for a, b in zip(rr, pp):
            a, q = mpmath.mpf(a), max(mpmath.mpf(b), floor)
            total += (a * mpmath.log(a / q) if a > 0 else 0) - a + q
        exact.append(total)
    if dtype == "fp16":
        assert cell.flushed_frac > 0.05  # the case this test is about
    assert cell.kl_max == pytest.approx(float(max(exact)), rel=1e-6)
    assert cell.kl_mean == pytest.approx(float(sum(exact) / 3), rel=1e-6)


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_flex_math_kl_floor_is_the_dtype_its_p_is_cast_to(dtype, kernels):
    """flex-math casts P to the dtype (docs/reference/numerics.md), so its KL floor is the dtype's smallest
    subnormal, as the eager path's: P = _safe_softmax(fp32(fp32(q k^T) scale)) cast to the dtype, against
    the float64 softmax of q k^T scale, KL = sum r log(r / q') - r + q', q' = max(P, floor)."""
    from attncheck.judge import diagnose_attention
    from attncheck.numerics.inputs.scores import prepare_inputs

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, t, 16, generator=g).to(dt) * 3 for t in (40, 90, 90))
    opts = Options(dtypes=(dtype,), methods=("torch",), paths=("flex-math",), kernels=kernels)
    d = diagnose_attention("x", prepare_inputs(q, k, v=v), opts)
    (c,) = d.cells
    s32 = (q.float() @ k.float().transpose(-1, -2)) * torch.tensor(0.25)
    p = torch.softmax(s32, dim=-1).to(dt).double()
    r = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.25, dim=-1)

    def kl_mean(floor: float) -> float:
        qq = p.clamp_min(floor)
        delta = (r - qq) / qq  # log1p where r is near q; r log(r / q) where r << q (delta rounds to -1); 0 log 0 = 0
        term = torch.where(delta.abs() < 0.5, r * torch.log1p(delta), r * (torch.log(r) - torch.log(qq)))
        return float((torch.where(r > 0, term, 0.0) + (qq - r)).sum(dim=-1).mean())

    tiny = {"fp16": 2.0**-24, "bf16": 2.0**-133, "fp32": 2.0**-149}[dtype]
    assert c.name == f"flex-math/{dtype}" and c.kl_mean == pytest.approx(kl_mean(tiny), rel=1e-6)
    if dtype == "fp16":  # the case the statement is about: fp16 flushes keys, and fp32's floor would move KL
        assert c.flushed_frac > 0.3 and abs(kl_mean(2.0**-149) / kl_mean(tiny) - 1) > 0.5


def test_naive_row_sum_overflow_is_reported_as_sum_overflow():
    x = torch.full((1, 100), 7.0)  # exp(7) = 1097 finite in fp16; 100 of them are not
    d = diagnose("s", x, Options(methods=("naive",), dtypes=("fp16",)))
    c = d.cell("naive", "fp16")
    assert (c.overflow_rows, c.zero_rows, c.zero_causes, c.nan_rows, c.events) == (
        1,
        1,
        {"sum_overflow": 1},
        0,
        {"sum_overflow": 1},
    )
    f = next(f for f in d.findings if f.code == "sum_overflow")
    assert "every exp is finite but the row sum overflows to inf in 1 row(s)" in f.message and f.examples == [(0,)]
    assert not [f for f in d.findings if f.code in ("exp_overflow", "zero_rows")]


def test_hand_written_stable_is_not_held_to_flashattentions_rule():
    """stable in fp16 rounds x - max, exp and the quotient (three roundings) where torch.softmax
    rounds once: it misses the 2x rule on ordinary scores. The finding judges kernels only."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 4
    xc = x.half()
    ref = torch.softmax(xc.double(), dim=-1)
    hand = torch.exp(xc - xc.amax(dim=-1, keepdim=True))
    hand = hand / hand.sum(dim=-1, keepdim=True)
    err_hand = (hand.double() - ref).abs().max().item()
    err_torch = (torch.softmax(xc, dim=-1).double() - ref).abs().max().item()
    assert err_hand > 2 * err_torch  # the premise, measured here
    d = diagnose("s", x, Options(dtypes=("fp16",)))
    assert d.cell("stable", "fp16").max_abs_err_algo == err_hand
    assert "worse_than_torch" not in {f.code for f in d.findings}


def test_one_dimensional_tensor_is_one_row():
    d = diagnose("v", torch.tensor([1.0, 2.0, 3.0]))
    assert d.census.rows == 1 and d.census.keys == 3


def test_fp64_input_is_cast_to_each_dtype():
    x = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64)
    d = diagnose("f64", x, Options(methods=("torch",), dtypes=("fp32",)))
    assert d.dtype == "fp64"
    # The cast error alone: fp32 rounding of 0.1 etc. moves p by < eps32.
    assert 0 < d.cell("torch", "fp32").max_abs_err < 2 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize(
    "tensor,message",
    [
        (torch.zeros(2, 3, dtype=torch.int64), "has dtype int64; attncheck needs floating-point scores"),
        (torch.zeros(2, 3, dtype=torch.complex64), "has dtype complex64; attncheck needs floating-point scores"),
        (torch.zeros(0, 3), r"is empty \(shape \(0, 3\)\)"),
        (torch.tensor(1.0), "is a scalar"),
    ],
)
def test_bad_tensors(tensor, message):
    with pytest.raises(AttncheckError, match=message):
        diagnose("t", tensor)


def test_bad_options():
    with pytest.raises(AttncheckError, match="unknown dtype"):
        Options(dtypes=("fp8",))
    with pytest.raises(AttncheckError, match="block must be an integer >= 1, got 0"):
        Options(block=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available: GPU test skipped")
def test_cuda_diagnosis_matches_cpu():
    x = problem_rows().repeat(4, 1) * 1.5
    cpu = diagnose("x", x, Options(device="cpu", kernels="torch"))
    gpu = diagnose("x", x, Options(device="cuda"))
    for a, b in zip(cpu.cells, gpu.cells):
        assert (a.nan_causes, a.zero_causes, a.overflow_rows) == (b.nan_causes, b.zero_causes, b.overflow_rows), a.name
        # Different exp implementations: within a few units of the dtype's eps.
        eps = torch.finfo({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]).eps
        assert abs(a.max_abs_err - b.max_abs_err) <= 4 * eps, a.name
    assert cpu.census.nan == gpu.census.nan and cpu.census.max == gpu.census.max
    assert [f.code for f in cpu.findings] == [f.code for f in gpu.findings]


@pytest.mark.parametrize("chunk_elements", [8, 1 << 20])
def test_nan_rows_are_counted_per_head(chunk_elements):
    x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(9))  # (B, H, Tq, Tk)
    x[1, 2, :3, 0] = float("nan")  # three rows of batch 1, head 2
    x[0, 1, 0, :] = float("-inf")  # one fully masked row of batch 0, head 1
    cell = diagnose("h", x, Options(methods=("stable",), dtypes=("fp32",), chunk_elements=chunk_elements)).cell(
        "stable", "fp32"
    )
    assert cell.nan_rows_by_head == [((1, 2), 3), ((0, 1), 1)]


@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_cast_overflow_is_found_in_masked_rows_and_only_there(kernels):
    """Rows under a -inf mask are checked for values the cast sends to inf like any other."""
    x = torch.zeros(4, 8)
    x[:, 4:] = NEG  # every row masked
    x[1, 0] = 70000.0  # beyond fp16's 65504: +inf in fp16, a NaN row
    x[2, 0] = -1e6  # -inf in fp16: one more masked key, the row stays defined
    x[3, 0] = 65504.0  # fp16's largest: stays finite
    d = diagnose("m", x, Options(methods=("stable",), dtypes=("fp16", "bf16"), kernels=kernels))
    assert d.cell("stable", "fp16").nan_causes == {"cast_overflow": 1}
    assert d.cell("stable", "bf16").nan_causes == {}
    fp16 = next(h for h in d.census.headroom if h.dtype == "fp16")
    assert (fp16.cast_posinf_values, fp16.cast_neginf_values, fp16.cast_overflow_rows) == (1, 1, 2)


# --------------------------------------------------------------------------- overflow boundaries

# Where exp overflows each dtype, typed in from the formats (not from torch.finfo): a value
# rounds to inf at or beyond the largest finite value plus half an ulp.
EXP_LIMIT = {"fp16": 65520.0, "bf16": 2.0**128 - 2.0**119, "fp32": 2.0**128 - 2.0**103}
FORMAT = {"fp16": (11, -14, 15), "bf16": (8, -126, 127), "fp32": (24, -126, 127)}
TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
INT_VIEW = {"fp16": torch.int16, "bf16": torch.int16, "fp32": torch.int32}


def around(dtype: str, x: float, n: int = 24) -> list[float]:
    """The 2n representable values of ``dtype`` nearest to x, enumerated by bit pattern."""
    at = torch.tensor([x], dtype=torch.float64).to(torch.float32).to(TORCH[dtype]).view(INT_VIEW[dtype]).to(torch.int64)
    codes = torch.arange(int(at) - n, int(at) + n).to(INT_VIEW[dtype])
    return codes.view(TORCH[dtype]).double().tolist()


def expected_overflow(rows: list[list[float]], dtype: str) -> tuple[int, int]:
    """(rows where an exp overflows, rows where every exp is finite but their sum is inf),
    from each score rounded once to the dtype, exp in float64 and sums exact."""
    bits, emin, emax = FORMAT[dtype]
    limit = EXP_LIMIT[dtype]
    exp_rows = sum_rows = 0
    for row in rows:
        e = [math.exp(nearest(v, bits, emin, emax)) for v in row]
        if max(e) >= limit:
            exp_rows += 1
        elif sum(nearest(v, bits, emin, emax) for v in e) >= limit:
            sum_rows += 1
    return exp_rows, sum_rows


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("given", ["same", "fp64"])
def test_overflow_rows_at_the_exp_and_sum_boundaries(dtype, given):
    """Every representable value around ln(limit) (one exp overflows) and ln(limit / 2) (two
    exps sum past the limit), and for fp64 inputs the midpoints between them a hair either
    side (where rounding through float32 would round twice): the cells' overflow rows by
    event against the independent count."""
    limit = EXP_LIMIT[dtype]
    values = around(dtype, math.log(limit)) + around(dtype, math.log(limit / 2))
    if given == "fp64":
        mids = [(a + b) / 2 for a, b in zip(values, values[1:]) if b > a]
        values += mids + [m - m * 2.0**-40 for m in mids] + [m + m * 2.0**-40 for m in mids]
    rows = [[v, 0.0, -1.0, -2.0] for v in values] + [[v, v, -1.0, -2.0] for v in values]
    x = torch.tensor(rows, dtype=torch.float64 if given == "fp64" else TORCH[dtype])
    d = diagnose("b", x, Options(methods=("naive", "stable"), dtypes=(dtype,)))
    exp_rows, sum_rows = expected_overflow(rows, dtype)
    assert exp_rows and sum_rows  # both boundaries are crossed
    naive = d.cell("naive", dtype)
    assert naive.overflow_events == {"exp_overflow": exp_rows, "sum_overflow": sum_rows}
    assert naive.overflow_rows == exp_rows + sum_rows
    assert naive.nan_causes.get("exp_overflow", 0) + naive.zero_causes.get("exp_overflow", 0) == exp_rows
    assert naive.zero_causes.get("sum_overflow", 0) == sum_rows
    stable = d.cell("stable", dtype)
    assert stable.overflow_rows == 0 and stable.nan_rows == 0


def test_fp64_scores_round_once_before_the_softmax():
    # 65519.99 rounds to 65504 in fp16 (torch's own cast goes through float32 to inf), and
    # 11.0898437499 to 11.0859375, whose exp is finite (torch's: 11.09375, inf).
    x = torch.tensor([[65519.99, 0.0], [math.nextafter(11.08984375, 0), 0.0]], dtype=torch.float64)
    d = diagnose("b", x, Options(methods=("naive", "stable"), dtypes=("fp16",)))
    assert d.cell("stable", "fp16").nan_rows == 0 and d.census.headroom[0].cast_posinf_values == 0
    assert d.cell("naive", "fp16").overflow_events == {"exp_overflow": 1}  # the 65504 row only


def test_a_sentinel_added_to_scores_is_one_mask_value():
    # finfo(fp16).min + scores in fp16 rounds to -65504, -65280, -65152 ...: one mask value,
    # reported as the mask holds it, with the span of row minima it stands for.
    g = torch.Generator().manual_seed(0)
    s = (torch.rand(64, 16, generator=g) * 400).half()
    masked = torch.zeros(64, 16, dtype=torch.bool)
    masked[:, 8:] = True
    masked[:4] = True  # fully masked rows
    x = torch.where(masked, s + torch.finfo(torch.float16).min, s)  # (64, 16) fp16
    mins = torch.where(masked, x.double(), math.inf).amin(dim=-1)
    assert len(set(mins.tolist())) > 3  # many distinct row minima
    d = diagnose("m", x, Options(dtypes=("fp16",), methods=("stable",)))
    assert d.census.sentinels == [(-65504.0, 64)]
    assert d.census.sentinel_spans == [(float(mins.min()), float(mins.max()))]
    f = next(f for f in d.findings if f.code == "fully_masked_rows")
    assert "e.g. -65504)" in f.message
    # -1e9 added in fp32 rounds to -1e9 itself; an unknown constant is its most frequent value.
    y = torch.where(masked, torch.full_like(s.float(), -1e9), s.float())
    assert diagnose("m", y, Options(dtypes=("fp32",), methods=("stable",))).census.sentinels == [(-1e9, 64)]
    z = torch.where(masked, torch.full_like(s.float(), -123456.0), s.float())
    assert diagnose("m", z, Options(dtypes=("fp32",), methods=("stable",))).census.sentinels == [(-123456.0, 64)]
