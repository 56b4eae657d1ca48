"""attncheck.config.check: the [tool.attncheck] schema and config discovery."""

import math
import re

import numpy as np
import pytest
import torch

from attncheck.config.check import (
    Budget,
    find_config,
    load_config,
    parse_table,
)
from attncheck.errors import AttncheckError

SYN = {"synthetic": [{"d_k": 16, "seq": 32, "rows": 64}]}
KNOWN_TOP = (
    "inputs, keys, synthetic, dtypes, methods, block, order, accum, device, max_memory, max_work, budget, ignore"
)
KNOWN_BUDGET = (
    "nan, overflow, zero_rows, argmax_flips, max_abs_err, max_abs_err_algo, rmse, kl_max, "
    "relative_to_torch, relative_to_torch_atol, out_nan, out_max_abs_err, out_rmse, out_rel_l1, out_cos_min, "
    "out_relative_to_torch, fp16, bf16, fp32"
)
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
    assert (s.d_k, s.scale.name, s.seq, s.rows, s.dist, s.std, s.seed, s.dtypes) == (
        16,
        "sqrt",
        32,
        64,
        "normal",
        1.0,
        0,
        None,
    )
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
            "synthetic": [
                {
                    "d_k": 128,
                    "scale": 0.125,
                    "seq": 256,
                    "rows": 1024,
                    "dist": "outliers",
                    "std": 2,
                    "seed": 3,
                    "dtype": "fp16",
                }
            ],
            "budget": {
                "nan": 1,
                "max_abs_err": 1e-2,
                "relative_to_torch": 2,
                "relative_to_torch_atol": 1e-6,
                "fp32": {"max_abs_err": 1e-6},
            },
        }
    )
    assert cfg.dtypes == ("bf16", "fp16") and cfg.methods == ("tiled", "torch")
    assert (cfg.block, cfg.order, cfg.accum, cfg.device) == (64, "reverse", "dtype", "auto")
    assert cfg.synthetic[0].name == "synthetic[0]:dk=128,scale=0.125,seq=256,std=2,dist=outliers,seed=3"
    assert cfg.synthetic[0].dtypes == ("fp16",)
    assert cfg.budget == Budget(nan=1, overflow=0, max_abs_err=0.01, relative_to_torch=2.0, relative_to_torch_atol=1e-6)
    # A dtype table overrides the keys it sets and inherits the rest.
    assert cfg.budget_for("fp32") == Budget(
        nan=1, overflow=0, max_abs_err=1e-6, relative_to_torch=2.0, relative_to_torch_atol=1e-6
    )
    assert cfg.budget_for("bf16") == cfg.budget


