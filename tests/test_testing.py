"""attncheck.testing.assert_softmax_ok: passes, fails with a readable message, refuses bad arguments."""

import math
import re

import numpy as np
import pytest
import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.sweep.synthetic import make_scores
from attncheck.testing import assert_softmax_ok

LN_FP16_LIMIT = math.log(65520.0)


def healthy(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 16, 32, generator=g).to(device)  # (B, H, T, T) logits of std 1


def test_passes_on_healthy_scores_and_returns_the_case(device):
    case = assert_softmax_ok(healthy(device), dtype="bf16", method="stable", max_abs_err=1e-2)
    assert case.passed and case.name == "stable/bf16" and case.shape == (2, 4, 16, 32)
    assert [c.budget for c in case.checks] == ["nan", "overflow", "max_abs_err"]


def test_accepts_numpy_and_torch_dtypes():
    x = healthy().numpy()
    assert assert_softmax_ok(x, dtype=torch.float16, method="online").name == "tiled/fp16"
    assert assert_softmax_ok(x.astype(np.float64), "fp32", "torch", max_abs_err=1e-6).passed


def test_naive_fp16_overflow_fails_with_rows_in_the_message():
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    x[2, 10] = 12.0  # exp(12) > 65504: naive fp16 overflows in row 2 only
    assert (x.max(axis=-1) > LN_FP16_LIMIT).sum() == 1
    with pytest.raises(AssertionError) as e:
        assert_softmax_ok(x, dtype="fp16", method="naive")
    assert str(e.value) == (
        "attncheck: naive/fp16 of scores (6x64) broke its budget: "
        "nan 1 > budget 0 (row 2); overflow 1 > budget 0 (row 2)"
    )
    assert_softmax_ok(x, dtype="fp16", method="stable")  # the same scores are fine once the max is subtracted


def test_max_abs_err_failure_names_the_worst_row():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3
    xc = x.to(torch.bfloat16)
    z = xc - xc.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    p = (e / e.sum(dim=-1, keepdim=True)).double()  # stable softmax in bf16, written out
    per_row = (p - torch.softmax(x, dim=-1)).abs().amax(dim=-1)  # (3, 5)
    err = float(per_row.max())
    flat = int(per_row.argmax())
    with pytest.raises(AssertionError) as info:
        assert_softmax_ok(x, max_abs_err=1e-4, name="block0.attn")
    assert str(info.value) == (
        f"attncheck: stable/bf16 of block0.attn (3x5x64) broke its budget: max_abs_err {err:.3g} > budget 0.0001 "
        f"(worst row ({flat // 5},{flat % 5})); nan 0 <= budget 0 ok; overflow 0 <= budget 0 ok"
    )


def test_relative_to_torch_passes_stable_and_fails_a_worse_sum():
    x = make_scores(64, 1024, 128, seed=0) / math.sqrt(128)  # inputs where stable fp16 is < 2x torch (see test_checks)
    assert_softmax_ok(x, dtype="fp16", method="stable", relative_to_torch=2.0)
    with pytest.raises(
        AssertionError,
        match=r"^attncheck: stable/fp16 of scores \(64x1024\) broke its budget: relative_to_torch: max_abs_err_algo "
        r"\S+ > 2 x torch \S+ = \S+ \(\d+\.\d\dx torch\) \(worst row \d+\)",
    ):
        assert_softmax_ok(x, dtype="fp16", method="stable", relative_to_torch=2.0, accum="dtype")


def test_unchecked_budgets_do_not_fail():
    x = np.full((2, 8), 20.0, dtype=np.float32)  # naive fp16 overflows everywhere
    with pytest.raises(AssertionError):
        assert_softmax_ok(x, dtype="fp16", method="naive")
    case = assert_softmax_ok(x, dtype="fp16", method="tiled", nan=None, overflow=None, zero_rows=0)
    assert [c.budget for c in case.checks] == ["zero_rows"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"nan": "zero"}, "nan must be an integer >= 0, got 'zero'"),
        ({"max_abs_err": -1.0}, "max_abs_err must be a number >= 0, got -1.0"),
        ({"relative_to_torch": 0}, "relative_to_torch must be a number > 0, got 0"),
        ({"relative_to_torch_atol": 1e-6}, "relative_to_torch_atol is set but relative_to_torch is not"),
        ({"nan": None, "overflow": None}, "assert_softmax_ok: every budget is None, so nothing would be checked"),
        ({"method": "fast"}, "method: unknown method 'fast' (choose from naive, stable, tiled, torch)"),
        ({"dtype": "fp8"}, "dtype: unknown dtype 'fp8' (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz)"),
    ],
)
def test_bad_arguments_raise_attncheck_error(kwargs, message):
    with pytest.raises(AttncheckError) as e:
        assert_softmax_ok(healthy(), **kwargs)
    assert str(e.value) == message


def test_bad_scores_raise_attncheck_error():
    with pytest.raises(AttncheckError, match=re.escape("scores must be a torch.Tensor or a numpy array, got list")):
        assert_softmax_ok([[1.0, 2.0]])
    with pytest.raises(
        AttncheckError, match=re.escape("scores has dtype int64; attncheck needs floating-point scores")
    ):
        assert_softmax_ok(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(
        AttncheckError,
        match=re.escape("scores has dtype int64; attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)"),
    ):
        assert_softmax_ok(torch.zeros(2, 3, dtype=torch.int64))
