"""attncheck.check_config and attncheck.checks: the [tool.attncheck] schema, config discovery,
and budgets judged on numbers computed here independently (numpy counts, hand-written softmax)."""

import math
import re

import numpy as np
import pytest
import torch

from attncheck.check_config import (
    Budget,
    CheckConfig,
    find_config,
    load_config,
    parse_table,
)
from attncheck.checks import budget_checks, check_tensor, locate_worst_row, run_check, synthetic_scores
from attncheck.errors import AttncheckError
from attncheck.synthetic import make_scores

SYN = {"synthetic": [{"d_k": 16, "seq": 32, "rows": 64}]}
KNOWN_TOP = "inputs, keys, synthetic, dtypes, methods, block, order, accum, device, budget"
KNOWN_BUDGET = "nan, overflow, zero_rows, argmax_flips, max_abs_err, max_abs_err_algo, rmse, kl_max, relative_to_torch, relative_to_torch_atol, fp16, bf16, fp32"
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


# --------------------------------------------------------------------------- schema


def test_defaults():
    cfg = parse_table(SYN)
    assert cfg.dtypes == ("fp16", "bf16", "fp32")
    assert cfg.methods == ("stable", "tiled", "torch")
    assert (cfg.block, cfg.order, cfg.accum, cfg.device) == (128, "forward", "fp32", "cpu")
    assert cfg.budget == Budget(nan=0, overflow=0)
    assert cfg.budget.active() == [("nan", 0), ("overflow", 0)]
    s = cfg.synthetic[0]
    assert (s.d_k, s.scale.name, s.seq, s.rows, s.dist, s.std, s.seed, s.dtypes) == (16, "sqrt", 32, 64, "normal", 1.0, 0, None)
    assert s.name == "synthetic[0]:dk=16,scale=sqrt,seq=32,rows=64,dist=normal,seed=0"


def test_full_table():
    cfg = parse_table(
        {
            "dtypes": ["bfloat16", "half", "bf16"],
            "methods": ["online", "torch"],
            "block": 64,
            "order": "reverse",
            "accum": "dtype",
            "device": "auto",
            "synthetic": [{"d_k": 128, "scale": 0.125, "seq": 256, "rows": 1024, "dist": "outliers", "std": 2, "seed": 3, "dtype": "fp16"}],
            "budget": {"nan": 1, "max_abs_err": 1e-2, "relative_to_torch": 2, "relative_to_torch_atol": 1e-6, "fp32": {"max_abs_err": 1e-6}},
        }
    )
    assert cfg.dtypes == ("bf16", "fp16") and cfg.methods == ("tiled", "torch")
    assert (cfg.block, cfg.order, cfg.accum, cfg.device) == (64, "reverse", "dtype", "auto")
    assert cfg.synthetic[0].name == "synthetic[0]:dk=128,scale=0.125,seq=256,std=2,dist=outliers,seed=3"
    assert cfg.synthetic[0].dtypes == ("fp16",)
    assert cfg.budget == Budget(nan=1, overflow=0, max_abs_err=0.01, relative_to_torch=2.0, relative_to_torch_atol=1e-6)
    # A dtype table overrides the keys it sets and inherits the rest.
    assert cfg.budget_for("fp32") == Budget(nan=1, overflow=0, max_abs_err=1e-6, relative_to_torch=2.0, relative_to_torch_atol=1e-6)
    assert cfg.budget_for("bf16") == cfg.budget


