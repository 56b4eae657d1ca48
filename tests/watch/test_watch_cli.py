"""`attncheck watch` on hostile input: each case exits 2 with one line, or does the right thing,
or is bounded; never a traceback, never a file said written and not. And the report's shape:
repeated alerts grouped (one fix per code) within 80 columns, --what-if's own help."""

import io
import json
import os
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.loaders.watchlog import read_watch_log
from attncheck.report.watch import PLOT_CALLS, render_watch
from attncheck.watcher.trends import analyse

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


def log_of(
    path, modules=("layers.0.attn",), steps=range(1, 31), heads=1, logit=lambda s, h: 2.0 ** (s / 3), kind="sdpa"
):
    with open(path, "w") as fh:
        for step in steps:
            calls = [
                {
                    "module": m,
                    "kind": kind,
                    "dtype": "fp32",
                    "path": "flash",
                    "heads": heads,
                    "max_logit": [logit(step, h) for h in range(heads)],
                    "entropy_mean": [1.0] * heads,
                    "collapsed": [0.0] * heads,
                    "scale": 0.125,
                    "limit": {"logit": 3.4e38, "what": "S in fp32"},
                }
                for m in modules
            ]
            fh.write(json.dumps({"schema": "attncheck.watch/1", "step": step, "calls": calls}) + "\n")
    return str(path)


def one_line_error(r, *words):
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("attncheck: error:") and r.stderr.count("\n") == 1 and "Traceback" not in r.output
    for w in words:
        assert w in r.stderr, r.stderr


@pytest.mark.parametrize("window", ["2", "3", "4"])
def test_a_window_too_short_to_fit_a_growth_is_refused(tmp_path, window):
    one_line_error(
        runner.invoke(app, ["watch", log_of(tmp_path / "w.jsonl"), "--window", window]), "--window must be at least 5"
    )


def test_fp8_what_if_is_refused_and_others_are_judged(tmp_path):
    p = log_of(tmp_path / "w.jsonl")
    one_line_error(runner.invoke(app, ["watch", p, "--what-if", "e4m3"]), "e4m3", "FP8 kernels hold S in fp32")
    r = runner.invoke(app, ["watch", p, "--what-if", "fp16", "--horizon", "100", "--fail-on", "what-if:headroom_low"])
    assert r.exit_code == 1 and "what-if fp16" in r.stdout  # 2^(s/3) reaches 65504 x 0.125 = 8188 within 100 steps


def test_the_watch_help_describes_its_own_what_if():
    r = runner.invoke(app, ["watch", "--help"], env={"COLUMNS": "200"})
    assert "hand-written (eager) attention" in r.stdout and "Captured calls" not in r.stdout


@pytest.mark.parametrize("name", ["p.txt", "p.json", "myplot", "-", "", ".png"])
def test_plot_names_that_are_not_png_files_are_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # a name without a folder would be written here
    one_line_error(runner.invoke(app, ["watch", log_of(tmp_path / "w.jsonl"), "--plot", name]), "--plot")
    assert sorted(os.listdir(tmp_path)) == ["w.jsonl"]


def test_plot_files_that_cannot_be_written_are_one_line(tmp_path):
    p = log_of(tmp_path / "w.jsonl")
    (tmp_path / "file").write_text("")
    one_line_error(runner.invoke(app, ["watch", p, "--plot", str(tmp_path / "file" / "p.png")]), "does not exist")
    one_line_error(
        runner.invoke(app, ["watch", p, "--plot", str(tmp_path / ("x" * 300 + ".png"))]),
        "cannot write --plot",
        "longer than the 255 bytes",
    )
    (tmp_path / "full.png").symlink_to("/dev/full")
    one_line_error(
        runner.invoke(app, ["watch", p, "--plot", str(tmp_path / "full.png")]), "cannot write --plot", "No space left"
    )


def test_names_with_mathtext_are_drawn_as_text(tmp_path):
    p = log_of(tmp_path / "w.jsonl", modules=(r"$\frac{1}{0}$", r"\alpha.attn", "$x^", "a\x1bb"))
    r = runner.invoke(app, ["watch", p, "--plot", str(tmp_path / "p.png"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "w.jsonl"
    os.mkfifo(fifo)
    one_line_error(runner.invoke(app, ["watch", str(fifo)]), "not a regular file")


def test_flex_records_the_watch_writes_are_read(tmp_path):
    p = log_of(tmp_path / "w.jsonl", kind="flex")
    assert read_watch_log(p).records[0].calls[0].kind == "flex"
    assert runner.invoke(app, ["watch", p, "--fail-on", "logit_growth"]).exit_code == 1


@pytest.mark.parametrize("calls", [60, pytest.param(3000, marks=pytest.mark.slow)])
def test_a_plot_of_thousands_of_calls_is_bounded(tmp_path, calls):
    """60 or 3,000 calls: the PLOT_CALLS worst are drawn (the growing one, layer 51, among them), and it says so."""
    modules = [f"layers.{i}.attn" for i in range(calls)]
    p = log_of(tmp_path / "w.jsonl", modules=modules, steps=range(1, 9), logit=lambda s, h: 1.0)
    with open(p, "a") as fh:  # steps 9-30: layer 51 grows
        for step in range(9, 31):
            rows = [
                {"module": m, "kind": "sdpa", "heads": 1, "max_logit": [2.0**step if m == "layers.51.attn" else 1.0]}
                for m in modules
            ]
            fh.write(json.dumps({"schema": "attncheck.watch/1", "step": step, "calls": rows}) + "\n")
    start = time.perf_counter()
    r = runner.invoke(app, ["watch", p, "--plot", str(tmp_path / "p.png")])
    took = time.perf_counter() - start
    assert r.exit_code == 0, r.output
    assert f"{PLOT_CALLS} of {calls} calls drawn" in r.stderr and (tmp_path / "p.png").read_bytes()[:8] == PNG
    assert took < 30  # 42 s and 2.4 GB before: the picture was 3000 rows tall


def test_repeated_alerts_are_grouped_one_fix_per_code_within_80_columns(tmp_path):
    """24 heads growing: one logit_growth diagnostic, its fix once, the heads listed per call."""
    p = log_of(tmp_path / "w.jsonl", modules=("blocks.0.attn", "blocks.1.attn", "blocks.2.attn"), heads=8)
    report = analyse([read_watch_log(p)])
    assert sum(a.code == "logit_growth" for a in report.alerts) == 24
    out = io.StringIO()
    Console(width=80, file=out, color_system=None).print(render_watch(report))
    text = out.getvalue()
    assert text.count("= fix:") == text.count("warning[") == 2  # logit_growth and headroom_low? one each
    assert "24 alerts" in text and "blocks.1.attn heads 0, 1, 2, 3, 4, 5, 6, 7, from step" in text.replace(
        "\n    ", " "
    )
    assert max(map(len, text.splitlines())) <= 80
