"""Names from files (tensor keys, .npz members, .safetensors keys, file and folder names, module
paths of a capture) through every output: the terminal report, the model report, JSON, Markdown,
JUnit, the progress bar and the one-line errors. Each name holds Rich markup, control characters
or an escape sequence: it must print as itself (control characters as their escapes, format.visible),
never be read as markup or reach the terminal raw, and never cost a traceback."""

from __future__ import annotations

import io
import json
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from safetensors.torch import save_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.format import visible
from attncheck.loaders.formats.pt import key_text
from attncheck.report.progress import Progress

runner = CliRunner()

# Markup Rich would read (and reject: '[/]' closes nothing), control characters, a colour escape,
# an OSC 8 hyperlink, a line separator and a right-to-left override.
NAMES = [
    "[/]",
    "[red]x",
    "[bold]b[/bold]",
    "a\nb",
    "c\rd",
    "e\x1b[31mred\x1b[0m",
    "\x1b]8;;http://x\x07link\x1b]8;;\x07",
    "f\u2028g",
    "h\u202ei",
    "t\tab",
    "[link=file:///etc/passwd]l[/link]",
]
RAW = ("\x1b", "\r", "\x07", "\u2028", "\u202e", "\t")  # never written raw by attncheck


def invoke(*args, env=None):
    """Wide enough that no name folds across lines of a table."""
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400", **(env or {})})


def literal(text: str, name: str) -> None:
    """``name`` is in ``text`` as format.visible writes it, and nothing raw is."""
    assert visible(name) in text, (visible(name), text)
    for ch in RAW:
        assert ch not in text, (ch, text)


def no_traceback(r) -> None:
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit), r.output


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("names")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g)
    np.savez(d / "m.npz", **{n: x.numpy() for n in NAMES})
    save_file({n: x.clone() for n in NAMES}, str(d / "m.safetensors"))
    torch.save({n: x.clone() for n in NAMES}, d / "m.pt")
    return d


@pytest.mark.parametrize("suffix", ["npz", "safetensors"])
def test_member_and_key_names_in_the_reports_and_json(files, suffix):
    path = files / f"m.{suffix}"
    r = invoke("run", path, "--quiet", "--brief", "--dtype", "fp32", "--method", "stable")
    no_traceback(r)
    assert r.exit_code == 0, r.output
    for n in NAMES:  # the model report: one line per tensor
        literal(r.stdout, n)
    r = invoke("run", path, "--quiet", "--brief", "--full", "--dtype", "fp32", "--method", "stable")
    assert r.exit_code == 0, r.output
    for n in NAMES:  # every tensor's own report: the panel title
        literal(r.stdout, f"{path}:{n}")
    r = invoke("run", path, "--quiet", "--dtype", "fp32", "--method", "stable", "--json", "-")
    assert r.exit_code == 0, r.output
    names = {t["name"] for t in json.loads(r.stdout)["tensors"]}
    assert names == {f"{path}:{n}" for n in NAMES}  # JSON keeps every name exactly


def test_pt_keys_are_named_as_python_literals(files):
    r = invoke("run", files / "m.pt", "--quiet", "--brief", "--dtype", "fp32", "--method", "stable")
    assert r.exit_code == 0, r.output
    for n in NAMES:  # a key with brackets or a control character is a Python literal in brackets
        literal(r.stdout, key_text((n,)))


def test_a_key_selected_by_its_name(files):
    r = invoke(
        "run", files / "m.safetensors", "--key", "[[]/]", "--quiet", "--brief", "--dtype", "fp32", "--method", "stable"
    )
    assert r.exit_code == 0, r.output
    literal(r.stdout, f"{files / 'm.safetensors'}:[/]")


def test_file_and_folder_names(tmp_path):
    folder = tmp_path / "[bold]dir\x1b[2J"
    folder.mkdir()
    for n in ("[red]x.npy", "e\x1b[31m.npy", "a\nb.npy"):
        np.save(folder / n, np.ones((2, 8), np.float32))
    r = invoke("run", folder, "--quiet", "--brief", "--dtype", "fp32", "--method", "stable")
    no_traceback(r)
    assert r.exit_code == 0, r.output
    for n in ("[red]x.npy", "e\x1b[31m.npy", "a\nb.npy"):
        literal(r.stdout, os.path.join(folder, n))


def test_an_error_that_quotes_a_name_is_one_line(tmp_path):
    for n in NAMES:
        np.savez(tmp_path / "bad.npz", **{n: np.ones((2, 4), np.int32)})
        r = invoke("run", tmp_path / "bad.npz")
        no_traceback(r)
        assert r.exit_code == 2, r.output
        lines = r.stderr.strip("\n").split("\n")
        assert len(lines) == 1 and lines[0].startswith("attncheck: error: "), r.stderr
        literal(lines[0], f"bad.npz:{n}")


def test_progress_bar_shows_a_name_as_itself():
    with Progress(True, delay=0.0, force_terminal=True) as progress:
        for n in NAMES:
            progress.track(n, 10)(5)
        shown = [
            column.render(task).plain for task in progress._progress.tasks for column in progress._progress.columns[:1]
        ]
    assert shown == [visible(n) for n in NAMES]


def test_progress_bar_of_a_run(files):
    r = invoke(
        "run", files / "m.npz", "--brief", "--dtype", "fp32", "--method", "stable", env={"ATTNCHECK_PROGRESS": "always"}
    )
    no_traceback(r)
    assert r.exit_code == 0, r.output
    assert visible(f"{files / 'm.npz'}:[/]") in r.stderr


# --------------------------------------------------------------------------- a captured model


