"""--what-if fa4 and --what-if kernels on a healthy model: a bf16 Llama (GQA, SDPA, head dim 16) built from a
config with random init reports no FlashAttention-3/-4 finding, its kernel replay includes them, and the command
exits 0 under --fail-on error,warning,nan."""

import pytest
import torch

import attncheck
from attncheck.codes import SEVERITY
from attncheck.findings import failed_conditions
from attncheck.registry import PATHS

from .conftest import VOCAB, batch

FRONTIER = ("fa3", "fa4")


def llama_d16(seed: int = 0):
    """conftest's Llama with GQA at head dim 16 (64 wide, 4 heads): FlashAttention-4's FP8 mode takes head dims
    that are multiples of 16 (its support refuses conftest's 8 in e4m3)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def healthy():
    model = llama_d16()
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if="fa4,kernels") as cap:
        model(**batch())
    return cap


def test_a_healthy_bf16_model_has_no_frontier_kernel_finding_and_passes_fail_on(healthy):
    cap = healthy
    assert cap.calls and all(r.diagnosis is not None and r.what_if is not None for r in cap.calls)
    assert failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []
    loud = [
        (r.call.module, f.code, f.cells)
        for r in cap.calls
        for f in r.what_if.findings
        if f.severity != "info" and any(c.split("(")[0].split("/")[0] in FRONTIER for c in f.cells)
    ]
    assert loud == []
    assert not any(f.code == "p_saturation" for r in cap.calls for f in r.what_if.findings)
    assert not any(c.events.get("p_saturation") for r in cap.calls for c in r.what_if.cells)


def test_the_kernel_replay_includes_fa3_and_fa4(healthy):
    report = healthy.result.model
    assert set(FRONTIER) <= set(PATHS.names())
    for call in report.kernels:
        by = {k.path: k for k in call.kernels}
        assert set(FRONTIER) <= set(by), call.kernels
        assert all(not by[p].breaks for p in FRONTIER if by[p].refused is None)


def test_the_fa4_replay_and_settings_grid_on_a_healthy_model(healthy):
    report = healthy.result.model
    assert report.kernels and all(
        any(k.path == "fa4" and k.refused is None and not k.breaks for k in call.kernels) for call in report.kernels
    )
    grids = {(s.path, s.dtype): s for s in report.settings}
    assert set(grids) == {("fa4", "bf16"), ("fa4", "e4m3")}  # the call's dtype and FA4's FP8 mode
    for s in grids.values():
        assert s.calls == len(healthy.calls) and s.best is not None
        assert all(p.calls_bad == 0 and p.findings == [] for p in s.points if p.refused is None)
    assert grids[("fa4", "bf16")].default == "t8" and grids[("fa4", "e4m3")].default == "t0,o8"


class Std2Attention(torch.nn.Module):
    """One SDPA call whose logits have a standard deviation of 2 (flash-attention PR 2694's setup: one head of 64
    queries over 2048 keys, d = 64, values e4m3 holds exactly), in bf16."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        e4m3 = torch.float8_e4m3fn
        self.q = (torch.randn(1, 1, 64, 64, generator=g) * 2.0).to(e4m3).to(torch.bfloat16)
        self.k = torch.randn(1, 1, 2048, 64, generator=g).to(e4m3).to(torch.bfloat16)
        self.v = torch.randn(1, 1, 2048, 64, generator=g).to(e4m3).to(torch.bfloat16)

    def forward(self):
        return torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v)


def test_a_model_with_logit_std_2_saturates_p_under_fa4_fp8_with_offset_8_and_not_4():
    with torch.no_grad(), attncheck.capture(diagnose=True, what_if="fa4") as cap:
        Std2Attention()()
    grids = {(s.path, s.dtype): s for s in cap.result.model.settings}
    fp8 = grids[("fa4", "e4m3")]
    assert fp8.point("t4,o8").events.get("p_saturation", 0) > 0
    assert fp8.point("t4,o4").events.get("p_saturation", 0) == 0
    if "p_saturation" in SEVERITY:  # the finding, where registered
        assert "p_saturation" in fp8.point("t4,o8").findings and "p_saturation" not in fp8.point("t4,o4").findings
    assert fp8.best not in (None, "t4,o8") and fp8.point(fp8.best).err < fp8.point("t4,o8").err
    # the model's own cell (the CPU flash kernel in bf16) is untouched: the what-ifs are never its verdict
    assert failed_conditions(cap.result.tensors, ["error", "warning", "nan"]) == []


def test_an_fp32_model_is_swept_in_bf16_and_e4m3():
    """FlashAttention-4 takes no fp32: an fp32 call's grid runs in bf16 (and in e4m3), each named."""
    from .conftest import gpt2

    with torch.no_grad(), attncheck.capture(diagnose=True, what_if="fa4") as cap:
        gpt2("sdpa", torch.float32, width=64)(**batch())
    grids = {s.dtype: s for s in cap.result.model.settings}
    assert set(grids) == {"bf16", "e4m3"} and cap.result.model.settings_refused == []
    assert all(s.best is not None for s in grids.values())


@pytest.mark.slow
def test_asked_kernel_paths_on_a_capture_run_where_the_kernel_would(tmp_path):
    """--path fa4,fa3 on a capture: no fp32 cell (neither kernel takes fp32); with --what-if e4m3, fa4's FP8 mode is
    computed beside flash-fp8; a what-if cell with a warning is named on the closing line, beside 'would break'."""
    import json

    from typer.testing import CliRunner

    from attncheck.cli import app

    torch.manual_seed(0)
    q = torch.randn(1, 2, 512, 16, dtype=torch.bfloat16) * 1.5  # logits of std ~2.2 after the 1/4 scale, 4 key tiles
    k = torch.randn(1, 2, 512, 16, dtype=torch.bfloat16) * 1.5
    v = torch.randn(1, 2, 512, 16, dtype=torch.bfloat16)
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    r = CliRunner().invoke(app, ["run", str(tmp_path / "cap"), "--path", "fa4,fa3", "--json", "-"])
    assert r.exit_code == 0, r.output
    cells = {c["name"] for c in json.loads(r.stdout)["model"]["calls"][0]["what_if"]["cells"]}
    assert {"fa4/bf16", "fa3/fp16"} <= cells and not {"fa4/fp32", "fa3/fp32"} & cells
    args = ["run", str(tmp_path / "cap"), "--what-if", "e4m3", "--path", "fa4", "--rescale-threshold", "4"]
    r = CliRunner().invoke(app, [*args, "--max-offset", "8"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "fa4/e4m3" in r.output and "p_saturation" in r.output
    assert "what-if: no cell asked would break (warnings in fa4/e4m3)" in " ".join(r.output.split())
