"""Key shares, first-token share and the sink rate on constructed attention where they are known in closed form."""

from __future__ import annotations

import math

import pytest
import torch

from attncheck.findings.activations import SINK_EPSILON, sink_rate
from attncheck.judge import diagnose, diagnose_call
from attncheck.options import Options
from attncheck.results import CallInfo

ONE = Options(dtypes=("fp32",), methods=("torch",))


def _causal_half(t: int) -> torch.Tensor:
    """(t, t) causal scores whose rows 1.. put exactly 1/2 on key 0: logit log(i) against i keys of logit 0."""
    s = torch.zeros(t, t, dtype=torch.float64)
    s[1:, 0] = torch.log(torch.arange(1, t, dtype=torch.float64))
    return s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


def test_causal_head_with_half_on_key_zero():
    t = 8
    s = _causal_half(t).expand(2, 3, t, t).contiguous()
    d = diagnose("s", s, ONE)
    shares = d.key_shares
    # row 0 puts 1 on key 0, every other row 1/2: (1 + (t - 1) / 2) / t
    assert shares.first_share == pytest.approx([(1 + (t - 1) / 2) / t] * 3, rel=1e-12)
    # uniform attention over each row's i + 1 visible keys gives key 0 the mean of 1 / (i + 1): H_t / t
    # (the baseline is summed in float32: a threshold's reference, not a reported number)
    assert shares.first_uniform == pytest.approx([sum(1 / (i + 1) for i in range(t)) / t] * 3, rel=1e-6)
    assert shares.top_key == [0, 0, 0]
    assert len(shares.first_importance) == 6


def test_importance_matches_sail_sg_formula():
    """sail-sg/Attention-Sink's compute_attention_sink on a random causal pattern: (A / ratios).sum(dim=-2) with
    ratios[k] = T - k, written here independently in float64."""
    g = torch.Generator().manual_seed(1)
    t = 12
    logits = torch.randn(2, 4, t, t, generator=g, dtype=torch.float64) * 3
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    a = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
    ratios = torch.arange(t, 0, -1, dtype=torch.float64)[None, None, None, :].expand_as(a)
    importance = (a / ratios).sum(dim=-2)  # (B, H, T)
    d = diagnose("s", logits.masked_fill(causal, float("-inf")), ONE)
    assert d.key_shares.first_importance == pytest.approx(importance[..., 0].reshape(-1).tolist(), rel=1e-12)
    pooled = importance.mean(dim=0)  # equal visible counts per batch element: pooling is the batch mean
    assert d.key_shares.first_share == pytest.approx(pooled[:, 0].tolist(), rel=1e-12)
    top = pooled.argmax(dim=-1)
    assert d.key_shares.top_key == top.tolist()
    assert d.key_shares.top_share == pytest.approx(pooled.gather(1, top[:, None])[:, 0].tolist(), rel=1e-12)
    # the sink rate: the share of (batch, head) pairs whose importance of key 0 exceeds 0.3
    from attncheck.numerics.cells.calls import scores_report

    report = scores_report(CallInfo(0, "s", "scores"), d)
    hits, pairs = sink_rate([report])
    assert pairs == 8 and hits == int((importance[..., 0] > SINK_EPSILON).sum())


def test_padded_row_and_padded_key_are_left_out():
    """A fully masked (padded) query row sees no key: it counts for none; a padded key 0 has no share at all."""
    t = 4
    s = torch.zeros(1, 2, t, t, dtype=torch.float64)
    s[0, 0, 3, :] = float("-inf")  # head 0: the last query is padding
    s[0, 1, :, 0] = float("-inf")  # head 1: key 0 is padding, every row spreads over 3 keys
    d = diagnose("s", s, ONE)
    sh = d.key_shares
    assert sh.first_share[0] == pytest.approx(1 / t)  # 3 visible queries, each 1/4 on key 0
    assert sh.first_share[1] is None and sh.first_importance[1] is None
    assert sh.top_share[1] == pytest.approx(1 / 3) and sh.top_key[1] in (1, 2, 3)


def test_qk_call_with_half_on_key_zero_is_a_sink():
    """q and k built so that a non-causal head puts exactly 1/2 of every row on key 0: q.k_0 * scale = log(T - 1),
    every other key 0. The call is judged: attention_sink names head 0 and key 0."""
    t, d = 9, 4
    q = torch.zeros(1, 2, t, d, dtype=torch.float64)
    k = torch.zeros(1, 2, t, d, dtype=torch.float64)
    v = torch.randn(1, 2, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q[0, 0, :, 0] = 1.0
    k[0, 0, 0, 0] = math.log(t - 1) * math.sqrt(d)  # SDPA's scale 1/sqrt(d) undone
    info = CallInfo(0, "c", "qk")
    report = diagnose_call(info, {"q": q.float(), "k": k.float(), "v": v.float()}, ONE)
    shares = report.diagnosis.key_shares
    assert shares.first_share[0] == pytest.approx(0.5, rel=1e-6)  # q, k rounded to fp32 once
    assert shares.first_share[1] == pytest.approx(1 / t, rel=1e-12)  # all logits 0: uniform
    assert shares.first_uniform == pytest.approx([1 / t, 1 / t], rel=1e-12)  # no mask: 1 / T for every key
    assert report.heads[0].first_share == pytest.approx(0.5, rel=1e-6)
    sink = [f for f in report.diagnosis.findings if f.code == "attention_sink"]
    assert len(sink) == 1 and "head 0 key 0 0.5" in sink[0].message and "head 1" not in sink[0].message
