"""Where the reports go, when that place is hostile: standard output closed (``>&-``), a pipe
whose reader went away (``| head -1``), a full device, a ``--json`` path that is a folder or a
FIFO. Each ends with one line on stderr and exit 2, or (a closed pipe) quietly with the
command's own exit code; never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def attncheck(*args: str, stdout=subprocess.PIPE, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "attncheck", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """The command run as the shell runs `attncheck ARGS >&-`: no file descriptor 1 at all."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    line = " ".join([sys.executable, "-m", "attncheck", *args]) + " >&-"
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=120)


def one_line(proc: subprocess.CompletedProcess, match: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("attncheck: error: ") and match in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize(
    "args",
    [
        ("run", "--example", "--json", "-"),  # the JSON report on stdout
        ("run", "--example"),  # the tables
        ("sweep", "--dk", "16"),
        ("check", "--config", "nowhere.toml"),  # refused for stdout before the config is even read
        ("explain", "input_nan"),
    ],
)
def test_closed_stdout_is_one_line_before_any_work(args):
    proc = closed_stdout(*args)
    one_line(proc, "cannot write the report to standard output: it is closed")
    assert "Traceback" not in proc.stderr


def test_a_pipe_whose_reader_left_ends_quietly():
    """`attncheck explain CODE | head -0`: the reader is gone before the first write."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = attncheck("explain", "input_nan", stdout=write)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.slow  # a diagnosis in a subprocess: 4 s
def test_a_closed_pipe_keeps_the_verdict_of_the_report():
    """The tables of `run --example --fail-on nan | head -0`: no error line and no traceback, and the
    exit code is the verdict's (1: the example has NaN rows), as if the whole report had been read."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = attncheck("run", "--example", "--fail-on", "nan", stdout=write)
        json_proc = attncheck("run", "--example", "--json", "-", stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 1 and "error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert (json_proc.returncode, json_proc.stderr) == (0, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_stdout_on_a_full_device_is_one_line():
    with open("/dev/full", "w") as full:
        proc = attncheck("explain", "input_nan", stdout=full)
    one_line(proc, "cannot write the report to standard output: No space left on device")


# --------------------------------------------------------------------------- report files (in process)

from typer.testing import CliRunner  # noqa: E402

from attncheck.cli import app  # noqa: E402

runner = CliRunner()


def in_process(*args):
    return runner.invoke(app, [str(a) for a in args])


def refused(r, match: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attncheck: error: ") and match in lines[0], r.stderr
    assert "Traceback" not in r.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_json_to_a_fifo_nobody_reads_is_one_line_and_one_with_a_reader_gets_the_report(tmp_path):
    import json
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(in_process("run", "--example", "--brief", "--json", fifo), "it is a FIFO that no process reads")
    # A reader that holds the FIFO open (as `--json >(jq .)` does) and drains it while the command writes.
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    chunks: list[bytes] = []

    def drain():
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # the writer is there, nothing new yet
                chunk = None
            if chunk:
                chunks.append(chunk)
            elif chunk == b"" and chunks:  # the writer closed it after writing
                return
            else:
                time.sleep(0.002)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        r = in_process("run", "--example", "--brief", "--json", fifo)
    finally:
        reader.join(timeout=60)
        os.close(fd)
    got = {"doc": json.loads(b"".join(chunks))}
    assert r.exit_code == 0 and got["doc"]["schema"].startswith("attncheck.run/"), r.output


@pytest.mark.parametrize(
    "plot,match",
    [
        ("p.txt", "matplotlib writes no '.txt' pictures"),
        ("-", "--plot needs a file name: it does not write to standard output"),
        ("", "--plot is an empty name"),
        ("a" * 300 + ".png", "the file name is longer than the"),
    ],
)
def test_sweep_plot_names_matplotlib_cannot_write_are_refused_before_the_sweep(tmp_path, monkeypatch, plot, match):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    refused(in_process("sweep", "--dk", "16", "--scale", "sqrt", "--plot", plot), match)
    assert os.listdir(tmp_path) == []  # nothing written, not even a file named '-'


@pytest.mark.slow  # three commands in subprocesses: 10 s
def test_run_sweep_and_check_leave_nothing_in_the_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "attncheck.toml").write_text(
        'dtypes = ["fp16"]\n[[synthetic]]\nd_k = 8\nrows = 8\nseq = 16\npaths = ["flash"]\n'
    )
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for args in (
        ("run", "--example"),
        ("sweep", "--dk", "8", "--scale", "sqrt", "--rows", "8", "--seq", "16"),
        ("check",),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "attncheck", *args, "--quiet"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.listdir(tmp) == []


@pytest.mark.slow  # two subprocesses, one a diagnosis: 6 s
def test_a_closed_stderr_keeps_the_exit_code_and_the_report():
    """`2>&-`: the progress bar (forced on) and the error line have nowhere to go; the report still
    comes out and the exit code still says how the command ended (1 was a traceback before)."""
    env = {
        **os.environ,
        "ATTNCHECK_PROGRESS": "always",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    base = f"{sys.executable} -m attncheck"
    ok = subprocess.run(
        ["bash", "-c", f"{base} run --example --json - 2>&-"], capture_output=True, text=True, env=env, timeout=120
    )
    assert ok.returncode == 0 and '"schema": "attncheck.run/' in ok.stdout
    bad = subprocess.run(
        ["bash", "-c", f"{base} run no-such-file.npy 2>&-"], capture_output=True, text=True, env=env, timeout=120
    )
    assert (bad.returncode, bad.stdout) == (2, "")
