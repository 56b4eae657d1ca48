"""`attncheck run` through typer's CliRunner: exit codes, exact error lines, JSON."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.codes import FIX, SEVERITY

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {result.stderr!r}"
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def healthy(tmp_path):
    p = tmp_path / "healthy.npy"
    np.save(p, np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32))
    return p


@pytest.fixture
def overflow_fp16(tmp_path):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[1, 3] = 15.0  # exp(15) overflows fp16
    p = tmp_path / "logits.safetensors"
    save_file({"layer0.scores": x, "layer1.scores": x / 4}, str(p))
    return p


# --------------------------------------------------------------------------- happy paths


def test_example_runs_and_reports_its_problems():
    r = invoke("run", "--example")
    assert r.exit_code == 0, r.output
    for code in ("exp_overflow", "fully_masked_rows", "sentinel_not_repr"):
        assert code in r.stdout
    assert "Method x dtype" in r.stdout


def test_healthy_file_exits_zero_even_with_fail_on(healthy):
    r = invoke("run", healthy, "--fail-on", "nan,overflow")
    assert r.exit_code == 0, r.output
    assert "0 error(s)" in r.stdout


def test_fail_on_nan_exits_one_and_says_why(overflow_fp16):
    r = invoke("run", overflow_fp16, "--fail-on", "nan", "--key", "layer0.*")
    assert r.exit_code == 1
    assert r.stderr.strip() == f"attncheck: --fail-on nan: {overflow_fp16}:layer0.scores: naive/fp16"


def test_fail_on_a_finding_code(overflow_fp16):
    assert invoke("run", overflow_fp16, "--fail-on", "exp_overflow").exit_code == 1
    assert invoke("run", overflow_fp16, "--fail-on", "underflow").exit_code == 0


def test_fail_on_is_not_triggered_by_cells_not_computed(overflow_fp16):
    r = invoke("run", overflow_fp16, "--fail-on", "nan,overflow", "--method", "stable,tiled,torch")
    assert r.exit_code == 0, r.output


def test_json_to_stdout_has_the_contract_keys(overflow_fp16):
    r = invoke("run", overflow_fp16, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # tables are not mixed in
    assert doc["schema"] == "attncheck.run/3"
    assert {"schema", "attncheck_version", "device", "tensors"} <= doc.keys()
    assert doc["device"] == "cpu"
    assert [t["name"] for t in doc["tensors"]] == [f"{overflow_fp16}:layer0.scores", f"{overflow_fp16}:layer1.scores"]
    t = doc["tensors"][0]
    assert {"name", "shape", "dtype", "census", "cells", "findings"} <= t.keys()
    assert t["shape"] == [4, 64] and t["dtype"] == "fp32"
    assert {"rows", "nan", "posinf", "neginf", "fully_masked_rows", "max", "min"} <= t["census"].keys()
    assert t["census"]["rows"] == 4 and t["census"]["max"] == 15.0
    assert len(t["cells"]) == 12
    for cell in t["cells"]:
        assert {
            "method",
            "dtype",
            "nan_rows",
            "nan_causes",
            "overflow_rows",
            "zero_rows",
            "max_abs_err",
            "rmse",
            "max_row_sum_err",
            "kl_max",
            "argmax_flips",
        } <= cell.keys()
        assert isinstance(cell["nan_causes"], dict)
    naive16 = next(c for c in t["cells"] if (c["method"], c["dtype"]) == ("naive", "fp16"))
    assert naive16["nan_rows"] == 1 and naive16["nan_causes"] == {"exp_overflow": 1}
    codes = {f["code"] for f in t["findings"]}
    assert "exp_overflow" in codes
    for f in t["findings"]:
        assert f["severity"] == SEVERITY[f["code"]] or f["code"] == "sentinel_not_representable"
        assert f["fix"] == FIX[f["code"]]


def test_json_writes_null_for_non_finite_numbers(tmp_path):
    p = tmp_path / "masked.npy"
    np.save(p, np.full((2, 4), -np.inf, dtype=np.float32))
    out = tmp_path / "report.json"
    r = invoke("run", p, "--json", out, "--method", "stable")
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())  # strict JSON: no NaN/Infinity literals
    cell = doc["tensors"][0]["cells"][0]
    assert cell["max_abs_err"] is None and cell["nan_causes"] == {"fully_masked": 2}
    assert doc["tensors"][0]["census"]["max"] is None


def test_pt_nested_names_and_key_glob(tmp_path):
    p = tmp_path / "dump.pt"
    torch.save({"layers": [{"scores": torch.randn(3, 5)}, {"scores": torch.randn(3, 5)}], "step": 7}, p)
    r = invoke("run", p, "--key", "layers.1.*", "--json", "-")
    assert r.exit_code == 0, r.output
    assert [t["name"] for t in json.loads(r.stdout)["tensors"]] == [f"{p}:layers.1.scores"]


def test_dtype_and_method_selection(healthy):
    r = invoke("run", healthy, "--dtype", "bf16", "--method", "online,torch", "--json", "-")
    cells = json.loads(r.stdout)["tensors"][0]["cells"]
    assert [(c["method"], c["dtype"]) for c in cells] == [("tiled", "bf16"), ("torch", "bf16")]


# --------------------------------------------------------------------------- bad input


def bad_files(tmp_path):
    """(path, expected message tail) for every kind of bad file."""
    cases = []
    for ext in (".npy", ".npz", ".pt", ".safetensors"):
        p = tmp_path / f"random{ext}"
        p.write_bytes(os.urandom(256))
        cases.append((p, "not a valid"))
    good = {
        ".npy": lambda p: np.save(p, np.ones((64, 64), np.float32)),
        ".npz": lambda p: np.savez(p, a=np.ones((64, 64), np.float32)),
        ".pt": lambda p: torch.save(torch.ones(64, 64), p),
        ".safetensors": lambda p: save_file({"a": torch.ones(64, 64)}, str(p)),
    }
    for ext, write in good.items():
        p = tmp_path / f"truncated{ext}"
        write(p)
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
        cases.append((p, "not a valid"))
    return cases


def test_random_and_truncated_files_exit_2_with_one_line(tmp_path):
    for path, expected in bad_files(tmp_path):
        r = invoke("run", path)
        assert r.exit_code == 2, (path, r.output)
        line = error_line(r)
        assert line.startswith(f"attncheck: error: {path}: {expected}"), line


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_objects_are_refused_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save({"scores": torch.ones(2, 2), "x": Payload(str(marker))}, p)
    r = invoke("run", p)
    assert r.exit_code == 2
    assert error_line(r).startswith(
        f"attncheck: error: {p}: refused to load: it holds pickled objects other than tensors"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "make,expected",
    [
        (
            lambda p: np.save(p.with_suffix(".npy"), np.array([{"a": 1}], dtype=object), allow_pickle=True),
            "{p}.npy: holds an object array (pickled Python objects), which attncheck does not support; nothing was "
            "unpickled. Save a numeric floating-point array",
        ),
        (
            lambda p: torch.save(torch.zeros(2, 3, dtype=torch.int64), p.with_suffix(".pt")),
            "{p}.pt has dtype int64; attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)",
        ),
        (
            lambda p: torch.save(torch.zeros(2, 3, dtype=torch.complex64), p.with_suffix(".pt")),
            "{p}.pt has dtype complex64; attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)",
        ),
        (lambda p: torch.save(torch.zeros(0, 4), p.with_suffix(".pt")), "{p}.pt is empty (shape (0, 4))"),
        (
            lambda p: p.with_suffix(".txt").write_text("hi"),
            "{p}.txt: unsupported file type '.txt' (supported: .pt, .pth, .npy, .npz, .safetensors)",
        ),
    ],
    ids=["object-npy", "int-pt", "complex-pt", "empty", "extension"],
)
def test_bad_tensor_files(tmp_path, make, expected):
    stem = tmp_path / "bad"
    make(stem)
    path = next(tmp_path.iterdir())
    r = invoke("run", path)
    assert r.exit_code == 2
    assert error_line(r) == "attncheck: error: " + expected.format(p=stem)


def test_missing_file(tmp_path):
    r = invoke("run", tmp_path / "nope.pt")
    assert r.exit_code == 2
    assert error_line(r) == f"attncheck: error: {tmp_path / 'nope.pt'}: no such file or directory"


def test_key_matching_nothing(overflow_fp16):
    r = invoke("run", overflow_fp16, "--key", "attn*")
    assert r.exit_code == 2
    assert error_line(r) == (
        f"attncheck: error: --key 'attn*' matches no tensor (available: "
        f"{overflow_fp16}:layer0.scores, {overflow_fp16}:layer1.scores)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is absent")
def test_cuda_requested_without_cuda(healthy):
    r = invoke("run", healthy, "--device", "cuda")
    assert r.exit_code == 2
    assert (
        error_line(r)
        == "attncheck: error: --device cuda requested but CUDA is not available (torch.cuda.is_available() is "
        "False); use --device cpu"
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["--dtype", "fp8"],
            "--dtype: unknown dtype 'fp8' (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz)",
        ),
        (
            ["--dtype", "fp64"],
            "--dtype: dtype 'fp64' cannot be used here (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz)",
        ),
        (
            ["--p-scale", "256"],
            "--p-scale applies to FP8 cells: add an FP8 dtype (e4m3, e5m2, e4m3fnuz, e5m2fnuz) to --dtype (on a "
            "capture: to --what-if)",
        ),
        (["--dtype", "e4m3", "--p-scale", "-1"], "--p-scale must be a number > 0, got -1"),
        (
            ["--dtype", "e4m3", "--fp8-scaling", "head"],
            "--fp8-scaling and --incoherent apply to attention computed from --q and --k",
        ),
        (
            ["--dtype", "e4m3", "--fp8-accum", "24"],
            "--fp8-accum must be 'fp32', 'kernel' or a mantissa bit count from 1 to 23 (Hopper's FP8 MMA keeps "
            "13), got 24",
        ),
        (
            ["--dtype", "e4m3", "--fp8-accum", "fp16"],
            "--fp8-accum must be 'fp32', 'kernel' or a mantissa bit count from 1 to 23 (Hopper's FP8 MMA keeps "
            "13), got 'fp16'",
        ),
        (["--dtype", "e4m3", "--fp8-flush", "0"], "--fp8-flush must be an integer >= 1, got 0"),
        (
            ["--fp8-accum", "13"],
            "--fp8-accum applies to FP8 cells: add an FP8 dtype (e4m3, e5m2, e4m3fnuz, e5m2fnuz) to --dtype (on a "
            "capture: to --what-if)",
        ),
        (
            ["--dtype", "e4m3", "--fp8-flush", "4"],
            "--fp8-accum and --fp8-flush set the accumulator of the FP8 kernels' tensor-core products, computed "
            "from --q and --k or a capture; the file holds scores only",
        ),
        (
            ["--dtype", "e4m3", "--method", "naive"],
            "no cell to compute: in e4m3 only a softmax that casts P to FP8 runs (tiled); add it to --method or a "
            "dtype such as fp16",
        ),
        (["--method", "fast"], "--method: unknown method 'fast' (choose from naive, stable, tiled, torch)"),
        (["--dtype", ""], "--dtype is empty (choose from fp16, bf16, fp32, e4m3, e5m2, e4m3fnuz, e5m2fnuz)"),
        (
            ["--fail-on", "bogus"],
            "--fail-on: unknown condition 'bogus' (use nan, overflow, zero, flip, error, warning or a finding code, "
            "or what-if:CONDITION)",
        ),
        (["--block", "0"], "--block must be an integer >= 1, got 0"),
        (["--block", "x"], "--block must be an integer >= 1, got 'x'"),
        (["--device", "tpu"], "--device must be one of auto, cpu, cuda or cuda:N, got 'tpu'"),
        (
            ["--no-such-thing"],
            "No such option: --no-such-thing (see 'attncheck run --help')",
        ),  # --bogus: click suggests --rows
    ],
)
def test_bad_options(healthy, args, expected):
    r = invoke("run", healthy, *args)
    assert r.exit_code == 2
    assert error_line(r) == f"attncheck: error: {expected}"


def test_no_input():
    r = invoke("run")
    assert r.exit_code == 2
    assert (
        error_line(r)
        == "attncheck: error: no input: give score files or directories, --q and --k, or --example for a built-in one"
    )


def test_unwritable_json_target(healthy, tmp_path):
    r = invoke("run", healthy, "--json", tmp_path / "no" / "dir" / "r.json")
    assert r.exit_code == 2
    assert error_line(r).startswith("attncheck: error: cannot write")


# --------------------------------------------------------------------------- start-up


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["run", "--help"],
        ["run", "--dtype", "fp8", "x.pt"],
        ["run", "--bogus"],
        ["--version"],
        ["sweep", "--help"],
        ["sweep", "--dk", "0"],
    ],
)
def test_help_and_argument_errors_do_not_import_torch(argv):
    code = (
        "import sys\n"
        f"sys.argv = ['attncheck'] + {argv!r}\n"
        "from attncheck.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.exit(3 if 'torch' in sys.modules or 'numpy' in sys.modules else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"torch or numpy imported for {argv}: {proc.stderr}"


WAIT_POLICY_PROBE = """
import os, sys
seen = []
def hook(event, args):  # the variable as it stands when torch (and with it libgomp) is first imported
    if event == "import" and args[0] == "torch" and not seen:
        seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.addaudithook(hook)
