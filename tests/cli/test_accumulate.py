"""``attncheck run --accumulate``: bad values exit 2 with one line (without torch), and the findings on a q/k/v
dump whose fp16 P@V accumulator overflows and on one whose does not, each checked against numbers computed here."""

import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "value, expected",
    [
        (
            "fp32-seq",
            "attncheck: error: --accumulate: 'fp32-seq' is not a sum kept in 16 bits: give DTYPE-ORDER with DTYPE one "
            "of fp16, bf16 and ORDER one of seq, pairwise, block, online, e.g. fp16-seq, fp16-pairwise, fp16-block:64, "
            "fp16-online",
        ),
        (
            "bf16-online",
            "attncheck: error: --accumulate: 'bf16-online': llama.cpp's online kernel keeps P@V in 16 bits only for "
            "an f16 V cache (with a bf16 V it accumulates in fp32); give fp16-online",
        ),
        (
            "fp16-block",
            "attncheck: error: --accumulate: 'fp16-block' has order block, which needs its size, e.g. fp16-block:64",
        ),
        (
            "fp16-seq:8",
            "attncheck: error: --accumulate: 'fp16-seq:8' gives a size, which only order block takes (e.g. "
            "fp16-block:8)",
        ),
        (
            "fp16-block:0",
            "attncheck: error: --accumulate: 'fp16-block:0' has a block size that is no integer from 1 to 2^62",
        ),
        (
            "fp16-block:99999999999999999999",
            "attncheck: error: --accumulate: 'fp16-block:99999999999999999999' has a block size that is no integer "
            "from 1 to 2^62",
        ),
        (",", "attncheck: error: --accumulate is empty"),
    ],
)
def test_bad_accumulate_exits_2_with_one_line(value: str, expected: str) -> None:
    result = runner.invoke(app, ["run", "--example", "--accumulate", value])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [expected] and "Traceback" not in result.output


def test_bad_accumulate_does_not_import_torch() -> None:
    for argv in (
        "['attncheck', 'run', '--example', '--accumulate', 'fp8-seq']",
        f"['attncheck', 'capture', '--no-save', '--accumulate', 'fp16-seq', '--', {__file__!r}]",  # keeps no tensors
    ):
        _exits_2_without_torch(argv)


