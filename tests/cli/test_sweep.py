"""`attncheck sweep` end to end: exit codes, exact error lines, JSON keys, tables, the plot."""

import io
import json
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config.sweep import SweepConfig
from attncheck.params import scales as parse_scales
from attncheck.pipelines.sweep import run_sweep
from attncheck.report.sweep import print_sweep

runner = CliRunner()
SMALL = ["--dk", "16,64", "--rows", "128", "--seq", "32"]

POINT_KEYS = {
    "dk",
    "scale",
    "scale_value",
    "std",
    "seq",
    "var_qk",
    "var_qk_theory",
    "var_scaled",
    "var_scaled_theory",
    "max_prob_mean",
    "entropy_mean",
    "entropy_norm_mean",
    "jacobian_norm_mean",
    "cells",
}
CELL_KEYS = {"method", "dtype", "nan_rate", "overflow_rate", "max_abs_err"}


def sweep(*args):
    return runner.invoke(app, ["sweep", *args])


def test_the_ends_of_the_std_and_scale_ranges_run():
    r = sweep(
        "--std",
        "1e30,1e-30",
        "--scale",
        "1e-30,1e30",
        "--dk",
        "16",
        "--seq",
        "16",
        "--rows",
        "32",
        "--dtype",
        "fp16",
        "--method",
        "naive",
        "--path",
        "none",
        "--json",
        "-",
        "--quiet",
    )
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["points"]) == 4


