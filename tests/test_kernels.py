"""The fused CPU kernels and the torch code path compute the same diagnosis."""

import math

import pytest
import torch

from attncheck.diagnose import Options, diagnose

from .test_diagnose import problem_rows

pytest.importorskip("numba")


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
        assert (a.nan_causes, a.zero_causes, a.overflow_rows, a.argmax_flips, a.compared_rows) == (b.nan_causes, b.zero_causes, b.overflow_rows, b.argmax_flips, b.compared_rows), a.name
        for field in ("max_abs_err", "rmse", "max_abs_err_algo", "rmse_algo", "max_row_sum_err", "kl_mean", "kl_max", "flushed_frac"):
            assert close(getattr(a, field), getattr(b, field)), (a.name, field, getattr(a, field), getattr(b, field))
    ca, cb = fused.census, plain.census
    assert (ca.nan, ca.posinf, ca.neginf, ca.masked, ca.fully_masked_rows, ca.min, ca.max, ca.sentinels) == (cb.nan, cb.posinf, cb.neginf, cb.masked, cb.fully_masked_rows, cb.min, cb.max, cb.sentinels)
    assert close(ca.mean, cb.mean, 1e-12) and close(ca.std, cb.std, 1e-12)
    assert ca.headroom == cb.headroom
    da, db = fused.distribution, plain.distribution
    for field in ("entropy_mean", "entropy_min", "entropy_max", "entropy_norm_mean", "max_prob_mean", "jacobian_norm_mean"):
        # entropy = log S - sum(p z): ~1e-16 absolute error, ~1e-11 relative on a near one-hot row
        assert close(getattr(da, field), getattr(db, field), 1e-9), field
    assert da.collapsed_rows == db.collapsed_rows
    assert [f.code for f in fused.findings] == [f.code for f in plain.findings]


@pytest.mark.parametrize("use_kernels", ["fused", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_diagnose_never_modifies_its_input(use_kernels, dtype):
    x = problem_rows().to(dtype)
    before = x.clone()
    diagnose("x", x, Options(kernels=use_kernels))
    assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(x.isnan(), before.isnan())
