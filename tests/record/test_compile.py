"""torch.compile'd models under capture: whatever the entry point (torch.compile(module),
module.compile(), a compiled function, fullgraph=True), in inference and in training, they run
unchanged (the same outputs and gradients as without capture) and every attention call is recorded;
with --compile eager (the default) the compiled code runs as its eager code, each call and the
report say so; with --compile keep it runs compiled, unrecorded, and the report says how often.

The default tests compile with dynamo and the aot_eager backend (dynamo traces the hooks and the
mode exactly as with inductor, without a C++ build); the slow ones with inductor itself."""

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.findings import failed_conditions

from .conftest import batch, llama_gqa

runner = CliRunner()


class Attention(torch.nn.Module):
    def __init__(self, eager: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.eager = eager

    def forward(self, x):
        q, k, v = (z.view(x.shape[0], 16, 4, 8).transpose(1, 2) for z in self.qkv(x).split(32, -1))
        if self.eager:  # the chain inductor's attention pattern matcher may rewrite to SDPA
            o = torch.softmax((q @ k.transpose(-1, -2)) * 8**-0.5, dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + o.transpose(1, 2).reshape(x.shape)


class Stack(torch.nn.Module):
    def __init__(self, eager: bool = False, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(eager) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make(eager=False, seed=0):
    torch.manual_seed(seed)
    return Stack(eager)


X = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))


def train_steps(model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(X).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


ENTRY_POINTS = {
    "torch.compile(module)": lambda m: torch.compile(m, backend="aot_eager"),
    "module.compile()": lambda m: (m.compile(backend="aot_eager"), m)[1],
    "fullgraph=True": lambda m: torch.compile(m, backend="aot_eager", fullgraph=True),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_compiled_module_is_captured_unchanged_with_every_call(entry):
    torch._dynamo.reset()
    alone = train_steps(ENTRY_POINTS[entry](make()))
    torch._dynamo.reset()
    with attncheck.capture() as cap:
        watched = train_steps(ENTRY_POINTS[entry](make()))
    torch.testing.assert_close(watched, alone, rtol=1e-6, atol=1e-7)  # the same program: the same losses
    assert [c.module for c in cap.calls] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ] * 2  # the wrapper left out of the paths
    assert all(c.meta["compiled"] == "eager" for c in cap.calls)
    assert cap.compiled_runs >= 2


def test_a_compiled_function_is_captured_and_marked():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 2, 8, 4)
    with attncheck.capture() as cap:
        fn = torch.compile(attend, backend="aot_eager")
        out = fn(q, q, q)
        F.scaled_dot_product_attention(q, q, q)  # outside compiled code: not marked
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))
    assert [c.meta.get("compiled") for c in cap.calls] == ["eager", None]
    with attncheck.capture() as cap:

        @torch.compile(backend="aot_eager", fullgraph=True)  # the decorator with arguments
        def decorated(q):
            return F.scaled_dot_product_attention(q, q, q)

        decorated(q)
    assert [c.meta.get("compiled") for c in cap.calls] == ["eager"]


def test_keep_runs_compiled_code_unrecorded_and_says_so():
    torch._dynamo.reset()
    model = torch.compile(make(), backend="aot_eager", fullgraph=True)
    alone = model(X)
    with attncheck.capture(compile="keep") as cap:
        out = model(X)
        F.scaled_dot_product_attention(X.view(2, 16, 4, 8), X.view(2, 16, 4, 8), X.view(2, 16, 4, 8))  # eager: recorded
    torch.testing.assert_close(out, alone)
    assert len(cap.calls) == 1 and cap.compiled_runs == 1


