"""output_nan: a NaN in V, or a V beyond fp16's range, makes rows of O = P@V NaN/inf while their softmax is finite.
The rows are counted against float64 torch attention on the same tensors (and V as fp16 holds it), the cause names
the V entry, and --fail-on error,warning,nan fails; a dump with a finite V in range stays clean."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()
AT = (0, 0, 100, 3)  # the planted V entry: batch, kv head, key, dim


def dump(tmp_path, value: float | None, causal: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    if value is not None:
        v[AT] = value
    path = tmp_path / "qkv.safetensors"
    save_file({"q": q, "k": k, "v": v}, str(path))
    return path, q, k, v


def float64_bad_rows(q, k, v, causal: bool, v_dtype=None) -> int:
    """Rows of float64 attention softmax(q k^T / 4) @ V that hold NaN or inf (V cast to ``v_dtype`` first)."""
    s = q.double() @ k.double().transpose(-1, -2) / 4
    if causal:
        s = s.masked_fill(torch.ones(256, 256, dtype=torch.bool).triu(1), float("-inf"))
    vv = (v if v_dtype is None else v.to(v_dtype)).double()
    o = torch.softmax(s, dim=-1) @ vv
    return int((~torch.isfinite(o).all(dim=-1)).sum())


def run(path, tmp_path, causal: bool):
    out = tmp_path / "r.json"
    args = ["run", "--q", f"{path}:q", "--k", f"{path}:k", "--v", f"{path}:v", "--dtype", "fp16", "--path"]
    args += ["eager", "--method", "torch", "--brief", "--fail-on", "error,warning,nan", "--json", str(out)]
    result = runner.invoke(app, args + (["--causal"] if causal else []))
    return result, json.loads(out.read_text())["tensors"][0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("value, cause", [(float("nan"), "v_nonfinite"), (1e5, "v_cast_overflow")])
def test_a_bad_v_entry_is_an_output_nan_error_naming_it(tmp_path, value, cause, causal):
    path, q, k, v = dump(tmp_path, value, causal)
    result, t = run(path, tmp_path, causal)
    assert result.exit_code == 1, result.output
    want = float64_bad_rows(q, k, v, causal, torch.float16)
    assert want == 256  # 0 x NaN is NaN, causal or not: every row of head 0, whose V holds the entry
    (cell,) = t["cells"]
    assert cell["out_nan_rows"] == want and cell["out_nan_causes"] == {cause: want}
    (f,) = [f for f in t["findings"] if f["code"] == "output_nan"]
    assert f["severity"] == "error" and f["rows"] == want and f"{AT}" in f["message"]
    if cause == "v_cast_overflow":
        assert float64_bad_rows(q, k, v, causal) == 0  # float64 V is fine: the cast to fp16 is the cause
        assert t["attention"]["v_cast_overflow"] == {"fp16": int(torch.isinf(v.half()).sum())}
        assert "largest |v| 100000" in f["message"]
    else:
        assert t["attention"]["v_nonfinite"] == 1 and t["attention"]["v_nonfinite_at"][0][0] == list(AT)
    assert "output_nan" in result.output and "nan: " in result.stderr


def test_a_finite_v_in_range_has_no_output_nan(tmp_path):
    path, q, k, v = dump(tmp_path, None, True)
    result, t = run(path, tmp_path, True)
    assert result.exit_code == 0, result.output
    assert float64_bad_rows(q, k, v, True, torch.float16) == 0
    assert t["cells"][0]["out_nan_rows"] == 0 and t["cells"][0]["out_nan_causes"] == {}
    assert t["attention"]["v_nonfinite"] == 0 and t["attention"]["v_cast_overflow"] == {}


def test_p_at_v_past_fp16s_max_is_pv_overflow(tmp_path):
    """V = 65,504 (fp16's max) everywhere: O = P@V is max x sum(P), and where fp16's rounding of P makes the sum
    exceed 65,520 / 65,504 the product rounds to inf. Counted against torch's own fp16 softmax and P@V, and the
    float64 product of that P and V (seed 114: two rows)."""
    g = torch.Generator().manual_seed(114)
    q, k = (torch.randn(1, 1, 64, 16, generator=g) * 2 for _ in range(2))
    v = torch.full((1, 1, 64, 16), 65504.0)
    path = tmp_path / "qkv.safetensors"
    save_file({"q": q, "k": k, "v": v}, str(path))
    p = torch.softmax(q.half() @ k.half().transpose(-1, -2) * 0.25, dim=-1)
    torch_rows = int((~torch.isfinite(p @ v.half()).all(dim=-1)).sum())
    exact = (p.double() @ v.double()).abs().amax(dim=-1)
    assert torch_rows == int((exact >= 65520).sum()) == 2
    result, t = run(path, tmp_path, False)
    assert result.exit_code == 1, result.output
    (cell,) = t["cells"]
    assert cell["out_nan_causes"] == {"pv_overflow": 2} and cell["out_pv_max"] == pytest.approx(float(exact.max()))
    (f,) = [f for f in t["findings"] if f["code"] == "output_nan"]
    assert f"P@V reaches {float(exact.max()):.6g} in float64" in f["message"]
