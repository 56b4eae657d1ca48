"""Healthy models report clean: the cells a model runs decide, so a healthy transformers model
(GPT-2, Llama with GQA and left padding, BERT, Qwen2, T5, ViT; eager and SDPA; fp32, fp16, bf16),
nn.TransformerEncoderLayer and nn.MultiheadAttention give 0 errors and 0 warnings, and
--fail-on error,warning,nan holds nothing. Findings that are true but harmless in the model's cell
(left padding's fully masked rows, T5's scale of 1) are info."""

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.findings import failed_conditions

from .conftest import batch, bert, gemma2, gpt2, llama_gqa, qwen2, t5, vit

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def run_model(arch: str, impl: str, dtype: torch.dtype):
    if arch == "gpt2":
        return gpt2(impl, dtype), batch(left_pad=3)
    if arch == "llama":
        return llama_gqa(impl, dtype), batch(left_pad=3)
    if arch == "qwen2":
        return qwen2(impl, dtype), batch(left_pad=3)
    if arch == "bert":
        return bert(impl, dtype), batch(right_pad=4)
    if arch == "t5":
        inputs = batch(right_pad=2)
        return t5(impl, dtype), {**inputs, "decoder_input_ids": inputs["input_ids"][:, :6]}
    g = torch.Generator().manual_seed(1)
    return vit(impl, dtype), {"pixel_values": torch.randn(2, 3, 16, 16, generator=g).to(dtype)}


