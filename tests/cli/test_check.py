"""`attncheck check` end to end: exit codes 0/1/2, exact error lines, JUnit XML parsed with
ElementTree, Markdown, JSON, $GITHUB_STEP_SUMMARY, and the example config of examples/ci/."""

import importlib.util
import io
import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config.check import load_config

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
LN_FP16_LIMIT = math.log(65520.0)


@pytest.fixture(autouse=True)
def no_step_summary(monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


def check(*args):
    return runner.invoke(app, ["check", *map(str, args)])


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {result.stderr!r}"
    assert "Traceback" not in result.output
    return lines[0]


PASSING = """\
[tool.attncheck]
inputs = ["dumps/*.npy"]
dtypes = ["bf16", "fp16"]
methods = ["stable", "tiled", "torch"]

[tool.attncheck.budget]
nan = 0
overflow = 0
max_abs_err = 1e-2

[[tool.attncheck.synthetic]]
d_k = 32
seq = 64
rows = 64
"""

OVERFLOWING = """\
[tool.attncheck]
inputs = ["dumps/*.npy"]
dtypes = ["fp16"]
methods = ["naive", "stable"]

[tool.attncheck.budget]
nan = 1000
overflow = 0
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder with one healthy dump; the test writes its pyproject.toml."""
    (tmp_path / "dumps").mkdir()
    np.save(tmp_path / "dumps" / "healthy.npy", np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def overflow_dump(project):
    """fp16 logits where some rows hold a score above ln(65520): naive fp16 overflows exactly there."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16, 64)) * 1.5
    hot = rng.random((2, 16)) < 0.25
    x[..., 7] = np.where(hot, 11.5 + 6 * rng.random((2, 16)), x[..., 7])
    x = x.astype(np.float16)
    (project / "dumps" / "healthy.npy").unlink()
    np.save(project / "dumps" / "overflow.npy", x)
    (project / "pyproject.toml").write_text(OVERFLOWING)
    return x


# --------------------------------------------------------------------------- exit 0


def test_passing_config_exits_0_and_writes_every_report(project):
    (project / "pyproject.toml").write_text(PASSING)
    r = check("--junit", "out.xml", "--markdown", "out.md", "--json", "out.json")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    assert "all 12 case(s) within budget (2 input(s), config pyproject.toml, device cpu)" in " ".join(r.stdout.split())

    suite = ET.parse(project / "out.xml").getroot()
    assert (suite.tag, suite.get("name"), suite.get("tests"), suite.get("failures"), suite.get("errors")) == (
        "testsuite",
        "attncheck",
        "12",
        "0",
        "0",
    )
    cases = suite.findall("testcase")
    assert {c.get("classname") for c in cases} == {
        "attncheck.dumps/healthy.npy",
        "attncheck.synthetic[0]:dk=32,scale=sqrt,seq=64,rows=64,dist=normal,seed=0",
    }
    assert [c.get("name") for c in cases[:6]] == [
        "stable/bf16",
        "stable/fp16",
        "tiled/bf16",
        "tiled/fp16",
        "torch/bf16",
        "torch/fp16",
    ]
    assert all(c.find("failure") is None for c in cases)

    doc = json.loads((project / "out.json").read_text())
    assert doc["schema"] == "attncheck.check/1" and doc["passed"] is True
    assert doc["config"] == "pyproject.toml" and doc["config_path"] == str(project / "pyproject.toml")
    assert doc["summary"] == {"cases": 12, "passed": 12, "failed": 0}
    assert doc["budget"]["max_abs_err"] == 0.01 and doc["budget"]["rmse"] is None
    first = doc["cases"][0]
    assert {"input", "method", "dtype", "name", "passed", "shape", "rows", "compared_rows", "checks"} <= set(first)
    assert [c["budget"] for c in first["checks"]] == ["nan", "overflow", "max_abs_err"]

    md = (project / "out.md").read_text()
    assert md.startswith("### attncheck check: ✅ all 12 case(s) within budget\n")
    assert "| result | input | cell | nan (<= 0) | overflow (<= 0) | max_abs_err (<= 0.01) |" in md
    assert md.count("| ✅ pass |") == 12


def test_help_is_documented():
    r = check("--help")
    assert r.exit_code == 0
    for option in ("--config", "--junit", "--markdown", "--json", "--device", "--quiet"):
        assert option in r.stdout
    assert "Exit codes" in r.stdout


# --------------------------------------------------------------------------- exit 1


def test_fp16_naive_overflow_exits_1_and_junit_names_the_case(overflow_dump, project):
    expected = int((overflow_dump.astype(np.float64).max(axis=-1) > LN_FP16_LIMIT).sum())  # counted without attncheck
    assert expected >= 3
    r = check("--junit", "junit.xml", "--json", "report.json")
    assert r.exit_code == 1, r.output

    suite = ET.parse(project / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    failed = [tc for tc in suite.iter("testcase") if tc.find("failure") is not None]
    assert [(tc.get("classname"), tc.get("name")) for tc in failed] == [("attncheck.dumps/overflow.npy", "naive/fp16")]
    failure = failed[0].find("failure")
    assert failure.get("type") == "budget"
    assert re.fullmatch(rf"overflow {expected} > budget 0 \(rows .+\)", failure.get("message")), failure.get("message")
    assert f"FAIL overflow: {expected} > budget 0; rows " in failure.text
    assert f"ok   nan: {expected} <= budget 1000" in failure.text
    assert "input dumps/overflow.npy, shape (2, 16, 64), cell naive/fp16: 32 rows" in failure.text

    doc = json.loads((project / "report.json").read_text())
    case = next(c for c in doc["cases"] if c["name"] == "naive/fp16")
    overflow = next(c for c in case["checks"] if c["budget"] == "overflow")
    assert (overflow["measured"], overflow["limit"], overflow["passed"]) == (expected, 0, False)
    hot = {tuple(map(int, i)) for i in np.argwhere(overflow_dump.astype(np.float64).max(axis=-1) > LN_FP16_LIMIT)}
    assert overflow["rows"] and {tuple(r) for r in overflow["rows"]} <= hot
    assert doc["passed"] is False and doc["summary"] == {"cases": 2, "passed": 1, "failed": 1}

    assert r.stderr.startswith(
        f"attncheck: budget broken: dumps/overflow.npy naive/fp16: overflow {expected} > budget 0 (rows "
    )
    assert len(r.stderr.strip().splitlines()) == 1


def test_markdown_goes_to_the_step_summary_too(overflow_dump, project, monkeypatch):
    summary = project / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    r = check("--markdown", "check.md", "--quiet")
    assert r.exit_code == 1
    md = (project / "check.md").read_text()
    assert md.startswith("### attncheck check: ❌ 1 of 2 case(s) broke their budget\n")
    assert "| ❌ fail | `dumps/overflow.npy` | naive/fp16 |" in md
    assert "**Budgets broken**" in md
    assert summary.read_text() == "earlier step\n" + md + "\n"
    assert "budget broken" not in r.stdout and "case(s) broke their budget" in r.stdout  # --quiet: the verdict only


def test_json_to_stdout_prints_only_json(overflow_dump):
    r = check("--json", "-")
    assert r.exit_code == 1
    assert json.loads(r.stdout)["summary"]["failed"] == 1


def test_rich_summary_fits_80_columns(overflow_dump, project):
    from attncheck.pipelines.check import run_check
    from attncheck.report.check import print_summary

    result = run_check(load_config(project / "pyproject.toml"))
    buf = io.StringIO()
    print_summary(Console(width=80, file=buf, color_system=None), result)
    text = buf.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "…" not in text
    assert re.search(r"FAIL\s+naive/fp16\s+\d+\s+\d+", text)
    assert re.search(r"pass\s+stable/fp16\s+0\s+0", text)


OUTPUT_BUDGET = """\
[tool.attncheck]
dtypes = ["bf16"]
methods = ["torch"]

[[tool.attncheck.synthetic]]
d_k = 64
seq = 128
rows = 128
paths = ["eager", "flash"]

[tool.attncheck.budget]
out_rmse = 1e-4
out_cos_min = 0.99
"""


def test_output_budget_on_attention_paths_exits_1(project):
    """bf16 keeps 8 significant bits: rounding P and O puts O's RMSE on N(0,1) inputs well above 1e-4 in every path,
    while the rows still point the right way (cosine > 0.99)."""
    (project / "pyproject.toml").write_text(OUTPUT_BUDGET)
    r = check("--json", "report.json", "--junit", "junit.xml")
    assert r.exit_code == 1, r.output
    doc = json.loads((project / "report.json").read_text())
    assert [c["name"] for c in doc["cases"]] == ["eager:torch/bf16", "flash/bf16"]
    for case in doc["cases"]:
        rmse, cos = (next(c for c in case["checks"] if c["budget"] == b) for b in ("out_rmse", "out_cos_min"))
        assert rmse["passed"] is False and 1e-4 < rmse["measured"] < 1e-2
        assert cos["passed"] is True and 0.99 < cos["measured"] < 1
        assert rmse["message"].startswith("out_rmse ") and " > budget 0.0001" in rmse["message"]
    suite = ET.parse(project / "junit.xml").getroot()
    assert [tc.get("name") for tc in suite.iter("testcase")] == ["eager:torch/bf16", "flash/bf16"]
    assert "ok   out_cos_min: 0.99" in suite.find("testcase/failure").text
    assert r.stderr.count("budget broken") == 2 and "flash/bf16: out_rmse" in r.stderr


# --------------------------------------------------------------------------- exit 2


def write_config(project, text):
    (project / "pyproject.toml").write_text(textwrap.dedent(text))


CONFIG_ERRORS = [
    (
        '[tool.attncheck]\ninputs = ["dumps/*.npy"]\nblock = \n',
        r"pyproject\.toml: invalid TOML: Invalid value \(at line 3, column 9\)",
    ),
    (
        '[tool.attncheck]\ninputs = ["dumps/*.npy"]\n[tool.attncheck.budgett]\nnan = 0\n',
        re.escape(
            "unknown key 'tool.attncheck.budgett' in pyproject.toml (known: inputs, keys, synthetic, dtypes, "
            "methods, block, order, accum, device, max_memory, max_work, budget, ignore)"
        ),
    ),
    (
        '[tool.attncheck]\ninputs = ["dumps/*.npy"]\n[tool.attncheck.budget]\nnan = "zero"\n',
        re.escape("tool.attncheck.budget.nan must be an integer >= 0, got 'zero'"),
    ),
    (
        '[tool.attncheck]\ninputs = ["dumps/*.pt"]\n',
        re.escape("tool.attncheck.inputs: 'dumps/*.pt' matches no file (relative to ") + ".+" + re.escape(")"),
    ),
    (
        "[tool.attncheck]\ndtypes = ['bf16']\n",
        re.escape(
            '[tool.attncheck] has no inputs: set tool.attncheck.inputs = ["dumps/*.safetensors"] or add a '
            "[[tool.attncheck.synthetic]] table"
        ),
    ),
    (
        "[tool.attncheck]\n[[tool.attncheck.synthetic]]\nd_k = 8\npaths = ['eager', 'triton']\n",
        re.escape(
            "tool.attncheck.synthetic[0].paths: unknown path 'triton' (choose from eager, sdpa-math, flash, fa2, "
            "fa2-fma, mem-efficient, cudnn, fa4, flex, flex-math)"
        ),
    ),
    (
        "[tool.attncheck]\n[[tool.attncheck.synthetic]]\nd_k = 8\n[tool.attncheck.budget]\nout_rmse = 1e-3\n",
        re.escape(
            "tool.attncheck.budget.out_rmse judges the attention output O = P@V, which needs V: add paths = "
            '["eager", "flash"] to a [[tool.attncheck.synthetic]] entry (saved score dumps have no V)'
        ),
    ),
    (
        "[project]\nname = 'x'\n",
        r"no config found: no attncheck\.toml, and no pyproject\.toml with a \[tool\.attncheck\] table, in .+ or its "
        r"parents; add one or pass --config FILE",
    ),
    # q and k of 10^9 keys x 64 (512 GB), and one head's 1024 x 10^9 scores: refused before torch is imported
    (
        "[tool.attncheck]\n[[tool.attncheck.synthetic]]\nd_k = 64\nseq = 1000000000\n",
        re.escape(
            "tool.attncheck.synthetic[0]: its q and k (1 heads x (1024 queries + 1000000000 keys) x d_k 64) and a "
            "head's scores need 23,365 GiB, "
            "over tool.attncheck.max_memory 1 GiB: lower seq, rows or d_k, or raise tool.attncheck.max_memory"
        ),
    ),
    (
        "[tool.attncheck]\nmax_memory = '64MiB'\n[[tool.attncheck.synthetic]]\nd_k = 64\nseq = 4096\n",
        re.escape(
            "tool.attncheck.synthetic[0]: its q and k (1 heads x (1024 queries + 4096 keys) x d_k 64) and a head's "
            "scores need 98.5 MiB, "
            "over tool.attncheck.max_memory 64 MiB: lower seq, rows or d_k, or raise tool.attncheck.max_memory"
        ),
    ),
    (
        "[tool.attncheck]\nmax_memory = 'lots'\n[[tool.attncheck.synthetic]]\nd_k = 64\n",
        re.escape("tool.attncheck.max_memory: 'lots' is not a size (e.g. 1GiB, 512MiB, 2G)"),
    ),
]


@pytest.mark.parametrize(
    "text,pattern",
    CONFIG_ERRORS,
    ids=[
        "bad-toml",
        "unknown-key",
        "wrong-type",
        "no-match",
        "no-inputs",
        "unknown-path",
        "out-without-v",
        "no-table",
        "huge-seq",
        "over-max-memory",
        "bad-max-memory",
    ],
)
def test_config_errors_exit_2_with_one_line(project, text, pattern):
    (project / "pyproject.toml").write_text(text)
    r = check("--junit", "junit.xml")
    assert r.exit_code == 2, r.output
    assert re.fullmatch("attncheck: error: " + pattern, error_line(r)), r.stderr
    assert r.stdout == "" and not (project / "junit.xml").exists()


def test_option_errors_exit_2(project):
    (project / "pyproject.toml").write_text(PASSING)
    for args, message in [
        (["--device", "tpu"], "--device must be one of auto, cpu, cuda or cuda:N, got 'tpu'"),
        (
            ["--junit", "no/such/dir/j.xml"],
            f"cannot write --junit no/such/dir/j.xml: folder {project}/no/such/dir does not exist",
        ),
        (["--markdown", "."], "cannot write --markdown .: it is a folder; give a file name"),
        (["--config", "missing.toml"], "config missing.toml: no such file"),
    ]:
        r = check(*args)
        assert r.exit_code == 2, (args, r.output)
        assert error_line(r) == f"attncheck: error: {message}"


def test_config_that_is_not_a_regular_file_or_has_a_name_too_long(project):
    start = time.perf_counter()
    r = check("--config", "/dev/zero")
    assert (
        r.exit_code == 2 and error_line(r) == "attncheck: error: config /dev/zero: not a regular file; give a TOML file"
    )
    assert time.perf_counter() - start < 5
    long = "c" * 300 + ".toml"
    r = check("--config", long)
    assert r.exit_code == 2 and error_line(r) == f"attncheck: error: config {long}: cannot read it (File name too long)"


def test_synthetic_input_within_max_memory_streams_its_rows(project):
    # One head of 1024 queries x 4096 keys: q, k and two heads' scores fit 128 MiB; the check
    # reads its rows in blocks and gives the numbers of the whole-tensor check.
    (project / "pyproject.toml").write_text(
        "[tool.attncheck]\nmax_memory = '128MiB'\ndtypes = ['fp32']\nmethods = ['torch']\n"
        "[[tool.attncheck.synthetic]]\nd_k = 16\nseq = 4096\n"
    )
    r = check("--json", "-")
    assert r.exit_code == 0, r.output
    (case,) = json.loads(r.stdout)["cases"]
    assert case["shape"] == [1024, 4096] and case["passed"]


def test_junit_to_stdout(overflow_dump, project):
    r = check("--junit", "-")
    assert r.exit_code == 1
    suite = ET.fromstring(r.stdout)  # the XML alone: no summary table mixed in
    assert suite.tag == "testsuite" and int(suite.get("failures")) == 1
    assert not (project / "-").exists()
    r = check("--junit", "-", "--json", "-")
    assert (
        r.exit_code == 2
        and error_line(r)
        == "attncheck: error: --junit and --json both write to standard output ('-'); send one of them to a file"
    )


def test_npz_held_whole_over_max_memory_exits_2(project):
    # A Fortran-ordered member is read whole: its declared 64 MiB (deflated to ~64 KB) is refused first.
    import zipfile

    import numpy.lib.format as npformat

    with zipfile.ZipFile(project / "dumps" / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("s.npy", "w", force_zip64=True) as f:
            header = io.BytesIO()
            npformat.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": True, "shape": (16, 1 << 20)})
            f.write(header.getvalue())
            for _ in range(64):
                f.write(bytes(1 << 20))
    (project / "pyproject.toml").write_text('[tool.attncheck]\ninputs = ["dumps/bomb.npz"]\nmax_memory = "16MiB"\n')
    r = check()
    assert r.exit_code == 2
    assert (
        error_line(r)
        == f"attncheck: error: {project / 'dumps' / 'bomb.npz'}:s: a Fortran-ordered array is read whole: it needs "
        "64 MiB, over tool.attncheck.max_memory 16 MiB"
    )


def test_unreadable_input_exits_2(project):
    (project / "dumps" / "broken.npy").write_bytes(b"not numpy")
    (project / "pyproject.toml").write_text(PASSING)
    r = check()
    assert r.exit_code == 2
    assert error_line(r).startswith("attncheck: error: ") and "broken.npy" in r.stderr


def test_keys_that_match_nothing_name_the_config_key(project):
    (project / "pyproject.toml").write_text('[tool.attncheck]\ninputs = ["dumps/*.npy"]\nkeys = ["layer*"]\n')
    r = check()
    assert r.exit_code == 2
    assert error_line(r).startswith("attncheck: error: tool.attncheck.keys 'layer*' matches no tensor")


def test_config_option_takes_a_standalone_file(project, tmp_path):
    other = tmp_path / "ci" / "attncheck.toml"
    other.parent.mkdir()
    other.write_text('inputs = ["../dumps/*.npy"]\ndtypes = ["fp32"]\nmethods = ["torch"]\n')
    r = check("--config", other, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["config"] == "ci/attncheck.toml" and [c["input"] for c in doc["cases"]] == ["../dumps/healthy.npy"]


def test_config_errors_do_not_import_torch(tmp_path):
    """The config is read and checked before torch is imported: with torch made unimportable,
    `check --help` works and every config error above still gets its line and exit 2."""
    script = textwrap.dedent(
        f"""
        import os, re, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from typer.testing import CliRunner
        from attncheck.cli import app
        runner = CliRunner()
        r = runner.invoke(app, ["check", "--help"])
        assert r.exit_code == 0 and "--junit" in r.stdout, r.output
        os.chdir({str(tmp_path)!r})
        os.mkdir("dumps")
        open("dumps/x.npy", "wb").close()
        for text, pattern in {CONFIG_ERRORS!r}:
            open("pyproject.toml", "w").write(text)
            r = runner.invoke(app, ["check"])
            assert r.exit_code == 2, (text, r.exit_code, r.output, r.exception)
            assert re.fullmatch("attncheck: error: " + pattern, r.stderr.strip()), (text, r.stderr)
        r = runner.invoke(app, ["check", "--device", "tpu"])
        assert r.exit_code == 2
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_importing_the_command_does_not_import_torch():
    code = (
        "import sys, attncheck.cli.check, attncheck.config.check; print('torch' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr


# --------------------------------------------------------------------------- examples/ci


@pytest.fixture
def ci_example(tmp_path, monkeypatch):
    """examples/ci/ copied, its dumps written by its own script, as the workflow does."""
    target = tmp_path / "ci"
    shutil.copytree(ROOT / "examples" / "ci", target, ignore=shutil.ignore_patterns("dumps", "*.xml", "*.md"))
    spec = importlib.util.spec_from_file_location("make_dumps", target / "make_dumps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its __main__ default: dumps/ next to the script
    module.write_dumps(target / "dumps")
    monkeypatch.chdir(target)
    return target


def test_example_config_loads_and_passes(ci_example):
    cfg = load_config("pyproject.toml")
    assert cfg.inputs == ("dumps/*.safetensors",)
    assert [Path(f).name for f in cfg.files] == ["layer0.safetensors", "layer1.safetensors"]
    assert cfg.dtypes == ("bf16", "fp16") and cfg.methods == ("tiled", "torch")
    assert (cfg.budget.nan, cfg.budget.overflow, cfg.budget.max_abs_err, cfg.budget.relative_to_torch) == (
        0,
        0,
        1e-2,
        2.0,
    )
    assert cfg.budget_for("fp16").max_abs_err == 2e-3
    assert [s.name for s in cfg.synthetic] == [
        "synthetic[0]:dk=128,scale=sqrt,seq=256,dist=normal,seed=0",
        "synthetic[1]:dk=64,scale=sqrt,seq=128,dist=outliers,seed=0",
        "synthetic[2]:dk=128,scale=sqrt,seq=256,rows=512,paths=eager+flash,dist=normal,seed=0",
    ]
    assert (cfg.budget.out_relative_to_torch, cfg.budget.out_cos_min) == (2.0, 0.999)

    # The workflow's step, run where the workflow runs it.
    workflow = (ROOT / "examples" / "ci" / "attncheck.yml").read_text()
    command = re.search(r"run: attncheck (check .+)", workflow).group(1).split()
    assert command == ["check", "--junit", "attncheck-junit.xml", "--markdown", "attncheck.md"]
    assert "working-directory: examples/ci" in workflow and "path: examples/ci/attncheck-junit.xml" in workflow
    assert "if: always()" in workflow and "torch==2.13.0" in workflow
    r = runner.invoke(app, command)
    assert r.exit_code == 0, r.output
    suite = ET.parse(ci_example / "attncheck-junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("18", "0")
    names = [tc.get("name") for tc in suite.iter("testcase") if "paths=" in tc.get("classname")]
    assert names == ["eager:torch/bf16", "eager:torch/fp16", "flash/bf16", "flash/fp16"]


# --------------------------------------------------------------------------- progress


def run_check_cli(project, *args, progress: str | None):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("ATTNCHECK_PROGRESS", "GITHUB_STEP_SUMMARY")}
    if progress is not None:
        env.update(ATTNCHECK_PROGRESS=progress, COLUMNS="100")
    return subprocess.run(
        [sys.executable, "-m", "attncheck", "check", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=project,
    )


@pytest.mark.slow
def test_progress_goes_to_stderr_never_into_json_stdout(project):
    (project / "pyproject.toml").write_text(PASSING)
    shown = run_check_cli(project, "--json", "-", progress="always")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["schema"] == "attncheck.check/1"
    assert (
        "dumps/healthy.npy" in shown.stderr and "16/16" in shown.stderr and "rows" in shown.stderr
    )  # a bar per input, on stderr
    assert "64/64" in shown.stderr  # the synthetic entry's rows
    quiet = run_check_cli(project, "--json", "-", "--quiet", progress="always")
    assert json.loads(quiet.stdout)["schema"] == "attncheck.check/1" and quiet.stderr == ""


def test_no_progress_when_stderr_is_not_a_terminal(project):
    (project / "pyproject.toml").write_text(PASSING)
    proc = run_check_cli(project, "--json", "-", progress=None)
    assert proc.returncode == 0 and proc.stderr == ""


HOSTILE_CONFIGS = [
    (
        'inputs = ["*.npy"]\n[budget]\nnan = 1' + "0" * 5000,
        "attncheck.toml: holds an integer of more than 4,300 digits, which no setting takes",
    ),
    ("inputs = " + "[" * 100_000 + "]" * 100_000, "attncheck.toml: arrays or tables nested too deep to be a config"),
    (
        'inputs = ["*.npy"]\nx = ' + "{a = " * 5000 + "1" + "}" * 5000,
        "attncheck.toml: arrays or tables nested too deep to be a config",
    ),
    ('inputs = ["*.npy"]\nmax_memory = "1B"', "must be at least 1MiB"),
    (
        'inputs = ["*.npy"]\n[budget]\nmax_abs_err = 1' + "0" * 5000 + ".0",
        "budget.max_abs_err must be a number >= 0, got inf",
    ),
    ("[[synthetic]]\nd_k = 1024\nseq = 1048576\nrows = 1048576", "synthetic[0]: its q and k"),
]


@pytest.mark.parametrize(
    "text,message",
    HOSTILE_CONFIGS,
    ids=["digits", "deep_array", "deep_table", "tiny_memory", "huge_float", "terabytes"],
)
def test_hostile_configs_are_one_line(tmp_path, text, message):
    (tmp_path / "attncheck.toml").write_text(text + "\n")
    np.save(tmp_path / "a.npy", np.zeros((2, 8), np.float32))
    r = check("--config", tmp_path / "attncheck.toml")
    assert r.exit_code == 2, r.output
    line = error_line(r)
    assert line.startswith("attncheck: error: ") and message in line, line
