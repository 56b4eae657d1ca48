"""attncheck.numerics.cells.budgets and pipelines.check: budgets judged on numbers computed here
independently (numpy counts, hand-written softmax)."""

import math

import numpy as np
import pytest
import torch

from attncheck.config.check import Budget, CheckConfig, parse_table
from attncheck.config.run import Options
from attncheck.errors import AttncheckError
from attncheck.loaders import memory_source
from attncheck.numerics.sweep.synthetic import make_scores
from attncheck.pipelines.budgets import (
    budget_checks,
    check_tensor,
    locate_worst_row,
    synthetic_scores,
    synthetic_source,
)
from attncheck.pipelines.check import run_check
from attncheck.report.check import describe_check

SYN = {"synthetic": [{"d_k": 16, "seq": 32, "rows": 64}]}
LN_FP16_LIMIT = math.log(65520.0)  # exp(x) rounds to inf in fp16 above this


def stable_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Textbook max-subtracted softmax with every tensor in ``dtype`` (the sum as torch reduces it)."""
    xc = x.to(dtype)
    z = xc - xc.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    return e / e.sum(dim=-1, keepdim=True)


def pairwise_stable_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same, but the row sum is a pairwise tree rounded to ``dtype`` at every level."""
    xc = x.to(dtype)
    e = torch.exp(xc - xc.amax(dim=-1, keepdim=True))
    n = e.shape[-1]
    s = torch.nn.functional.pad(e, (0, (1 << (n - 1).bit_length()) - n))
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return e / s


def max_err(p: torch.Tensor, ref: torch.Tensor) -> tuple[float, int]:
    """max |p - ref| and the flat row where it is largest."""
    per_row = (p.to(torch.float64) - ref).abs().amax(dim=-1).reshape(-1)
    return float(per_row.max()), int(per_row.argmax())


# --------------------------------------------------------------------------- budgets, against independent numbers


@pytest.fixture(scope="module")
def fp16_overflow_scores():
    """(4, 16, 64) fp16 logits: most rows small (sum of exps far below 65504), some with a max above ln(65520)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 64, generator=g) * 1.5
    hot = torch.rand(4, 16, generator=g) < 0.2
    x[..., 5] = torch.where(hot, 11.2 + 8 * torch.rand(4, 16, generator=g), x[..., 5])
    return x.half()


def test_naive_fp16_overflow_rows_match_a_numpy_count(fp16_overflow_scores):
    x = fp16_overflow_scores
    row_max = x.numpy().astype(np.float64).max(axis=-1)
    expected = int((row_max > LN_FP16_LIMIT).sum())
    assert 3 <= expected < 64
    assert (
        float(np.exp(x.numpy().astype(np.float64)).sum(axis=-1)[row_max <= LN_FP16_LIMIT].max()) < 65504
    )  # no sum overflow
    (case,) = check_tensor("x", x, Budget(), Options(dtypes=("fp16",), methods=("naive",)))
    by = {c.budget: c for c in case.failures}
    assert set(by) == {"nan", "overflow"} and not case.passed
    assert by["overflow"].measured == expected and by["nan"].measured == expected
    hot_rows = {tuple(int(i) for i in idx) for idx in np.argwhere(row_max > LN_FP16_LIMIT)}
    assert by["overflow"].rows and set(by["overflow"].rows) <= hot_rows
    assert describe_check(by["overflow"]).startswith(f"overflow {expected} > budget 0 (rows ")
    # A budget that allows them passes; stable never overflows on the same scores.
    (allowed,) = check_tensor(
        "x", x, Budget(nan=expected, overflow=expected), Options(dtypes=("fp16",), methods=("naive",))
    )
    assert allowed.passed
    (stable,) = check_tensor("x", x, Budget(), Options(dtypes=("fp16",), methods=("stable",)))
    assert stable.passed and [c.measured for c in stable.checks] == [0, 0]


def test_max_abs_err_budget_and_worst_row():
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    ref = torch.softmax(x, dim=-1)  # float64 of the scores as given
    err, flat = max_err(stable_in(x, torch.bfloat16), ref)
    worst = (flat // 5, flat % 5)
    (ok,) = check_tensor("x", x, Budget(max_abs_err=err * 1.01), Options(dtypes=("bf16",), methods=("stable",)))
    assert ok.passed
    (bad,) = check_tensor("x", x, Budget(max_abs_err=err / 2), Options(dtypes=("bf16",), methods=("stable",)))
    (check,) = bad.failures
    assert check.measured == pytest.approx(err, rel=1e-12)
    assert check.worst_row == worst
    assert (
        describe_check(check)
        == f"max_abs_err {check.measured:.3g} > budget {err / 2:.3g} (worst row ({worst[0]},{worst[1]}))"
    )


def test_locate_worst_row_against_the_cast_scores():
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 4
    xc = x.half()
    _, flat = max_err(stable_in(x, torch.float16), torch.softmax(xc.double(), dim=-1))
    assert locate_worst_row(memory_source("x", x), "stable", "fp16", cast_reference=True) == (flat,)


def test_unmeasurable_error_fails_with_a_reason():
    x = torch.full((2, 8), 20.0)  # every row overflows naive fp16: no finite row to compare
    (case,) = check_tensor("x", x, Budget(max_abs_err=1.0), Options(dtypes=("fp16",), methods=("naive",)))
    check = next(c for c in case.checks if c.budget == "max_abs_err")
    assert not check.passed and check.measured is None
    assert (
        describe_check(check)
        == "max_abs_err not measured: no row where the cell and the float64 reference are both finite (budget 1)"
    )


@pytest.fixture(scope="module")
def long_rows():
    """Fixed inputs where the two methods below sit on clear sides of FlashAttention's 2x rule."""
    return make_scores(64, 1024, 128, seed=0) / math.sqrt(128)  # (64, 1024) float64