def capture_diagnosed(model, inputs):
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        model(**inputs)
    return cap


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "bert", "t5", "vit"])
def test_healthy_transformers_model_reports_no_error_and_no_warning(arch, impl, dtype):
    model, inputs = run_model(arch, impl, DTYPES[dtype])
    cap = capture_diagnosed(model, inputs)
    assert cap.calls and all(r.diagnosis is not None for r in cap.calls)
    loud = [
        (r.call.module, f.code, f.severity) for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"
    ]
    assert loud == []
    report = cap.result.model
    assert report.first_bad is None and report.known
    assert failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []
    # each call computed the one cell its model ran: torch.softmax in its dtype= (Llama, Qwen2 and ViT
    # ask for fp32) or the scores' dtype, or the path of the SDPA backend PyTorch chose, in the call's dtype
    for r in cap.calls:
        expected = ("torch", r.call.softmax_dtype or dtype) if impl == "eager" else ("flash", dtype)
        assert [(c.method, c.dtype, c.role) for c in r.diagnosis.cells] == [(*expected, "model")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module", ["encoder_layer", "mha"])
def test_healthy_torch_attention_modules_report_clean(module, dtype):
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    x = torch.randn(2, 12, 32).to(dt)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 9:] = True
    if module == "mha":
        m = torch.nn.MultiheadAttention(32, 4, batch_first=True).to(dt).eval()
        run = lambda: m(x, x, x, key_padding_mask=pad)  # noqa: E731  need_weights: the eager softmax path
    else:
        m = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).to(dt).eval()
        run = lambda: m(x, src_key_padding_mask=pad)  # noqa: E731
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        run()
    assert cap.calls and cap.result.model.first_bad is None
    assert [f.code for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"] == []


def test_left_padding_is_info_and_t5s_scale_is_info():
    cap = capture_diagnosed(*run_model("llama", "sdpa", torch.float32))
    masked = [f for r in cap.calls for f in r.diagnosis.findings if f.code == "fully_masked_rows"]
    assert masked and {f.severity for f in masked} == {"info"}  # the SDPA kernel gives those rows zeros
    cap = capture_diagnosed(*run_model("t5", "sdpa", torch.float32))
    codes = {f.code for r in cap.calls for f in r.diagnosis.findings}
    assert "missing_scale" not in codes  # T5 folds 1/sqrt(d_k) into its init: the scale is the model's, not missing
    scale = [f for r in cap.calls for f in r.diagnosis.findings if f.code == "model_scale"]
    assert scale and {f.severity for f in scale} == {"info"} and all("scale= argument" in f.message for f in scale)
    # the advice fits a model trained with its scale: nothing to divide (sqrt(8) would change T5's logits)
    assert all(f.fix.startswith("nothing to change") and "divide by" not in f.fix for f in scale)
    assert all(r.call.meta["scale_source"] == "argument" and r.call.scale == 1.0 for r in cap.calls)


@pytest.mark.parametrize("dtype", DTYPES)
def test_healthy_gemma2_soft_capped_eager_reports_its_own_scale_as_a_fact(dtype):
    """Gemma-2 scales by 1/sqrt(query_pre_attn_scalar) = 1/16 with head_dim 32 (0.354 x 1/sqrt(32)) and soft-caps
    its logits: the capture traces the scale through the cap, and the model's own scale is never a warning."""
    model = gemma2(DTYPES[dtype])
    cap = capture_diagnosed(model, batch(left_pad=0))
    assert len(cap.calls) == 2
    loud = [(r.call.module, f.code) for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"]
    assert loud == []
    assert failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []
    attn = model.model.layers[0].self_attn
    for r in cap.calls:
        assert r.call.meta["scale_source"] == "traced" and r.call.scale == attn.scaling == 256**-0.5
        assert float(r.call.meta["softcap"]) == model.config.attn_logit_softcapping
        assert {f.code for f in r.diagnosis.findings} == {"model_scale"}
        assert r.diagnosis.findings[0].fix.startswith("nothing to change")
    # the headroom is S's before the cap: float64 max |q.k| of the model's own q and k (recorded again, without
    # the diagnosis) against the scores' dtype's limit, fp16's 65504 + half an ulp
    with torch.no_grad(), attncheck.capture() as raw:
        model(**batch(left_pad=0))
    top = torch.tensor(torch.finfo(DTYPES[dtype]).max, dtype=DTYPES[dtype])
    limit = top.item() + (top - torch.nextafter(top, torch.zeros_like(top))).item() / 2  # max + half an ulp: fp16 65520
    assert dtype != "fp16" or limit == 65520.0
    for line, r in zip(cap.result.model.lines, raw.calls):
        qk = torch.matmul(r.tensors["q"].double(), r.tensors["k"].double().transpose(-1, -2)).abs().max().item()
        assert line.limit.kind == "qk_overflow" and line.limit.value == pytest.approx(qk, rel=1e-12)
        assert line.limit.threshold == pytest.approx(limit, rel=1e-6)
        assert line.headroom == pytest.approx(line.limit.threshold - qk)


def test_a_healthy_model_captured_from_the_command_line_exits_0_under_fail_on(tmp_path):
    script = tmp_path / "healthy.py"
    script.write_text(
        "import torch, transformers as T\n"
        "torch.manual_seed(0)\n"
        "m = T.GPT2LMHeadModel._from_config(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, "
        "n_positions=64), attn_implementation='sdpa').eval()\n"
        "ids = torch.randint(0, 64, (2, 12)); am = torch.ones(2, 12, dtype=torch.long); am[1, :5] = 0\n"
        "with torch.no_grad():\n"
        "    m(input_ids=ids, attention_mask=am)\n"
    )
    r = CliRunner().invoke(
        app,
        ["capture", "--out", str(tmp_path / "cap"), "--quiet", "--fail-on", "error,warning,nan", "--", str(script)],
        env={"COLUMNS": "100"},
    )
    assert r.exit_code == 0, r.output
    assert "0 error(s), 0 warning(s); no call goes wrong in the cells the model runs" in " ".join(r.stdout.split())


def test_a_bert_with_large_logits_what_if_fp16_only_naive_breaks():
    """As a pretrained BERT encoder whose layer-0 logits reach ~45: healthy in fp32 SDPA; in fp16,
    SDPA (S in fp32) and an eager port (torch.softmax subtracts the max; 45 is far below 65504) are
    safe, and only a naive softmax (exp(45) > 65504) breaks, asked with --what-if all."""
    model = bert("sdpa", torch.float32)
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(30)
            layer.attention.self.key.weight.mul_(30)
    inputs = batch(right_pad=4)
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if=("fp16",)) as cap:
        model(**inputs)
    top = max(line.max_logit for line in cap.result.model.lines)
    assert 11.09 < top < 65504  # past naive fp16's exp overflow, far inside fp16's range
    assert cap.result.model.first_bad is None and not [
        f for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"
    ]
    answers = {a.cell: a for a in cap.result.model.what_if}
    assert set(answers) == {"flash/fp16", "eager:torch/fp16"} and all(a.bad_calls == 0 for a in answers.values())
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if="all") as cap:
        model(**inputs)
    answers = {a.cell: a for a in cap.result.model.what_if}
    broken = {name for name, a in answers.items() if a.bad_calls and name.endswith("/fp16")}
    assert broken == {"eager:naive/fp16"} and answers["eager:naive/fp16"].first.first_cause == "exp_overflow"
    assert answers["eager:stable/fp16"].bad_calls == answers["flash/fp16"].bad_calls == 0


