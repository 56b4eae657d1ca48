"""Faults injected into real (tiny, randomly initialised) models: what attncheck says about the
captured calls is checked against what the model itself computed."""

import math

import pytest
import torch
import torch.nn.functional as F

import attncheck
from attncheck.config.run import Options

from .conftest import batch, bert, gemma2, gpt2, llama_gqa

FP16_TORCH = Options(dtypes=("fp16",), methods=("torch", "tiled"))


def nan_rows_per_head(probs: torch.Tensor) -> list[int]:
    """(B, H, Tq, Tk) probabilities -> rows holding NaN, per head over the batch."""
    return torch.isnan(probs).any(dim=-1).sum(dim=(0, 2)).tolist()


def test_scaled_qk_head_in_fp16_eager_is_named_and_matches_the_models_nans():
    model = gpt2("eager", torch.float16)
    layer, head, d, width = 1, 2, 8, 32
    with torch.no_grad():  # c_attn's columns are q | k | v, each head_dim wide per head
        w = model.transformer.h[layer].attn.c_attn.weight
        w[:, head * d : (head + 1) * d] *= 3000
        w[:, width + head * d : width + (head + 1) * d] *= 3000
    inputs = batch()
    with torch.no_grad():
        probs = model(**inputs, output_attentions=True).attentions  # the model's own softmax outputs
    assert torch.isnan(probs[layer]).any() and not torch.isnan(probs[0]).any()

    with torch.no_grad(), attncheck.capture(diagnose=True, options=FP16_TORCH) as cap:
        model(**inputs)
    report = cap.result.model
    first = report.lines[report.first_bad]
    assert first.module == f"transformer.h.{layer}.attn" and first.kind == "softmax" and first.cell == "torch/fp16"
    assert first.first_cause == "qk_overflow" and first.heads == [head]
    for call, p in zip(cap.calls, probs):
        assert [h.nan_rows for h in call.heads] == nan_rows_per_head(p)  # per layer and head, as the model
        assert call.diagnosis.cell("torch", "fp16").nan_rows == int(torch.isnan(p).any(dim=-1).sum())
    bad = cap.calls[layer]
    assert "qk_overflow" in [f.code for f in bad.diagnosis.findings]
    assert [h.head for h in bad.heads if h.qk_overflow] == [head]
    outliers = {(o.module, o.head, o.tensor) for o in report.outliers}
    assert outliers == {(f"transformer.h.{layer}.attn", head, "q"), (f"transformer.h.{layer}.attn", head, "k")}
    # the root cause leads the findings: the overflow of Q@K^T before the +inf it put in the scores
    from attncheck.model import findings_in_order

    codes = [code for code, *_ in findings_in_order(cap.calls, report.first_bad)]
    assert codes[0] == "qk_overflow" and codes.index("qk_overflow") < codes.index("inf_input")


def test_qk_overflow_count_per_head_matches_the_fp16_matmul(tmp_path):
    model = gpt2("eager", torch.float16)
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight
        w[:, 8:16] *= 2000
        w[:, 40:48] *= 2000
    with torch.no_grad(), attncheck.capture(tmp_path / "cap") as cap:
        model(**batch())
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "cap" / cap.calls[0]["file"]))
    q, k, scores = t["q"], t["k"], t["scores"]
    s = torch.matmul(q, k.transpose(-1, -2))  # what the model's fp16 matmul gives
    expected = torch.isinf(s).sum(dim=(0, 2, 3)).tolist()
    assert expected[1] > 0 and sum(expected) == expected[1]
    assert torch.isinf(scores)[torch.isinf(s)].all()  # the recorded scores carry those infs
    from attncheck.config.run import RunRequest
    from attncheck.pipelines.run import run

    result = run(RunRequest((str(tmp_path / "cap"),), options=FP16_TORCH))
    assert [h.qk_overflow for h in result.calls[0].heads] == expected


