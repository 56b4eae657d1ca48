"""Where the fused kernels are cached, and what a first compile says.

The cache lives in the user's cache directory (``$NUMBA_CACHE_DIR`` when set), never
inside the installed package; with no writable directory the kernels compile in
memory; a cold cache gets one notice line, on stderr from the CLI, none with --quiet.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("numba")

from attncheck.cli import app  # noqa: E402
from attncheck.numerics.backends import cache, numba_rows  # noqa: E402


@pytest.fixture
def fresh_choice(monkeypatch):
    """Let cache_dir() decide again, under the environment the test sets."""
    monkeypatch.setattr(cache, "_cache_dir", False)
    yield
    monkeypatch.setattr(cache, "_cache_dir", False)


def test_numba_cache_dir_is_respected(fresh_choice, monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine" and (tmp_path / "mine").is_dir()


def test_default_is_the_user_cache_dir(fresh_choice, monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "attncheck" / "numba"


def test_unwritable_directories_fall_back_then_give_none(fresh_choice, monkeypatch, tmp_path):
    import tempfile

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # nothing can be created below a regular file, not even by root
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "xdg"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert cache.cache_dir().parent == tmp_path / "tmp"
    monkeypatch.setattr(cache, "_cache_dir", False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocker / "tmp"))
    assert cache.cache_dir() is None  # compile in memory: the kernels module decorates with cache=False


def test_nothing_is_cached_inside_the_package():
    numba_rows.kernels().algo_reference_rows(np.zeros((2, 3), np.float32), np.empty((2, 3)))
    package = Path(importlib.util.find_spec("attncheck").origin).parent
    assert not [p for p in package.rglob("*") if p.suffix in (".nbi", ".nbc")]


def test_a_cold_cache_gets_one_notice(fresh_choice, monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba_rows, "_warm", set())
    heard = []
    x = np.zeros((2, 3), np.float32)
    numba_rows.call("algo_reference_rows", "float32", x, np.empty((2, 3)), notice=heard.append)
    numba_rows.call("algo_reference_rows", "float32", x, np.empty((2, 3)), notice=heard.append)
    assert heard == [numba_rows.COMPILE_NOTICE]
    assert len(list(tmp_path.glob("attncheck-*.stamp"))) == 1
    monkeypatch.setattr(numba_rows, "_warm", set())  # a new process: the stamp says the cache is warm
    numba_rows.call("algo_reference_rows", "float32", x, np.empty((2, 3)), notice=heard.append)
    assert heard == [numba_rows.COMPILE_NOTICE]


def test_the_cli_prints_the_notice_on_stderr_unless_quiet(fresh_choice, monkeypatch, tmp_path):
    path = tmp_path / "big.npy"
    np.save(path, torch.randn(4096, 1024).numpy())  # 2^22 elements: the fused kernels run
    for quiet, expected in ((False, f"attncheck: {numba_rows.COMPILE_NOTICE}\n"), (True, "")):
        monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / f"cache-{quiet}"))
        monkeypatch.setattr(cache, "_cache_dir", False)
        monkeypatch.setattr(numba_rows, "_warm", set())
        args = ["run", str(path), "--dtype", "fp32", "--method", "torch", "--json", str(tmp_path / "r.json")] + (
            ["--quiet"] if quiet else []
        )
        r = CliRunner().invoke(app, args, env={"ATTNCHECK_PROGRESS": "never"})
        assert r.exit_code == 0, r.output
        assert r.stderr == expected


@pytest.mark.slow
def test_no_writable_cache_directory_still_runs(tmp_path):
    """A read-only installation: no cache anywhere, the kernels compile in memory (~30 s)."""
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = dict(os.environ, XDG_CACHE_HOME=str(blocker / "x"), HOME=str(blocker / "h"))
    env.pop("NUMBA_CACHE_DIR", None)
    code = (
        "import tempfile; tempfile.gettempdir = lambda: %r\n"
        "import torch; from attncheck import Options, diagnose\n"
        "print(diagnose('x', torch.randn(8, 16), Options(kernels='fused')).backend)" % str(blocker / "t")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "numba", out.stderr
