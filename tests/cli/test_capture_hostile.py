"""`attncheck capture` and `run` on the scripts and command lines of the hostile-input audit: calls in
other threads, a script that changes directory or removes the capture folder, a negative SDPA scale,
names the file system refuses, paths holding markup, a full standard output, Unicode digits, a
syntax error. Each gets one line on stderr and exit 2, or a correct result; never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r, match: str | None = None) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("attncheck: error: "), r.stderr
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


def script(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def manifest(d) -> dict:
    return json.loads((d / "manifest.json").read_text())


# --------------------------------------------------------------------------- threads


THREADS = """
    import threading
    from concurrent.futures import ThreadPoolExecutor
    import torch, torch.nn.functional as F
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    {main}
    threads = [threading.Thread(target=F.scaled_dot_product_attention, args=(q, q, q)) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: F.scaled_dot_product_attention(q, q, q, is_causal=True), range(3)))
"""


def test_calls_in_other_threads_are_recorded(tmp_path):
    s = script(tmp_path, "threads.py", THREADS.format(main="F.scaled_dot_product_attention(q, q, q)"))
    r = invoke("capture", "--quiet", "--out", tmp_path / "cap", s)
    assert r.exit_code == 0, r.output
    doc = manifest(tmp_path / "cap")
    assert len(doc["calls"]) == 7 and doc["calls_seen"] == 7
    assert sorted(c["index"] for c in doc["calls"]) == list(range(7))  # one number per call, none twice


def test_a_script_whose_calls_are_all_in_threads(tmp_path):
    s = script(tmp_path, "only_threads.py", THREADS.format(main=""))
    r = invoke("capture", "--quiet", "--no-save", "--json", "-", s)
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["model"]["calls"]) == 6


class _Eager(nn.Module):
    def forward(self, q):
        return (q @ q.transpose(-1, -2) * 0.35).softmax(-1) @ q


def test_threads_running_before_and_started_while_recording(tmp_path):
    """A thread started while recording is followed like the main one (SDPA and eager softmax with its
    q, k and v); from a thread that ran before recording began, SDPA calls are recorded."""
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: None, range(4)))  # its workers run before the capture
        with torch.no_grad(), attncheck.capture() as cap:
            list(pool.map(lambda _: F.scaled_dot_product_attention(q, q, q), range(4)))
            t = threading.Thread(target=lambda: _Eager()(q))
            t.start()
            t.join()
    assert [c.kind for c in cap.calls] == ["sdpa"] * 4 + ["softmax"]
    assert sorted(cap.calls[-1].tensors) == ["k", "q", "scores", "v"]
    assert sorted(c.index for c in cap.calls) == list(range(5))
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # restored


def test_multihead_attention_in_several_threads(tmp_path):
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attncheck.capture() as cap:
        threads = [threading.Thread(target=mha, args=(x, x, x)) for _ in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        mha(x, x, x)
    assert len(cap.calls) == 4 and all(sorted(c.tensors) == ["k", "q", "scores", "v"] for c in cap.calls)
    assert all(c.meta["mha"] == "true" for c in cap.calls)
    assert F.softmax is torch.nn.functional.softmax and torch.bmm is torch._C._VariableFunctions.bmm


# --------------------------------------------------------------------------- the script's surroundings


def test_a_script_that_changes_directory_writes_the_capture_where_asked(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    s = script(
        tmp_path,
        "chdir.py",
        f"""
        import os, torch, torch.nn.functional as F
        os.chdir({str(elsewhere)!r})
        q = torch.randn(1, 2, 4, 8)
        F.scaled_dot_product_attention(q, q, q)
    """,
    )
    monkeypatch.chdir(tmp_path)
    r = invoke("capture", "--quiet", "--out", "cap", "--json", "report.json", s)
    assert r.exit_code == 0, r.output
    assert len(manifest(tmp_path / "cap")["calls"]) == 1
    assert (tmp_path / "report.json").is_file() and list(elsewhere.iterdir()) == []
    assert os.getcwd() == str(tmp_path)


def test_a_script_that_removes_the_capture_folder(tmp_path):
    s = script(
        tmp_path,
        "rm.py",
        """
        import shutil, sys, time, torch, torch.nn.functional as F
        q = torch.randn(1, 2, 4, 8)
        F.scaled_dot_product_attention(q, q, q)
        time.sleep(0.2)
        shutil.rmtree(sys.argv[1])
        F.scaled_dot_product_attention(q, q, q)
    """,
    )
    one_error(invoke("capture", "--quiet", "--out", tmp_path / "cap", s, tmp_path / "cap"), "capture's manifest")


def test_negative_sdpa_scale_is_refused_in_one_line(tmp_path):
    s = script(
        tmp_path,
        "neg.py",
        """
        import torch, torch.nn.functional as F
        q = torch.randn(1, 2, 4, 8)
        F.scaled_dot_product_attention(q, q, q, scale=-0.5)
    """,
    )
    one_error(
        invoke("capture", "--quiet", "--out", tmp_path / "cap", s), "metadata: scale: expected float > 0.0, got '-0.5'"
    )
    one_error(invoke("capture", "--quiet", "--no-save", s), "metadata: scale: expected float > 0.0, got '-0.5'")


def test_syntax_error_says_where(tmp_path):
    s = script(tmp_path, "syntax.py", "import torch\nx = (1,\ndef f(:\n")
    r = invoke("capture", "--quiet", "--out", tmp_path / "cap", s)
    assert r.exit_code == 2
    assert (
        r.stderr.strip().splitlines()[-1].startswith(f"attncheck: error: {s} failed (SyntaxError at line 3, column 1")
    )


def test_out_name_longer_than_the_file_system_allows(tmp_path):
    s = script(tmp_path, "ok.py", "import torch\n")
    one_error(invoke("capture", "--quiet", "--out", tmp_path / ("a" * 300), s), "File name too long")


def test_paths_holding_markup(tmp_path):
    folder = tmp_path / "m[" / "x]"
    folder.mkdir(parents=True)
    np.save(folder / "c.npy", np.ones((2, 8), np.float32))
    r = invoke("run", tmp_path / "m[/x]/c.npy", "--quiet", "--brief", "--dtype", "fp32", "--method", "stable")
    assert r.exit_code == 0, r.output
    assert "m[/x]/c.npy" in r.stdout.replace("\n", "")
    s = script(
        tmp_path,
        "ok.py",
        "import torch, torch.nn.functional as F\nq = torch.randn(1, 2, 4, 8)\n"
        "F.scaled_dot_product_attention(q, q, q)\n",
    )
    r = invoke("capture", "--quiet", "--out", tmp_path / "m[/x]/cap", s)
    assert r.exit_code == 0, r.output


def test_unicode_digits_in_integer_options(tmp_path):
    torch.save({"q": torch.ones(2, 1, 4, 8), "k": torch.ones(2, 1, 4, 8)}, tmp_path / "qk.pt")
    one_error(
        invoke("run", "--q", f"{tmp_path / 'qk.pt'}:q", "--k", f"{tmp_path / 'qk.pt'}:k", "--pad-left", "\u00b2,0"),
        "--pad-left: '²' is not a non-negative integer",
    )
    one_error(invoke("run", "--example", "--device", "cuda:\u00b2"), "--device")
    one_error(invoke("capture", "--forward", "\u00b2", tmp_path / "qk.pt"), "--forward")
    one_error(
        invoke("run", "--example", "--block", "1" + "0" * 5000),
        "--block must be an integer from 1 to 2^62, got an integer of 5,001 digits",
    )


# --------------------------------------------------------------------------- standard output refused


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--example", "--brief", "--quiet"],
        ["run", "--example", "--json", "-", "--quiet"],
        ["--version"],
        ["run", "--help"],
        ["sweep", "--dk", "16", "--scale", "sqrt", "--seq", "16", "--rows", "8", "--quiet"],
    ],
)
def test_a_full_standard_output_is_one_line(args, capfd):
    with open("/dev/full", "w") as full, contextlib.redirect_stdout(full):
        code = app(args, standalone_mode=False)
    err = capfd.readouterr().err
    assert code == 2
    assert err == "attncheck: error: cannot write the report to standard output: No space left on device\n"


@pytest.mark.slow  # a subprocess with threads: 7 s
def test_threads_leave_no_mode_behind_at_exit(tmp_path):
    """Each thread started while recording takes the mode off its stack when its run returns: the
    process ends cleanly (a mode left on a finished thread's stack aborted the interpreter at exit)."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import threading, torch, torch.nn as nn, torch.nn.functional as F, attncheck
        mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
        x, q = torch.randn(2, 5, 8), torch.randn(1, 2, 4, 8)
        for _ in range(10):
            with torch.no_grad(), attncheck.capture() as cap:
                ts = [threading.Thread(target=mha, args=(x, x, x)) for _ in range(3)]
                ts += [threading.Thread(target=F.scaled_dot_product_attention, args=(q, q, q)) for _ in range(3)]
                [t.start() for t in ts]
                [t.join() for t in ts]
            assert len(cap.calls) == 6 and sum("q" in c.tensors for c in cap.calls) == 6, [sorted(c.tensors) for c in cap.calls]
        print("ok")
    """)  # noqa: E501 (the long line is the child script's assert, inside the string)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), proc.stderr[-2000:]