def test_left_padding_with_fp16_min_masks_gives_finite_uniform_rows_as_the_model_does():
    model = gpt2("eager", torch.float16)
    pad, heads = 3, 4
    inputs = batch(left_pad=pad)
    with torch.no_grad():
        probs = model(**inputs, output_attentions=True).attentions
    with torch.no_grad(), attncheck.capture(diagnose=True, options=FP16_TORCH) as cap:
        model(**inputs)
    keep = inputs["attention_mask"].bool()[:, None, :] & torch.ones(12, 12, dtype=torch.bool).tril()  # (B, Tq, Tk)
    masked_rows = int((~keep.any(-1)).sum()) * heads  # every key masked: the first `pad` queries of row 0
    assert masked_rows == pad * heads
    for call, p in zip(cap.calls, probs):
        d = call.diagnosis
        assert d.census.fully_masked_rows == masked_rows and d.census.sentinels[0][0] == torch.finfo(torch.float16).min
        assert d.cell("torch", "fp16").nan_rows == 0 and not torch.isnan(p).any()  # finite, as the model's rows
        uniform = p[0, :, :pad]  # the model gives those rows 1/T everywhere
        assert (uniform == torch.tensor(1 / 12, dtype=torch.float16)).all()
        finding = next(f for f in d.findings if f.code == "fully_masked_rows")
        assert (
            "finite uniform row" in finding.message and finding.severity == "info"
        )  # harmless in the cell the model runs
    assert cap.result.model.first_bad is None


def test_left_padding_in_sdpa_gives_zero_rows_as_the_kernel_does():
    model = gpt2("sdpa", torch.float16)
    pad, heads = 3, 4
    inputs = batch(left_pad=pad)
    with torch.no_grad(), attncheck.capture() as cap:  # in memory: the real SDPA is run on what was recorded
        model(**inputs)
    call = cap.calls[0]
    t = call.tensors
    out = F.scaled_dot_product_attention(
        t["q"], t["k"], t["v"], attn_mask=t["attn_mask"], scale=float(call.meta["scale"])
    )
    zero_rows = int((out == 0).all(dim=-1).sum())
    assert zero_rows == pad * heads
    result = diagnose_recorded(cap)
    cell = result.calls[0].diagnosis.cell("flash", "fp16")  # the model's cell for an SDPA call
    assert cell.nan_rows == 0 and cell.zero_causes == {"fully_masked": zero_rows}


def diagnose_recorded(cap):
    """The in-memory calls of a capture, diagnosed as run diagnoses files."""
    from attncheck.judge import diagnose_call
    from attncheck.loaders.calls import info_from_meta
    from attncheck.model import model_report
    from attncheck.results import RunResult

    reports = [
        diagnose_call(info_from_meta(c.meta, index=c.index, name=c.module, file=None), c.tensors, FP16_TORCH)
        for c in cap.calls
    ]
    return RunResult([r.diagnosis for r in reports], "cpu", reports, model_report(reports))


class SummedMaskAttention(torch.nn.Module):
    """Causal, key-padding and query-padding planes of finfo.min, added together (the bug)."""

    def __init__(self, width=16, heads=2, eager=False):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.heads, self.eager = heads, eager

    def forward(self, x, pad):  # x (B, T, E), pad (B, T) True = padding
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.heads, e // self.heads).transpose(1, 2) for z in self.qkv(x).split(e, dim=-1))
        low = torch.finfo(x.dtype).min
        causal = torch.zeros(t, t, dtype=x.dtype).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), low)
        keys = torch.zeros(b, 1, 1, t, dtype=x.dtype).masked_fill(pad[:, None, None, :], low)
        queries = torch.zeros(b, 1, t, 1, dtype=x.dtype).masked_fill(pad[:, None, :, None], low)
        self.mask = causal + keys + queries  # (B, 1, T, T): -inf where two planes meet
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.mask, dim=-1)
        return p @ v


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_summed_causal_and_padding_masks_give_neginf_as_in_the_model(eager):
    torch.manual_seed(0)
    model = SummedMaskAttention(eager=eager).half().eval()
    pad_len, heads = 3, 2
    x = torch.randn(2, 8, 16, dtype=torch.float16)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[0, :pad_len] = True
    with torch.no_grad():
        out = model(x, pad)
    with torch.no_grad(), attncheck.capture(diagnose=True, options=FP16_TORCH) as cap:
        model(x, pad)
    d = cap.calls[0].diagnosis
    rows_all_neginf = pad_len * heads  # padded queries: every key masked by two planes
    if eager:  # the model's softmax gives NaN there; attncheck's torch/fp16 cell the same rows, as fully masked
        model_nan = int(torch.isnan(out).any(dim=-1).sum())
        assert model_nan == rows_all_neginf
        cell = d.cell("torch", "fp16")
        assert cell.nan_rows == model_nan and cell.nan_causes == {"fully_masked": model_nan}
        assert d.census.neginf_rows == model_nan
    else:  # SDPA returns zeros there; so does the flash cell (the model's), and the mask's -inf are counted and named
        zero = int((out == 0).all(dim=-1).sum())
        assert zero == rows_all_neginf
        assert d.cell("flash", "fp16").zero_causes == {"fully_masked": zero}
        finding = next(f for f in d.findings if f.code == "summed_mask_planes")
        assert str(int(torch.isneginf(model.mask).sum())) in finding.message and "-65504" in finding.message


