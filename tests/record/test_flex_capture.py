"""FlexAttention under capture: transformers' Llama with attn_implementation='flex_attention' and
hand-written flex calls (causal block mask, sliding window, ALiBi, tanh soft-capping) are recorded
with their mask and logits after the score_mod, judged by the flex path the program runs (the fused
kernel where flex_attention is torch.compile'd, as transformers runs it; the math path without
torch.compile), saved and read back, and healthy models report clean. A soft cap is numerics: a
model whose raw logits overflow fp16 in hand-written attention has no finding under flex with the
cap, where the what-if of hand-written attention does."""

import json

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.findings import failed_conditions

from .conftest import VOCAB, batch

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*:UserWarning")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def llama_flex(dtype=torch.float32, seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="flex_attention", dtype=dtype).eval()


@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning"
)  # torch's own, on importing inductor (transformers compiles create_block_mask)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_healthy_flex_llama_reports_clean_with_the_kernel_it_runs(dtype):
    pytest.importorskip("transformers")
    model, inputs = llama_flex(DTYPES[dtype]), batch(left_pad=3)
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(**inputs)
    assert [r.call.module for r in cap.calls] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(r.call.kind == "flex" and r.call.meta["flex_impl"] == "compiled" for r in cap.calls)
    assert [[c.name for c in r.diagnosis.cells] for r in cap.calls] == [[f"flex/{dtype}"]] * 2
    loud = [(r.call.module, f.code) for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"]
    assert loud == [] and failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []
    assert "captured as its eager code" in cap.result.model.capture["note"]


class Attn(torch.nn.Module):
    def __init__(self, score_mod=None, block_mask=None, scale=None):
        super().__init__()
        self.score_mod, self.block_mask, self.scale = score_mod, block_mask, scale

    def forward(self, q, k, v):
        return flex_attention(q, k, v, score_mod=self.score_mod, block_mask=self.block_mask, scale=self.scale)


def softcap(score, b, h, qi, ki):
    return 50.0 * torch.tanh(score / 50.0)


def test_a_soft_cap_is_numerics_no_overflow_where_raw_logits_would_have_one(tmp_path):
    """fp16 q and k whose Q@K^T passes 65504: hand-written attention in fp16 overflows (its what-if
    says so); flex computes S in fp32 and caps it at 50, so its own cell is clean, its headroom the
    cap's, and the report shows the logits before and after the cap."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 32, 16, generator=g).to(torch.float16)
    k = torch.randn(1, 2, 32, 16, generator=g).to(torch.float16)
    q[0, 1] += 70.0  # head 1: q.k near 70 * 70 * 16 = 78400 > 65504
    k[0, 1] += 70.0
    v = torch.randn(1, 2, 32, 16, generator=g).to(torch.float16)
    scale = 1e-3  # S = q.k / 1000 (near 78): the cap does not saturate
    with attncheck.capture(tmp_path / "cap"):
        out = Attn(softcap, scale=scale)(q, k, v)
    assert torch.isfinite(out).all()
    json_out = tmp_path / "r.json"
    r = runner.invoke(
        app,
        ["run", str(tmp_path / "cap"), "--what-if", "fp16", "--json", str(json_out), "--fail-on", "error,warning,nan"],
    )
    assert r.exit_code == 0, r.output  # the model's cell: no finding
    doc = json.loads(json_out.read_text())
    (call,) = doc["model"]["calls"]
    assert call["cell"] == "flex-math/fp16" and call["verdict"] == "ok" and call["errors"] == []
    assert call["max_logit"] <= 50.0  # judged after the cap
    before = float((q.double() @ k.double().transpose(-1, -2)).max()) * scale
    assert before > 65504 * scale and call["score_mod"] == {
        "name": "softcap",
        "max_logit_before": pytest.approx(before, rel=1e-6),
    }
    assert call["limit"]["value"] <= 50.0 and "after softcap" in call["limit"]["what"]
    what_if = {c["name"]: c for c in call["what_if"]["cells"]}
    assert what_if["eager:torch/fp16"]["nan_rows"] > 0  # the raw logits, as hand-written fp16 attention computes them
    text = " ".join(r.output.split())
    assert "#0 Attn: softcap " in text and " -> " in text


@pytest.mark.parametrize("kind", ["causal", "window", "alibi"])
def test_hand_written_flex_calls_are_recorded_saved_and_read_back(kind, tmp_path):
    t = 48
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, t, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    mods = {
        "causal": (None, lambda b, h, qi, ki: qi >= ki),
        "window": (None, lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 8)),
        "alibi": (lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), lambda b, h, qi, ki: qi >= ki),
    }
    score_mod, mask_mod = mods[kind]
    bm = create_block_mask(mask_mod, None, None, t, t, device="cpu")
    with attncheck.capture(tmp_path / "cap"):
        Attn(score_mod, bm)(q, k, v)
    manifest = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert [c["kind"] for c in manifest["calls"]] == ["flex"]
    r = runner.invoke(
        app, ["run", str(tmp_path / "cap"), "--json", str(tmp_path / "r.json"), "--fail-on", "error,warning,nan"]
    )
    assert r.exit_code == 0, r.output
    (call,) = json.loads((tmp_path / "r.json").read_text())["model"]["calls"]
    assert call["cell"] == "flex-math/bf16" and call["verdict"] == "ok"
    assert (call["score_mod"] is not None) == (kind == "alibi")


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::UserWarning"
)  # inductor's and dynamo's own, on this torch
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_flex_llama_computes_the_same_under_capture_as_compiled(dtype):
    """transformers compiles flex_attention (inductor's CPU kernel); capture runs it as its eager code:
    the logits agree to the kernels' rounding. (Compiled flex has no backward on CPU in torch 2.13,
    so a compiled flex model cannot train on a CPU, with capture or without.)"""
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    inputs = batch(left_pad=3)
    alone_model, model = llama_flex(DTYPES[dtype]), llama_flex(DTYPES[dtype])
    with torch.no_grad():
        alone = alone_model(**inputs).logits
    with torch.no_grad(), attncheck.capture() as cap:
        out = model(**inputs).logits
    tol = 1e-5 if dtype == "fp32" else 2e-2
    torch.testing.assert_close(out.float(), alone.float(), rtol=tol, atol=tol)
    assert len(cap.calls) == 2 and all(c.meta["flex_impl"] == "compiled" for c in cap.calls)


def test_a_flex_call_over_max_bytes_is_refused_before_its_logits_are_computed(monkeypatch):
    """A flex call with a score_mod costs its logits (12 bytes per score, fp32 and float64): past
    max_bytes it is not recorded, recording stops and says why, and the logits are never computed."""
    import attncheck.record.flex as mode

    computed = []
    monkeypatch.setattr(mode, "flex_logits", lambda *a, **k: computed.append(1))
    q = torch.randn(1, 2, 64, 8)
    with attncheck.capture(max_bytes=64 * 64 * 2 * 12) as cap:  # the logits alone are 2 x 64 x 64 x 13 bytes
        out = Attn(softcap)(q, q, q)
    assert cap.calls == [] and computed == [] and torch.isfinite(out).all()
    assert "max_bytes" in cap.stopped and "flex in Attn" in cap.stopped


def test_a_score_mod_that_changes_no_logit_costs_nothing():
    """transformers passes flex a score_mod always; where it changes no logit the call is recorded
    as one without (no logits kept: S from q and k is the same), and judged alike."""

    def unchanged(score, b, h, qi, ki):
        return score

    q = torch.randn(1, 2, 16, 8)
    with attncheck.capture(diagnose=True) as cap:
        Attn(unchanged)(q, q, q)
    (r,) = cap.calls
    assert r.call.meta["score_mod"] == "none" and "logit_before_mod" not in r.call.meta
    assert r.call.meta["flex_impl"] == "math" and [c.name for c in r.diagnosis.cells] == ["flex-math/fp32"]
    assert cap.result.model.lines[0].score_mod is None
