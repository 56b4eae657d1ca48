"""What-if cells: answers known from the dtypes' limits, checked against torch itself, and never
counted as the model's. Plus each model cell's headroom (its first failure) against numbers
computed here from torch.finfo and float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from attncheck.config.run import Options
from attncheck.findings import failed_conditions
from attncheck.judge import diagnose_call
from attncheck.model import model_report
from attncheck.numerics.precision import exp_overflow_threshold, exp_underflow_threshold, rounding_limit
from attncheck.results import CallInfo


def sdpa_call(index=0, **kw):
    return CallInfo(index=index, name=f"c{index}", kind="sdpa", module=f"layers.{index}.attn", **kw)


def big_logits(seed=0):
    """bf16 q, k whose largest |q.k| is about 1e5: beyond fp16's 65504, far inside bf16 (and fp32)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 16, 16, generator=g)
    k = torch.randn(1, 2, 16, 16, generator=g)
    q[0, 1] *= 90
    k[0, 1] *= 90
    v = torch.randn(1, 2, 16, 16, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def test_a_logit_that_fits_bf16_but_not_fp16_breaks_an_fp16_eager_port_only():
    q, k, v = big_logits()
    raw = q.double() @ k.double().transpose(-1, -2)
    assert 65504 < float(raw.abs().max()) < 1e7  # fp16's Q@K^T overflows; bf16's does not
    report = diagnose_call(sdpa_call(), {"q": q, "k": k, "v": v}, Options(), what_if=("fp16", "bf16"))
    # The model (SDPA in bf16, the flash kernel: S in fp32) is fine, and torch's own kernel agrees.
    assert not torch.isnan(F.scaled_dot_product_attention(q, k, v)).any()
    model = report.diagnosis.cell("flash", "bf16")
    assert (
        model.role == "model"
        and model.nan_rows == 0
        and not [f for f in report.diagnosis.findings if f.severity == "error"]
    )
    w = report.what_if
    assert {c.name for c in w.cells} == {"flash/fp16", "eager:torch/fp16", "eager:torch/bf16"}
    assert w.cell("flash", "fp16").nan_rows == 0 and w.cell("torch", "bf16", path="eager").nan_rows == 0
    # Hand-written fp16 attention, as torch computes it: Q@K^T in fp16, then the scale, then softmax.
    s16 = torch.matmul(q.half(), k.half().transpose(-1, -2)) * (1 / math.sqrt(16))
    nan16 = torch.isnan(torch.softmax(s16, dim=-1)).any(dim=-1)
    eager16 = w.cell("torch", "fp16", path="eager")
    assert eager16.nan_rows == int(nan16.sum()) > 0 and eager16.nan_causes == {"qk_overflow": eager16.nan_rows}
    assert eager16.nan_rows_per_head == nan16.sum(dim=(0, 2)).tolist()  # all in head 1
    assert "qk_overflow" in {f.code for f in w.findings} and "qk_overflow" not in {
        f.code for f in report.diagnosis.findings
    }
    # The model report: the model's verdict stays ok; the what-if names the call and head where fp16 eager breaks.
    rep = model_report([report])
    assert rep.first_bad is None
    (eager,) = [a for a in rep.what_if if a.cell == "eager:torch/fp16"]
    assert eager.bad_calls == 1 and eager.first.first_cause == "qk_overflow" and eager.first.heads == [1]
    assert (
        eager.limit.kind == "qk_overflow"
        and eager.limit.threshold == rounding_limit(torch.float16)
        and eager.headroom < 0
    )
    # --fail-on judges the model unless asked for the what-if
    assert failed_conditions([report.diagnosis], ["nan", "error"]) == []
    assert failed_conditions([report.what_if], ["nan"]) != []


def sink_call():
    """q . k = 13 on the last key and exactly 0 on the 1023 others, in every row: values FP8
    quantisation keeps exactly (zeros stay zero, and q.k is one product of two exact values).
    FlashAttention-3 visits key blocks last to first: the running max is 13 from the first block
    on, so every other key's P_j is exp(-13) * 256 before the cast."""
    d, t = 16, 1024
    scale = 1 / math.sqrt(d)
    q = torch.zeros(1, 1, t, d)
    k = torch.zeros(1, 1, t, d)
    q[..., 0] = 1.0
    k[0, 0, -1, 0] = 13.0 / scale
    k[0, 0, :-1, 1] = 1.0
    v = torch.randn(1, 1, t, d, generator=torch.Generator().manual_seed(0))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def test_an_fp8_what_if_flushes_the_keys_the_p_cast_threshold_says():
    q, k, v = sink_call()
    report = diagnose_call(sdpa_call(), {"q": q, "k": k, "v": v}, Options(), what_if=("fp8",))
    (cell,) = report.what_if.cells
    assert cell.name == "flash-fp8/e4m3" and cell.role == "what-if"
    # torch's own float8 cast of P = exp(s - m) * 256: every key but the sink flushes to 0
    s = torch.full((1024,), 0.0)
    s[0] = 13.0
    p8 = (torch.exp(s - s.max()) * 256).to(torch.float8_e4m3fn).float()
    assert (p8[1:] == 0).all() and p8[0] != 0
    threshold = math.log(256) - exp_underflow_threshold(torch.float8_e4m3fn)
    assert 12 < threshold < 13  # the keys 13 below the max are past it
    assert cell.limit.kind == "p_cast_flush" and cell.limit.threshold == pytest.approx(threshold)
    assert cell.limit.value == pytest.approx(13.0) and cell.limit.headroom < 0
    lost = 1023 * math.exp(-13) / (1 + 1023 * math.exp(-13))  # float64: the probability the 1023 keys carry
    assert lost > 1e-3 and cell.pcast_mass_rows == 1024 and cell.pcast_mass_max == pytest.approx(lost, rel=1e-3)
    assert cell.pcast_flushed_frac == pytest.approx(1023 / 1024)
    assert "p_cast_underflow" in {f.code for f in report.what_if.findings}
    # the model (bf16 SDPA) loses nothing to a P cast; its findings are about the input: a collapsed head, whose
    # last key is the sink every query parks on (info)
    assert [f.code for f in report.diagnosis.findings] == ["entropy_collapse", "attention_sink"]
    assert "head 0 key 1023 0.99" in report.diagnosis.findings[1].message


def test_headroom_is_the_model_cells_own_first_failure():
    q, k, v = big_logits()
    raw = float((q.double() @ k.double().transpose(-1, -2)).abs().max())
    sdpa = diagnose_call(sdpa_call(), {"q": q, "k": k, "v": v}, Options())
    lim = sdpa.diagnosis.cell("flash", "bf16").limit  # flash: S = Q@K^T in fp32, then the scale
    assert (lim.kind, lim.threshold, lim.value) == ("qk_overflow", rounding_limit(torch.float32), raw)
    # A softmax call of an fp16 model whose code scales after Q@K^T (traced): its S in fp16.
    g = torch.Generator().manual_seed(2)
    scores = (torch.randn(1, 2, 8, 8, generator=g) * 4).half()
    info = CallInfo(0, "c0", "softmax", module="m", scale=0.125, meta={"scale_source": "traced"})
    eager = diagnose_call(info, {"scores": scores}, Options())
    lim = eager.diagnosis.cell("torch", "fp16").limit
    top = float(scores.double().abs().max())
    assert (lim.kind, lim.threshold) == ("qk_overflow", 65520.0) and lim.value == pytest.approx(top / 0.125)
    assert lim.headroom == pytest.approx(65520 - top / 0.125)
    # Bare scores, naive in fp16: exp overflows above ln(65520) ~ 11.09.
    from attncheck.judge import diagnose

    d = diagnose("x", scores.float(), Options(dtypes=("fp16",), methods=("naive", "torch")))
    naive = d.cell("naive", "fp16").limit
    assert naive.kind == "exp_overflow" and naive.threshold == exp_overflow_threshold(torch.float16) == pytest.approx(
        math.log(65520)
    )
    assert naive.value == float(scores.float().max())
    cast = d.cell("torch", "fp16").limit  # fp32 scores cast to fp16: the cast is torch/fp16's first failure
    assert cast.kind == "cast_overflow" and cast.threshold == 65520.0
    assert (
        diagnose("x", scores.float(), Options(dtypes=("fp32",), methods=("torch",))).cell("torch", "fp32").limit is None
    )


def test_an_eager_port_of_a_boolean_mask_adds_finfo_min_as_transformers_does():
    """SDPA makes a boolean-masked key -inf (a fully masked row: zeros); ported to eager attention,
    transformers adds finfo(dtype).min instead: the row is finite there, as torch computes it here."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    keep = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    keep[..., 2, :] = False  # query 2 may attend to nothing
    report = diagnose_call(sdpa_call(), {"q": q, "k": k, "v": v, "attn_mask": keep}, Options(), what_if=("fp16",))
    assert report.diagnosis.cell("flash", "fp32").zero_causes == {"fully_masked": 2}  # SDPA's zeros, both heads
    low = torch.finfo(torch.float16).min
    s16 = torch.matmul(q.half(), k.half().transpose(-1, -2)) * (1 / math.sqrt(8)) + torch.zeros(
        6, 6, dtype=torch.float16
    ).masked_fill(~keep[0, 0], low)
    p16 = torch.softmax(s16, dim=-1)
    assert not torch.isnan(p16).any()
    eager = report.what_if.cell("torch", "fp16", path="eager")
    assert eager.nan_rows == 0 and eager.zero_rows == 0 and report.what_if.attention.dtypes["fp16"].mask_values == [low]
