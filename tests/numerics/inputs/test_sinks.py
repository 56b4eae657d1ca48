"""Learned sinks' numbers against what is known without the code: shares of a uniform row (1 / (n + 1) for a sink of
0 over n zero scores), the outputs of a constant V (1 - share against float64, exactly 1 without the sink), and the
bit-identity of a sink whose share is below fp32's unit roundoff 2^-24 (torch's bf16 softmax sums in fp32: the sum,
so every probability, is unchanged)."""

import math

import pytest
import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.inputs.sinks import eager_sink_output, sink_facts, sink_logits, split_sinks


def test_a_uniform_row_gives_the_sink_one_share_of_n_plus_one_and_a_constant_v_tells_the_errors():
    n = 3
    scores = torch.zeros(1, 2, 4, n, dtype=torch.bfloat16)
    sinks = torch.tensor([0.0, -30.0], dtype=torch.bfloat16)
    v = torch.ones(1, 2, n, 8, dtype=torch.bfloat16)
    facts = sink_facts(scores, sinks, v)
    far = math.exp(-30.0) / (n + math.exp(-30.0))
    assert [h.share_max for h in facts.heads] == [0.25, far]
    assert [h.share_median for h in facts.heads] == [0.25, far]
    near, dead = facts.heads
    # with the sink: P = 1/4 each (exact in bf16), O = 3/4; without: O = 1; float64: O = 1 - share
    assert (near.err_model, near.err_nosinks, near.diff_nosinks, near.changed) == (0.0, 0.25, 0.25, 4 * 8)
    assert near.rel_nosinks == 0.25 / 0.75
    assert dead.changed == 0 and dead.diff_nosinks == 0.0 and dead.err_model == dead.err_nosinks
    assert dead.err_model == pytest.approx(far, rel=1e-3)  # 1 - (1 - share) in float64: ~1e-16 / 3e-14 lost
    assert facts.rounding == 2.0**-9 and facts.elements == 4 * 8 and facts.dtype == "bf16"


def test_a_share_below_fp32s_unit_roundoff_leaves_the_bf16_output_bit_for_bit_and_one_near_the_max_does_not():
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(2, 4, 32, 48, generator=g) * 2).bfloat16()
    v = torch.randn(2, 4, 48, 16, generator=g).bfloat16()
    top = float(scores.float().amax())
    far = torch.full((4,), top - 40.0).bfloat16()  # share <= exp(-40 + top - row max) < 2^-24 here
    facts = sink_facts(scores, far, v)
    assert all(h.share_max < 2.0**-24 and h.changed == 0 for h in facts.heads)
    assert torch.equal(eager_sink_output(scores, far, v), eager_sink_output(scores, None, v))
    near = torch.full((4,), top).bfloat16()
    assert all(h.share_max > 0.01 and h.changed > 0 for h in sink_facts(scores, near, v).heads)


def test_the_softmax_call_is_judged_on_what_the_model_softmax_received():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 2, 5, 6, generator=g).bfloat16()
    sinks = torch.tensor([0.5, -1.0]).bfloat16()
    tensors = {"scores": scores, "sinks": sinks, "q": scores, "k": scores, "v": torch.ones(1, 2, 6, 3).bfloat16()}
    out, facts = split_sinks({"sinks": "true"}, tensors)
    assert facts is not None and set(out) == {"scores", "v"}
    col = sinks.reshape(1, 2, 1, 1).expand(1, 2, 5, 1)
    c = torch.cat([scores, col], dim=-1)
    assert torch.equal(out["scores"], c - c.amax(-1, keepdim=True)) and torch.equal(
        sink_logits(scores, sinks), out["scores"]
    )
    assert split_sinks({}, tensors) == (tensors, None)  # no sinks in the metadata: the call as given


def test_sinks_of_another_head_count_are_refused_in_one_line():
    scores = torch.zeros(1, 4, 2, 3)
    with pytest.raises(AttncheckError, match=r"its sinks \(shape \[3\]\) must hold one logit per head"):
        split_sinks({"sinks": "true"}, {"scores": scores, "sinks": torch.zeros(3)})


def test_blocks_of_queries_change_no_number(monkeypatch):
    import attncheck.numerics.inputs.sinks as sinks_module

    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 20, 24, generator=g).bfloat16()
    v = torch.randn(2, 3, 24, 8, generator=g).bfloat16()
    sinks = torch.tensor([0.0, 1.0, -2.0]).bfloat16()
    whole = sink_facts(scores, sinks, v)
    row = 8 * (6 * (24 + 1) + 6 * 8) * 2  # the bytes of one query row of both batch elements
    monkeypatch.setattr(sinks_module, "SINK_BLOCK_BYTES", 7 * row)  # 7 of one head's 20 queries per block
    assert sinks_module._blocks(2, 3, 20, 24, 8)[:4] == [
        (slice(0, 1), slice(0, 7)),
        (slice(0, 1), slice(7, 14)),
        (slice(0, 1), slice(14, 20)),
        (slice(1, 2), slice(0, 7)),
    ]
    blocked = sink_facts(scores, sinks, v)
    for a, b in zip(whole.heads, blocked.heads):  # the L2 sums add in another order: their last bits may differ
        assert (a.rel_model, a.rel_nosinks) == pytest.approx((b.rel_model, b.rel_nosinks), rel=1e-12)
        a.rel_model, a.rel_nosinks = b.rel_model, b.rel_nosinks
    assert blocked == whole


@pytest.mark.parametrize("mask", [float("-inf"), torch.finfo(torch.bfloat16).min])
def test_rows_that_see_no_key_are_counted_and_left_out_of_the_shares_and_the_nosinks_numbers(mask):
    """A padded query (every key -inf, or the dtype's min as transformers' eager mask adds it) gives its sink the
    whole denominator: share 1 in every head, hiding the real share; without the sink its softmax is NaN (-inf) or
    uniform over masked keys. Uniform rows of n zero scores and a sink of 0 over the rows that see keys: share
    1 / (n + 1) (0.25 here), a constant V: 3/4 with the sink, 1 without, so the difference is exactly 0.25."""
    n = 3
    scores = torch.zeros(2, 2, 4, n, dtype=torch.bfloat16)
    scores[0, :, :2] = mask  # batch 0's first two queries are padding
    sinks = torch.zeros(2, dtype=torch.bfloat16)
    v = torch.ones(2, 2, n, 8, dtype=torch.bfloat16)
    facts = sink_facts(scores, sinks, v)
    for h in facts.heads:
        assert h.masked_rows == 2
        assert h.share_max == 0.25 and h.share_median == 0.25
        assert h.diff_nosinks == 0.25 and h.err_nosinks == 0.25 and math.isfinite(h.rel_nosinks)
        assert h.changed == (2 * 4 - 2) * 8  # the rows that see keys: 3/4 against 1 everywhere


def test_a_nan_sink_has_a_nan_share_not_zero():
    scores = torch.zeros(1, 2, 4, 3, dtype=torch.bfloat16)
    sinks = torch.tensor([float("nan"), 0.0], dtype=torch.bfloat16)
    nan, ok = sink_facts(scores, sinks, torch.ones(1, 2, 3, 8, dtype=torch.bfloat16)).heads
    assert math.isnan(nan.share_max) and math.isnan(nan.share_median) and math.isnan(nan.err_model)
    assert ok.share_max == 0.25
