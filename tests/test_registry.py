"""attncheck.registry: methods and dtypes defined once, and everything derived from them.

A method added through the registry runs beside the built-ins on the fused CPU path
(2^22 elements and more) and reports its own numbers, checked here against numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config.run import Options
from attncheck.errors import AttncheckError
from attncheck.judge import diagnose
from attncheck.numerics.methods.softmax import MethodOutput, tiled_softmax
from attncheck.numerics.precision import DtypeLimits, limits_of, overflow_result, torch_dtype
from attncheck.registry import DTYPES, EVENTS, METHODS, MethodSpec, dtype_names, method_names

BUILT_IN = ("naive", "stable", "tiled", "torch")


def stable_rounds_twice(x: torch.Tensor, params) -> MethodOutput:
    """A hand-written stable softmax that multiplies by the reciprocal of the row sum, itself
    rounded to the dtype: every probability rounds twice (stable's division rounds once)."""
    z = x - x.amax(dim=-1, keepdim=True)  # (r, T) in the dtype
    e = torch.exp(z)
    s = e.sum(dim=-1, keepdim=True)  # fp32 inside, rounded to the dtype
    p = e * s.reciprocal()
    return MethodOutput(p, {"exp_overflow": torch.isinf(s.squeeze(-1)) & torch.isfinite(x.amax(dim=-1))})


def tiled_small_blocks(x: torch.Tensor, params) -> MethodOutput:
    """A second method whose output is fp32, beside tiled's."""
    return MethodOutput(tiled_softmax(x, block=16))


@pytest.fixture
def extra_methods():
    specs = [
        MethodSpec("stable2", "stable, quotient rounded twice", stable_rounds_twice, events=("exp_overflow",)),
        MethodSpec("tiled16", "tiled with 16-key blocks", tiled_small_blocks, output="fp32"),
        MethodSpec(
            "stable2-plain",
            "stable2 with its metrics from the torch backend",
            stable_rounds_twice,
            events=("exp_overflow",),
            fused=False,
        ),
    ]
    for spec in specs:
        METHODS.register(spec)
    yield [s.name for s in specs]
    for spec in specs:
        METHODS.unregister(spec.name)


@pytest.fixture(scope="module")
def big_scores():
    """(2, 16, 128, 1024) fp32 = 2^22 elements: the fused kernels' size. Head (0, 3) is
    unscaled (fp16 exp overflow), batch 1's first 4 queries are fully masked."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 128, 1024, generator=g) * 2
    x[0, 3] *= 8
    x[1, :, :4, :] = float("-inf")
    return x


def numpy_cell(x: np.ndarray, p: np.ndarray) -> dict:
    """NaN rows, max abs error and RMSE of p against float64 softmax of x, as attncheck defines them."""
    x, p = x.reshape(-1, x.shape[-1]).astype(np.float64), p.reshape(-1, p.shape[-1]).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        ref = e / e.sum(axis=-1, keepdims=True)
    nan_rows = ~np.isfinite(p).all(axis=-1)
    ok = ~nan_rows & np.isfinite(ref).all(axis=-1)
    d = p[ok] - ref[ok]
    return {
        "nan_rows": int(nan_rows.sum()),
        "max_abs_err": float(np.abs(d).max()),
        "rmse": math.sqrt(float((d * d).sum()) / d.size),
    }


def test_a_registered_method_runs_beside_the_built_ins_on_the_fused_path(big_scores, extra_methods):
    """Six methods, two with fp32 output: beyond the four slots the fused kernel once had."""
    methods = (*BUILT_IN, *extra_methods)
    d = diagnose("x", big_scores, Options(methods=methods, dtypes=("fp16", "bf16")))
    assert d.backend == "numba"
    assert [c.name for c in d.cells][:2] == ["naive/fp16", "naive/bf16"] and len(d.cells) == 2 * len(methods)
    for dt in ("fp16", "bf16"):
        xc = big_scores.to(torch_dtype(DTYPES.get(dt)))
        # Fully masked rows: -inf - (-inf) = NaN in stable2, zeros in tiled16.
        for name, fn, nan_rows in (("stable2", stable_rounds_twice, 4 * 16), ("tiled16", tiled_small_blocks, 0)):
            want = numpy_cell(big_scores.numpy(), fn(xc.reshape(-1, 1024), None).probs.float().numpy())
            c = d.cell(name, dt)
            assert c.nan_rows == want["nan_rows"] == nan_rows
            assert c.max_abs_err == pytest.approx(want["max_abs_err"], rel=1e-12)
            assert c.rmse == pytest.approx(want["rmse"], rel=1e-9)
        # The same method with its metrics from the torch backend gives the same numbers.
        a, b = d.cell("stable2", dt), d.cell("stable2-plain", dt)
        assert (a.nan_rows, a.nan_causes, a.max_abs_err) == (b.nan_rows, b.nan_causes, b.max_abs_err)
        assert a.rmse == pytest.approx(b.rmse, rel=1e-12) and a.kl_mean == pytest.approx(b.kl_mean, rel=1e-9)
    # The built-ins are unchanged by their new neighbours.
    alone = diagnose("x", big_scores, Options(dtypes=("fp16",)))
    for m in BUILT_IN:
        assert d.cell(m, "fp16") == alone.cell(m, "fp16")


def test_tiled16_nan_rows_are_zero_rows_not_nan(big_scores, extra_methods):
    """tiled16 returns zeros for fully masked rows, so the numpy count above sees its NaN
    rows only where stable2 has them; check the zero rows directly."""
    c = diagnose("x", big_scores[1:, :2], Options(methods=("tiled16",), dtypes=("fp16",), kernels="torch")).cell(
        "tiled16", "fp16"
    )
    assert c.nan_rows == 0 and c.zero_causes == {"fully_masked": 8}


def test_registered_method_in_the_json_report(tmp_path, big_scores, extra_methods):
    path = tmp_path / "big.npy"
    np.save(path, big_scores.numpy())
    r = CliRunner().invoke(
        app,
        [
            "run",
            str(path),
            "--dtype",
            "fp16",
            "--method",
            "naive,stable,tiled,torch,stable2,tiled16",
            "--json",
            "-",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    cells = {c["name"]: c for c in json.loads(r.stdout)["tensors"][0]["cells"]}
    assert list(cells) == ["naive/fp16", "stable/fp16", "tiled/fp16", "torch/fp16", "stable2/fp16", "tiled16/fp16"]
    want = numpy_cell(
        big_scores.numpy(), stable_rounds_twice(big_scores.half().reshape(-1, 1024), None).probs.float().numpy()
    )
    assert cells["stable2/fp16"]["max_abs_err"] == pytest.approx(want["max_abs_err"], rel=1e-12)
    assert cells["stable2/fp16"]["rmse"] == pytest.approx(want["rmse"], rel=1e-9)
    assert (
        cells["stable2/fp16"]["rmse_algo"] > 1.01 * cells["stable/fp16"]["rmse_algo"]
    )  # rounding twice: its own, larger error


def test_a_method_that_breaks_its_promise_is_named():
    METHODS.register(
        MethodSpec("liar", "claims fp16 output, returns fp64", lambda x, p: MethodOutput(torch.softmax(x.double(), -1)))
    )
    try:
        with pytest.raises(TypeError, match="method liar returned torch.float64"):
            diagnose("x", torch.randn(4, 8), Options(methods=("liar",), dtypes=("fp16",)))
    finally:
        METHODS.unregister("liar")


def test_aliases_of_one_method_count_once():
    opts = Options(methods=("online", "tiled", "TILED"), dtypes=("half", "fp16"))
    assert opts.methods == ("tiled",) and opts.dtypes == ("fp16",)
    d = diagnose("x", torch.randn(3, 5, 16), opts)
    assert [c.name for c in d.cells] == ["tiled/fp16"] and d.cells[0].rows == 15


def test_names_and_help_come_from_the_registry():
    assert method_names() == BUILT_IN and dtype_names() == ("fp16", "bf16", "fp32")
    r = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "naive, stable, tiled (alias online), torch" in r.stdout and "fp16, bf16, fp32" in r.stdout
    assert set(EVENTS) >= {e for s in METHODS for e in s.events}


def test_registry_refuses_taken_names_and_unknown_events():
    with pytest.raises(ValueError, match="taken"):
        METHODS.register(MethodSpec("online", "x", stable_rounds_twice))
    with pytest.raises(ValueError, match="unknown events"):
        MethodSpec("x", "x", stable_rounds_twice, events=("boom",))
    with pytest.raises(AttncheckError, match="unknown method 'fast'"):
        METHODS.get("fast")


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp64", "e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_each_dtype_has_its_limits_from_torch(name):
    spec = DTYPES.get(name)
    dt = torch_dtype(spec)
    lim = limits_of(dt)
    assert isinstance(lim, DtypeLimits) and lim.max == torch.finfo(dt).max
    assert spec.has_inf == (lim.overflow == "inf") or lim.overflow == "saturate"
    if torch.finfo(dt).bits < 32:  # formats narrower than fp32, probed from fp32 neighbours
        at = np.float32(lim.rounding_limit)
        assert float(at) == lim.rounding_limit
        below = torch.tensor(np.nextafter(at, np.float32(0))).to(dt).double().item()
        beyond = torch.tensor(at).to(dt).double().item()
        assert below == lim.max  # just below the rounding limit: the largest finite value
        assert beyond == overflow_result(dt) or (math.isnan(beyond) and math.isnan(overflow_result(dt)))
        assert beyond != lim.max or lim.overflow == "saturate"
    tiniest = torch.tensor(
        [lim.smallest_subnormal, lim.smallest_subnormal * 0.5, lim.smallest_subnormal * 0.75], dtype=torch.float64
    )
    assert tiniest.to(dt).double().tolist() == [
        lim.smallest_subnormal,
        0.0,
        lim.smallest_subnormal,
    ]  # the tie at half rounds to 0
    assert (torch.tensor(1.0 + lim.eps, dtype=torch.float64).to(dt).double().item() - 1.0) == lim.eps
    assert torch.tensor(1.0 + lim.eps * 0.5, dtype=torch.float64).to(dt).double().item() == 1.0


def test_fp8_room_what_a_cast_beyond_the_range_gives():
    """Measured from torch's own casts (torch 2.13 on the CPU): e5m2 has inf; e4m3fn has no
    inf and its cast saturates at 448; the fnuz formats give NaN."""
    e4m3, e5m2 = torch_dtype(DTYPES.get("e4m3")), torch_dtype(DTYPES.get("e5m2"))
    assert torch.finfo(e4m3).max == 448 and torch.finfo(e5m2).max == 57344
    assert math.isinf(overflow_result(e5m2)) and not DTYPES.get("e4m3").has_inf
    assert overflow_result(e4m3) == float(torch.tensor(1e6).to(e4m3).float())
    assert limits_of(e4m3).rounding_limit == 464.0  # 448 + half of the top binade's ulp (32)
    fnuz = getattr(torch, "float8_e4m3fnuz", None)
    if fnuz is not None:
        assert math.isnan(overflow_result(fnuz))
    assert Options(dtypes=("e4m3",)).dtypes == ("e4m3",)  # a P-cast cell
    with pytest.raises(AttncheckError, match="dtype 'fp64' cannot be used here"):
        Options(dtypes=("fp64",))
