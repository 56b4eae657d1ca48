"""The generator against the distributions it claims: moments from theory, not from the code.

Standard errors: the sample variance of n i.i.d. draws with variance v and fourth
moment m4 has standard error sqrt((m4 - v^2) / n) (2 v^2 / n for a normal). Bands are 5 of them.
"""

import math

import pytest
import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.sweep.synthetic import make_qk, make_scores


def test_shapes_dtype_and_layout():
    q, k = make_qk(3, 5, 7, 16, seed=1)
    assert q.shape == (3, 5, 16) and k.shape == (3, 7, 16)
    assert q.dtype == k.dtype == torch.float64
    q32, _ = make_qk(3, 5, 7, 16, seed=1, dtype=torch.float32)
    assert q32.dtype == torch.float32


def test_same_seed_same_draws_and_std_only_multiplies():
    q1, k1 = make_qk(2, 4, 8, 16, seed=7)
    q2, k2 = make_qk(2, 4, 8, 16, seed=7)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    q3, _ = make_qk(2, 4, 8, 16, seed=8)
    assert not torch.equal(q1, q3)
    q4, k4 = make_qk(2, 4, 8, 16, seed=7, std=2.5)
    assert torch.equal(q4, 2.5 * q1) and torch.equal(k4, 2.5 * k1)


def test_scores_are_q_dot_k_per_row_with_keys_shared_within_a_head():
    # 10 rows with 4 keys: heads of 4 queries -> 3 heads, the last cut to 2 queries.
    s = make_scores(10, 4, 8, seed=3)
    assert s.shape == (10, 4)
    q, k = make_qk(3, 4, 4, 8, seed=3)  # the same draws, read back
    expected = torch.einsum("hqd,hsd->hqs", q, k).reshape(12, 4)[:10]  # (R, S)
    torch.testing.assert_close(s, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("std", [1.0, 0.3, 4.0])
def test_normal_entries_have_mean_0_and_variance_std_squared(std):
    q, k = make_qk(64, 128, 128, 64, std=std, seed=11)
    x = torch.cat([q.flatten(), k.flatten()])
    n = x.numel()
    v = std**2
    assert abs(float(x.mean())) <= 5 * math.sqrt(v / n)
    assert abs(float(x.var()) - v) <= 5 * v * math.sqrt(2 / (n - 1))


def test_outliers_follow_flashattention3_mixture():
    """N(0,1) + N(0,100) * Bernoulli(0.001): variance 1.1; |x| > 8 almost only where the mask fired."""
    q, k = make_qk(64, 128, 128, 128, dist="outliers", seed=5)
    x = torch.cat([q.flatten(), k.flatten()])
    n = x.numel()
    p = 0.001
    v = 1 + p * 100
    m4 = 3 * ((1 - p) + p * 101**2)
    assert abs(float(x.var()) - v) <= 5 * math.sqrt((m4 - v * v) / n)
    # A plain normal would give var 1: the band above excludes it.
    assert 5 * math.sqrt((m4 - v * v) / n) < 0.05
    # P(|x| > 8) = (1 - p) P(|N(0,1)| > 8) + p P(|N(0,101)| > 8); the first term is ~1e-15.
    share = (1 - p) * math.erfc(8 / math.sqrt(2)) + p * math.erfc(8 / math.sqrt(2 * 101))
    count = int((x.abs() > 8).sum())
    assert abs(count - n * share) <= 5 * math.sqrt(n * share)


def test_sizes_over_the_budget_are_refused_before_allocating():
    with pytest.raises(
        AttncheckError,
        match=r"synthetic Q/K of 1000000 heads x \(128 queries \+ 128 keys\) x d_k 512 need .* GiB, over the 2 GiB "
        r"budget",
    ):
        make_qk(1_000_000, 128, 128, 512)


@pytest.mark.parametrize("bad", [dict(heads=0), dict(dk=0), dict(seq=-1)])
def test_non_positive_sizes_are_refused(bad):
    args = dict(heads=2, queries=2, seq=2, dk=2) | bad
    with pytest.raises(AttncheckError, match="must be >= 1"):
        make_qk(**args)


def test_unknown_distribution_is_refused():
    with pytest.raises(AttncheckError, match="unknown distribution 'cauchy'"):
        make_qk(1, 1, 2, 2, dist="cauchy")