SCALE_HELP = "none, sqrt = 1/sqrt(d_k) (or auto, the same), dk = 1/d_k, dk2 = 1/d_k^2 or a positive number"
BAD_INPUTS = [
    (["--dk", "0"], "--dk must be an integer >= 1, got 0"),
    (["--dk", "16,-32"], "--dk must be an integer >= 1, got -32"),
    (["--dk", "abc"], "--dk must be an integer >= 1, got 'abc'"),
    (["--dk", "1.5"], "--dk must be an integer >= 1, got '1.5'"),
    (["--dk", ","], "--dk is empty"),
    (["--scale", "huge"], f"--scale must be one of {SCALE_HELP}, got 'huge'"),
    (["--scale", "sqrt,-0.5"], f"--scale must be one of {SCALE_HELP}, got '-0.5'"),
    (["--seq", "1"], "--seq must be an integer >= 2, got 1"),
    (["--seq", "many"], "--seq must be an integer >= 2, got 'many'"),
    (["--rows", "-4"], "--rows must be an integer >= 2, got -4"),
    (["--std", "0"], "--std must be a number > 0, got 0"),
    (["--std", "wide"], "--std must be a number > 0, got 'wide'"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--block", "0"], "--block must be an integer >= 1, got 0"),
    (["--dist", "cauchy"], "--dist must be one of normal, outliers, got 'cauchy'"),
    (["--dtype", "fp8"], "--dtype: unknown dtype 'fp8' (choose from fp16, bf16, fp32)"),
    (["--method", "fast"], "--method: unknown method 'fast' (choose from naive, stable, tiled, torch)"),
    (["--device", "tpu"], "--device must be one of auto, cpu, cuda or cuda:N, got 'tpu'"),
    (
        ["--rows", "100000000"],
        "a sweep point of 100000000 rows x 128 keys x d_k 512 needs about 3,433 GiB of memory, over the 2 GiB "
        "budget: lower --rows, --seq or --dk",
    ),
    (
        ["--dk", "100000000"],
        "a sweep point of 4096 rows x 128 keys x d_k 100000000 needs about 18,311 GiB of memory, over the 2 GiB "
        "budget: lower --rows, --seq or --dk",
    ),
    (
        # q and k are 1.9 GiB; drawing the outliers' second normal and masks needs 1.2 GiB more
        ["--dk", "1000000", "--rows", "128", "--seq", "32", "--dist", "outliers"],
        "a sweep point of 128 rows x 32 keys x d_k 1000000 needs about 6.91 GiB of memory, over the 2 GiB budget: "
        "lower --rows, --seq or --dk",
    ),
    (
        ["--json", "/no/such/folder/out.json"],
        "cannot write --json /no/such/folder/out.json: folder /no/such/folder does not exist",
    ),
    (
        ["--plot", "/no/such/folder/out.png"],
        "cannot write --plot /no/such/folder/out.png: folder /no/such/folder does not exist",
    ),
    (["--plot", "/"], "cannot write --plot /: it is a folder; give a file name"),
    # the theory's float64 moments: std 1e200 overflowed, 1e-300 divided by zero, a subnormal scale never ended
    (["--std", "1e200"], "--std must be from 1e-30 to 1e+30 for the sweep's theory, got 1e+200"),
    (["--std", "1e-300"], "--std must be from 1e-30 to 1e+30 for the sweep's theory, got 1e-300"),
    (["--scale", "5e-324"], "--scale must be from 1e-30 to 1e+30 for the sweep's theory, got 4.94066e-324"),
    (["--rows", "1" + "0" * 5000], "--rows must be an integer from 2 to 2^62, got an integer of 5,001 digits"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(args, message):
    result = sweep(*args)
    assert result.exit_code == 2
    assert result.stderr == f"attncheck: error: {message}\n"
    assert result.stdout == ""


def test_bad_input_is_rejected_without_torch():
    """Options are checked before torch is imported: with torch made unimportable, every
    bad input above still gets its one line and exit 2 (and --help works)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from typer.testing import CliRunner
        from attncheck.cli import app
        runner = CliRunner()
        for args, message in {BAD_INPUTS!r}:
            r = runner.invoke(app, ["sweep", *args])
            assert r.exit_code == 2, (args, r.exit_code, r.output, r.exception)
            assert r.stderr == "attncheck: error: " + message + "\\n", (args, r.stderr)
        r = runner.invoke(app, ["sweep", "--help"])
        assert r.exit_code == 0 and "--scale" in r.stdout
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_importing_the_command_does_not_import_torch():
    code = (
        "import sys, attncheck.cli.sweep, attncheck.config.sweep; print('torch' in sys.modules, 'matplotlib' in "
        "sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr


def test_json_has_schema_options_and_point_keys(tmp_path):
    target = tmp_path / "sweep.json"
    result = sweep(*SMALL, "--scale", "none,sqrt,0.125", "--json", str(target))
    assert result.exit_code == 0, result.output
    doc = json.loads(target.read_text())
    assert doc["schema"] == "attncheck.sweep/1"
    assert {"attncheck_version", "options", "points"} <= set(doc)
    assert doc["options"]["dk"] == [16, 64] and doc["options"]["scale"] == ["none", "sqrt", "0.125"]
    assert len(doc["points"]) == 2 * 3
    for point in doc["points"]:
        assert POINT_KEYS <= set(point)
        assert len(point["cells"]) == 3 * 4
        for cell in point["cells"]:
            assert CELL_KEYS <= set(cell)
    named = {(p["dk"], p["scale"]): p for p in doc["points"]}
    assert named[(16, "0.125")]["scale_value"] == 0.125  # a number keeps the name it was given
    assert named[(64, "sqrt")]["scale_value"] == 0.125  # 1/sqrt(64)
    assert named[(64, "sqrt")]["var_scaled_theory"] == pytest.approx(1.0)
    assert named[(16, "none")]["var_qk_theory"] == 16


def test_json_to_stdout_prints_only_json():
    result = sweep(*SMALL, "--scale", "sqrt", "--dtype", "fp16", "--method", "naive", "--json", "-")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert [p["dk"] for p in doc["points"]] == [16, 64]


def test_tables_print_every_section():
    result = sweep(*SMALL)
    assert result.exit_code == 0, result.output
    for title in (
        "1. Var(q.k) grows as d_k",
        "2. Effect of the scaling factor",
        "3. Naive softmax",
        "4. Max |p - p_float64|",
        "5. Output O = P@V",
    ):
        assert title in result.stdout
    result = sweep(*SMALL, "--path", "none")
    assert result.exit_code == 0 and "5. Output" not in result.stdout


def test_json_outputs_per_path_and_dtype():
    result = sweep(*SMALL, "--scale", "sqrt", "--dtype", "bf16", "--path", "eager,flash", "--json", "-")
    assert result.exit_code == 0, result.output
    for point in json.loads(result.stdout)["points"]:
        assert [(o["path"], o["dtype"]) for o in point["outputs"]] == [("eager", "bf16"), ("flash", "bf16")]
        for o in point["outputs"]:
            assert o["nan_rate"] == 0 and 1e-4 < o["rmse"] < 1e-2 and o["rmse"] <= o["max_abs_err"]


def test_preset_pcast_prints_the_closed_form_beside_the_measurement():
    result = sweep("--preset", "pcast", "--json", "-")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["preset"]
    assert doc["name"] == "pcast" and all(c["holds"] for c in doc["checks"])
    grid = doc["grids"][0]
    assert grid["columns"][:4] == ["gap", "S", "6.93 + ln S", "closed form"] and len(grid["rows"]) == 21
    table = sweep("--preset", "pcast")
    assert table.exit_code == 0 and "closed form" in table.stdout and "…" not in table.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "fa2"], "--preset must be one of fa3, pcast, got 'fa2'"),
        (["--preset", "fa3", "--dk", "64"], "--preset fa3 sets its own inputs: --dk does not apply"),
        (
            ["--preset", "fa3", "--dtype", "bf16", "--rows", "8"],
            "--preset fa3 sets its own inputs: --dtype, --rows do not apply",
        ),
        (["--path", "xformers"], "--path: unknown path 'xformers' (choose from eager, sdpa-math, flash)"),
        # The grid computes in fp16, bf16 and fp32; the FP8 paths are --preset fa3's.
        (
            ["--path", "flash,flash-fp8"],
            "--path: path 'flash-fp8' cannot be used here (choose from eager, sdpa-math, flash)",
        ),
    ],
)
def test_preset_and_path_errors(args, message):
    result = sweep(*args)
    assert result.exit_code == 2 and result.stderr == f"attncheck: error: {message}\n"


@pytest.mark.parametrize("width", [80, 120])
def test_tables_fit_the_terminal(width):
    config = SweepConfig(dks=(16, 32, 64, 128, 256, 512), scales=parse_scales("none,sqrt,dk,dk2"), seqs=(32,), rows=64)
    buf = io.StringIO()
    print_sweep(Console(width=width, file=buf, color_system=None), run_sweep(config))
    text = buf.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width
    assert "…" not in text  # nothing cut short
    # Unscaled d_k = 512 logits (std ~22.6) overflow naive fp16 in every row: the error map says so.
    assert "ovf 100%" in text


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path):
    target = tmp_path / "sweep.png"
    result = sweep(*SMALL, "--plot", str(target))
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_overflow_and_error_maps_per_dtype():
    import matplotlib.pyplot as plt

    from attncheck.report.sweep_plot import sweep_figure

    config = SweepConfig(
        dks=(16, 256),
        scales=tuple(parse_scales("none,sqrt")),
        rows=128,
        seqs=(32,),
        dtypes=("fp16", "fp32"),
        methods=("naive", "stable"),
    )
    result = run_sweep(config)
    fig = sweep_figure(result)
    try:
        titles = [ax.get_title() for ax in fig.axes]
        for dtype in ("fp16", "fp32"):
            assert f"{dtype}: share of rows that overflow (any method)" in titles
            assert f"{dtype}: log10 max |p - p_float64|" in titles
        # The overflow map is the sweep's numbers: unscaled d_k 256 overflows naive fp16 in every row.
        ax = next(a for a in fig.axes if a.get_title().startswith("fp16: share"))
        grid = ax.get_images()[0].get_array()
        point = next(p for p in result.points if p.dk == 256 and p.scale == "none")
        assert grid[0][1] == max(c.overflow_rate for c in point.cells if c.dtype == "fp16") == 1.0
    finally:
        plt.close(fig)


def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = sweep(*SMALL, "--plot", str(tmp_path / "sweep.png"))
    assert result.exit_code == 2
    assert result.stderr == "attncheck: error: --plot needs matplotlib: pip install 'attncheck[plot]'\n"
    assert not (tmp_path / "sweep.png").exists()


def test_sweep_has_help_text():
    result = sweep("--help")
    assert result.exit_code == 0
    assert "Sweep synthetic Q and K" in result.stdout


def test_block_wider_than_the_rows_runs_as_one_block(tmp_path):
    # A key block of 10^11 keys is one block over the row: no padding to allocate.
    out = tmp_path / "wide.json"
    result = sweep(
        "--dk",
        "16",
        "--scale",
        "sqrt",
        "--rows",
        "64",
        "--seq",
        "32",
        "--method",
        "tiled,stable",
        "--dtype",
        "fp32",
        "--block",
        "99999999999",
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    cells = {c["method"]: c for c in json.loads(out.read_text())["points"][0]["cells"]}
    assert cells["tiled"]["nan_rate"] == 0 and cells["tiled"]["max_abs_err"] < 1e-6


def run_sweep_cli(*args, progress: str | None):
    import os

    env = {k: v for k, v in os.environ.items() if k != "ATTNCHECK_PROGRESS"}
    if progress is not None:
        env.update(ATTNCHECK_PROGRESS=progress, COLUMNS="100")
    return subprocess.run(
        [sys.executable, "-m", "attncheck", "sweep", *SMALL, "--path", "none", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
def test_progress_goes_to_stderr_never_into_json_stdout():
    shown = run_sweep_cli("--json", "-", progress="always")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["schema"] == "attncheck.sweep/1"
    assert "/8\x1b" in shown.stderr and "grid points" in shown.stderr  # the bar was drawn, on stderr: 2 d_k x 4 scales
    quiet = run_sweep_cli("--json", "-", "--quiet", progress="always")
    assert json.loads(quiet.stdout)["schema"] == "attncheck.sweep/1" and quiet.stderr == ""


@pytest.mark.slow  # as run's and check's, which stay in the default run
def test_no_progress_when_stderr_is_not_a_terminal():
    proc = run_sweep_cli("--json", "-", progress=None)
    assert proc.returncode == 0 and proc.stderr == ""


@pytest.mark.slow
def test_preset_shows_progress_on_stderr_never_in_json():
    import os

    env = dict(
        {k: v for k, v in os.environ.items() if k != "ATTNCHECK_PROGRESS"}, ATTNCHECK_PROGRESS="always", COLUMNS="100"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "attncheck", "sweep", "--preset", "pcast", "--json", "-"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["preset"]["name"] == "pcast"
    from attncheck.numerics.sweep.presets import PCAST_GAPS, PCAST_SCALES

    steps = len(PCAST_GAPS) * len(PCAST_SCALES)
    assert "preset pcast" in proc.stderr and f"/{steps}\x1b" in proc.stderr and "steps" in proc.stderr