class _OwnScaling(torch.nn.Module):
    """Hand-written attention whose scale the trace cannot follow (a tensor factor), named by its module's
    ``scaling`` attribute as transformers' attention modules name theirs."""

    scaling = 0.01

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-1, -2)) * torch.tensor([self.scaling])  # (1,): not a number the trace reads
        return torch.matmul(torch.softmax(s, dim=-1), v)


def test_a_scale_the_module_names_is_the_models_own():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 64, generator=g) for _ in range(3))
    with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
        _OwnScaling()(q, k, v)
    (r,) = cap.calls
    assert r.call.meta["scale_source"] == "module" and r.call.scale == 0.01
    # 0.01 x sqrt(64) = 0.08 < 64^(-1/4): double_scale's band, but the model's own choice
    assert [(f.code, f.severity) for f in r.diagnosis.findings] == [("model_scale", "info")]
    assert "the scaling attribute of the model's attention module" in r.diagnosis.findings[0].message


@pytest.mark.slow  # ~8 s (the script's import of transformers); the library test above is the default run's
def test_a_healthy_gemma2_captured_from_the_command_line_passes_fail_on(tmp_path):
    """As a user runs it: Gemma-2 from its config, fp16, eager, soft-capped, under attncheck capture."""
    script = tmp_path / "gemma.py"
    script.write_text(
        "import torch, transformers as T\n"
        "torch.manual_seed(0)\n"
        "cfg = T.Gemma2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,\n"
        "                     head_dim=32, intermediate_size=128, vocab_size=64, query_pre_attn_scalar=256,\n"
        "                     attn_logit_softcapping=50.0)\n"
        "m = T.Gemma2ForCausalLM._from_config(cfg, attn_implementation='eager', dtype=torch.float16)\n"
        "m.eval()\n"
        "with torch.no_grad():\n"
        "    m(input_ids=torch.randint(2, 64, (2, 12)))\n"
    )
    args = ["capture", "--out", str(tmp_path / "cap"), "--fail-on", "error,warning,nan", "--", str(script)]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "info[model_scale]" in text and "double_scale" not in text
    assert "S = Q@K^T before the soft cap in fp16 rounds to inf at |S| >= 65520" in text
    assert "2 call(s) on cpu: 0 error(s), 0 warning(s); no call goes wrong in the cells the model runs" in text


def test_a_healthy_bf16_model_asked_in_fp8_has_no_accumulator_finding():
    """FP8 cells are what-ifs of a bf16 capture; at a healthy model's key lengths the FP8 tensor cores' 13-bit
    accumulator stays within twice fp32 accumulation's error: no fp8_accumulator finding, and none that counts."""
    model, inputs = run_model("llama", "sdpa", torch.bfloat16)
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if=("e4m3",)) as cap:
        model(**inputs)
    fp8 = [c for r in cap.calls for c in r.what_if.cells if c.fp8_accum is not None]
    assert fp8 and all(c.fp8_accum == "13 bits" and c.fp8_accum_rmse["fp32"] is not None for c in fp8)
    found = [f for r in cap.calls for d in (r.diagnosis, r.what_if) for f in d.findings]
    assert not [f for f in found if f.code == "fp8_accumulator"]
    assert cap.result.model.first_bad is None
