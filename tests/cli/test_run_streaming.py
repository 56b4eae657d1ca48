"""`attncheck run` on files larger than --max-memory: same numbers, bounded memory, clean JSON."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.judge import diagnose
from attncheck.numerics.cells.diagnose import Options
from attncheck.report.run import diagnosis_json

runner = CliRunner()


def scores(rows=512, keys=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, keys, generator=g) * 4
    x[3, 7] = 14.0  # fp16 naive overflow
    x[rows // 5, :] = float("-inf")  # fully masked
    x[rows // 3, 10] = float("nan")
    return x


@pytest.mark.parametrize("fmt", ["npy", "safetensors"])
def test_file_larger_than_max_memory_gives_the_in_memory_numbers(tmp_path, fmt):
    x = scores().reshape(2, 256, 1024)
    path = tmp_path / f"s.{fmt}"
    if fmt == "npy":
        np.save(path, x.numpy())
    else:
        from safetensors.torch import save_file

        save_file({"scores": x}, str(path))
    assert path.stat().st_size > 2 * 1024 * 1024 - 1024  # 2 MiB file, 1 MiB budget: ~50 chunks of ~10 rows
    r = runner.invoke(app, ["run", str(path), "--max-memory", "1MiB", "--json", "-"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["tensors"][0]
    expected = json.loads(
        json.dumps(diagnosis_json(diagnose(got["name"], x, Options(kernels="torch"))), allow_nan=False)
    )
    for key in ("census", "distribution", "findings"):
        assert got[key] == expected[key], key
    for a, b in zip(got["cells"], expected["cells"]):
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-6), (a["name"], k)  # kernels vs torch path
            else:
                assert a[k] == b[k], (a["name"], k)


PROBE = textwrap.dedent(
    """
    import resource, subprocess, sys
    subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
    """
)


def peak_rss_mib(args, env):
    # A bare launcher, so the child's peak is not inherited from this (large) pytest process.
    out = subprocess.run(
        [sys.executable, "-c", PROBE, sys.executable, "-m", "attncheck", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return int(out.stdout.strip())


def sparse_npy(path, rows, keys):
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, keys), np.float32))
    header["shape"] = (rows, keys)
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        fh.seek(rows * keys * 4 - 1, 1)
        fh.write(b"\0")


@pytest.mark.slow
def test_memory_stays_bounded_on_a_file_many_times_the_budget(tmp_path):
    big, small = tmp_path / "big.npy", tmp_path / "small.npy"
    sparse_npy(big, 16384, 1024)  # 64 MiB of fp32 scores
    sparse_npy(small, 16, 1024)
    env = dict(os.environ, ATTNCHECK_KERNELS="torch")
    common = [
        "--dtype",
        "fp32",
        "--method",
        "stable",
        "--max-memory",
        "8MiB",
        "--quiet",
        "--json",
        str(tmp_path / "r.json"),
    ]
    base = peak_rss_mib(["run", str(small), *common], env)
    peak = peak_rss_mib(["run", str(big), *common], env)
    assert json.loads((tmp_path / "r.json").read_text())["tensors"][0]["census"]["rows"] == 16384
    assert peak - base < 40, f"peak {peak} MiB vs {base} MiB for a 64 MiB file with an 8 MiB budget"


@pytest.mark.slow  # a subprocess on a pseudo-terminal: 7 s
def test_progress_goes_to_stderr_never_into_json_stdout(tmp_path):
    path = tmp_path / "s.npy"
    np.save(path, scores(64, 256).numpy())
    env = dict(os.environ, ATTNCHECK_PROGRESS="always", COLUMNS="100")
    run = lambda *extra: subprocess.run(  # noqa: E731 (a local shorthand for one subprocess call)
        [sys.executable, "-m", "attncheck", "run", str(path), "--json", "-", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    shown = run()
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["schema"] == "attncheck.run/3"
    assert "rows" in shown.stderr  # the bar was drawn, on stderr
    quiet = run("--quiet")
    assert json.loads(quiet.stdout)["schema"] == "attncheck.run/3" and quiet.stderr == ""


def test_no_progress_when_stderr_is_not_a_terminal(tmp_path):
    path = tmp_path / "s.npy"
    np.save(path, scores(64, 256).numpy())
    env = {k: v for k, v in os.environ.items() if k != "ATTNCHECK_PROGRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "attncheck", "run", str(path), "--json", "-"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0 and proc.stderr == ""


def test_bad_max_memory():
    r = runner.invoke(app, ["run", "--example", "--max-memory", "lots"])
    assert r.exit_code == 2
    assert r.stderr.strip() == "attncheck: error: --max-memory: 'lots' is not a size (e.g. 1GiB, 512MiB, 2G)"