def test_relative_to_torch_passes_stable_and_fails_a_worse_sum(long_rows):
    x = long_rows
    xc = x.half()
    ref = torch.softmax(xc.double(), dim=-1)  # float64 of the cast scores: algorithmic error
    torch_err, _ = max_err(torch.softmax(xc, dim=-1), ref)
    stable_err, _ = max_err(stable_in(x, torch.float16), ref)
    worse_err, worst_flat = max_err(pairwise_stable_in(x, torch.float16), ref)
    # Facts of these inputs, measured here without attncheck:
    assert stable_err / torch_err < 1.8 and worse_err / torch_err > 3

    budget = Budget(relative_to_torch=2.0)
    (stable,) = check_tensor("x", x, budget, Options(dtypes=("fp16",), methods=("stable",)))
    (rel,) = [c for c in stable.checks if c.budget == "relative_to_torch"]
    assert rel.passed
    assert rel.measured == pytest.approx(stable_err, rel=1e-12) and rel.reference == pytest.approx(torch_err, rel=1e-12)
    assert rel.bound == pytest.approx(2 * torch_err, rel=1e-12)

    # The deliberately worse implementation: the row sum rounded to fp16 at every level of a pairwise tree.
    (worse,) = check_tensor("x", x, budget, Options(dtypes=("fp16",), methods=("stable",), accum="dtype"))
    (rel,) = worse.failures
    assert rel.budget == "relative_to_torch"
    assert rel.measured == pytest.approx(worse_err, rel=1e-12) and rel.ratio == pytest.approx(
        worse_err / torch_err, rel=1e-9
    )
    assert rel.worst_row == (worst_flat,)
    assert describe_check(rel).startswith(
        f"relative_to_torch: max_abs_err_algo {worse_err:.3g} > 2 x torch {torch_err:.3g} = {2 * torch_err:.3g} ("
    )


def test_torch_cell_is_computed_but_reported_only_when_listed(long_rows):
    x = long_rows[:8]
    cases = check_tensor("x", x, Budget(relative_to_torch=2.0), Options(dtypes=("bf16", "fp16"), methods=("tiled",)))
    assert [c.name for c in cases] == ["tiled/bf16", "tiled/fp16"]
    assert all(any(c.budget == "relative_to_torch" for c in case.checks) for case in cases)
    cases = check_tensor("x", x, Budget(relative_to_torch=2.0), Options(dtypes=("bf16",), methods=("torch", "tiled")))
    assert [c.name for c in cases] == ["torch/bf16", "tiled/bf16"]
    assert [c.budget for c in cases[0].checks] == ["nan", "overflow"]  # torch is not judged against itself


def test_relative_atol_widens_the_bound(long_rows):
    x = long_rows[:8]
    (case,) = check_tensor(
        "x",
        x,
        Budget(relative_to_torch=0.5, relative_to_torch_atol=1.0),
        Options(dtypes=("fp16",), methods=("stable",)),
    )
    (rel,) = [c for c in case.checks if c.budget == "relative_to_torch"]
    assert rel.passed and rel.bound == pytest.approx(0.5 * rel.reference + 1.0)


