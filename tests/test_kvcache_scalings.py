"""The KV cache's scalings over several calls of a layer (attncheck.pipelines.kvcache): 'tensor' and 'head' from the
capture's amax, 'dynamic' from the layer's first call alone (vLLM's calc_kv_scales: amax / 200 for K, / 100 for V),
'unit' 1.0; saturation counted per head against counts written here; an outlier channel named as the cause."""

import pytest
import torch

from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.pipelines.kvcache import KVCall, asks_of, run_kv

E4M3_MAX = 448.0


def call(module, index, k, v, q=None):
    q = torch.ones(1, 4, k.shape[2], k.shape[3], dtype=torch.bfloat16) if q is None else q
    inp = prepare_inputs(q, k, None, v=v, causal=True)
    return KVCall(module, index, lambda: (inp, torch.bfloat16))


def kv(seed, scale_v=1.0, scale_k=1.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(1, 2, 8, 16, generator=g) * scale_k).bfloat16()
    v = (torch.randn(1, 2, 8, 16, generator=g) * scale_v).bfloat16()
    return k, v


def test_asks_of_tokens():
    assert asks_of(["kv:fp8_e4m3:unit", "fp16", "kv:fp8_e5m2"]) == [
        ("fp8_e4m3", "unit"),
        ("fp8_e5m2", "unit"),
        ("fp8_e5m2", "tensor"),
        ("fp8_e5m2", "head"),
        ("fp8_e5m2", "dynamic"),
    ]


def test_scales_per_scaling_over_two_calls_of_a_layer():
    (k0, v0), (k1, v1) = kv(0), kv(1, scale_v=10.0)  # the second call's V is ten times larger
    calls = [call("layer", 0, k0, v0), call("layer", 1, k1, v1)]
    asks = [("fp8_e4m3", s) for s in ("unit", "tensor", "head", "dynamic")]
    report = run_kv(asks, calls)
    by = {c.scaling: {h.kv_head: h for h in c.heads} for c in report.caches}
    v_amax = torch.maximum(v0.double().abs().amax(dim=(0, 2, 3)), v1.double().abs().amax(dim=(0, 2, 3)))
    k_amax = torch.maximum(k0.double().abs().amax(dim=(0, 2, 3)), k1.double().abs().amax(dim=(0, 2, 3)))
    f32 = lambda x: float(torch.tensor(float(x), dtype=torch.float32))  # noqa: E731  (scales are stored in fp32)
    for h in range(2):
        assert by["unit"][h].v_scale == by["unit"][h].k_scale == 1.0
        assert by["tensor"][h].v_scale == f32(v_amax.max() / E4M3_MAX)
        assert by["head"][h].v_scale == f32(v_amax[h] / E4M3_MAX)
        assert by["head"][h].k_scale == f32(k_amax[h] / E4M3_MAX)
        # dynamic: the first call's amax over every head, never the second's
        assert by["dynamic"][h].v_scale == f32(v0.double().abs().max() / 100)
        assert by["dynamic"][h].k_scale == f32(k0.double().abs().max() / 200)
        assert by["head"][h].calls == 2 and by["head"][h].v_amax == float(v_amax[h])
    # dynamic: the second call's V (x10) passes the first's amax x 100 / 448 ... counted against a cast written here
    s = by["dynamic"][0].v_scale
    want = [int(((torch.cat([v0, v1], dim=2)[:, h].float() / s).abs() > 464).sum()) for h in range(2)]
    assert [by["dynamic"][h].v_saturated for h in range(2)] == want


def test_outlier_channel_named_as_the_cause():
    k, v = kv(2)
    v[0, 1, 5, 3] = 1920.0  # exact in bf16  # one channel of kv head 1, token 5
    report = run_kv([("fp8_e4m3", "unit")], [call("model.layers.3.self_attn", 0, k, v)])
    (cache,) = report.caches
    head = next(h for h in cache.heads if h.kv_head == 1)
    ch = next(c for c in head.channels if c.tensor == "v")
    median = v[0, 1].double().abs().amax(dim=0).median()
    assert (ch.channel, ch.token) == (3, 5) and ch.ratio == pytest.approx(1920.0 / float(median))
    assert head.v_saturated == 1
    sat = [f for f in cache.findings if f.code == "kv_cache_saturation"]
    assert len(sat) == 1 and "amax 1920 > 448" in sat[0].message
    assert "the amax sits in channel 3" in sat[0].message and "(token 5 of call 0)" in sat[0].message