sys.argv = ["attncheck", "run", "--example", "--dtype", "fp32", "--method", "stable", "--quiet", "--json", "-"]
from attncheck.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
print(code, len(seen), repr(seen[0]) if seen else "-", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "given, expected",
    [(None, "PASSIVE"), ("ACTIVE", "ACTIVE"), pytest.param("active", "active", marks=pytest.mark.slow)],
)  # a subprocess each: 3.5 s
def test_the_command_keeps_idle_openmp_threads_from_spinning_unless_told(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    proc = subprocess.run(
        [sys.executable, "-c", WAIT_POLICY_PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.stderr.strip() == f"0 1 {expected!r}", proc.stderr


def test_every_command_has_help():
    r = invoke("--help")
    assert r.exit_code == 0
    for name in ("run", "sweep"):
        assert name in r.stdout
        sub = invoke(name, "--help")
        assert sub.exit_code == 0 and len(sub.stdout) > 200


@pytest.mark.parametrize("command", ["run", "sweep", "check", None])
def test_help_shows_flags_without_a_type(command):
    r = runner.invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0
    assert "<bool>" not in r.stdout and "<str>" not in r.stdout and "<list" not in r.stdout
    flags = ("--version", "--help") if command is None else ("--quiet", "--help")
    for flag in flags + (("--brief", "--example", "--causal") if command == "run" else ()):
        (line,) = [ln for ln in r.stdout.splitlines() if f" {flag} " in ln or ln.rstrip().endswith(flag)][:1]
        assert "<" not in line, line


def test_module_entry_point(healthy):
    proc = subprocess.run(
        [sys.executable, "-m", "attncheck", "run", str(healthy), "--json", "-"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schema"] == "attncheck.run/3"


def test_plain_pickle_is_refused(tmp_path):
    p = tmp_path / "plain.pt"
    with open(p, "wb") as fh:
        pickle.dump({"x": [1.0, 2.0]}, fh, protocol=2)
    r = invoke("run", p)
    assert r.exit_code == 2
    assert error_line(r).startswith(f"attncheck: error: {p}:")


def test_help_keeps_bracketed_text():
    # Rich reads [..] as markup: the check help must still show the table's name.
    r = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "200"})
    assert r.stdout.count("[tool.attncheck]") >= 2


def test_file_colon_key_as_a_path_says_how_to_pick_the_tensor(tmp_path):
    """FILE:KEY is --q's form; as a score path it names no file, and the error says what to write."""
    p = tmp_path / "dump.pt"
    torch.save({"scores": torch.zeros(2, 3)}, p)
    r = invoke("run", f"{p}:scores")
    assert r.exit_code == 2
    assert (
        error_line(r)
        == f"attncheck: error: {p}:scores: no such file or directory (to diagnose the tensor 'scores' of {p}, pass "
        f"{p} --key 'scores')"
    )
    r = invoke("run", p, "--key", "scores", "--brief", "--dtype", "fp32")
    assert r.exit_code == 0, r.output


def test_ignore_leaves_its_rows_out_of_the_head_grid_of_score_files(tmp_path, monkeypatch):
    """Score files (no capture): with --ignore fully_masked_rows the call table counts 0 NaN rows for a file
    whose only NaN rows are fully masked, and the layer x head grid agrees (no N2 beside the table's 0)."""
    g = np.random.default_rng(0)
    a = g.standard_normal((2, 4, 8, 8)).astype(np.float16)
    a[1, 2, 5] = a[0, 2, 3] = -np.inf  # head 2: two rows with every key masked
    b = g.standard_normal((2, 4, 8, 8)).astype(np.float16)
    b[0, 1, 2, 3] = np.inf  # head 1: +inf, not ignored
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)

    def grid(*extra):
        monkeypatch.chdir(tmp_path)  # short names: a call column that does not wrap
        r = CliRunner().invoke(app, ["run", "a.npy", "b.npy", *extra], env={"COLUMNS": "100"})
        lines = [line.split() for line in r.stdout.splitlines() if line.strip()]
        rows = [w for w in lines if w[0] in ("a.npy", "b.npy")]  # the grid's rows start with the call
        table = [[x for x in w if x != ">"] for w in lines if w[0].isdigit() and ("a.npy" in w or "b.npy" in w)]
        return rows, table

    rows, _ = grid()
    assert rows[0][3] == "N2" and rows[1][2] == "N1"
    rows, table = grid("--ignore", "fully_masked_rows")
    assert table[0][4] == "0" and not any(cell.startswith("N") for cell in rows[0][1:]) and rows[1][2] == "N1"


def test_fp8_accumulator_options(tmp_path):
    """--fp8-accum fp32 with --fp8-flush has nothing to flush: exit 2 with one line; each alone runs."""
    g = torch.Generator().manual_seed(0)
    f = tmp_path / "qkv.pt"
    torch.save({n: torch.randn(1, 1, 8, 32, generator=g) for n in "qkv"}, f)
    qkv = ["--q", f"{f}:q", "--k", f"{f}:k", "--v", f"{f}:v", "--dtype", "e4m3", "--brief"]
    r = invoke("run", *qkv, "--fp8-accum", "fp32", "--fp8-flush", "4")
    assert r.exit_code == 2
    assert error_line(r) == (
        "attncheck: error: --fp8-flush flushes the reduced FP8 accumulator into fp32; with --fp8-accum fp32 there "
        "is nothing to flush"
    )
    for extra in (["--fp8-accum", "fp32"], ["--fp8-accum", "9", "--fp8-flush", "2"]):
        assert invoke("run", *qkv, *extra).exit_code == 0
