"""--rescale-threshold, --max-offset and --what-if fa4 on the command line: bad values and places where they
would change nothing exit 2 with one line, before any work (and without importing torch)."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()


def error_line(args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    return lines[0]


QK = ["run", "--q", "q.pt", "--k", "k.pt"]  # never read: every case below is refused before any file is opened


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            [*QK, "--path", "fa4", "--rescale-threshold", "-1"],
            "attncheck: error: --rescale-threshold must be a number >= 0, got -1",
        ),
        (
            [*QK, "--path", "fa4", "--max-offset", "eight"],
            "attncheck: error: --max-offset must be a number >= 0, got 'eight'",
        ),
        (
            [*QK, "--path", "fa4", "--max-offset", "nan"],
            "attncheck: error: --max-offset must be a number >= 0, got nan",
        ),
        (
            [*QK, "--path", "fa4", "--rescale-threshold", "100", "--max-offset", "30"],
            "attncheck: error: --rescale-threshold: the rescale threshold plus the max offset must stay below 128 "
            "(P = 2^(threshold + offset) would overflow fp32 before any cast), got 130",
        ),
        (
            [*QK, "--rescale-threshold", "4"],
            "attncheck: error: --rescale-threshold sets FlashAttention-4's lazy rescale: add fa4 to --path (or ask "
            "--what-if kernels)",
        ),
        (
            [*QK, "--path", "flash", "--rescale-threshold", "4", "--max-offset", "4"],
            "attncheck: error: --rescale-threshold and --max-offset set FlashAttention-4's lazy rescale: add fa4 to "
            "--path (or ask --what-if kernels)",
        ),
        (
            ["run", "--example", "--max-offset", "4"],
            "attncheck: error: --max-offset sets FlashAttention-4's lazy rescale, which computes attention from "
            "--q/--k or a capture, not the built-in example's scores",
        ),
        (
            ["run", "--example", "--what-if", "fa4"],
            "attncheck: error: --what-if asks about a captured model's calls; with --q/--k or --example every cell "
            "is computed already (choose them with --dtype, --method, --path; --what-if fa4 sweeps a kernel's "
            "settings on --q/--k without score files)",
        ),
        (
            [*QK, "--what-if", "fa4,fp16"],
            "attncheck: error: --what-if asks about a captured model's calls; with --q/--k or --example every cell "
            "is computed already (choose them with --dtype, --method, --path; --what-if fa4 sweeps a kernel's "
            "settings on --q/--k without score files)",
        ),
        (
            ["capture", "--rescale-threshold", "inf", __file__],
            "attncheck: error: --rescale-threshold must be a number >= 0, got inf",
        ),
        (
            ["watch", "logs", "--what-if", "fa4"],
            "attncheck: error: --what-if: fa4: the watch judges logged statistics, not tensors, so it cannot replay "
            "a call under other kernels or through a KV cache; capture the step (attncheck capture) and run attncheck "
            "run DIR --what-if fa4",
        ),
    ],
)
def test_bad_fa4_options_exit_2_with_one_line(args, expected):
    assert error_line(args) == expected


def test_fa4_option_errors_do_not_import_torch():
    argv = ["run", "--q", "q.pt", "--k", "k.pt", "--path", "fa4", "--rescale-threshold", "-1"]
    code = (
        "import sys\n"
        f"sys.argv = ['attncheck'] + {argv!r}\n"
        "from attncheck.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "sys.exit(3 if 'torch' in sys.modules or 'numpy' in sys.modules else code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, f"torch or numpy imported, or not exit 2: {proc.stderr}"


def test_the_options_reach_the_fa4_kernel(tmp_path):
    """--rescale-threshold 4 --max-offset 8 on logits of std 2 (e4m3 values, PR 2694's setup): the fa4/e4m3 cell
    saturates P and its headroom is ln(448 / 2^12) < 0; with the defaults (threshold 0) it saturates nothing and
    the headroom is ln(448 / 2^8). The saturation is counted by the kernel, the headroom from torch.finfo."""
    import json
    import math

    import torch

    g = torch.Generator().manual_seed(0)
    e4m3 = torch.float8_e4m3fn
    qkv = {
        "q": (torch.randn(1, 1, 16, 64, generator=g) * 2.0).to(e4m3).to(torch.bfloat16),
        "k": torch.randn(1, 1, 2048, 64, generator=g).to(e4m3).to(torch.bfloat16),
        "v": torch.randn(1, 1, 2048, 64, generator=g).to(e4m3).to(torch.bfloat16),
    }
    path = tmp_path / "std2.pt"
    torch.save(qkv, path)
    base = ["run", "--q", f"{path}:q", "--k", f"{path}:k", "--v", f"{path}:v", "--dtype", "e4m3", "--path", "fa4"]
    top = float(torch.finfo(e4m3).max)
    for extra, saturates, p_max in (
        ([], False, 2.0**8),
        (["--rescale-threshold", "4", "--max-offset", "8"], True, 2.0**12),
    ):
        out = tmp_path / "r.json"
        args = [*base, *extra, "--fp8-scaling", "none", "--quiet", "--json", str(out)]
        r = runner.invoke(app, args, env={"ATTNCHECK_KERNELS": "torch"})  # no numba compile: the kernel is torch
        assert r.exit_code == 0, r.output
        (cell,) = json.loads(out.read_text())["tensors"][0]["cells"]
        assert cell["name"] == "fa4/e4m3"
        assert (cell["events"].get("p_saturation", 0) > 0) == saturates
        assert cell["limit"]["headroom"] == pytest.approx(math.log(top / p_max))


def test_fa4_and_accumulator_options_where_nothing_would_use_them(tmp_path):
    """Refused in one line, not ignored: the FA4 what-if and knobs on scores alone, the FP8 accumulator with only
    fa4 (which has no accumulator model) in --path, the FP8 max offset on 16-bit cells, a grid in no dtype FA4 takes,
    the accumulator on scores alone."""
    import torch

    torch.manual_seed(0)
    torch.save(torch.randn(1, 2, 8, 8), tmp_path / "scores.pt")
    torch.save({"q": torch.randn(1, 2, 8, 16), "k": torch.randn(1, 2, 8, 16)}, tmp_path / "qk.pt")
    scores = str(tmp_path / "scores.pt")
    qk = ["run", "--q", f"{tmp_path / 'qk.pt'}:q", "--k", f"{tmp_path / 'qk.pt'}:k"]
    cases = [
        (["run", scores, "--what-if", "fa4"], "--what-if fa4 asks for FlashAttention-4, computed from Q and K"),
        (["run", scores, "--rescale-threshold", "4"], "--rescale-threshold asks for FlashAttention-4"),
        (["run", scores, "--dtype", "e4m3", "--fp8-flush", "4"], "the file holds scores only"),
        ([*qk, "--dtype", "e4m3", "--path", "fa4", "--fp8-accum", "5"], "(fa3, flash-fp8, sage): none is in --path"),
        ([*qk, "--dtype", "fp16", "--path", "fa4", "--max-offset", "4"], "--max-offset is FlashAttention-4's FP8"),
        ([*qk, "--dtype", "fp32", "--what-if", "fa4"], "FlashAttention-4 has no settings grid in fp32"),
    ]
    for args, expected in cases:
        assert expected in error_line(args), args