MODELS = {
    "gpt2-eager": lambda: (gpt2("eager"), batch()),
    "gpt2-sdpa": lambda: (gpt2("sdpa"), batch()),
    "llama-gqa-sdpa": lambda: (llama_gqa("sdpa"), batch()),
    "bert-eager-padding": lambda: (bert("eager"), batch(right_pad=4)),
    "bert-sdpa-padding": lambda: (bert("sdpa"), batch(right_pad=4)),
}


@pytest.mark.parametrize("name", MODELS)
def test_healthy_fp32_model_is_bit_identical_under_capture_and_gives_no_error(name, tmp_path):
    model, inputs = MODELS[name]()
    with torch.no_grad():
        expected = model(**inputs)[0]
    with torch.no_grad(), attncheck.capture(tmp_path / "cap") as cap:
        written = model(**inputs)[0]
    with torch.no_grad(), attncheck.capture(diagnose=True) as diag:
        diagnosed = model(**inputs)[0]
    assert torch.equal(written, expected) and torch.equal(diagnosed, expected)
    kinds = {c["kind"] for c in cap.calls}
    assert kinds == ({"softmax"} if "eager" in name else {"sdpa"}) and len(cap.calls) == 2
    assert all(c["module"].endswith(("attn", "self_attn", "attention.self")) for c in cap.calls)
    errors = [(r.call.module, f.code) for r in diag.calls for f in r.diagnosis.findings if f.severity == "error"]
    assert errors == [] and diag.result.model.first_bad is None
    if name.startswith("llama"):  # GQA: k and v keep their 2 heads, q has 4
        assert [c["tensors"]["k"]["shape"][1] for c in cap.calls] == [2, 2] and diag.calls[0].call.enable_gqa


