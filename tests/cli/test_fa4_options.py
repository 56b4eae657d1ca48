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
            "a call under other kernels; capture the step (attncheck capture) and run attncheck run DIR --what-if fa4",
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