def test_the_report_and_the_manifest_say_what_was_judged(tmp_path):
    script = tmp_path / "comp.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "class A(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.qkv = torch.nn.Linear(32, 96)\n"
        "    def forward(self, x):\n"
        "        q, k, v = (z.view(1, 16, 4, 8).transpose(1, 2) for z in self.qkv(x).split(32, -1))\n"
        "        return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "torch.manual_seed(0)\n"
        "m = torch.compile(torch.nn.Sequential(A(), torch.nn.Identity()), backend='aot_eager')\n"
        "m(torch.randn(1, 16, 32)); m(torch.randn(1, 16, 32))\n"
    )
    out = tmp_path / "cap"
    r = runner.invoke(
        app,
        [
            "capture",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "r.json"),
            "--fail-on",
            "error,warning,nan",
            str(script),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "UserWarning" not in r.output  # torch's warning about global hooks and compiled modules is ours to handle
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compile"] == {"mode": "eager", "compiled_runs": 2, "compiled_calls": 2}
    assert [c["module"] for c in manifest["calls"]] == ["0", "0"]
    note = "2 call(s) ran inside torch.compile'd code, captured as its eager code"
    assert note in " ".join(r.output.split())
    report = json.loads((tmp_path / "r.json").read_text())
    assert note in report["model"]["capture"]["note"] and report["model"]["capture"]["compile"]["mode"] == "eager"
    r = runner.invoke(app, ["run", str(out)])  # the capture read back says it too
    assert r.exit_code == 0 and note in " ".join(r.output.split())
    r = runner.invoke(app, ["capture", "--compile", "keep", "--out", str(tmp_path / "cap2"), str(script)])
    assert r.exit_code == 2 and "ran 2 time(s) compiled and unrecorded (--compile keep)" in " ".join(r.stderr.split())
    r = runner.invoke(app, ["capture", "--compile", "fast", str(script)])
    assert r.exit_code == 2 and "--compile" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("training", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["inference", "training"])
def test_a_compiled_transformers_llama_is_captured_whole_and_healthy(training):
    torch._dynamo.reset()
    inputs = batch(left_pad=3)
    model = llama_gqa("sdpa")
    alone_model = llama_gqa("sdpa")

    def go(m):
        m = torch.compile(m, backend="aot_eager")
        if not training:
            with torch.no_grad():
                return m(**inputs).logits
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(2):
            loss = m(**inputs, labels=inputs["input_ids"]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.detach()

    alone = go(alone_model)
    torch._dynamo.reset()
    with attncheck.capture(diagnose=True) as cap:
        out = go(model)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)
    steps = 2 if training else 1
    assert [r.call.module for r in cap.calls] == ["model.layers.0.self_attn", "model.layers.1.self_attn"] * steps
    assert all(r.call.meta.get("compiled") == "eager" for r in cap.calls)
    loud = [(r.call.module, f.code) for r in cap.calls for f in r.diagnosis.findings if f.severity != "info"]
    assert loud == [] and failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []
    assert "captured as its eager code" in cap.result.model.capture["note"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own use of torch.jit on this torch
@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager-attention"])
def test_inductor_compiled_models_run_unchanged_under_capture(eager):
    """With inductor itself: the losses of two training steps under capture (the eager code run) and
    without it (inductor's kernels; an eager softmax chain it may rewrite to SDPA) agree to fp32
    rounding, and the report says the eager code was judged."""
    torch._dynamo.reset()
    alone = train_steps(torch.compile(make(eager)))
    with attncheck.capture(diagnose=True) as cap:
        watched = train_steps(torch.compile(make(eager)))
    torch.testing.assert_close(watched, alone, rtol=1e-5, atol=1e-6)
    assert len(cap.calls) == 6 and all(r.call.meta.get("compiled") == "eager" for r in cap.calls)
    assert "judged as the eager code computes" in cap.result.model.capture["note"]
    torch._dynamo.reset()
    with attncheck.capture(compile="keep") as cap:
        kept = train_steps(torch.compile(make(eager)))
    torch.testing.assert_close(kept, alone, rtol=1e-6, atol=1e-7)
    assert cap.calls == [] and cap.compiled_runs == 2
