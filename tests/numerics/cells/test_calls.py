"""One attention call diagnosed with SDPA's semantics, checked against float64 computed here and
against torch's own SDPA kernel; per-head statistics; the cell the model runs."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncheck.config.run import Options
from attncheck.errors import AttncheckError
from attncheck.judge import diagnose_call
from attncheck.numerics.cells.calls import model_cell
from attncheck.results import CallInfo

OPTS = Options(dtypes=("fp16", "fp32"), methods=("stable", "tiled", "torch"))


def tensors(b=2, hq=4, hk=4, tq=6, tk=6, d=8, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g) * spread
    k = torch.randn(b, hk, tk, d, generator=g) * spread
    v = torch.randn(b, hk, tk, d, generator=g)
    return q, k, v


def sdpa_info(**kw):
    return CallInfo(index=3, name="cap/0003-m.safetensors", kind="sdpa", module="model.layers.1.self_attn", **kw)


def float64_scores(q, k, scale, group=1):
    k = k.repeat_interleave(group, dim=1)
    return (q.double() @ k.double().transpose(-1, -2)) * scale


def test_bool_mask_is_true_where_a_query_attends_and_fully_masked_rows_are_zeros_as_sdpa():
    q, k, v = tensors()
    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[1, 0, 2] = False  # a query that may attend to nothing
    report = diagnose_call(sdpa_info(), {"q": q, "k": k, "v": v, "attn_mask": keep}, OPTS)
    d = report.diagnosis
    s = float64_scores(q, k, 1 / math.sqrt(8)).masked_fill(~keep, -math.inf)
    assert d.census.max == float(s[torch.isfinite(s)].max())
    assert d.census.masked == int((~keep).expand(2, 4, 6, 6).sum())
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # the kernel: zeros where nothing is attended
    zero_rows = int((out == 0).all(dim=-1).sum())
    assert zero_rows == 4 and report.cell == ("flash", "fp32")
    flash = d.cell("flash", "fp32")
    assert flash.zero_causes == {"fully_masked": zero_rows} and flash.out_nan_rows == 0
    assert flash.out_max_abs_err < 1e-5  # O of the flash path against float64, with the call's v
    assert d.census.fully_masked_rows == zero_rows


def test_float_mask_is_added_and_scale_is_used_as_given():
    q, k, v = tensors()
    mask = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -1e4)
    mask[:, 0] += 0.5
    report = diagnose_call(sdpa_info(scale=0.3), {"q": q, "k": k, "v": v, "attn_mask": mask}, OPTS)
    s = float64_scores(q, k, 0.3) + mask.double()
    assert report.diagnosis.census.max == float(s.max())
    assert report.diagnosis.attention.scale == 0.3


@pytest.mark.parametrize("tq,tk", [(4, 7), (7, 4)])
def test_is_causal_is_aligned_top_left_as_pytorch(tq, tk):
    q, k, v = tensors(tq=tq, tk=tk)
    report = diagnose_call(sdpa_info(is_causal=True), {"q": q, "k": k, "v": v}, OPTS)
    allowed = torch.ones(tq, tk, dtype=torch.bool).tril()  # PyTorch's is_causal (its documentation)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert torch.allclose(ref, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    d = report.diagnosis
    assert d.census.masked == int((~allowed).sum()) * 2 * 4
    s = float64_scores(q, k, 1 / math.sqrt(8)).masked_fill(~allowed, -math.inf)
    assert d.census.max == float(s.max())


def test_gqa_maps_each_query_head_to_its_kv_head():
    q, k, v = tensors(hq=4, hk=2)
    k[:, 1] *= 5  # kv head 1 serves query heads 2 and 3
    report = diagnose_call(sdpa_info(enable_gqa=True), {"q": q, "k": k, "v": v}, OPTS)
    s = float64_scores(q, k, 1 / math.sqrt(8), group=2)  # (B, 4, T, T)
    assert report.diagnosis.census.max == float(s.max())
    assert [h.max_logit for h in report.heads] == s.amax(dim=(0, 2, 3)).tolist()
    kmax = k.abs().amax(dim=(0, 2, 3)).double().tolist()
    assert [h.k_max_abs for h in report.heads] == [kmax[0], kmax[0], kmax[1], kmax[1]]
    assert [h.q_max_abs for h in report.heads] == q.abs().amax(dim=(0, 2, 3)).double().tolist()


def test_qk_overflow_in_fp16_breaks_an_eager_port_but_not_the_sdpa_kernel_the_model_runs():
    q, k, v = tensors(spread=1.0)
    q[:, 1] *= 150
    k[:, 1] *= 150
    h = q.half(), k.half()
    s16 = torch.matmul(h[0].float(), h[1].float().transpose(-1, -2)).half()  # hand-written fp16 attention's Q@K^T
    expected = torch.isinf(s16).sum(dim=(0, 2, 3)).tolist()
    assert expected[1] > 0 and sum(expected) == expected[1]
    report = diagnose_call(sdpa_info(), {"q": q.half(), "k": k.half(), "v": v.half()}, OPTS, what_if=("fp16",))
    # The fused kernel holds S in fp32: torch's own SDPA has no NaN, and neither has the model's cell,
    # nor any head of it (the heads count overflow as the model rounds S).
    assert not torch.isnan(F.scaled_dot_product_attention(q.half(), k.half(), v.half())).any()
    assert report.cell == ("flash", "fp16") and [c.name for c in report.diagnosis.cells] == ["flash/fp16"]
    assert report.diagnosis.cell("flash", "fp16").nan_rows == 0 and [x.qk_overflow for x in report.heads] == [0] * 4
    assert not [f for f in report.diagnosis.findings if f.severity != "info"]
    # The what-if: the same call as eager attention in fp16 overflows exactly where fp16's Q@K^T does.
    eager = report.what_if.cell("torch", "fp16", path="eager")
    assert eager.role == "what-if" and report.what_if.attention.dtypes["fp16"].qk_overflow_values == sum(expected)
    nan_rows = torch.isposinf(s16).any(dim=-1) | torch.isneginf(s16).all(dim=-1)  # softmax: inf - inf, or 0/0
    assert eager.nan_causes.get("qk_overflow") == int(nan_rows.sum()) > 0
    assert "qk_overflow" in [f.code for f in report.what_if.findings]


def test_a_mask_that_does_not_broadcast_names_the_call():
    q, k, v = tensors()
    with pytest.raises(AttncheckError) as e:
        diagnose_call(sdpa_info(), {"q": q, "k": k, "v": v, "attn_mask": torch.ones(3, 5, dtype=torch.bool)}, OPTS)
    assert e.value.message == (
        "cap/0003-m.safetensors (call 3, sdpa in model.layers.1.self_attn): mask of shape (3, 5) does not "
        "broadcast to the scores' shape (batch 2, heads 4, queries 6, keys 6)"
    )


def test_softmax_call_with_q_and_k_fits_the_scale_and_keeps_the_scores():
    q, k, _ = tensors()
    scores = (q @ k.transpose(-1, -2)) * 0.125
    info = CallInfo(index=0, name="c", kind="softmax", module="m", scale=0.125)
    report = diagnose_call(info, {"scores": scores, "q": q, "k": k}, OPTS)
    assert report.call.has_qk and report.diagnosis.census.max == float(scores.max())
    assert report.diagnosis.attention.fitted_scale == pytest.approx(0.125, rel=1e-6)
    assert [h.max_logit for h in report.heads] == scores.amax(dim=(0, 2, 3)).double().tolist()


@pytest.mark.parametrize(
    "kind,dtype,softmax_dtype,meta,cell,role",
    [
        ("softmax", "fp16", None, {}, (None, "torch", "fp16"), "model"),
        ("softmax", "fp16", "fp32", {}, (None, "torch", "fp32"), "model"),
        ("sdpa", "bf16", None, {}, ("flash", "flash", "bf16"), "model"),
        ("sdpa", "fp32", None, {"sdpa_backend": "math"}, ("sdpa-math", "sdpa-math", "fp32"), "model"),
        ("sdpa", "fp16", None, {"sdpa_backend": "efficient_attention"}, ("flash", "flash", "fp16"), "model"),
        ("qk", "fp32", None, {}, ("eager", "torch", "fp32"), "asked"),
        ("scores", "fp64", None, {}, None, None),
    ],
)
def test_the_cell_the_model_runs(kind, dtype, softmax_dtype, meta, cell, role):
    key = model_cell(CallInfo(0, "c", kind, dtype=dtype, softmax_dtype=softmax_dtype, meta=meta))
    assert (key and (key.path, key.method, key.dtype)) == cell and (key and key.role) == role


def test_a_captured_call_computes_its_models_cell_and_the_cells_asked_as_what_ifs():
    q, k, v = tensors()
    t = {"q": q.half(), "k": k.half(), "v": v.half()}
    alone = diagnose_call(sdpa_info(), t, Options())
    assert [(c.name, c.role) for c in alone.diagnosis.cells] == [("flash/fp16", "model")] and alone.what_if is None
    asked = diagnose_call(sdpa_info(), t, Options(), asked=Options(dtypes=("fp32",), methods=("naive",)))
    assert [c.name for c in asked.diagnosis.cells] == ["flash/fp16"]
    assert {(c.name, c.role) for c in asked.what_if.cells} == {
        (n, "what-if") for n in ("eager:naive/fp32", "sdpa-math/fp32", "flash/fp32")
    }
    fp16 = diagnose_call(sdpa_info(), t, Options(), what_if=("fp16", "bf16"))
    assert [c.name for c in fp16.what_if.cells] == [
        "eager:torch/fp16",
        "flash/bf16",
        "eager:torch/bf16",
    ]  # never the model's own cell
    every = diagnose_call(sdpa_info(), t, Options(), what_if=("all",))
    names = {c.name for c in every.what_if.cells}
    assert (
        "flash/fp16" not in names
        and {"eager:naive/fp16", "sdpa-math/bf16", "flash/fp32", "flash-fp8/e4m3", "sage/e4m3"} <= names
    )
