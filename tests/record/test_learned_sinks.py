"""Learned attention sinks (gpt-oss): a tiny transformers GptOss from its config, captured with its sinks; each
head's share of the denominator against a float64 softmax over [S, sink] computed here; a sink far below the rows'
max reported as changing nothing in bf16, checked against the bf16 output computed here with and without it; a sink
near the rows' max reported as effective, and the what-if kernel that drops it as different from the model's cell.
"""

import pytest
import torch
import transformers

import attncheck
from attncheck.findings import failed_conditions
from attncheck.numerics.inputs.sinks import eager_sink_output
from attncheck.report.model_sinks import sinks_block

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gpt_oss(dtype: torch.dtype, sinks: float | None = None):
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        num_hidden_layers=2,  # one sliding-window layer, one full
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        vocab_size=64,
        sliding_window=6,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype).eval()
    if sinks is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(sinks)
    return model


def captured(model, what_if=()):
    """The model's calls, diagnosed in memory, and each attention module's own output (o_proj's input)."""
    outputs = []
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: outputs.append(a[0].detach()))
        for layer in model.model.layers
    ]
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if=what_if) as cap:
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return cap, outputs


@pytest.fixture(scope="module")
def bf16_capture():
    return captured(gpt_oss(torch.bfloat16), what_if=("nosinks",))


def test_the_capture_holds_each_call_with_its_sinks_and_reproduces_the_models_output(bf16_capture):
    cap, outputs = bf16_capture
    model = gpt_oss(torch.bfloat16)
    assert len(cap.calls) == 2
    with torch.no_grad(), attncheck.capture() as raw:
        model(input_ids=torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1)))
    for layer, call in enumerate(raw.calls):
        assert call.kind == "softmax" and call.meta["sinks"] == "true" and call.meta["has_qk"] == "true"
        t = call.tensors
        assert set(t) == {"scores", "q", "k", "v", "sinks"}
        assert t["scores"].shape == (2, 4, 10, 10) and t["sinks"].shape == (4,)  # Tk keys; one logit per head
        assert t["sinks"].dtype == torch.bfloat16
        assert torch.equal(t["sinks"], model.model.layers[layer].self_attn.sinks.detach())
        # the model's cell rebuilt from what was recorded is the module's own output, bit for bit
        out = eager_sink_output(t["scores"], t["sinks"], t["v"])
        assert torch.equal(out.transpose(1, 2).reshape(2, 10, -1), outputs[layer])


def test_the_sink_share_per_head_is_the_float64_softmax_over_scores_and_sink(bf16_capture):
    cap, _ = bf16_capture
    with torch.no_grad(), attncheck.capture() as raw:
        gpt_oss(torch.bfloat16)(input_ids=torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1)))
    for report, call in zip(cap.calls, raw.calls):
        s, sink = call.tensors["scores"].double(), call.tensors["sinks"].double()
        col = sink.reshape(1, -1, 1, 1).expand(2, -1, 10, 1)
        share = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., -1]  # (batch, heads, queries)
        per_head = share.transpose(0, 1).reshape(4, -1)
        facts = report.sinks
        assert facts is not None and facts.dtype == "bf16" and facts.rounding == 2.0**-9
        assert [h.share_max for h in facts.heads] == pytest.approx(per_head.amax(1).tolist(), rel=1e-12)
        assert [h.share_median for h in facts.heads] == pytest.approx(per_head.median(1).values.tolist(), rel=1e-12)
        # random init draws the sinks from N(0, 0.02): near the rows' max, each takes its share (the first query
        # sees one key: half its denominator)
        assert all(0.4 < h.share_max < 0.6 and h.changed > 0 for h in facts.heads)
        assert "sink_no_effect" not in {f.code for f in report.diagnosis.findings}


def test_a_sink_near_the_rows_max_changes_the_output_and_the_what_if_that_drops_it_differs(bf16_capture):
    cap, outputs = bf16_capture
    for report, out in zip(cap.calls, outputs):
        facts = report.sinks
        assert facts.nosinks
        for h in facts.heads:
            assert h.changed > 0 and h.diff_nosinks > 0.05 and h.err_nosinks > 20 * h.err_model
    # the what-if is apart from the model's verdict
    assert failed_conditions(cap.result.tensors, ["error", "warning"]) == []


def test_a_sink_far_below_the_rows_max_changes_nothing_in_bf16():
    model = gpt_oss(torch.bfloat16, sinks=-30.0)
    cap, _ = captured(model)
    with torch.no_grad(), attncheck.capture() as raw:
        model(input_ids=torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1)))
    for report, call in zip(cap.calls, raw.calls):
        s, sink, v = (call.tensors[r] for r in ("scores", "sinks", "v"))
        # the bf16 output with and without the sink, as gpt-oss's eager code computes it, written out here
        c = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(2, -1, 10, 1)], dim=-1)
        with_sink = torch.softmax(c - c.amax(-1, keepdim=True), dim=-1, dtype=torch.bfloat16)[..., :-1] @ v
        without = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1, dtype=torch.bfloat16) @ v
        assert torch.equal(with_sink, without)
        assert all(h.changed == 0 and h.share_max < 2.0**-9 for h in report.sinks.heads)
        found = [f for f in report.diagnosis.findings if f.code == "sink_no_effect"]
        assert len(found) == 1 and found[0].severity == "info" and "heads 0, 1, 2, 3" in found[0].message


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_healthy_gpt_oss_reports_no_error_and_no_warning(dtype):
    cap, _ = captured(gpt_oss(DTYPES[dtype]), what_if=("kernels",))
    assert [f.code for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"] == []
    assert failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []
    assert all(r.sinks is not None and r.sinks.nosinks for r in cap.calls)  # 'kernels' holds the nosinks what-if


def test_sdpa_forced_on_gpt_oss_drops_the_sinks_and_is_reported():
    """transformers refuses 'sdpa' for GptOss; forced through the config, its SDPA integration ignores s_aux: the
    model's output no longer depends on the sinks (checked here), and the capture names the dropped sinks."""
    model = gpt_oss(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="does not support an attention implementation"):
        model.set_attn_implementation("sdpa")
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.add_(3.0)
        assert torch.equal(model(input_ids=ids).logits, before)  # the sinks do nothing under forced SDPA
    cap, outputs = captured(model)
    eager = gpt_oss(torch.bfloat16)
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.add_(3.0)
    ref, eager_outputs = captured(eager)
    for report, own, with_sinks, eager_report in zip(cap.calls, outputs, eager_outputs, ref.calls):
        assert report.call.kind == "sdpa" and report.sinks is not None and report.sinks.ignored
        found = [f for f in report.diagnosis.findings if f.code == "sinks_ignored"]
        assert len(found) == 1 and found[0].severity == "error"
        # what the call dropped, measured on the eager model's own outputs with and without its sinks
        dropped = (own.double() - with_sinks.double()).abs().amax().item()
        assert max(h.diff_nosinks for h in report.sinks.heads) == pytest.approx(dropped, rel=0.05)
        assert [h.share_max for h in report.sinks.heads] == pytest.approx(
            [h.share_max for h in eager_report.sinks.heads], rel=1e-2
        )
    assert failed_conditions(cap.result.tensors, ["error"]) != []


def test_the_gradients_of_a_call_with_sinks_are_said_to_be_left_out():
    model = gpt_oss(torch.float32).train()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with attncheck.capture(diagnose=True) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
    assert cap.calls and all(r.sinks is not None and r.sinks.grads_left_out for r in cap.calls)
    assert "backward with the sinks is not computed yet" in sinks_block(cap.calls).plain