def test_budget_checks_on_a_cell_of_known_counts(fp16_overflow_scores):
    from attncheck.judge import diagnose

    cell = diagnose("x", fp16_overflow_scores, Options(dtypes=("fp16",), methods=("naive",))).cell("naive", "fp16")
    checks = budget_checks(cell, Budget(nan=None, overflow=None, zero_rows=0, argmax_flips=100))
    assert [(c.budget, c.passed) for c in checks] == [("zero_rows", cell.zero_rows == 0), ("argmax_flips", True)]


def test_per_dtype_budget_applies_to_its_cells(long_rows):
    x = long_rows[:8]
    budgets = {"fp32": Budget(max_abs_err=1e-12)}
    cases = check_tensor("x", x, Budget(max_abs_err=1.0), Options(dtypes=("bf16", "fp32"), methods=("torch",)), budgets)
    assert [(c.name, c.passed) for c in cases] == [("torch/bf16", True), ("torch/fp32", False)]


def test_run_check_names_inputs_relative_to_the_config(tmp_path, monkeypatch):
    (tmp_path / "dumps").mkdir()
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    np.savez(tmp_path / "dumps" / "layers.npz", l0=x, l1=x / 2)
    cfg = parse_table(
        {
            "inputs": ["dumps/*.npz"],
            "keys": ["l1"],
            "dtypes": ["bf16"],
            "methods": ["torch"],
            "synthetic": [{"d_k": 8, "seq": 16, "rows": 16}],
        },
        root=tmp_path,
    )
    monkeypatch.chdir(tmp_path / "dumps")
    result = run_check(cfg)
    assert result.inputs == ["dumps/layers.npz:l1", "synthetic[0]:dk=8,scale=sqrt,seq=16,rows=16,dist=normal,seed=0"]
    assert result.passed and result.device == "cpu"
    assert [c.name for c in result.cases] == ["torch/bf16", "torch/bf16"]


def test_synthetic_scores_are_the_sweep_generator_scaled():
    spec = parse_table({"synthetic": [{"d_k": 64, "scale": "dk", "seq": 32, "rows": 48, "seed": 5}]}).synthetic[0]
    s = synthetic_scores(spec)
    assert s.shape == (48, 32) and s.dtype == torch.float64
    torch.testing.assert_close(s, make_scores(48, 32, 64, seed=5) / 64, rtol=0, atol=0)


@pytest.mark.parametrize("rows, seq, block", [(48, 32, 7), (48, 32, 48), (100, 16, 5), (100, 16, 1000), (5, 64, 2)])
def test_synthetic_source_streams_the_scores_bit_for_bit(rows, seq, block):
    spec = parse_table(
        {"synthetic": [{"d_k": 32, "scale": "sqrt", "seq": seq, "rows": rows, "seed": 3, "dist": "outliers"}]}
    ).synthetic[0]
    whole = synthetic_scores(spec)
    src = synthetic_source(spec)
    parts = list(src.row_blocks(block))
    assert src.shape == (rows, seq) and [p.shape[0] for p in parts[:-1]] == [block] * (len(parts) - 1)
    assert torch.equal(torch.cat(parts), whole)
    with pytest.raises(AttncheckError, match=r"synthetic\[0\]:dk=32.*: needs .* over max_memory 1 KiB"):
        synthetic_source(spec, max_bytes=1024)


def test_config_dataclass_is_usable_directly():
    cfg = CheckConfig(synthetic=parse_table(SYN).synthetic, dtypes=("fp32",), methods=("torch",))
    assert run_check(cfg).passed