def test_each_call_loaded_once_more_when_the_amax_was_gathered():
    """Calibrated scalings need the capture's amax: gathered while the calls are diagnosed (AmaxPass), the cache's
    own pass loads each call once; without it, twice (a first pass for the amax)."""
    from attncheck.pipelines.kvcache import AmaxPass
    from attncheck.results import CallInfo

    loads = []
    k, v = kv(3)
    inp = prepare_inputs(torch.ones(1, 4, 8, 16, dtype=torch.bfloat16), k, None, v=v, causal=True)

    def counted(i):
        return KVCall("layer", i, lambda: loads.append(i) or (inp, torch.bfloat16))

    asks = [("fp8_e4m3", "head"), ("fp8_e4m3", "unit")]
    alone = run_kv(asks, [counted(0), counted(1)])
    assert loads == [0, 1, 0, 1]
    loads.clear()
    amax = AmaxPass()
    for i in range(2):
        info = CallInfo(i, "call", "sdpa", module="layer", is_causal=True)
        amax.observe(info, {"q": torch.ones(1, 4, 8, 16, dtype=torch.bfloat16), "k": k, "v": v})
    gathered = run_kv(asks, [counted(0), counted(1)], amax=amax)
    assert loads == [0, 1]
    assert [h.v_scale for h in gathered.caches[0].heads] == [h.v_scale for h in alone.caches[0].heads]


def test_int4_asks_and_a_call_not_whole_groups_left_out_with_why():
    assert asks_of(["kv:int4:g64", "kv:int4:g16:r8", "kv:int4:g64"]) == [("int4", "g64"), ("int4", "g16:r8")]
    k, v = kv(4)  # 2 kv heads x 8 tokens x 16 = 256 values per batch row: groups of 64, not of 512
    report = run_kv([("int4", "g64"), ("int4", "g512")], [call("layer", 0, k, v)])
    whole, refused = report.caches
    assert (
        len(whole.heads) == 2
        and refused.heads == []
        and refused.summary == "int4 KV in groups of 512: no call replayed"
    )
    assert report.skipped == [
        ("layer (call 0)", "kv:int4:g512: 256 values per batch row are not groups of 512 (quanto refuses it)")
    ]
    assert all(h.k_saturated == h.v_saturated == 0 for h in whole.heads)


def test_fa3_consumer_quantises_q_at_vllms_scale():
    """kv:fp8_e4m3:SCALING:fa3: Q through FP8 too, at 1.0 (unit: Q beyond 448 counted, written here) or, dynamic,
    the first call's amax / 200 (vLLM's Q_SCALE_CONSTANT); O as FlashAttention-3's FP8 path on that Q scale."""
    from attncheck.numerics import kvcache as kc

    k, v = kv(5)
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(1, 4, 8, 16, generator=g) * 300).bfloat16()
    report = run_kv([("fp8_e4m3", "unit:fa3"), ("fp8_e4m3", "dynamic:fa3")], [call("layer", 0, k, v, q=q)])
    unit, dynamic = ({h.kv_head: h for h in c.heads} for c in report.caches)
    over = [int((q[:, 2 * h : 2 * h + 2].double().abs() > 464).sum()) for h in range(2)]
    assert [unit[h].q_saturated for h in range(2)] == over and min(over) > 0
    assert [dynamic[h].q_saturated for h in range(2)] == [0, 0]
    q_scale = float(torch.tensor(float(q.double().abs().max()) / 200, dtype=torch.float32))
    inp = call("layer", 0, k, v, q=q).load()[0]
    for h in range(2):
        qh, kh, vh = q[:, 2 * h : 2 * h + 2], k[:, h : h + 1], v[:, h : h + 1]
        bias = kc.mask_bias(inp.masked[:, :1] if inp.masked is not None else None, None, (1, 2, 8, 8))
        ks, vs = (torch.tensor([dynamic[h].k_scale]), torch.tensor([dynamic[h].v_scale]))
        out = kc.fa3_fp8_output(qh, kh, vh, bias, inp.scale, "fp8_e4m3", (q_scale, ks, vs))
        ref = kc.kernel_output(qh, kh, vh, bias, inp.scale, torch.bfloat16)
        assert dynamic[h].cosine == pytest.approx(float(kc.output_error(out, ref, 1).cosine[0]), abs=1e-12)
    assert "Q saturates in FP8" in " ".join(f.message for f in report.caches[0].findings)