BAD_TABLES = [
    ({"budget": {"nan": "zero"}}, "tool.attncheck.budget.nan must be an integer >= 0, got 'zero'"),
    ({"budget": {"nan": -1}}, "tool.attncheck.budget.nan must be an integer >= 0, got -1"),
    ({"budget": {"overflow": 0.5}}, "tool.attncheck.budget.overflow must be an integer >= 0, got 0.5"),
    ({"budget": {"argmax_flips": True}}, "tool.attncheck.budget.argmax_flips must be an integer >= 0, got true"),
    ({"budget": {"max_abs_err": "1e-2"}}, "tool.attncheck.budget.max_abs_err must be a number >= 0, got '1e-2'"),
    ({"budget": {"kl_max": float("nan")}}, "tool.attncheck.budget.kl_max must be a number >= 0, got nan"),
    ({"budget": {"relative_to_torch": 0}}, "tool.attncheck.budget.relative_to_torch must be a number > 0, got 0"),
    (
        {"budget": {"relative_to_torch_atol": 1e-6}},
        "tool.attncheck.budget.relative_to_torch_atol is set but relative_to_torch is not",
    ),
    ({"budget": 3}, "tool.attncheck.budget must be a table, got 3"),
    (
        {"budget": {"fp32": {"max_abs_err": -1.0}}},
        "tool.attncheck.budget.fp32.max_abs_err must be a number >= 0, got -1.0",
    ),
    ({"budgett": {}}, f"unknown key 'tool.attncheck.budgett' in <config> (known: {KNOWN_TOP})"),
    ({"budget": {"nans": 0}}, f"unknown key 'tool.attncheck.budget.nans' in <config> (known: {KNOWN_BUDGET})"),
    ({"budget": {"fp8": {}}}, f"unknown key 'tool.attncheck.budget.fp8' in <config> (known: {KNOWN_BUDGET})"),
    (
        {"budget": {"bf16": {"fp16": {}}}},
        "unknown key 'tool.attncheck.budget.bf16.fp16' in <config> (known: nan, overflow, zero_rows, argmax_flips, "
        "max_abs_err, max_abs_err_algo, rmse, kl_max, relative_to_torch, relative_to_torch_atol, out_nan, "
        "out_max_abs_err, out_rmse, out_rel_l1, "
        "out_cos_min, out_relative_to_torch)",
    ),
    ({"dtypes": ["fp8"]}, "tool.attncheck.dtypes: unknown dtype 'fp8' (choose from fp16, bf16, fp32)"),
    ({"dtypes": []}, "tool.attncheck.dtypes is empty (choose from fp16, bf16, fp32)"),
    ({"dtypes": [16]}, "tool.attncheck.dtypes must be a list of dtype names (fp16, bf16, fp32), got [16]"),
    ({"methods": ["fast"]}, "tool.attncheck.methods: unknown method 'fast' (choose from naive, stable, tiled, torch)"),
    ({"block": 0}, "tool.attncheck.block must be an integer >= 1, got 0"),
    ({"order": "sideways"}, "tool.attncheck.order must be one of forward, reverse, got 'sideways'"),
    ({"accum": "fp64"}, "tool.attncheck.accum must be one of fp32, dtype, got 'fp64'"),
    ({"device": "tpu"}, "tool.attncheck.device must be one of auto, cpu, cuda or cuda:N, got 'tpu'"),
    (
        {"inputs": "dumps/*.pt"},
        "tool.attncheck.inputs must be a list of strings (globs of tensor files), got 'dumps/*.pt'",
    ),
    ({"keys": ["a"]}, "tool.attncheck.keys picks tensors inside files, but tool.attncheck.inputs names no file"),
    (
        {"synthetic": {"d_k": 64}},
        "tool.attncheck.synthetic must be an array of tables ([[tool.attncheck.synthetic]]), got a table",
    ),
    (
        {"synthetic": [{"scale": "sqrt"}]},
        "tool.attncheck.synthetic[0].d_k is missing (the head dimension, e.g. d_k = 128)",
    ),
    ({"synthetic": [{"d_k": 0}]}, "tool.attncheck.synthetic[0].d_k must be an integer >= 1, got 0"),
    (
        {"synthetic": [{"d_k": 8}, {"d_k": 8, "seq": 1}]},
        "tool.attncheck.synthetic[1].seq must be an integer >= 2, got 1",
    ),
    (
        {"synthetic": [{"d_k": 8, "scale": "huge"}]},
        "tool.attncheck.synthetic[0].scale must be one of none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, "
        "dk2 = 1/d_k^2 or a positive number, got 'huge'",
    ),
    (
        {"synthetic": [{"d_k": 8, "scale": -1}]},
        "tool.attncheck.synthetic[0].scale must be one of none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, "
        "dk2 = 1/d_k^2 or a positive number, got -1",
    ),
    (
        {"synthetic": [{"d_k": 8, "dist": "cauchy"}]},
        "tool.attncheck.synthetic[0].dist must be one of normal, outliers, got 'cauchy'",
    ),
    ({"synthetic": [{"d_k": 8, "std": 0}]}, "tool.attncheck.synthetic[0].std must be a number > 0, got 0"),
    (
        {"synthetic": [{"d_k": 8, "dtype": "int8"}]},
        "tool.attncheck.synthetic[0].dtype: unknown dtype 'int8' (choose from fp16, bf16, fp32)",
    ),
    (
        {"synthetic": [{"dk": 8}]},
        "unknown key 'tool.attncheck.synthetic[0].dk' in <config> (known: d_k, scale, seq, rows, dist, std, seed, "
        "dtype, paths)",
    ),
    (
        {"synthetic": [{"d_k": 8, "paths": ["flash", "xformers"]}]},
        "tool.attncheck.synthetic[0].paths: unknown path 'xformers' (choose from eager, sdpa-math, flash, fa2, "
        "fa2-fma, mem-efficient, cudnn, fa4, flex, flex-math)",
    ),
    (
        {"synthetic": [{"d_k": 8, "paths": []}]},
        "tool.attncheck.synthetic[0].paths is empty (choose from eager, sdpa-math, flash, fa2, fa2-fma, "
        "mem-efficient, cudnn, fa4, flex, flex-math)",
    ),
    (
        {"synthetic": [{"d_k": 8}], "budget": {"out_rmse": 1e-3}},
        'tool.attncheck.budget.out_rmse judges the attention output O = P@V, which needs V: add paths = ["eager", '
        '"flash"] to a '
        "[[tool.attncheck.synthetic]] entry (saved score dumps have no V)",
    ),
    (
        {"synthetic": [{"d_k": 8}], "budget": {"fp16": {"out_nan": 0}}},
        "tool.attncheck.budget.fp16.out_nan judges the attention output O = P@V, which needs V: add paths = "
        '["eager", "flash"] to a '
        "[[tool.attncheck.synthetic]] entry (saved score dumps have no V)",
    ),
    (
        {"synthetic": [{"d_k": 8, "paths": ["flash"]}], "budget": {"out_relative_to_torch": 2}},
        "tool.attncheck.budget.out_relative_to_torch compares each cell with torch.softmax on the eager path: add "
        '"eager" to '
        "tool.attncheck.synthetic[0].paths",
    ),
    (
        {"synthetic": [{"d_k": 8, "paths": ["flash"]}], "budget": {"out_cos_min": 1.5}},
        "tool.attncheck.budget.out_cos_min is a cosine similarity: a number between -1 and 1, got 1.5",
    ),
    (
        {"synthetic": [{"d_k": 8, "paths": ["flash"]}], "budget": {"out_relative_to_torch": 0}},
        "tool.attncheck.budget.out_relative_to_torch must be a number > 0, got 0",
    ),
    # FP8 cells depend on run's --p-scale and --fp8-scaling, which a config has no key for: refused, named (issue 32)
    (
        {"dtypes": ["fp16", "e4m3"]},
        "tool.attncheck.dtypes: 'e4m3' is an FP8 format; check computes in fp16, bf16, fp32 "
        "(FP8 cells need run's --p-scale and --fp8-scaling: judge them with 'attncheck run --dtype e4m3')",
    ),
    (
        {"synthetic": [{"d_k": 8, "dtype": "float8_e5m2"}]},
        "tool.attncheck.synthetic[0].dtype: 'float8_e5m2' is an FP8 format; check "
        "computes in fp16, bf16, fp32 (FP8 cells need run's --p-scale and --fp8-scaling: judge them with 'attncheck "
        "run --dtype e4m3')",
    ),
    (
        {"synthetic": [{"d_k": 8, "paths": ["eager", "sage"]}]},
        "tool.attncheck.synthetic[0].paths: 'sage' computes in FP8; check computes "
        "the paths eager, sdpa-math, flash, fa2, fa2-fma, mem-efficient, cudnn, fa4, flex, flex-math (FP8 cells need "
        "run's --p-scale and --fp8-scaling: judge them with "
        "'attncheck run --dtype e4m3')",
    ),
    (
        {"budget": {"e4m3": {"nan": 0}}},
        "tool.attncheck.budget.e4m3: 'e4m3' is an FP8 format; check computes in fp16, bf16, fp32 "
        "(FP8 cells need run's --p-scale and --fp8-scaling: judge them with 'attncheck run --dtype e4m3')",
    ),
    (
        {},
        '[tool.attncheck] has no inputs: set tool.attncheck.inputs = ["dumps/*.safetensors"] or add a '
        "[[tool.attncheck.synthetic]] table",
    ),
    (
        {"inputs": []},
        '[tool.attncheck] has no inputs: set tool.attncheck.inputs = ["dumps/*.safetensors"] or add a '
        "[[tool.attncheck.synthetic]] table",
    ),
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


def test_ignore_takes_finding_codes(tmp_path):
    cfg = parse_table({**SYN, "ignore": ["fully_masked_rows"]}, root=tmp_path)
    assert cfg.ignore == ("fully_masked_rows",)
    with pytest.raises(
        AttncheckError, match=r"^tool.attncheck.ignore: unknown finding code 'masked' \(known: input_nan"
    ):
        parse_table({**SYN, "ignore": ["masked"]}, root=tmp_path)
    with pytest.raises(AttncheckError, match="tool.attncheck.ignore must be a list of strings"):
        parse_table({**SYN, "ignore": "fully_masked_rows"}, root=tmp_path)


def test_ignored_codes_leave_their_rows_out_of_the_count_budgets(tmp_path):
    from attncheck.pipelines.check import run_check

    x = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    x[0, 1, 3] = -np.inf  # one fully masked row: NaN in torch.softmax
    np.save(tmp_path / "s.npy", x)
    table = {"inputs": ["s.npy"], "methods": ["torch"], "dtypes": ["fp32"]}
    assert not run_check(parse_table(table, root=tmp_path)).passed  # nan budget 0 by default
    result = run_check(parse_table({**table, "ignore": ["fully_masked_rows"]}, root=tmp_path))
    assert result.passed and result.cases[0].checks[0].measured == 0 and result.ignore == ("fully_masked_rows",)


@pytest.mark.parametrize(
    "pattern",
    [
        "**/*.npy",
        "x/**/*.npy",
        "**",
        "x/**",
        "**/y/*.npy",
        "*/y/**/*.npy",
        "x/**/c.npy",
        "./**/*.npy",
        "**/.e.npy",
        "*.npy",
        "x/*/c.npy",
    ],
)
def test_input_globs_find_what_pythons_glob_finds_where_no_folder_loops(tmp_path, pattern):
    """glob_inputs walks '**' itself (to enter each real folder once); on a tree without loops it
    finds the same paths as glob.glob, hidden names and links to folders included."""
    import glob
    import os

    from attncheck.config.check import glob_inputs

    for name in ("a.npy", "x/b.npy", "x/y/c.npy", ".h/d.npy", "x/.e.npy", "z/y/c.npy"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    os.symlink(
        tmp_path / "z", tmp_path / "x" / "link"
    )  # a link to a folder elsewhere in the tree: followed, as glob does
    found = {os.path.normpath(p) for p in glob.glob(pattern, root_dir=tmp_path, recursive=True)}
    # glob lists z's files again under x/link; glob_inputs enters each real folder once, by its own name first
    from_root = pattern.startswith(("**", "./**"))  # its '**' reaches z by its own name, before the link
    expected = sorted(p for p in found if not (from_root and (p + "/").startswith("x/link/")))
    got = sorted({os.path.normpath(p) for p in glob_inputs(pattern, str(tmp_path))})
    assert got == expected and got  # every pattern here finds something


def test_input_globs_enter_a_folder_that_links_to_itself_once(tmp_path):
    import os

    from attncheck.config.check import glob_inputs

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.npy").write_bytes(b"")
    os.symlink(".", tmp_path / "self")
    os.symlink("..", tmp_path / "d" / "up")
    os.symlink(tmp_path, tmp_path / "d" / "root")
    assert sorted(glob_inputs("**/*.npy", str(tmp_path))) == ["d/a.npy"]
    assert sorted(glob_inputs(str(tmp_path / "**" / "*.npy"), "/")) == [str(tmp_path / "d" / "a.npy")]