def test_check_reads_files_in_row_blocks(tmp_path, monkeypatch):
    """run_check never loads a dump whole: it diagnoses row blocks of each file, one file at a
    time, and its numbers are the whole-tensor check's."""
    import attncheck.loaders
    import attncheck.pipelines.budgets as budgets

    (tmp_path / "dumps").mkdir()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, 64, generator=g) * 4
    np.save(tmp_path / "dumps" / "a.npy", x.numpy())
    cfg = parse_table(
        {
            "inputs": ["dumps/*.npy"],
            "dtypes": ["fp16"],
            "methods": ["naive", "stable"],
            "budget": {"max_abs_err": 1e-9},
        },
        root=tmp_path,
    )
    whole = check_tensor("dumps/a.npy", x, cfg.budget, cfg.options())
    monkeypatch.setattr(attncheck.loaders, "load_tensors", lambda *a, **k: pytest.fail("check loaded a dump whole"))
    blocks = []
    real = budgets.diagnose_chunks

    def spy(name, shape, dtype, chunks, *args, **kw):
        return real(name, shape, dtype, (blocks.append(c.shape[0]) or c for c in chunks), *args, **kw)

    monkeypatch.setattr(budgets, "diagnose_chunks", spy)
    monkeypatch.setattr(budgets, "rows_per_chunk", lambda keys, options: 7)
    result = run_check(cfg)
    assert blocks == [7] * 17 + [1]  # 120 rows in blocks of 7
    assert [c.name for c in result.cases] == ["naive/fp16", "stable/fp16"]
    for got, want in zip(result.cases, whole):
        assert [(c.budget, c.measured, c.passed, c.rows) for c in got.checks] == [
            (c.budget, c.measured, c.passed, c.rows) for c in want.checks
        ]


def test_check_holds_one_pt_dump_at_a_time(tmp_path, monkeypatch):
    """.pt files are loaded whole, so check opens file i+1 only once file i is diagnosed and
    dropped: when a dump is loaded, no tensor of an earlier dump is alive. The cases are those
    of checking each file on its own."""
    import gc
    import weakref

    import attncheck.loaders.formats.pt as pt

    (tmp_path / "dumps").mkdir()
    g = torch.Generator().manual_seed(4)
    for i in range(4):
        x = torch.randn(2, 24, 48, generator=g) * (2 + i)
        x[0, 3, 5] = 12.0  # fp16 naive overflow in every dump
        torch.save({"scores": x, "more": {"s": x[:, :5] / 3}}, tmp_path / "dumps" / f"d{i}.pt")
    table = {"dtypes": ["fp16", "bf16"], "methods": ["naive", "tiled"], "budget": {"max_abs_err": 1e-3}}
    gc.collect()
    held: list[list] = []  # per load: weak references to its tensors and to what the loader made of them
    alive_at_load = []
    real_load, real_check = pt.torch.load, pt.check_tensor

    def load_spy(*args, **kwargs):
        alive_at_load.append(
            sum(any(ref() is not None for ref in refs) for refs in held)
        )  # earlier dumps still resident
        obj = real_load(*args, **kwargs)
        held.append([weakref.ref(obj["scores"]), weakref.ref(obj["more"]["s"])])
        return obj

    def check_spy(*args, **kwargs):
        tensor = real_check(*args, **kwargs)  # a detached view sharing the loaded storage
        held[-1].append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(pt.torch, "load", load_spy)
    monkeypatch.setattr(pt, "check_tensor", check_spy)
    result = run_check(parse_table({"inputs": ["dumps/*.pt"], **table}, root=tmp_path))
    assert alive_at_load == [0, 0, 0, 0]
    assert result.inputs == [f"dumps/d{i}.pt:{k}" for i in range(4) for k in ("scores", "more.s")]
    monkeypatch.setattr(pt.torch, "load", real_load)
    monkeypatch.setattr(pt, "check_tensor", real_check)
    alone = [
        c
        for i in range(4)
        for c in run_check(parse_table({"inputs": [f"dumps/d{i}.pt"], **table}, root=tmp_path)).cases
    ]
    assert len(result.cases) == len(alone) == 8 * 4
    for got, want in zip(result.cases, alone):
        assert (got.input, got.name, got.rows) == (want.input, want.name, want.rows)
        assert [(c.budget, c.measured, c.passed, c.rows) for c in got.checks] == [
            (c.budget, c.measured, c.passed, c.rows) for c in want.checks
        ]


# --------------------------------------------------------------------------- attention paths: budgets on O = P@V

PATH_SYN = {
    "synthetic": [{"d_k": 32, "seq": 64, "rows": 128, "dist": "outliers", "paths": ["eager", "sdpa-math", "flash"]}],
    "dtypes": ["fp16"],
    "methods": ["torch"],
}