BAD_TABLES = [
    ({"budget": {"nan": "zero"}}, "tool.attncheck.budget.nan must be an integer >= 0, got 'zero'"),
    ({"budget": {"nan": -1}}, "tool.attncheck.budget.nan must be an integer >= 0, got -1"),
    ({"budget": {"overflow": 0.5}}, "tool.attncheck.budget.overflow must be an integer >= 0, got 0.5"),
    ({"budget": {"argmax_flips": True}}, "tool.attncheck.budget.argmax_flips must be an integer >= 0, got true"),
    ({"budget": {"max_abs_err": "1e-2"}}, "tool.attncheck.budget.max_abs_err must be a number >= 0, got '1e-2'"),
    ({"budget": {"kl_max": float("nan")}}, "tool.attncheck.budget.kl_max must be a number >= 0, got nan"),
    ({"budget": {"relative_to_torch": 0}}, "tool.attncheck.budget.relative_to_torch must be a number > 0, got 0"),
    ({"budget": {"relative_to_torch_atol": 1e-6}}, "tool.attncheck.budget.relative_to_torch_atol is set but relative_to_torch is not"),
    ({"budget": 3}, "tool.attncheck.budget must be a table, got 3"),
    ({"budget": {"fp32": {"max_abs_err": -1.0}}}, "tool.attncheck.budget.fp32.max_abs_err must be a number >= 0, got -1.0"),
    ({"budgett": {}}, f"unknown key 'tool.attncheck.budgett' in <config> (known: {KNOWN_TOP})"),
    ({"budget": {"nans": 0}}, f"unknown key 'tool.attncheck.budget.nans' in <config> (known: {KNOWN_BUDGET})"),
    ({"budget": {"fp8": {}}}, f"unknown key 'tool.attncheck.budget.fp8' in <config> (known: {KNOWN_BUDGET})"),
    (
        {"budget": {"bf16": {"fp16": {}}}},
        "unknown key 'tool.attncheck.budget.bf16.fp16' in <config> (known: nan, overflow, zero_rows, argmax_flips, max_abs_err, "
        "max_abs_err_algo, rmse, kl_max, relative_to_torch, relative_to_torch_atol)",
    ),
    ({"dtypes": ["fp8"]}, "tool.attncheck.dtypes: unknown dtype 'fp8' (choose from fp16, bf16, fp32)"),
    ({"dtypes": []}, "tool.attncheck.dtypes is empty (choose from fp16, bf16, fp32)"),
    ({"dtypes": [16]}, "tool.attncheck.dtypes must be a list of dtype names (fp16, bf16, fp32), got [16]"),
    ({"methods": ["fast"]}, "tool.attncheck.methods: unknown method 'fast' (choose from naive, stable, tiled, torch)"),
    ({"block": 0}, "tool.attncheck.block must be an integer >= 1, got 0"),
    ({"order": "sideways"}, "tool.attncheck.order must be one of forward, reverse, got 'sideways'"),
    ({"accum": "fp64"}, "tool.attncheck.accum must be one of fp32, dtype, got 'fp64'"),
    ({"device": "tpu"}, "tool.attncheck.device must be one of auto, cpu, cuda, got 'tpu'"),
    ({"inputs": "dumps/*.pt"}, "tool.attncheck.inputs must be a list of strings (globs of tensor files), got 'dumps/*.pt'"),
    ({"keys": ["a"]}, "tool.attncheck.keys picks tensors inside files, but tool.attncheck.inputs names no file"),
    ({"synthetic": {"d_k": 64}}, "tool.attncheck.synthetic must be an array of tables ([[tool.attncheck.synthetic]]), got a table"),
    ({"synthetic": [{"scale": "sqrt"}]}, "tool.attncheck.synthetic[0].d_k is missing (the head dimension, e.g. d_k = 128)"),
    ({"synthetic": [{"d_k": 0}]}, "tool.attncheck.synthetic[0].d_k must be an integer >= 1, got 0"),
    ({"synthetic": [{"d_k": 8}, {"d_k": 8, "seq": 1}]}, "tool.attncheck.synthetic[1].seq must be an integer >= 2, got 1"),
    ({"synthetic": [{"d_k": 8, "scale": "huge"}]}, "tool.attncheck.synthetic[0].scale must be one of none, sqrt, dk, dk2 or a positive number, got 'huge'"),
    ({"synthetic": [{"d_k": 8, "scale": -1}]}, "tool.attncheck.synthetic[0].scale must be one of none, sqrt, dk, dk2 or a positive number, got -1"),
    ({"synthetic": [{"d_k": 8, "dist": "cauchy"}]}, "tool.attncheck.synthetic[0].dist must be one of normal, outliers, got 'cauchy'"),
    ({"synthetic": [{"d_k": 8, "std": 0}]}, "tool.attncheck.synthetic[0].std must be a number > 0, got 0"),
    ({"synthetic": [{"d_k": 8, "dtype": "int8"}]}, "tool.attncheck.synthetic[0].dtype: unknown dtype 'int8' (choose from fp16, bf16, fp32)"),
    ({"synthetic": [{"dk": 8}]}, "unknown key 'tool.attncheck.synthetic[0].dk' in <config> (known: d_k, scale, seq, rows, dist, std, seed, dtype)"),
    ({}, '[tool.attncheck] has no inputs: set tool.attncheck.inputs = ["dumps/*.safetensors"] or add a [[tool.attncheck.synthetic]] table'),
    ({"inputs": []}, '[tool.attncheck] has no inputs: set tool.attncheck.inputs = ["dumps/*.safetensors"] or add a [[tool.attncheck.synthetic]] table'),
]