class _Attention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({n: _Attention() for n in NAMES})

    def forward(self, q):
        return [b(q) for b in self.blocks.values()]


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cap") / "capture"
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    with attncheck.capture(d):
        _Model()(q)
    return d


def test_module_names_of_a_capture_in_the_model_report(capture_dir):
    r = invoke("run", capture_dir, "--quiet", "--brief")
    no_traceback(r)
    assert r.exit_code == 0, r.output
    for n in NAMES:
        literal(r.stdout, n)
    r = invoke("run", capture_dir, "--quiet", "--json", "-")
    assert r.exit_code == 0, r.output
    modules = [c["module"] for c in json.loads(r.stdout)["model"]["calls"]]
    assert modules == [f"blocks.{n}" for n in NAMES]


def test_module_names_in_the_full_reports_and_what_if(capture_dir):
    r = invoke("run", capture_dir, "--quiet", "--brief", "--detail", "blocks.[[]/]", "--what-if", "fp16")
    no_traceback(r)
    assert r.exit_code == 0, r.output
    literal(r.stdout, "[/]")
    assert r.stdout.count("╭─") == 2  # the one call's full report and its what-if


def test_module_names_in_the_messages_of_a_broken_call(capture_dir, tmp_path):
    import shutil

    d = tmp_path / "cap"
    shutil.copytree(capture_dir, d)
    doc = json.loads((d / "manifest.json").read_text())
    (d / doc["calls"][3]["file"]).unlink()  # the call of module 'blocks.a\nb'
    r = invoke("run", d, "--quiet", "--brief")
    assert r.exit_code == 2, r.output
    (line,) = r.stderr.strip("\n").split("\n")
    assert "listed in" in line and "missing" in line
    literal(line, "blocks.a\nb")
    r = invoke("run", d, "--quiet", "--brief", "--partial")
    assert r.exit_code == 2 and "Traceback" not in r.output
    literal(r.stdout, "blocks.a\nb")
    assert len(r.stderr.strip("\n").split("\n")) == 1


# --------------------------------------------------------------------------- check: Markdown, JUnit, the summary


def test_check_reports(tmp_path):
    dumps = tmp_path / "d[red]x"
    dumps.mkdir()
    for n in ("[red]x.npy", "e\x1b[31m.npy", "a`b|c<i>.npy"):
        np.save(dumps / n, np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32))
    (tmp_path / "attncheck.toml").write_text(
        'inputs = ["d*/*.npy"]\ndtypes = ["fp32"]\nmethods = ["stable"]\n[budget]\nmax_abs_err = 0\n'
    )
    r = invoke(
        "check",
        "--config",
        tmp_path / "attncheck.toml",
        "--markdown",
        tmp_path / "s.md",
        "--junit",
        tmp_path / "j.xml",
        "--json",
        tmp_path / "c.json",
    )
    no_traceback(r)
    assert r.exit_code == 1, r.output  # a zero budget breaks: the failure lines name the inputs
    for n in ("[red]x.npy", "e\x1b[31m.npy", "a`b|c<i>.npy"):
        path = f"d[red]x/{n}"  # inputs are named relative to the config's folder
        literal(r.stdout, path)
        literal(r.stderr, path)
    assert len(r.stderr.strip().splitlines()) == 3
    md = (tmp_path / "s.md").read_text()
    for raw in RAW:
        assert raw not in md
    assert "``d[red]x/a`b\\|c<i>.npy``" in md  # a code span: backticks kept, the pipe cannot split the row
    assert visible("d[red]x/e\x1b[31m.npy") in md
    suite = ET.parse(tmp_path / "j.xml").getroot()  # well-formed XML: no raw control character
    inputs = {tc.get("classname").removeprefix("attncheck.") for tc in suite.iter("testcase")}
    assert inputs == {visible(f"d[red]x/{n}") for n in ("[red]x.npy", "e\x1b[31m.npy", "a`b|c<i>.npy")}
    cases = json.loads((tmp_path / "c.json").read_text())["cases"]
    assert {c["input"] for c in cases} == {f"d[red]x/{n}" for n in ("[red]x.npy", "e\x1b[31m.npy", "a`b|c<i>.npy")}


def test_renderers_are_safe_on_a_console_that_reads_markup(capture_dir):
    """The report functions give Text for names: a console with markup on (the library's default) prints them
    as they are."""
    from attncheck.config.run import RunRequest
    from attncheck.pipelines.run import run
    from attncheck.report.model import print_model
    from attncheck.report.run import print_report

    result = run(RunRequest((str(capture_dir),)))
    out = io.StringIO()
    console = Console(file=out, width=100, color_system=None)
    print_model(console, result.model, result.calls, result.device)
    print_report(console, result.tensors, result.device)
    for n in NAMES:
        literal(out.getvalue(), n)


def test_module_names_in_the_summary(tmp_path):
    """--summary names the first bad call and the next as text, and its --detail hint is a glob that
    picks the first one alone, whatever its name (markup, escapes, glob characters)."""
    import shlex

    d = tmp_path / "capture"
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    q[0, 1, 2, 3] = float("nan")  # every call: a NaN row from its input
    with attncheck.capture(d):
        _Model()(q)
    r = invoke("run", d, "--quiet", "--summary")
    no_traceback(r)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1].startswith(f"first bad call: #0 {visible('blocks.' + NAMES[0])} (") and lines[-1].startswith(
        "more: --detail "
    )
    literal(r.stdout, "blocks." + NAMES[1])  # the later call
    hint = shlex.split(lines[-1].removeprefix("more: --detail ").split("; attncheck explain")[0])[0]
    detail = invoke("run", d, "--quiet", "--summary", "--detail", hint)
    assert detail.exit_code == 0 and detail.stdout.count("╭") == 1, detail.output  # one call's report: one census panel
