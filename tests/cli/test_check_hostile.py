"""`attncheck check` and `sweep` on the hostile inputs of issue 32: an FP8 dtype in a config, an
input glob over a folder that links to itself, a grid or synthetic input that asks for hours of
work. Each ends with one line on stderr and exit 2 (before any work), or runs to its end."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config.sweep import DEFAULT_MAX_WORK

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_step_summary(monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r, match: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attncheck: error: "), r.stderr
    assert "Traceback" not in r.output and match in lines[0], lines[0]
    return lines[0]


def config(tmp_path, text: str):
    (tmp_path / "attncheck.toml").write_text(text)
    return tmp_path / "attncheck.toml"


@pytest.mark.parametrize(
    "text",
    [
        '[[synthetic]]\nd_k = 64\ndtype = ["e4m3"]\n',  # the config: a KeyError traceback before
        'dtypes = ["fp16", "e5m2"]\n[[synthetic]]\nd_k = 64\nrows = 64\n',
        '[[synthetic]]\nd_k = 64\nrows = 64\npaths = ["flash-fp8"]\n',
    ],
)
def test_fp8_in_a_check_config_is_refused_naming_what_check_computes(tmp_path, text):
    line = one_error(invoke("check", "--config", config(tmp_path, text)), "check computes")
    assert "FP8" in line and "attncheck run --dtype e4m3" in line


def test_a_glob_over_a_folder_that_links_to_itself_ends(tmp_path):
    """`**/*.npy` where a folder links to itself and another to its parent: Python's glob never ends
    there; each real folder is entered once and the one file is found once."""
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "a.npy", np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8))
    os.symlink(".", tmp_path / "self")
    os.symlink("..", tmp_path / "d" / "up")
    cfg = config(tmp_path, 'inputs = ["**/*.npy"]\ndtypes = ["fp32"]\nmethods = ["torch"]\n')
    start = time.perf_counter()
    r = invoke("check", "--config", cfg, "--json", tmp_path / "out.json")
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - start < 30
    import json

    assert json.loads((tmp_path / "out.json").read_text())["inputs"] == ["d/a.npy"]


def test_synthetic_rows_past_max_work_are_refused_with_the_estimate(tmp_path):
    # 1,000,000 rows x 256 keys x 3 dtypes x 3 methods = 2.3e9 score elements (rows round up to 3,907 heads of 256)
    text = "[[synthetic]]\nd_k = 8\nrows = 1000000\nseq = 256\n"
    start = time.perf_counter()
    line = one_error(invoke("check", "--config", config(tmp_path, text)), "would compute 2.30e9 score elements")
    assert time.perf_counter() - start < 5  # refused up front, nothing drawn
    assert "1,000,000 rows x 256 keys x 9 cells" in line and "raise max_work" in line
    assert 3907 * 256 * 256 * 9 > DEFAULT_MAX_WORK > 3907 * 256 * 256 * 8  # the estimate against the limit, by hand


def test_max_work_raises_the_limit(tmp_path):
    text = 'max_work = 127\ndtypes = ["fp32"]\nmethods = ["torch"]\n[[synthetic]]\nd_k = 8\nrows = 8\nseq = 16\n'
    one_error(
        invoke("check", "--config", config(tmp_path, text)),
        "would compute 128 score elements (synthetic[0]: 8 rows x 16 keys x 1 cells), over max_work 127",
    )
    r = invoke("check", "--config", config(tmp_path, text.replace("max_work = 127", "max_work = 128")))
    assert r.exit_code == 0, r.output  # 8 rows x 16 keys x 1 cell = 128: at the limit, not over it


def test_a_sweep_of_3000_head_dimensions_is_refused_with_the_estimate():
    dks = ",".join(str(d) for d in range(1, 3001))
    start = time.perf_counter()
    line = one_error(invoke("sweep", "--dk", dks), "the sweep would compute 1.32e11 score elements")
    assert time.perf_counter() - start < 5
    # 3,000 d_k x 4 scales; 4096 rows x 128 keys; 3 dtypes x (4 methods + 3 paths) = 21 cells
    assert 3000 * 4 * 4096 * 128 * 21 == 132_120_576_000
    assert "12,000 grid points x 4096 rows x 128 keys x 21 cells" in line and "raise --max-work" in line


def test_sweep_max_work_is_checked_and_raises_the_limit():
    one_error(invoke("sweep", "--max-work", "0"), "--max-work must be a number > 0")
    # 1 d_k x 1 scale x 8 rows x 16 keys x 1 dtype x (1 method + 0 paths) = 128 elements
    small = (
        "sweep",
        "--dk",
        "8",
        "--scale",
        "sqrt",
        "--rows",
        "8",
        "--seq",
        "16",
        "--dtype",
        "fp32",
        "--method",
        "torch",
        "--path",
        "none",
    )
    one_error(
        invoke(*small, "--max-work", "127"),
        "the sweep would compute 128 score elements (1 grid points x 8 rows x 16 keys x 1 cells), over --max-work 127",
    )
    r = invoke(*small, "--max-work", "128", "--quiet")
    assert r.exit_code == 0, r.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_step_summary_fifo_nobody_reads_is_a_warning_not_a_hang(tmp_path, monkeypatch):
    fifo = tmp_path / "summary"
    os.mkfifo(fifo)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(fifo))
    text = 'dtypes = ["fp32"]\nmethods = ["torch"]\n[[synthetic]]\nd_k = 8\nrows = 8\nseq = 16\n'
    r = invoke("check", "--config", config(tmp_path, text))
    assert r.exit_code == 0, r.output
    assert r.stderr.strip() == (
        f"attncheck: warning: cannot append to $GITHUB_STEP_SUMMARY ({fifo}): it is a FIFO that no process "
        "reads; start its reader first, or give a file"
    )