def _exits_2_without_torch(argv: str) -> None:
    code = (
        "import sys\n"
        f"sys.argv = {argv}\n"
        "from attncheck.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "sys.exit(3 if 'torch' in sys.modules or 'numpy' in sys.modules else code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, f"torch or numpy imported, or not exit 2: {proc.stderr}"


def _dump(tmp_path, v_value: float) -> str:
    import torch

    q = torch.zeros(1, 1, 4, 8)  # equal logits: every key weighs 1 before the division
    k = torch.zeros(1, 1, 32, 8)
    v = torch.full((1, 1, 32, 4), v_value)
    path = tmp_path / "qkv.pt"
    torch.save({"q": q, "k": k, "v": v}, path)
    return str(path)


def test_overflowing_dump_reports_accumulator_overflow(tmp_path) -> None:
    """V = 4,096 on 32 equal keys: the exact running total is 4,096 j after j keys, exact in fp16 up to 61,440
    (j = 15), and 65,536 >= 65,520 (fp16's max plus half its ulp of 32) rounds to inf at j = 16."""
    path = _dump(tmp_path, 4096.0)
    out = tmp_path / "r.json"
    result = runner.invoke(
        app,
        ["run", "--q", f"{path}:q", "--k", f"{path}:k", "--v", f"{path}:v", "--accumulate", "fp16-seq",
         "--path", "eager", "--dtype", "fp32", "--json", str(out), "--fail-on", "accumulator_overflow"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    doc = json.loads(out.read_text())
    (tensor,) = doc["tensors"]
    (st,) = tensor["accumulate"]
    first = 65536 // 4096  # keys added when the exact total first reaches the rounding limit
    assert st["label"] == "fp16-seq" and st["out_overflow_rows"] == 4 and st["out_rows"] == 4
    assert st["out_first"]["key"] == first - 1 and st["out_first"]["partial"] == (first - 1) * 4096.0
    assert st["out_peak"] == 32 * 4096.0 and st["denom_overflow_rows"] == 0
    # every row's total passed the range: the output is inf in each, and no output error is claimed
    assert st["out_nonfinite_rows"] == 4 and st["out_err_max"] is None
    (f,) = [f for f in tensor["findings"] if f["code"] == "accumulator_overflow"]
    assert (
        f["severity"] == "error"
        and "passed its max 65,504 after 16 keys in row 0, head dim 0 (partial sum 61,440 became inf)" in (f["message"])
    )


def test_healthy_dump_has_no_lowsum_findings(tmp_path) -> None:
    """V = 1 on 32 equal keys: every partial sum is an integer below 2,048, exact in fp16: no overflow and the
    output exact (error 0 against float64)."""
    path = _dump(tmp_path, 1.0)
    out = tmp_path / "r.json"
    result = runner.invoke(
        app,
        ["run", "--q", f"{path}:q", "--k", f"{path}:k", "--v", f"{path}:v", "--accumulate", "fp16-seq,bf16-pairwise",
         "--path", "eager", "--dtype", "fp32", "--json", str(out), "--fail-on", "error,warning,nan"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (tensor,) = json.loads(out.read_text())["tensors"]
    assert [s["label"] for s in tensor["accumulate"]] == ["fp16-seq", "bf16-pairwise"]
    assert all(s["out_overflow_rows"] == 0 and s["out_err_max"] == 0.0 for s in tensor["accumulate"])
    assert not [f for f in tensor["findings"] if f["code"] in ("accumulator_overflow", "lowsum_error")]


def test_lowsum_error_says_which_outputs_are_inf_and_claims_no_error_for_them(tmp_path) -> None:
    """4,096 equal keys (q = 0): fp16-seq's denominator stops at 2,048 (2,048 + 1 rounds to 2,048 in fp16), a
    relative error of 0.5. Head 0 has V = 32: its exact P@V total 32 x 4,096 = 131,072 is past fp16's range, and its
    fp16 partial sums 32 j are exact until 65,536 rounds to inf, so each of its 4 outputs is inf. Head 1 has V = 1:
    the sum of ones stops at 2,048 like the denominator, and 2,048 / 2,048 = 1 is float64's 4,096 / 4,096 exactly."""
    import torch

    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4096, 8)
    v = torch.ones(1, 2, 4096, 4)
    v[:, 0] = 32.0
    path = tmp_path / "qkv.pt"
    torch.save({"q": q, "k": k, "v": v}, path)
    out = tmp_path / "r.json"
    result = runner.invoke(
        app,
        ["run", "--q", f"{path}:q", "--k", f"{path}:k", "--v", f"{path}:v", "--accumulate", "fp16-seq",
         "--path", "eager", "--dtype", "fp32", "--json", str(out), "--brief"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (tensor,) = json.loads(out.read_text())["tensors"]
    (st,) = tensor["accumulate"]
    assert (st["out_rows"], st["out_overflow_rows"], st["out_nonfinite_rows"], st["out_err_max"]) == (8, 4, 4, 0.0)
    assert st["denom_err_max"] == 0.5
    (f,) = [f for f in tensor["findings"] if f["code"] == "lowsum_error"]
    assert "the output's up to 0 over its 4 finite row(s), and inf or NaN in 4 row(s)" in f["message"]
    v[:, 1] = 32.0  # both heads: no finite output left, and none claimed
    torch.save({"q": q, "k": k, "v": v}, path)
    result = runner.invoke(
        app,
        ["run", "--q", f"{path}:q", "--k", f"{path}:k", "--v", f"{path}:v", "--accumulate", "fp16-seq",
         "--path", "eager", "--dtype", "fp32", "--json", str(out), "--brief"],
    )  # fmt: skip
    (tensor,) = json.loads(out.read_text())["tensors"]
    (st,) = tensor["accumulate"]
    assert st["out_nonfinite_rows"] == 8 and st["out_err_max"] is None
    (f,) = [f for f in tensor["findings"] if f["code"] == "lowsum_error"]
    assert "the output is inf or NaN in all 8 row(s)" in f["message"] and "output's up to" not in f["message"]
    # the table: no output error where no output is finite ('-'), every row's P@V overflowing at its 2,048th key
    assert re.search(r"fp16-seq\s+4,096\s+5\.00e-01\s+5\.00e-01\s+0\s+-\s+8 at 2,048", result.output)
