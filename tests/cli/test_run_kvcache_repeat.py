"""The KV-cache what-if where one module's calls store K with different head counts: transformers repeats K and V
over the query heads before SDPA when a mask is given (a padded batch, a generate() prefill) and not without one.
The repeated calls are mapped back to their kv heads (checked against K and V read from the capture's files here);
a call whose heads are not an exact repeat is refused in one line."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.errors import AttncheckError
from attncheck.numerics.inputs.prepare import AttentionInputs
from attncheck.pipelines.kvcache import KVCall, asks_of, run_kv

runner = CliRunner()


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()


def test_padded_forward_then_unpadded_replayed_per_kv_head(tmp_path):
    model = _llama()
    ids = torch.randint(3, 128, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad(), attncheck.capture(tmp_path / "c"):
        model(input_ids=ids, attention_mask=mask)  # K repeated over the 4 query heads
        model(input_ids=ids)  # K with its 2 kv heads (enable_gqa)
    files = sorted((tmp_path / "c").glob("0*.safetensors"))
    ks = [load_file(str(f))["k"].double() for f in files]
    assert [k.shape[1] for k in ks] == [4, 2]  # the case itself: different head counts in one module
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["run", str(tmp_path / "c"), "--quiet", "--json", str(out), "--what-if", "kv:fp8_e4m3"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    for cache in doc["kv_cache"]["caches"]:
        heads = cache["heads"]
        assert [(h["kv_head"], h["query_heads"], h["calls"]) for h in heads] == [(0, [0, 1], 2), (1, [2, 3], 2)]
        for h in heads:  # the amax per kv head: the repeated call's heads 2h, 2h+1 and the other's head h
            want = max(
                float(ks[0][:, 2 * h["kv_head"] : 2 * h["kv_head"] + 2].abs().max()),
                float(ks[1][:, h["kv_head"]].abs().max()),
            )
            assert h["k_amax"] == pytest.approx(want, rel=0, abs=0)


@pytest.mark.slow
def test_padded_generate_through_sdpa_replayed(tmp_path):
    model = _llama()
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    with torch.no_grad(), attncheck.capture(tmp_path / "g"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    out = tmp_path / "r.json"
    for ask in ("kv:fp8_e4m3", "kv:int4:g16"):
        result = runner.invoke(app, ["run", str(tmp_path / "g"), "--quiet", "--json", str(out), "--what-if", ask])
        assert result.exit_code == 0, result.output
        heads = json.loads(out.read_text())["kv_cache"]["caches"][0]["heads"]
        assert [h["query_heads"] for h in heads] == [[0, 1], [2, 3]]


def _inputs(k, q_heads=4):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, q_heads, 8, 16, generator=g)
    return AttentionInputs(q, k, 0.25, "1/sqrt(d)", "q", None, None, "-inf", (1,), v=k.clone())


def test_repeat_mapped_back_in_either_order_and_a_non_repeat_refused():
    g = torch.Generator().manual_seed(0)
    k2 = torch.randn(1, 2, 8, 16, generator=g)
    k4 = k2.repeat_interleave(2, dim=1)
    asks = asks_of(["kv:fp8_e4m3:unit"])
    for order in ((k2, k4), (k4, k2)):
        calls = [KVCall("m", i, lambda k=k: (_inputs(k), torch.bfloat16)) for i, k in enumerate(order)]
        heads = run_kv(asks, calls).caches[0].heads
        assert [(h.kv_head, h.query_heads, h.calls) for h in heads] == [(0, [0, 1], 2), (1, [2, 3], 2)]
        assert [h.k_amax for h in heads] == [float(k2[:, h].abs().max()) for h in range(2)]
    other = torch.randn(1, 4, 8, 16, generator=g)  # 4 distinct heads after a call with 2
    calls = [KVCall("m", i, lambda k=k: (_inputs(k), torch.bfloat16)) for i, k in enumerate((k2, other))]
    with pytest.raises(AttncheckError, match=r"m \(call 1\): K holds 4 heads where the layer's first call holds 2"):
        run_kv(asks, calls)


def test_int4_groups_that_replay_no_call_refused_in_one_line(tmp_path):
    g = torch.Generator().manual_seed(0)
    for name in "qkv":  # 1 x 4 x 16 x 32: 2,048 values per batch row, whole groups of 16 but never of 7
        torch.save(torch.randn(1, 4, 16, 32, generator=g).bfloat16(), tmp_path / f"{name}.pt")
    args = ["run", *(x for n in "qkv" for x in (f"--{n}", str(tmp_path / f"{n}.pt"))), "--quiet"]
    for groups in ("g7", "g100000"):
        result = runner.invoke(app, [*args, "--what-if", f"kv:int4:{groups}", "--fail-on", "what-if:warning"])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"attncheck: error: --what-if kv:int4:{groups} replays no call: 2048 values per batch row are not groups "
            f"of {groups[1:]} (quanto refuses it)"
        ]
    assert runner.invoke(app, [*args, "--what-if", "kv:int4:g16"]).exit_code == 0


def test_int4_claim_narrowed_and_per_read_counts_documented():
    from pathlib import Path

    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.replace("│", " ").split())
    assert "quanto's per-group quantiser (transformers' quanto cache's) on each call's K and V" in text
    assert "prefill and flush timing on generate() not modelled" in text
    docs = Path(__file__).resolve().parents[2] / "docs"
    serving = " ".join((docs / "serving.md").read_text().split())
    assert "The timing of transformers' `QuantizedLayer.update` on a `generate()` capture is not modelled" in serving
    assert "the counts (`k_entries`, saturated, flushed) are per read" in serving
    assert "counts per read" in " ".join((docs / "reference" / "json.md").read_text().split())