def _scaled_gemma2(factor: float, head: int = 0):
    """A fp16 Gemma-2 whose query head ``head`` and the kv head it reads have q_proj / k_proj rows scaled."""
    model = gemma2(torch.float16)
    attn = model.model.layers[0].self_attn
    d, group = attn.head_dim, attn.num_key_value_groups
    with torch.no_grad():
        attn.q_proj.weight[head * d : (head + 1) * d] *= factor
        attn.k_proj.weight[(head // group) * d : (head // group + 1) * d] *= factor
    return model


def test_gemma2_overflow_before_the_soft_cap_is_measured_before_the_cap_and_said_harmless():
    """fp16 Q@K^T of a scaled head passes 65504 and rounds to inf before the tanh cap; the logits stay finite
    (cap x tanh(inf) = the cap). The headroom is S's (negative), the overflow is a finding, and its severity is
    what torch does with it: the same logit as the largest finite S, and a 0 gradient through the cap."""
    model = _scaled_gemma2(500.0)
    inputs = batch(left_pad=0)
    with torch.no_grad(), attncheck.capture() as raw:  # the model's own q, k and capped scores
        model(**inputs)
    q, k, scores = (raw.calls[0].tensors[n] for n in ("q", "k", "scores"))
    s16 = torch.matmul(q, k.transpose(-1, -2))  # (B, H, T, T) fp16, as the model computes S
    overflowed = int(torch.isinf(s16).sum())
    qk = torch.matmul(q.double(), k.double().transpose(-1, -2)).abs().max().item()
    # the cap hid it: no +inf or NaN in the scores the softmax saw (-inf: the causal mask, -65504 added to -50)
    assert overflowed > 0 and qk > 65520 and not (torch.isposinf(scores) | torch.isnan(scores)).any()

    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(**inputs)
    line, call = cap.result.model.lines[0], cap.calls[0]
    assert line.verdict == "ok" and line.nan_rows == 0
    assert line.limit.value == pytest.approx(qk, rel=1e-12)
    assert line.headroom == pytest.approx(65520 - qk) and line.headroom < 0
    found = {f.code: f for f in call.diagnosis.findings}
    # head 0's q and k, 500x the other heads', are massive activations of the call's q and k, and the head parks its
    # attention on one key (info); all its channels are scaled alike: no outlier channel within the head
    assert set(found) == {"model_scale", "softcap_overflow", "massive_activation", "attention_sink"}
    assert found["massive_activation"].severity == found["attention_sink"].severity == "info"
    f = found["softcap_overflow"]
    assert f.severity == "info" and f"at {overflowed} score(s)" in f.message and "harmless in the forward" in f.message
    assert "backward is harmless too" in f.message
    assert [h.qk_overflow for h in call.heads] == torch.isinf(s16).sum(dim=(0, 2, 3)).tolist()
    assert cap.result.model.first_bad is None
    # eager Gemma-2 repeats k over each kv group before Q@K^T: the scaled kv head 0 is named once, with its query heads
    found = [(o.tensor, o.head, o.kv_head, o.query_heads) for o in cap.result.model.outliers]
    assert found == [("q", 0, None, []), ("k", 0, 0, [0, 1])]
    # what the message says of the backward, asked of torch's autograd through the model's own chain: a 0 gradient at
    # the overflowed scores and finite gradients everywhere (loss through the whole model)
    s = s16.clone().requires_grad_(True)
    capped = torch.tanh(s * model.model.layers[0].self_attn.scaling / 50.0) * 50.0
    assert torch.autograd.grad(capped.float().sum(), s)[0][torch.isinf(s16)].eq(0).all()
    model.zero_grad()
    model(**inputs).logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


class _LooseCap(torch.nn.Module):
    """A soft cap that does not saturate at fp16's largest S: 1000 x tanh(S x 1e-4 / 1000) is 6.55 at S = 65504."""

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-1, -2)) * 1e-4
        s = torch.tanh(s / 1000.0) * 1000.0
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def test_an_overflow_a_soft_cap_does_not_hide_is_a_warning():
    q = torch.full((1, 1, 4, 32), 60.0, dtype=torch.float16)  # q.k = 115200 > 65504: inf, capped to 1000
    k, v = q.clone(), torch.ones(1, 1, 4, 32, dtype=torch.float16)
    q[0, 0, 0] = 1.0  # one query row stays in range
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        _LooseCap()(q, k, v)
    assert cap.calls[0].call.meta["softcap"] == "1000.0" and cap.calls[0].call.scale == pytest.approx(1e-4)
    finding = next(f for f in cap.calls[0].diagnosis.findings if f.code == "softcap_overflow")
    # torch: the finite S = 65504 gives 6.55, the inf gives 1000 exactly: the overflow changed the logits
    top = torch.tensor([65504.0, float("inf")], dtype=torch.float16)
    assert torch.tanh(top * 1e-4 / 1000.0).mul(1000.0).tolist() == [pytest.approx(6.55, abs=0.01), 1000.0]
    assert finding.severity == "warning" and "those logits are wrong" in finding.message
    assert f"at {3 * 4} score(s)" in finding.message