def _sdpa_math_out(q, k, v, dtype):
    """PyTorch's own MATH backend in ``dtype``, and float64 attention of the same inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        o = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v  # float64
    return o.double(), ref


def test_output_budgets_measure_what_torchs_sdpa_gives():
    """The sdpa-math cell's O errors are the errors of torch's own MATH backend against float64."""
    from attncheck.pipelines.budgets import synthetic_qkv

    cfg = parse_table(
        {
            **PATH_SYN,
            "budget": {"out_rmse": 1.0, "out_max_abs_err": 1.0, "out_rel_l1": 1.0, "out_cos_min": -1.0, "out_nan": 0},
        }
    )
    cases = {c.name: c for c in run_check(cfg).cases}
    assert list(cases) == ["eager:torch/fp16", "sdpa-math/fp16", "flash/fp16"]
    q, k, v = synthetic_qkv(cfg.synthetic[0])
    o, ref = _sdpa_math_out(q, k, v, torch.float16)
    d = o - ref
    cos = torch.nn.functional.cosine_similarity(o, ref, dim=-1)
    expect = {
        "out_max_abs_err": d.abs().max(),
        "out_rmse": d.pow(2).mean().sqrt(),
        "out_rel_l1": d.abs().sum() / ref.abs().sum(),
        "out_cos_min": cos.min(),
    }
    got = {c.budget: c.measured for c in cases["sdpa-math/fp16"].checks}
    for name, value in expect.items():
        assert got[name] == pytest.approx(float(value), rel=1e-9), name
    assert got["out_nan"] == 0 and cases["sdpa-math/fp16"].passed


def test_output_budgets_break_in_both_directions():
    """out_rmse is an upper bound, out_cos_min a lower one: a limit just past the measured value flips each."""
    cfg = parse_table({**PATH_SYN, "budget": {"out_rmse": 1.0, "out_cos_min": -1.0}})
    flash = next(c for c in run_check(cfg).cases if c.name == "flash/fp16")
    rmse, cos = (next(c.measured for c in flash.checks if c.budget == b) for b in ("out_rmse", "out_cos_min"))
    assert 0 < rmse < 1e-3 and 0.999 < cos < 1
    tight = parse_table({**PATH_SYN, "budget": {"out_rmse": rmse * 0.99, "out_cos_min": min(1.0, cos + 1e-9)}})
    flash = next(c for c in run_check(tight).cases if c.name == "flash/fp16")
    assert [(c.budget, c.passed) for c in flash.checks] == [
        ("nan", True),
        ("overflow", True),
        ("out_rmse", False),
        ("out_cos_min", False),
    ]
    assert [describe_check(c).split(" budget")[0] for c in flash.failures] == [
        f"out_rmse {rmse:.3g} >",
        f"out_cos_min {cos:.6f} <",
    ]
    loose = parse_table({**PATH_SYN, "budget": {"out_rmse": rmse, "out_cos_min": cos}})
    assert next(c for c in run_check(loose).cases if c.name == "flash/fp16").passed


def test_out_relative_to_torch_compares_with_the_eager_torch_cell():
    """FlashAttention's rule on O: each path's max |O - O_float64| against 2x the eager torch.softmax path's."""
    cfg = parse_table({**PATH_SYN, "methods": ["stable"], "budget": {"out_relative_to_torch": 2.0}})
    cases = {c.name: c for c in run_check(cfg).cases}
    assert list(cases) == ["eager:stable/fp16", "sdpa-math/fp16", "flash/fp16"]  # torch computed, not reported
    from attncheck.pipelines.budgets import synthetic_qkv

    q, k, v = synthetic_qkv(cfg.synthetic[0])
    ref64 = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), dim=-1) @ v
    qh, kh, vh = (t.half() for t in (q, k, v))
    s = (torch.matmul(qh, kh.transpose(-1, -2)) * (1 / math.sqrt(32))).half()  # eager: S in fp16, scale in fp16
    o_torch = torch.matmul(torch.softmax(s, dim=-1), vh).double()
    torch_err = float((o_torch - ref64).abs().max())
    for name in ("sdpa-math/fp16", "flash/fp16"):
        (check,) = cases[name].checks[2:]
        assert check.budget == "out_relative_to_torch" and check.reference == pytest.approx(torch_err, rel=1e-12)
        assert check.bound == pytest.approx(2 * torch_err) and check.passed == (check.measured <= 2 * torch_err)


def test_scores_inputs_skip_output_budgets(tmp_path):
    """A dump of scores has no V: out_* budgets apply to the synthetic entries with paths only."""
    np.save(tmp_path / "s.npy", np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    table = {**PATH_SYN, "inputs": ["s.npy"], "budget": {"out_rmse": 1.0}}
    cases = run_check(parse_table(table, root=tmp_path)).cases
    assert {c.budget for c in cases[0].checks} == {"nan", "overflow"}
    assert {c.budget for c in cases[-1].checks} == {"nan", "overflow", "out_rmse"}
