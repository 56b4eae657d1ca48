"""The backward under capture: dO and the kernels' own gradients recorded through read-only hooks,
training runs bit for bit as without capture, every call's backward judged by the path the model
ran, and the recorded gradients agreeing with it. torch's autograd is the judge throughout."""

import json

import pytest
import torch
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

from .conftest import VOCAB, llama_gqa


def mha_step(need_weights: bool):
    """PyTorch issue 41508: nn.MultiheadAttention with a key padding mask and a band attn_mask that
    leave one query row with no key; the NaN output row is left out of the loss."""
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    band = torch.zeros(6, 6, dtype=torch.bool)
    band[2, :4] = True
    out, _ = m(x, x, x, key_padding_mask=pad, attn_mask=band, need_weights=need_weights)
    out.nan_to_num().pow(2).mean().backward()
    return m, x


def test_mha_fully_masked_row_nan_gradients_are_found_with_module_row_cause_and_fix():
    m, x = mha_step(True)
    assert m.in_proj_weight.grad.isnan().any()  # torch: the whole batch's weights are poisoned
    with attncheck.capture(diagnose=True) as cap:
        m2, x2 = mha_step(True)
    assert torch.equal(m2.in_proj_weight.grad.nan_to_num(), m.in_proj_weight.grad.nan_to_num())
    (report,) = cap.calls
    cell = report.diagnosis.cells[0]
    b = cell.backward
    assert b is not None and b.real_compared and all(g.real_agrees for _, g in b.grads())
    assert (b.dq.nan_rows, b.dq.first_cause, b.dq.examples[0]) == (
        2,
        "fully_masked",
        (1, 0, 2),
    )  # batch 1, head 0, query 2
    assert b.dk.nan_rows == 12 and b.dv.nan_rows == 12
    found = [f for f in report.diagnosis.findings if f.code == "grad_nan_masked_row"]
    assert len(found) == 1 and found[0].severity == "error" and "_safe_softmax" in found[0].fix
    line = cap.result.model.lines[0]
    assert line.module == "MultiheadAttention" and line.grad_verdict == "nan" and line.grad_which == ["dq", "dk", "dv"]
    assert cap.result.model.first_grad_bad == 0


def test_the_same_step_through_sdpa_has_finite_gradients():
    m, _ = mha_step(False)
    assert not m.in_proj_weight.grad.isnan().any()
    with attncheck.capture(diagnose=True) as cap:
        mha_step(False)
    (report,) = cap.calls
    b = report.diagnosis.cells[0].backward
    assert report.call.kind == "sdpa" and b is not None and b.nan_rows == 0
    assert all(g.real_agrees for _, g in b.grads())
    assert not [f for f in report.diagnosis.findings if f.severity != "info"]
    assert cap.result.model.first_grad_bad is None