@pytest.mark.parametrize("table,message", BAD_TABLES, ids=[m[:60] for _, m in BAD_TABLES])
def test_bad_table_names_the_key(table, message):
    base = {} if not table or "inputs" in table or "synthetic" in table else dict(SYN)
    with pytest.raises(AttncheckError) as e:
        parse_table({**base, **table})
    assert str(e.value) == message


def test_input_globs_are_relative_to_the_config_folder(tmp_path, monkeypatch):
    (tmp_path / "dumps" / "deep").mkdir(parents=True)
    for name in ("b.npy", "a.npy", "deep/c.npy"):
        np.save(tmp_path / "dumps" / name, np.zeros((2, 4), np.float32))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = parse_table({"inputs": ["dumps/*.npy", "dumps/**/*.npy"]}, root=tmp_path)
    assert cfg.files == tuple(str(tmp_path / "dumps" / n) for n in ("a.npy", "b.npy", "deep/c.npy"))
    with pytest.raises(AttncheckError) as e:
        parse_table({"inputs": ["dumps/*.npy", "dumps/*.pt"]}, root=tmp_path)
    assert str(e.value) == f"tool.attncheck.inputs: 'dumps/*.pt' matches no file (relative to {tmp_path})"


# --------------------------------------------------------------------------- files and discovery


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


SYN_TOML = "[[tool.attncheck.synthetic]]\nd_k = 16\nseq = 32\nrows = 64\n"


def test_invalid_toml_gives_line_and_column(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "pyproject.toml", '[tool.attncheck]\ndtypes = ["bf16"]\nmethods = [stable]\n')
    with pytest.raises(AttncheckError) as e:
        load_config("pyproject.toml")
    assert re.fullmatch(r"pyproject\.toml: invalid TOML: .+ \(at line 3, column 12\)", str(e.value)), str(e.value)


def test_invalid_toml_stops_discovery_too(tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", "[tool.attncheck]\ndtypes = \n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttncheckError, match=r"^pyproject\.toml: invalid TOML: .*\(at line 2, column 10\)$"):
        find_config()


def test_unknown_key_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "pyproject.toml", SYN_TOML + "[tool.attncheck.budgett]\nnan = 0\n")
    with pytest.raises(AttncheckError) as e:
        load_config("pyproject.toml")
    assert str(e.value) == f"unknown key 'tool.attncheck.budgett' in pyproject.toml (known: {KNOWN_TOP})"


def test_find_config_walks_up_past_pyprojects_without_the_table(tmp_path, monkeypatch):
    top = write(tmp_path / "pyproject.toml", "[project]\nname = 'x'\n" + SYN_TOML)
    write(tmp_path / "pkg" / "pyproject.toml", "[project]\nname = 'inner'\n")  # no [tool.attncheck]: passed over
    deep = tmp_path / "pkg" / "src" / "deep"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert find_config() == top
    cfg = load_config(find_config())
    assert cfg.display == str(top)  # above the current directory: shown as it is
    assert cfg.root == str(tmp_path)


def test_attncheck_toml_wins_in_its_folder(tmp_path, monkeypatch):
    write(tmp_path / "pyproject.toml", SYN_TOML)
    standalone = write(tmp_path / "attncheck.toml", "[[synthetic]]\nd_k = 8\nseq = 16\nrows = 16\n")
    monkeypatch.chdir(tmp_path)
    assert find_config() == standalone
    cfg = load_config(find_config())
    assert (cfg.display, cfg.prefix, cfg.synthetic[0].d_k) == ("attncheck.toml", "", 8)


