"""End to end: a captured model's sinks, outlier channels and massive activations, against the model's own float64
attention; random-init models stay free of them."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

import attncheck

from .conftest import batch, gpt2, llama_gqa

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sinks_and_outliers.py"


def test_the_planted_sink_and_outlier_channel_are_named_with_the_models_own_numbers():
    """The example's GPT-2 run under capture: head 0 of layer 0 is a sink on key 0 with the share a float64
    softmax of its own q, k (recomputed here from the embeddings and weights) gives, its k channel 0 an outlier
    peaking at token 0, and a massive activation there."""
    with torch.no_grad(), attncheck.capture(diagnose=True) as diag:
        ns = runpy.run_path(str(EXAMPLE), run_name="__main__")
    model, ids, n_embd, d = ns["model"], ns["ids"], ns["n_embd"], ns["head_dim"]
    with torch.no_grad():
        tr = model.transformer
        x = tr.wte(ids) + tr.wpe(torch.arange(ids.shape[1]))
        qkv = tr.h[0].attn.c_attn(tr.h[0].ln_1(x)).to(torch.float64)[0]  # (T, 3 * n_embd)
    q, k = qkv[:, :d], qkv[:, n_embd : n_embd + d]  # head 0
    p = torch.softmax(q @ k.T / d**0.5 + _causal(q.shape[0]), dim=-1)
    want = p[:, 0].mean().item()  # every query of the causal pattern sees key 0
    first = diag.calls[0]
    assert first.heads[0].first_share == pytest.approx(want, rel=1e-5) and want > 0.8
    peak = first.heads[0].activations.k
    assert (peak.channel, peak.token) == (0, 0) and peak.value == pytest.approx(k[:, 0].abs().max().item(), rel=1e-6)
    codes = {f.code: f.message for f in first.diagnosis.findings}
    assert "head 0 key 0" in codes["attention_sink"]
    assert codes["outlier_channel"].startswith("1 outlier channel(s): head 0 k channel 0")
    assert "k token 0 head 0 channel 0" in codes["massive_activation"]
    report = diag.result.model
    assert {(m.position, m.head, m.what) for m in report.head_marks} == {(0, 0, "sink"), (0, 0, "channel")}
    assert report.sink_pairs == 8 and report.sink_hits == sum(
        v > 0.3 for c in diag.calls for v in c.diagnosis.key_shares.first_importance
    )
    second = {f.code for f in diag.calls[1].diagnosis.findings}
    assert not second & {"attention_sink", "outlier_channel", "massive_activation"}


def _causal(t: int) -> torch.Tensor:
    return torch.zeros(t, t, dtype=torch.float64).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))


@pytest.mark.parametrize("build", [lambda: (gpt2("sdpa"), batch()), lambda: (llama_gqa("sdpa"), batch())])
def test_random_init_models_have_no_sink_channel_or_massive_finding(build):
    model, inputs = build()
    with torch.no_grad(), attncheck.capture(diagnose=True) as diag:
        model(**inputs)
    found = [f for c in diag.calls for f in c.diagnosis.findings]
    codes = [f.code for f in found]
    assert [f.code for f in found if f.severity in ("error", "warning")] == []
    assert not set(codes) & {"attention_sink", "outlier_channel", "massive_activation"}
    assert diag.result.model.head_marks == [] and diag.result.model.sink_pairs > 0


def test_a_random_init_multihead_attention_has_no_sink_channel_or_massive_finding():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 12, 32)
    with torch.no_grad(), attncheck.capture(diagnose=True) as diag:
        mha(x, x, x)
    found = [f for c in diag.calls for f in c.diagnosis.findings]
    assert [f.code for f in found if f.severity in ("error", "warning")] == []
    assert not {f.code for f in found} & {"attention_sink", "outlier_channel", "massive_activation"}
    heads = diag.calls[0].heads
    assert len(heads) == 4 and all(h.activations is not None and h.first_share is not None for h in heads)
