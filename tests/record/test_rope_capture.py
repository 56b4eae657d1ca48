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
    (check,) = cap.result.model.capture["rope"]
    assert check.qk.calls == 1 and check.qk.q.vectors == 4 * 300  # the rotated q judged as the call came
    if table == "bf16":
        assert len(found) == 1 and "positions stop being distinct at 257" in found[0].message
        assert f"rotated q goes wrong from position {check.qk.q.first_affected:,}" in found[0].message
    else:
        assert found == [] and check.judged and check.qk.q.first_affected is None


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
@pytest.mark.parametrize("table", ["bf16", "fp32", "bf16 model, fp32 table"])
def test_run_reports_a_bf16_table_at_4k_positions_and_not_fp32(tmp_path, monkeypatch, table):
    model = llama()
    if table == "bf16":
        force_bf16_table(model)
    if table.startswith("bf16 model"):  # loaded with dtype=: the weights in bf16, inv_freq and the table's angles fp32
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(
            model.config, attn_implementation="sdpa", dtype=torch.bfloat16
        )
        model.eval()
    seen = true_rotations(monkeypatch)
    cap = captured(model, tmp_path, 4096)
    out = tmp_path / "report.json"
    r = CliRunner().invoke(app, ["run", str(cap), "--brief", "--fail-on", "error,warning,nan", "--json", str(out)])
    (check,) = json.loads(out.read_text())["model"]["capture"]["rope"]
    said = " ".join(r.output.split())
    tolerance = 2 * math.sin(ROPE_ANGLE_TOLERANCE / 2)
    for role in ("q", "k"):
        want = exact_errors(seen, role, 4096)  # the model's own unrotated vectors turned in float64
        first = int((want > tolerance).nonzero()[0, 0]) if bool((want > tolerance).any()) else None
        assert check["qk"][role]["first_affected"] == first
    if table == "bf16":
        assert r.exit_code == 1 and "rope_precision" in r.output
        assert "positions stop being distinct at 257" in said
        assert f"rotated q goes wrong from position {check['qk']['q']['first_affected']:,}" in said
    else:
        assert r.exit_code == 0, r.output
        assert "rope_precision" not in r.output and check["qk"]["q"]["first_affected"] is None


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
    assert check["qk"]["q"]["first_affected"] is None and check["qk"]["q"]["max_relative_error"] < 1e-5
    assert check["qk"]["k"]["role"] == "k" and check["qk"]["score_pairs"] > 0
    assert check["what_if"][0]["first_indistinct"] == first_repeated_bf16_position(300)
    bad = CliRunner().invoke(app, ["run", str(cap), "--what-if", "rope:fp8"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--what-if" in bad.stderr


def true_rotations(monkeypatch) -> list:
    """Spies on transformers' apply_rotary_pos_emb: each layer's q and k before the rotation and after it, as the
    model computed them (what a capture cannot record: the unrotated vectors)."""
    from transformers.models.llama import modeling_llama

    seen, original = [], modeling_llama.apply_rotary_pos_emb

    def spy(q, k, cos, sin, *args, **kwargs):
        out = original(q, k, cos, sin, *args, **kwargs)
        seen.append({"q": q.detach().clone(), "k": k.detach().clone(), "q_rot": out[0].detach(), "k_rot": out[1]})
        return out

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", spy)
    return seen


def exact_errors(seen: list, role: str, tokens: int, head_dim: int = 16, theta: float = 10000.0) -> torch.Tensor:
    """(tokens,) the largest |x_model - x_exact| / |x_exact| over layers and heads per position: x_exact the model's
    own unrotated vector turned in float64 by p x theta^(-2j/d), as apply_rotary_pos_emb turns it."""
    inv = torch.tensor([theta ** (-2 * j / head_dim) for j in range(head_dim // 2)], dtype=torch.float64)
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    worst = torch.zeros(tokens, dtype=torch.float64)
    for layer in seen:
        x, got = layer[role].double(), layer[role + "_rot"].double()
        half = head_dim // 2
        exact = x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
        err = ((got - exact).norm(dim=-1) / exact.norm(dim=-1)).amax(dim=(0, 1))
        worst = torch.maximum(worst, err)
    return worst


def test_bf16_table_rotated_q_and_k_against_the_models_own_unrotated_vectors(tmp_path, monkeypatch):
    """The rotated q and k of a Llama whose table is computed in bf16: the first position each goes wrong, and the
    largest error, as the model's own unrotated vectors (spied on, not recorded) turned in float64 say."""
    model = llama(layers=2)
    force_bf16_table(model)
    seen = true_rotations(monkeypatch)
    (check,) = capture_rope_checks([captured(model, tmp_path, 300)])
    tolerance = 2 * math.sin(ROPE_ANGLE_TOLERANCE / 2)
    qk = check.qk
    assert qk.calls == 2 and qk.note is None
    for role, found in (("q", qk.q), ("k", qk.k)):
        want = exact_errors(seen, role, 300)
        assert found.first_affected == int((want > tolerance).nonzero()[0, 0])
        assert found.affected_positions == int((want > tolerance).sum())
        assert found.max_relative_error == pytest.approx(float(want.max()), rel=1e-4)
        assert found.max_error_position == int(want.argmax()) and found.dtype == "fp32"
        # one frequency's angle passes the tolerance first; the vector, a mix of all eight, later
        assert found.first_affected >= check.first_affected
    assert qk.score_error <= qk.score_bound and qk.score_positions[1] <= qk.score_positions[0]
    (finding,) = rope_findings([check])
    assert f"rotated q goes wrong from position {qk.q.first_affected:,}" in finding.message
    assert f"rotated k goes wrong from position {qk.k.first_affected:,}" in finding.message


def test_a_bf16_model_with_its_table_from_fp32_is_clean(tmp_path):
    """Loaded in bf16 with dtype= (inv_freq stays fp32): q and k are off by the table's cast to bf16 alone, below bf16's
    own rounding of each entry, which the comparison does not count."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(llama().config, attn_implementation="sdpa", dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    (check,) = capture_rope_checks([captured(model.eval(), tmp_path, 300)])
    for v in (check.qk.q, check.qk.k):
        assert v.dtype == "bf16" and v.first_affected is None and v.max_relative_error < v.rounding == 2.0**-8
    assert rope_findings([check]) == []


def test_decode_steps_judge_the_keys_new_at_their_positions(tmp_path):
    """A decode step stored by its new rows: its k_tail holds the keys rotated by its own table (position 20, then
    21), judged; diagnosed as it runs, a step's k holds the cached keys too, rotated by earlier tables, and is left
    out with that reason."""
    model = llama()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    doc = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert [sorted(c["tensors"]) for c in doc["calls"][1:]] == [["k_tail", "q", "v_tail"]] * 2
    checks = capture_rope_checks([tmp_path / "cap"])
    assert [(c.first_position, c.qk.calls, c.qk.note) for c in checks] == [(0, 1, None), (20, 1, None), (21, 1, None)]
    heads = [c["tensors"]["k_tail"]["shape"][1] for c in doc["calls"][1:]]
    assert [c.qk.k.vectors for c in checks[1:]] == heads  # one new key per head at each step
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    step = cap.result.model.capture["rope"][1].qk
    assert step.calls == 1 and step.k is None
    assert step.note == "k not judged: k holds 21 positions and the table 1 (keys of a KV cache) (call #1)"