def test_standalone_file_keys_have_no_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "ci.toml", "[[synthetic]]\nd_k = 8\n[budget]\nnan = 'zero'\n")
    with pytest.raises(AttncheckError) as e:
        load_config("ci.toml")
    assert str(e.value) == "budget.nan must be an integer >= 0, got 'zero'"
    write(tmp_path / "ci.toml", "[[synthetic]]\nd_k = 8\n[budgett]\n")
    with pytest.raises(AttncheckError) as e:
        load_config("ci.toml")
    assert str(e.value) == f"unknown key 'budgett' in ci.toml (known: {KNOWN_TOP})"


def test_config_file_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttncheckError, match=r"^config nope\.toml: no such file$"):
        load_config("nope.toml")
    write(tmp_path / "pyproject.toml", "[project]\nname = 'x'\n")
    with pytest.raises(AttncheckError, match=r"^pyproject\.toml has no \[tool\.attncheck\] table$"):
        load_config("pyproject.toml")
    with pytest.raises(AttncheckError, match=r"^config \. is a folder|^config \.: is a folder"):
        load_config(".")


def test_no_config_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttncheckError) as e:
        find_config()
    assert str(e.value) == (
        f"no config found: no attncheck.toml, and no pyproject.toml with a [tool.attncheck] table, in {tmp_path} "
        "or its parents; add one or pass --config FILE"
    )


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
    assert float(np.exp(x.numpy().astype(np.float64)).sum(axis=-1)[row_max <= LN_FP16_LIMIT].max()) < 65504  # no sum overflow
    (case,) = check_tensor("x", x, Budget(), dtypes=("fp16",), methods=("naive",))
    by = {c.budget: c for c in case.failures}
    assert set(by) == {"nan", "overflow"} and not case.passed
    assert by["overflow"].measured == expected and by["nan"].measured == expected
    hot_rows = {tuple(int(i) for i in idx) for idx in np.argwhere(row_max > LN_FP16_LIMIT)}
    assert by["overflow"].rows and set(by["overflow"].rows) <= hot_rows
    assert by["overflow"].describe().startswith(f"overflow {expected} > budget 0 (rows ")
    # A budget that allows them passes; stable never overflows on the same scores.
    (allowed,) = check_tensor("x", x, Budget(nan=expected, overflow=expected), dtypes=("fp16",), methods=("naive",))
    assert allowed.passed
    (stable,) = check_tensor("x", x, Budget(), dtypes=("fp16",), methods=("stable",))
    assert stable.passed and [c.measured for c in stable.checks] == [0, 0]