def train(model, steps: int, autocast: bool, ids, mask):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_training_a_transformers_model_two_steps_under_capture(impl, autocast):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    alone = train(llama_gqa(impl).train(), 2, autocast, ids, mask)
    with attncheck.capture(diagnose=True) as cap:
        captured = train(llama_gqa(impl).train(), 2, autocast, ids, mask)
    assert alone[0] == captured[0] and all(torch.equal(a, b) for a, b in zip(alone[1], captured[1]))  # bit for bit
    assert len(cap.calls) == 4  # 2 layers x 2 steps
    for r in cap.calls:
        b = r.diagnosis.cells[0].backward
        assert b is not None and b.nan_rows == 0 and b.real_compared
        assert all(g.real_agrees for _, g in b.grads()), (
            r.call.module,
            [(n, g.real_bound_ratio) for n, g in b.grads()],
        )
        if impl == "eager":  # op for op as the model runs it: its own bits
            assert all(g.real_max_diff == 0.0 for _, g in b.grads())
    assert [f.code for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"] == []
    assert cap.result.model.first_bad is None and cap.result.model.first_grad_bad is None


def test_grads_false_records_the_forward_only_and_max_bytes_counts_gradients():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    with attncheck.capture(grads=False) as cap:
        train(llama_gqa("sdpa").train(), 1, False, ids, mask)
    assert cap.calls and all("grad_out" not in c.tensors and "out" not in c.tensors for c in cap.calls)
    with attncheck.capture() as cap:
        train(llama_gqa("sdpa").train(), 1, False, ids, mask)
    assert all({"grad_out", "grad_q", "grad_k", "grad_v", "out"} <= set(c.tensors) for c in cap.calls)
    forward_bytes = sum(
        t.numel() * t.element_size() for c in cap.calls for r, t in c.tensors.items() if not r.startswith("grad_")
    )
    with attncheck.capture(max_bytes=forward_bytes) as cap:  # room for the forward, not for the gradients
        train(llama_gqa("sdpa").train(), 1, False, ids, mask)
    assert cap.stopped and "gradients" in cap.stopped
    with pytest.raises(attncheck.AttncheckError, match="grads"):
        attncheck.capture(grads="yes")


def test_a_training_script_captured_to_a_directory_and_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.MultiheadAttention(16, 2, batch_first=True)\n"
        "x = torch.randn(2, 6, 16)\n"
        "pad = torch.zeros(2, 6, dtype=torch.bool); pad[1, 4:] = True\n"
        "band = torch.zeros(6, 6, dtype=torch.bool); band[2, :4] = True\n"
        "out, _ = m(x, x, x, key_padding_mask=pad, attn_mask=band)\n"
        "out.nan_to_num().pow(2).mean().backward()\n"
    )
    cap = tmp_path / "cap"
    runner = CliRunner()
    r = runner.invoke(
        app, ["capture", "--out", str(cap), "--quiet", "--json", str(tmp_path / "a.json"), "--", str(script)]
    )
    assert r.exit_code == 0, r.output
    manifest = json.loads((cap / "manifest.json").read_text())
    (entry,) = manifest["calls"]
    assert (
        entry["grads"]["file"] == "0000-MultiheadAttention.grads.safetensors"
        and (cap / entry["grads"]["file"]).is_file()
    )
    assert set(entry["grads"]["tensors"]) == {"grad_out", "grad_q", "grad_k", "grad_v"} and manifest["grad_calls"] == 1
    r = runner.invoke(app, ["run", str(cap), "--fail-on", "nan", "--json", "-"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    backward = doc["tensors"][0]["cells"][0]["backward"]
    assert backward["dq"]["nan_rows"] == 2 and backward["dq"]["first_cause"] == "fully_masked"
    assert {"max_abs_err", "rel_err", "flushed_frac", "first_cause", "nan_rows"} <= set(backward["dv"])
    assert doc["model"]["calls"][0]["backward"]["verdict"] == "nan" and doc["model"]["first_grad_bad"]["index"] == 0
    assert "torch/fp32 backward" in " ".join(doc["failed"])
    r = runner.invoke(
        app, ["run", str(cap), "--fail-on", "nan", "--ignore", "grad_nan_masked_row,fully_masked_rows", "--quiet"]
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["capture", "--out", str(tmp_path / "cap2"), "--no-grads", "--quiet", "--", str(script)])
    assert r.exit_code == 0 and "grads" not in json.loads((tmp_path / "cap2" / "manifest.json").read_text())["calls"][0]
    (cap / entry["grads"]["file"]).unlink()  # a listed gradients file that is gone: one line, exit 2
    r = runner.invoke(app, ["run", str(cap)])
    assert r.exit_code == 2 and "gradients file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_dropout_calls_are_judged_without_their_mask_and_not_compared(impl):
    """GPT-2 trains with attention dropout 0.1: its random mask is not recorded, so the backward is
    judged without it and the real gradients (with it) are not compared: no false mismatch."""
    from .conftest import gpt2

    model = gpt2(impl).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    with attncheck.capture(diagnose=True) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
    assert cap.calls and all(r.call.dropout_p == 0.1 for r in cap.calls)
    for r in cap.calls:
        b = r.diagnosis.cells[0].backward
        assert b is not None and not b.real_compared and "dropout (p=0.1)" in b.how
        assert all(g.real_agrees is None for _, g in b.grads())
    assert [f.code for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"] == []


def test_a_damaged_gradients_file_is_one_line_naming_the_call(tmp_path):
    from safetensors.torch import load_file, save_file

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nimport torch.nn.functional as F\ntorch.manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))\n"
        "F.scaled_dot_product_attention(q, k, v).sum().backward()\n"
    )
    cap = tmp_path / "cap"
    runner = CliRunner()
    assert runner.invoke(app, ["capture", "--out", str(cap), "--quiet", "--", str(script)]).exit_code == 0
    grads = next(cap.glob("*.grads.safetensors"))
    tensors = load_file(str(grads))
    from safetensors import safe_open

    with safe_open(str(grads), "pt") as fh:
        meta = fh.metadata()
    for role, bad in (("grad_out", torch.zeros(1, 2, 7, 4)), ("grad_k", torch.zeros(1, 2, 8, 4, dtype=torch.int32))):
        save_file({**tensors, role: bad}, str(grads), metadata=meta)
        r = runner.invoke(app, ["run", str(cap)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert len(r.stderr.strip().splitlines()) == 1 and role in r.stderr and "call 0" in r.stderr


def test_fp16_autocast_gradients_flush_without_a_loss_scale_and_not_with_one():
    """fp16 training without a loss scale: the attention gradients are so small that many flush to 0 in
    fp16 (a warning); with a loss scale of 2^16, none do and the recorded gradients agree (subnormal
    steps are within the bound)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    for scale, expected in ((1.0, {"grad_underflow"}), (2.0**16, set())):
        model = llama_gqa("sdpa").train()
        with attncheck.capture(diagnose=True) as cap:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(input_ids=ids).logits
            (logits.float().pow(2).mean() * scale).backward()
        assert {f.code for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"} == expected
        assert all(g.real_agrees for r in cap.calls for _, g in r.diagnosis.cells[0].backward.grads())
    assert all(r.diagnosis.cells[0].backward.scale_headroom > 100 for r in cap.calls)  # room for the scaler to grow


class CausalLM(torch.nn.Module):
    """A small 2-layer causal transformer written outside transformers, as a user writes one: pre-norm
    blocks, attention through SDPA (is_causal) or by hand (scores / sqrt(d), masked_fill, softmax)."""

    def __init__(self, impl: str, width: int = 64, heads: int = 4, layers: int = 2, tokens: int = 16):
        super().__init__()
        self.impl, self.heads = impl, heads
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, ids):
        b, t = ids.shape
        x = self.embed(ids) + self.pos[:t]
        for qkv, proj, norm, mlp in zip(self.qkv, self.proj, self.norm, self.mlp):
            q, k, v = qkv(norm(x)).reshape(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            if self.impl == "sdpa":
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
                s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
                a = torch.softmax(s, dim=-1) @ v
            x = x + proj(a.transpose(1, 2).reshape(b, t, -1))
            x = x + mlp(x)
        return self.head(x)


def train_causal_lm(impl: str, precision: str, seed: int, steps: int = 3) -> list[float]:
    """AdamW steps in fp32, under bf16 autocast, or under fp16 autocast with a loss scale of 2^12 (the
    gradients unscaled before the step, as GradScaler does)."""
    torch.manual_seed(seed)
    model = CausalLM(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 17))
    scale = 2.0**12 if precision == "fp16" else 1.0
    losses = []
    for _ in range(steps):
        with torch.autocast(
            "cpu", dtype=torch.float16 if precision == "fp16" else torch.bfloat16, enabled=precision != "fp32"
        ):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        (loss * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_healthy_training_capture(tmp_path, impl: str, precision: str, seed: int) -> None:
    cap = tmp_path / f"{impl}-{precision}-{seed}"
    with attncheck.capture(cap):
        losses = train_causal_lm(impl, precision, seed)
    assert losses[-1] < losses[0]  # it trains
    r = CliRunner().invoke(app, ["run", str(cap), "--fail-on", "error,warning,nan", "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert len(doc["tensors"]) == 6  # 2 layers x 3 steps
    assert not [f for t in doc["tensors"] for f in t["findings"] if f["severity"] != "info"]
    for t in doc["tensors"]:
        b = t["cells"][0]["backward"]
        assert b["real_compared"] and all(b[g]["real_bound_ratio"] <= 1.0 for g in ("dq", "dk", "dv"))


def test_healthy_fp32_sdpa_training_steps_raise_no_error_or_warning(tmp_path):
    """Issue 32's false alarm: three AdamW steps of a small causal transformer in fp32 through SDPA
    (torch's CPU flash kernel) gave grad_emulation_mismatch errors (this seed: dQ 3.3x the former bound);
    under the derived bound the capture passes --fail-on error,warning,nan."""
    assert_healthy_training_capture(tmp_path, "sdpa", "fp32", 1)


@pytest.mark.slow  # 18 captured trainings, ~40 s
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_healthy_training_steps_of_every_precision_and_path_raise_no_error_or_warning(tmp_path, impl, precision):
    for seed in range(3):
        assert_healthy_training_capture(tmp_path, impl, precision, seed)


def test_the_sdpa_backend_recorded_under_autocast_is_the_one_torch_runs():
    """As in Llama under bf16 autocast: q and k leave the rotary embedding in fp32 (bf16 times fp32 cos),
    v is bf16, the mask fp32. Autocast casts them all to bf16 and torch's CPU flash kernel runs (its
    gradients are flash's bits, not math's); asked with the inputs as given, torch would answer math.
    The capture records flash, so the model's cell is flash/bf16 and is judged against that kernel."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(4))
    v, do = v.bfloat16(), do.bfloat16()
    mask = torch.zeros(2, 1, 12, 12).masked_fill(
        torch.ones(12, 12, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min
    )

    def grads(backend=None):
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if backend is None:
                out = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask)
            else:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask)
        return torch.autograd.grad(out, (ql, kl, vl), do)

    ran = grads()
    assert all(torch.equal(a, b) for a, b in zip(ran, grads(SDPBackend.FLASH_ATTENTION)))
    assert not all(torch.equal(a, b) for a, b in zip(ran, grads(SDPBackend.MATH)))
    with attncheck.capture(diagnose=True) as cap:
        grads()
    (report,) = cap.calls
    assert report.call.meta["sdpa_backend"] == "flash_attention" and report.diagnosis.cells[0].name == "flash/bf16"
    assert all(g.real_agrees for _, g in report.diagnosis.cells[0].backward.grads())