def test_a_soft_capped_training_step_is_not_judged_by_a_backward_without_the_cap():
    """The backward paths have no soft cap: near the cap its tanh Jacobian (1 - tanh^2) moves dQ and dK far from an
    uncapped backward, which would be reported as the emulation being wrong. A soft-capped call is not judged there."""
    model = _scaled_gemma2(30.0).float().train()  # logits near the cap (max ~15 of 50)
    with attncheck.capture(diagnose=True) as cap:
        model(**batch()).logits.float().sum().backward()
    assert max(line.max_logit for line in cap.result.model.lines) > 10
    assert [f.code for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"] == []
    assert all(c.backward is None for r in cap.calls for c in r.diagnosis.cells)
    # ... and the report says so (never a silent "-" in the gradients' column)
    note = cap.result.model.capture["note"]
    assert note.endswith(
        f"{len(cap.calls)} soft-capped call(s): gradients not computed (no backward or what-if path has the cap's tanh)"
    )


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_scaled_kv_head_under_gqa_is_named_as_the_kv_head_its_query_heads_share(impl):
    """Llama with 4 query heads over 2 kv heads, kv head 1's k projection x1000: the k side's median is over kv heads
    (over the 4 query heads it was the mean of the bad and the good kv head, and no k outlier was named). SDPA gets k
    with 2 heads (enable_gqa); eager attention repeats k over each group first (repeat_kv)."""
    model = llama_gqa(impl, torch.float32)
    attn = model.model.layers[1].self_attn
    d = attn.head_dim
    with torch.no_grad():
        attn.k_proj.weight[d : 2 * d] *= 1000
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(**batch())
    found = [(o.module, o.tensor, o.kv_head, o.query_heads) for o in cap.result.model.outliers]
    assert found == [("model.layers.1.self_attn", "k", 1, [2, 3])]
    heads = cap.calls[1].heads
    assert [h.kv_head for h in heads] == [0, 0, 1, 1]
    o = cap.result.model.outliers[0]
    assert o.value == heads[2].k_max_abs and o.median == heads[0].k_max_abs and o.ratio > 100
    assert o.message.startswith("model.layers.1.self_attn kv head 1 (query heads 2, 3): max|k| ")


class _TwoEagerLayers(torch.nn.Module):
    """Two hand-written attention layers; the first masks every key of query 2 in batch 1 with -inf."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(2))

    def forward(self, x, mask):  # x (B, T, E), mask (B, 1, T, T) additive
        for i, proj in enumerate(self.layers):
            b, t, e = x.shape
            q, k, v = proj(x).view(b, t, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
            s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(e // self.heads)
            s = s + mask if i == 0 else s
            x = x + torch.matmul(torch.softmax(s, dim=-1), v).transpose(1, 2).reshape(b, t, e)
        return x


def test_the_root_cause_is_listed_before_the_nan_a_later_layer_inherits():
    """Layer 0's fully masked row (a warning: the cause) makes NaN that layer 1 reads (error input_nan: its
    consequence): the findings list the cause first, the consequence after it, naming the call it follows."""
    torch.manual_seed(0)
    model = _TwoEagerLayers()
    mask = torch.zeros(2, 1, 6, 6)
    mask[1, :, 2] = float("-inf")
    with torch.no_grad():
        out = model(torch.randn(2, 6, 16), mask)
    assert torch.isnan(out).any()  # the model itself propagates the NaN
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(torch.randn(2, 6, 16), mask)
    report = cap.result.model
    assert report.first_bad == 0 and report.lines[0].first_cause == "fully_masked"
    from attncheck.model import findings_in_order

    order = [(code, severity, cause) for code, severity, _, _, cause in findings_in_order(cap.calls, report.first_bad)]
    codes = [code for code, _, _ in order]
    assert codes.index("fully_masked_rows") < codes.index("input_nan")
    assert dict((c, (s, cause)) for c, s, cause in order)["input_nan"] == ("error", "#0 _TwoEagerLayers")
    assert dict((c, (s, cause)) for c, s, cause in order)["fully_masked_rows"] == ("warning", None)


def test_the_detail_of_a_traced_scale_call_whose_qk_overflowed_gives_its_max_qk():
    """GPT-2 eager traces its scale; such a call's --detail panel said max|q.k| 0 (its Q/K pipeline never ran):
    it is float64's max |q.k| of the model's own q and k, and the fp16 pipeline counts the Q@K^T overflow torch gets."""
    import io

    from rich.console import Console

    from attncheck.report.run import attention_table

    model = gpt2("eager", torch.float16)
    head, d = 2, 8
    with torch.no_grad():
        w = model.transformer.h[1].attn.c_attn.weight
        w[:, head * d : (head + 1) * d] *= 3000
        w[:, 32 + head * d : 32 + (head + 1) * d] *= 3000
    inputs = batch()
    with torch.no_grad(), attncheck.capture() as raw:
        model(**inputs)
    q, k = raw.calls[1].tensors["q"], raw.calls[1].tensors["k"]
    qk = torch.matmul(q.double(), k.double().transpose(-1, -2)).abs().max().item()
    overflowed = int(torch.isinf(torch.matmul(q, k.transpose(-1, -2))).sum())
    with torch.no_grad(), attncheck.capture(diagnose=True, options=FP16_TORCH) as cap:
        model(**inputs)
    diag = cap.calls[1].diagnosis
    assert cap.calls[1].call.meta["scale_source"] == "traced" and diag.attention.fitted_scale is None
    assert diag.attention.raw_max_abs == pytest.approx(qk, rel=1e-12) and qk > 65520
    assert diag.attention.dtypes["fp16"].qk_overflow_values == overflowed > 0
    buf = io.StringIO()
    Console(width=200, file=buf, color_system=None).print(attention_table(diag))
    assert f"max|q.k| {qk:.4g}" in buf.getvalue()
    # a healthy layer's call (far from any overflow: the Q/K pipeline is not run) still gives its max|q.k|
    q0, k0 = raw.calls[0].tensors["q"], raw.calls[0].tensors["k"]
    qk0 = torch.matmul(q0.double(), k0.double().transpose(-1, -2)).abs().max().item()
    assert cap.calls[0].diagnosis.attention.raw_max_abs == pytest.approx(qk0, rel=1e-12) and 0 < qk0 < 65520 / 4