def test_max_abs_err_budget_and_worst_row():
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    ref = torch.softmax(x, dim=-1)  # float64 of the scores as given
    err, flat = max_err(stable_in(x, torch.bfloat16), ref)
    worst = (flat // 5, flat % 5)
    (ok,) = check_tensor("x", x, Budget(max_abs_err=err * 1.01), dtypes=("bf16",), methods=("stable",))
    assert ok.passed
    (bad,) = check_tensor("x", x, Budget(max_abs_err=err / 2), dtypes=("bf16",), methods=("stable",))
    (check,) = bad.failures
    assert check.measured == pytest.approx(err, rel=1e-12)
    assert check.worst_row == worst
    assert check.describe() == f"max_abs_err {check.measured:.3g} > budget {err / 2:.3g} (worst row ({worst[0]}, {worst[1]}))"


def test_locate_worst_row_against_the_cast_scores():
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 4
    xc = x.half()
    _, flat = max_err(stable_in(x, torch.float16), torch.softmax(xc.double(), dim=-1))
    assert locate_worst_row(x, "stable", "fp16", cast_reference=True) == (flat,)


def test_unmeasurable_error_fails_with_a_reason():
    x = torch.full((2, 8), 20.0)  # every row overflows naive fp16: no finite row to compare
    (case,) = check_tensor("x", x, Budget(max_abs_err=1.0), dtypes=("fp16",), methods=("naive",))
    check = next(c for c in case.checks if c.budget == "max_abs_err")
    assert not check.passed and check.measured is None
    assert check.describe() == "max_abs_err not measured: no row where the cell and the float64 reference are both finite (budget 1)"


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
    (stable,) = check_tensor("x", x, budget, dtypes=("fp16",), methods=("stable",))
    (rel,) = [c for c in stable.checks if c.budget == "relative_to_torch"]
    assert rel.passed
    assert rel.measured == pytest.approx(stable_err, rel=1e-12) and rel.reference == pytest.approx(torch_err, rel=1e-12)
    assert rel.bound == pytest.approx(2 * torch_err, rel=1e-12)

    # The deliberately worse implementation: the row sum rounded to fp16 at every level of a pairwise tree.
    (worse,) = check_tensor("x", x, budget, dtypes=("fp16",), methods=("stable",), accum="dtype")
    (rel,) = worse.failures
    assert rel.budget == "relative_to_torch"
    assert rel.measured == pytest.approx(worse_err, rel=1e-12) and rel.ratio == pytest.approx(worse_err / torch_err, rel=1e-9)
    assert rel.worst_row == (worst_flat,)
    assert rel.describe().startswith(f"relative_to_torch: max_abs_err_algo {worse_err:.3g} > 2 x torch {torch_err:.3g} = {2 * torch_err:.3g} (")


def test_torch_cell_is_computed_but_reported_only_when_listed(long_rows):
    x = long_rows[:8]
    cases = check_tensor("x", x, Budget(relative_to_torch=2.0), dtypes=("bf16", "fp16"), methods=("tiled",))
    assert [c.name for c in cases] == ["tiled/bf16", "tiled/fp16"]
    assert all(any(c.budget == "relative_to_torch" for c in case.checks) for case in cases)
    cases = check_tensor("x", x, Budget(relative_to_torch=2.0), dtypes=("bf16",), methods=("torch", "tiled"))
    assert [c.name for c in cases] == ["torch/bf16", "tiled/bf16"]
    assert [c.budget for c in cases[0].checks] == ["nan", "overflow"]  # torch is not judged against itself


def test_relative_atol_widens_the_bound(long_rows):
    x = long_rows[:8]
    (case,) = check_tensor("x", x, Budget(relative_to_torch=0.5, relative_to_torch_atol=1.0), dtypes=("fp16",), methods=("stable",))
    (rel,) = [c for c in case.checks if c.budget == "relative_to_torch"]
    assert rel.passed and rel.bound == pytest.approx(0.5 * rel.reference + 1.0)


def test_budget_checks_on_a_cell_of_known_counts(fp16_overflow_scores):
    from attncheck.diagnose import Options, diagnose

    cell = diagnose("x", fp16_overflow_scores, Options(dtypes=("fp16",), methods=("naive",))).cell("naive", "fp16")
    checks = budget_checks(cell, Budget(nan=None, overflow=None, zero_rows=0, argmax_flips=100))
    assert [(c.budget, c.passed) for c in checks] == [("zero_rows", cell.zero_rows == 0), ("argmax_flips", True)]


def test_per_dtype_budget_applies_to_its_cells(long_rows):
    x = long_rows[:8]
    budgets = {"fp32": Budget(max_abs_err=1e-12)}
    cases = check_tensor("x", x, Budget(max_abs_err=1.0), dtypes=("bf16", "fp32"), methods=("torch",), budgets=budgets)
    assert [(c.name, c.passed) for c in cases] == [("torch/bf16", True), ("torch/fp32", False)]


def test_run_check_names_inputs_relative_to_the_config(tmp_path, monkeypatch):
    (tmp_path / "dumps").mkdir()
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    np.savez(tmp_path / "dumps" / "layers.npz", l0=x, l1=x / 2)
    cfg = parse_table({"inputs": ["dumps/*.npz"], "keys": ["l1"], "dtypes": ["bf16"], "methods": ["torch"], "synthetic": [{"d_k": 8, "seq": 16, "rows": 16}]}, root=tmp_path)
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


def test_config_dataclass_is_usable_directly():
    cfg = CheckConfig(synthetic=parse_table(SYN).synthetic, dtypes=("fp32",), methods=("torch",))
    assert run_check(cfg).passed
