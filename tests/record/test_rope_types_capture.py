"""RoPE types other than the default in a capture: a transformers Llama from a config with Llama 3.1's rope_scaling
(llama3) records its type and parameters and is clean in fp32, and its table computed in bf16 is reported; a yarn
table is judged on its attention factor too; a type not modelled (dynamic) is said to be not judged, by name, in the
report and the JSON; a manifest naming a type transformers does not have is one line and exit 2."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.findings.rope import rope_findings
from attncheck.pipelines.rope import capture_rope_checks
from tests.numerics.test_rope_types import LLAMA31, meta_apply_scaling
from tests.record.test_rope_capture import captured, force_bf16_table

transformers = pytest.importorskip("transformers")


def llama(**rope):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,  # head dim 16
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=16384,
        rope_parameters={"rope_theta": 500_000.0, **rope},
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def test_llama3_fp32_is_clean_and_judged_against_llama3_frequencies(tmp_path):
    model = llama(**LLAMA31)
    cap = captured(model, tmp_path, 300)
    (entry,) = json.loads((cap / "manifest.json").read_text())["rope_tables"]
    assert entry["rope_type"] == "llama3"
    assert {k: entry["parameters"][k] for k in LLAMA31 if k != "rope_type"} == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192.0,
    }
    (check,) = capture_rope_checks([cap])
    assert check.judged and check.rope_type == "llama3" and check.first_affected is None
    # the largest angle error, recomputed here: the model's own table against Meta's apply_scaling in Python floats
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(300)[None])
    inv = meta_apply_scaling(500_000.0, 16, 8.0, 1.0, 4.0, 8192)
    worst = max(
        abs(math.remainder(math.atan2(float(sin[0, p, j]), float(cos[0, p, j])) - p * inv[j], 2 * math.pi))
        for p in range(300)
        for j in range(8)
    )
    assert check.max_angle_error == pytest.approx(worst, rel=1e-9, abs=1e-15)
    assert rope_findings([check]) == []
    r = CliRunner().invoke(app, ["run", str(cap), "--brief", "--fail-on", "error,warning,nan"])
    assert r.exit_code == 0, r.output


def test_llama3_table_in_bf16_is_reported(tmp_path):
    model = llama(**LLAMA31)
    force_bf16_table(model)
    cap = captured(model, tmp_path, 300)
    r = CliRunner().invoke(app, ["run", str(cap), "--brief", "--fail-on", "error,warning,nan"])
    assert r.exit_code == 1
    said = " ".join(r.output.split())
    assert "rope_precision" in said and "llama3" in said and "positions stop being distinct at 257" in said


def test_yarn_is_judged_with_its_attention_factor(tmp_path):
    model = llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)
    assert model.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    (check,) = capture_rope_checks([captured(model, tmp_path, 300)])
    assert check.judged and check.attention_factor == pytest.approx(0.1 * math.log(4) + 1, rel=1e-15)
    assert check.first_affected is None and check.max_magnitude_error < 2.0**-22
    assert rope_findings([check]) == []


def test_yarn_table_without_its_attention_factor_is_reported(tmp_path):
    model = llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)
    model.model.rotary_emb.attention_scaling = 1.0  # cos and sin on the unit circle: yarn's factor dropped
    (check,) = capture_rope_checks([captured(model, tmp_path, 64)])
    expected = 1 - 1 / (0.1 * math.log(4) + 1)
    assert check.first_affected is None and check.max_magnitude_error == pytest.approx(expected, rel=1e-6)
    (finding,) = rope_findings([check])
    assert finding.severity == "warning" and "off their circle" in finding.message


def test_a_type_not_modelled_is_said_not_judged_in_the_report_and_json(tmp_path):
    cap = captured(llama(rope_type="dynamic", factor=2.0), tmp_path, 64)
    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        app, ["run", str(cap), "--brief", "--json", str(out), "--fail-on", "error,warning,nan"], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 0, r.output  # not judged is no failure
    assert "rope table 0 (1 call(s)): rope_type dynamic: not judged" in r.stdout
    (check,) = json.loads(out.read_text())["model"]["capture"]["rope"]
    assert check["judged"] is False and check["rope_type"] == "dynamic" and "dynamic" in check["note"]
    summary = CliRunner().invoke(app, ["run", str(cap), "--summary"], env={"COLUMNS": "200"})
    assert "not judged: rope table 0 (1 call(s)): rope_type dynamic: not judged" in summary.stdout


def test_an_unknown_rope_type_in_the_manifest_is_one_line(tmp_path):
    cap = captured(llama(**LLAMA31), tmp_path, 16)
    doc = json.loads((cap / "manifest.json").read_text())
    doc["rope_tables"][0]["rope_type"] = "spiral"
    (cap / "manifest.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["run", str(cap)])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "rope_type 'spiral', not a RoPE type attncheck knows" in r.stderr
    doc["rope_tables"][0].update(rope_type="llama3", parameters={"factor": "eight"})
    (cap / "manifest.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["run", str(cap)])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "rope_tables[0].parameters" in r.stderr


def test_capture_diagnose_judges_llama3_too():
    model = llama(**LLAMA31)
    force_bf16_table(model)
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if="rope:fp32") as cap:
        model(torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(1)))
    (check,) = cap.result.model.capture["rope"]
    assert check.rope_type == "llama3" and check.first_indistinct == 257
    assert check.what_if[0].dtype == "fp32" and check.what_if[0].first_affected is None


@pytest.mark.slow  # importing transformers' Gemma 3 takes ~4 s
def test_rope_parameters_nested_by_layer_type_are_read_per_layer(tmp_path):
    """Gemma 3's config nests its rope parameters by layer type (sliding: default, theta 10k; full: linear, factor 8,
    theta 1M), and each attention module knows its layer_type: each table is judged by its own type and theta (read
    as one default table of a fitted theta, the linear one was a false rope_precision)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        hidden_size=32,
        intermediate_size=32,
        vocab_size=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    )
    model = transformers.Gemma3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    checks = capture_rope_checks([captured(model, tmp_path, 40)])
    assert [(c.rope_type, c.theta, c.parameters.get("factor")) for c in checks] == [
        ("default", 10_000.0, None),
        ("linear", 1_000_000.0, 8.0),
    ]
    assert all(c.judged and c.first_affected is None for c in checks) and rope_findings(checks) == []
    assert checks[1].max_angle_error < 40 * 2.0**-22  # against 1M^(-2j/16) / 8, the fp32 rounding alone


@pytest.mark.parametrize("tokens", [200, 300])
def test_longrope_picks_its_factors_by_the_forwards_length(tmp_path, tokens):
    """Short factors up to original_max_position_embeddings (256), long ones beyond, as transformers picks them."""
    from tests.numerics.test_rope_types import LONG, SHORT

    model = llama(rope_type="longrope", long_factor=LONG, short_factor=SHORT, original_max_position_embeddings=256)
    cap = captured(model, tmp_path, tokens)
    (entry,) = json.loads((cap / "manifest.json").read_text())["rope_tables"]
    assert entry["parameters"]["long_factor"] == LONG and entry["parameters"]["short_factor"] == SHORT
    (check,) = capture_rope_checks([cap])
    assert check.judged and check.first_affected is None and check.max_angle_error < tokens * 2.0**-21
    assert check.attention_factor == pytest.approx(math.sqrt(1 + math.log(16384 / 256) / math.log(256)), rel=1e-15)
    assert check.max_magnitude_error < 2.0**-22 and rope_findings([check]) == []
