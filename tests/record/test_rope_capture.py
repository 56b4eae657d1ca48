"""The rotary table each attention call ran under: recorded once per distinct table, judged against float64, and
reported as rope_precision with the first position affected. A transformers Llama from a config whose table is
computed in bf16 (candle PR 3520's recipe) is reported; the same model as transformers computes it is clean."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.findings.rope import ROPE_ANGLE_TOLERANCE, rope_findings
from attncheck.pipelines.rope import capture_rope_checks

transformers = pytest.importorskip("transformers")


def llama(layers: int = 1, positions: int = 4096):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,  # head dim 16
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=positions,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def force_bf16_table(model) -> None:
    """The rotary table computed in bf16: positions and inverse frequencies cast before the product."""
    rope = model.model.rotary_emb

    def forward(x, position_ids):
        freqs = position_ids[..., None].bfloat16() * rope.inv_freq.bfloat16()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rope.forward = forward


def captured(model, tmp_path, tokens: int, name: str = "cap", runs: int = 1):
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attncheck.capture(tmp_path / name):
        for _ in range(runs):
            model(ids)
    return tmp_path / name


def first_repeated_bf16_position(n: int) -> int:
    """From torch's own cast: the first position whose bf16 value equals its predecessor's."""
    held = torch.arange(n).bfloat16().float()
    return int((held[1:] == held[:-1]).nonzero()[0, 0]) + 1


def test_bf16_table_is_reported_with_the_first_position_affected(tmp_path):
    model = llama(layers=2)
    force_bf16_table(model)
    cap = captured(model, tmp_path, 300)
    doc = json.loads((cap / "manifest.json").read_text())
    assert len(doc["rope_tables"]) == 1  # one table for both layers' calls
    assert [c["rope"] for c in doc["calls"]] == [0, 0] and doc["rope_tables"][0]["theta"] == 10000.0
    (check,) = capture_rope_checks([cap])
    assert check.judged and check.positions_from == "recorded" and check.theta_from == "config"
    assert check.first_indistinct == first_repeated_bf16_position(300) == 257
    # the first position affected, from float64 cos/sin of the exact angles against the model's own table
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(300)[None])
    inv = [10000.0 ** (-j / 8) for j in range(8)]
    worst = [
        max(
            abs(math.remainder(math.atan2(float(sin[0, p, j]), float(cos[0, p, j])) - p * inv[j], 2 * math.pi))
            for j in range(8)
        )
        for p in range(300)
    ]
    assert check.first_affected == next(p for p, e in enumerate(worst) if e > ROPE_ANGLE_TOLERANCE)
    (finding,) = rope_findings([check])
    assert finding.code == "rope_precision" and finding.severity == "error"
    assert "positions stop being distinct at 257" in finding.message
    assert f"first position affected {check.first_affected:,}" in finding.message


def test_the_same_llama_in_fp32_is_clean_and_tables_are_kept_once(tmp_path):
    model = llama(layers=2)
    cap = captured(model, tmp_path, 300, runs=2)  # two forwards of the same length: one table
    doc = json.loads((cap / "manifest.json").read_text())
    assert len(doc["rope_tables"]) == 1 and [c["rope"] for c in doc["calls"]] == [0, 0, 0, 0]
    (check,) = capture_rope_checks([cap])
    assert check.judged and check.first_affected is None and check.first_indistinct is None
    assert check.max_angle_error < 300 * 2.0**-23  # fp32's rounding of p x inv_freq and of cos, sin
    assert rope_findings([check]) == []


@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_capture_diagnose_judges_the_tables_too(table):
    """attncheck.capture(diagnose=True) writes nothing and reports as attncheck run does."""
    model = llama()
    if table == "bf16":
        force_bf16_table(model)
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(1)))
    found = [f for f in cap.result.model.findings if f.code == "rope_precision"]
    if table == "bf16":
        assert len(found) == 1 and "positions stop being distinct at 257" in found[0].message
    else:
        assert found == [] and cap.result.model.capture["rope"][0].judged


def test_a_different_length_is_another_table(tmp_path):
    model = llama()
    ids = [torch.randint(0, 64, (1, t)) for t in (20, 30)]
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        for x in ids:
            model(x)
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert [t["shape"] for t in doc["rope_tables"]] == [[1, 20, 16], [1, 30, 16]]
    assert [c["rope"] for c in doc["calls"]] == [0, 1]


def test_inverse_frequencies_cast_by_model_to_bfloat16_are_a_warning(tmp_path):
    """model.to(torch.bfloat16) casts the inv_freq buffer: positions stay exact, the angles drift."""
    model = llama().to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    (check,) = capture_rope_checks([captured(model, tmp_path, 400)])
    assert check.first_indistinct is None and check.first_affected is not None
    (finding,) = rope_findings([check])
    assert finding.severity == "warning"


def test_a_capture_without_tables_reads_as_before(tmp_path):
    cap = captured(llama(), tmp_path, 16)
    doc = json.loads((cap / "manifest.json").read_text())
    for c in doc["calls"]:
        c.pop("rope")
    (cap / doc.pop("rope_tables")[0]["file"]).unlink()
    (cap / "manifest.json").write_text(json.dumps(doc))
    assert capture_rope_checks([cap]) == []
    r = CliRunner().invoke(app, ["run", str(cap), "--brief", "--fail-on", "error,warning,nan"])
    assert r.exit_code == 0, r.output


@pytest.mark.slow  # a full diagnosis of 4,096 x 4,096 scores per head: ~40 s
@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_run_reports_a_bf16_table_at_4k_positions_and_not_fp32(tmp_path, table):
    model = llama()
    if table == "bf16":
        force_bf16_table(model)
    cap = captured(model, tmp_path, 4096)
    r = CliRunner().invoke(app, ["run", str(cap), "--brief", "--fail-on", "error,warning,nan"])
    if table == "bf16":
        assert r.exit_code == 1 and "rope_precision" in r.output
        assert "positions stop being distinct at 257" in " ".join(r.output.split())
    else:
        assert r.exit_code == 0, r.output
        assert "rope_precision" not in r.output


def test_what_if_rope_dtype_recomputes_the_tables_apart_from_the_verdict(tmp_path):
    cap = captured(llama(), tmp_path, 300)
    out = tmp_path / "report.json"
    args = ["run", str(cap), "--brief", "--what-if", "rope:bf16", "--json", str(out), "--fail-on", "error,warning"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output  # a what-if is never the model's finding
    said = " ".join(r.stdout.split())
    assert "rope table 0 computed in bf16 (positions 0 .. 299): positions stop being distinct at 257" in said
    (check,) = json.loads(out.read_text())["model"]["capture"]["rope"]
    assert check["first_indistinct"] is None and check["what_if"][0]["dtype"] == "bf16"
    assert check["what_if"][0]["first_indistinct"] == first_repeated_bf16_position(300)
    bad = CliRunner().invoke(app, ["run", str(cap), "--what-if", "rope:fp8"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--what-if" in bad.stderr
