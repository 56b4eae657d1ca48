"""A capture made on a GPU is judged by the path of the CUDA kernel that ran each call (fa2, mem-efficient,
cudnn), on a CPU; ``--what-if kernels`` replays each call under every kernel that could have run it and names
the ones that break it. CI has no GPU: the capture directories are written here as a GPU writes them
(``mark_cuda``)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app

from .conftest import batch, llama_gqa, mark_cuda

runner = CliRunner()


def capture_sdpa(path, q, k, v, **kw):
    with torch.no_grad(), attncheck.capture(path):
        F.scaled_dot_product_attention(q, k, v, **kw)


def run_json(path, *args):
    r = runner.invoke(app, ["run", str(path), "--json", "-", *args])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)["model"]


@pytest.mark.parametrize(
    "backend, path",
    [
        ("flash_attention", "fa2"),
        ("efficient_attention", "mem-efficient"),
        ("cudnn_attention", "cudnn"),
        ("math", "sdpa-math"),
    ],
)
def test_a_gpu_capture_is_judged_by_the_kernel_that_ran_each_call(tmp_path, backend, path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    capture_sdpa(tmp_path / "cap", q, k, v, is_causal=True)
    _, cpu = run_json(tmp_path / "cap")
    assert cpu["calls"][0]["cell"] == "flash/bf16"  # recorded on a CPU: PyTorch's CPU flash kernel
    mark_cuda(tmp_path / "cap", backend)
    code, model = run_json(tmp_path / "cap", "--fail-on", "error,warning,nan")
    assert code == 0 and model["calls"][0]["cell"] == f"{path}/bf16"


def test_a_gpu_capture_with_dropout_and_no_backend_is_judged_by_the_math_path(tmp_path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with attncheck.capture(tmp_path / "cap"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    _, model = run_json(tmp_path / "cap")
    assert model["calls"][0]["cell"] == "sdpa-math/fp32"  # PyTorch's CPU flash kernel takes no dropout


def test_pytorch_121558_is_nan_under_the_fused_kernel_alone(tmp_path):
    """bf16 Q, K, V every element 133120: NaN from the fused exponent (fa2-fma, fa3, fa4), finite
    from PyTorch's flash build (fa2, UNFUSE_FMA), the efficient and math backends (PyTorch issue 121558)."""
    q = torch.full((1, 1, 4, 64), 133120.0, dtype=torch.bfloat16)
    capture_sdpa(tmp_path / "cap", q, q, q)
    mark_cuda(tmp_path / "cap", "flash_attention")
    code, model = run_json(tmp_path / "cap", "--what-if", "kernels", "--fail-on", "nan")
    assert code == 0 and model["calls"][0]["cell"] == "fa2/bf16" and model["calls"][0]["verdict"] == "ok"
    assert model["recorded_on"] == "cuda:0, NVIDIA H100 80GB HBM3, sm 9.0" and model["calls"][0]["capability"] == "9.0"
    (call,) = model["kernels"]
    got = {k["path"]: (k["verdict"], k["cause"], k["ran"]) for k in call["kernels"] if k["refused"] is None}
    assert got.pop("fa2-fma") == ("nan", "fused_max", False)
    assert got.pop("fa3") == ("nan", "fused_max", False)  # FlashAttention-3's exponent is fused too
    assert got.pop("fa4") == ("nan", "fused_max", False)  # and FlashAttention-4's, with its max offset in the fma
    assert got == {p: ("ok", None, p == "fa2") for p in ("fa2", "sdpa-math", "flash", "mem-efficient", "cudnn")}
    assert call["summary"].startswith(
        "fa2-fma NaN (fused_max, 4 row(s)); fa3 NaN (fused_max, 4 row(s)); fa4 NaN (fused_max, 4 row(s)); "
        "finite under fa2 (ran), sdpa-math, flash"
    )
    r = runner.invoke(app, ["run", str(tmp_path / "cap"), "--what-if", "kernels", "--fail-on", "what-if:nan"])
    assert r.exit_code == 1, r.output
    assert "fa2-fma NaN (fused_max" in r.output and "Which kernel breaks each call" in r.output
    assert "1 call(s) recorded on cuda:0, NVIDIA H100 80GB HBM3, sm 9.0, judged on cpu" in " ".join(r.output.split())


def test_cudnn_padded_tile_is_predicted_for_the_cudnn_kernel_alone(tmp_path):
    """PyTorch issue 196678's construction (an explicit mask, 192 keys: 192 % 128 == 64, every logit near
    -120): cuDNN's backward NaN is predicted on every row under cudnn, and under no other kernel."""
    L, D = 192, 64
    torch.manual_seed(0)
    q = torch.randn(1, 1, L, D, dtype=torch.bfloat16) * 0.1
    k = torch.randn(1, 1, L, D, dtype=torch.bfloat16) * 0.1
    v = torch.randn(1, 1, L, D, dtype=torch.bfloat16)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    capture_sdpa(tmp_path / "cap", q, k, v, attn_mask=keep)
    mark_cuda(tmp_path / "cap", "cudnn_attention")
    _, model = run_json(tmp_path / "cap", "--what-if", "kernels")
    (call,) = model["kernels"]
    by = {k["path"]: k for k in call["kernels"]}
    assert by["cudnn"]["ran"] and by["cudnn"]["backward_rows"] == L and by["cudnn"]["backward_cause"] == "padded_tile"
    assert -121 < by["cudnn"]["lse"] < -119  # the first row: one key, logit about -120
    assert [p for p, k in by.items() if k["backward_rows"]] == ["cudnn"]
    assert by["fa2"]["refused"].startswith("an explicit mask")  # PyTorch's flash backend takes is_causal only
    assert all(k["verdict"] == "ok" for k in call["kernels"] if k["refused"] is None)
    is_causal = tmp_path / "causal"  # is_causal alone: the padded keys are masked by the kernel itself
    capture_sdpa(is_causal, q, k, v, is_causal=True)
    mark_cuda(is_causal, "cudnn_attention")
    _, model = run_json(is_causal, "--what-if", "kernels")
    assert not any(k["backward_rows"] for c in model["kernels"] for k in c["kernels"])


def test_what_if_kernels_refuses_where_it_cannot_replay():
    r = runner.invoke(app, ["watch", "missing.jsonl", "--what-if", "kernels"])
    assert r.exit_code == 2 and "kernels: the watch judges logged statistics" in r.stderr


@pytest.mark.parametrize("backend", ["flash_attention", "efficient_attention", "cudnn_attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_a_healthy_model_captured_on_a_gpu_is_clean_under_every_kernel(tmp_path, backend, dtype):
    """Llama with GQA and left padding, SDPA, marked as run by each CUDA backend: 0 errors, 0 warnings,
    under the kernel that ran and every kernel replayed."""
    model, inputs = llama_gqa("sdpa", dtype), batch(left_pad=3)
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        model(**inputs)
    mark_cuda(tmp_path / "cap", backend)
    r = runner.invoke(
        app,
        [
            "run",
            str(tmp_path / "cap"),
            "--what-if",
            "kernels",
            "--json",
            "-",
            "--fail-on",
            "error,warning,nan,what-if:error,what-if:warning,what-if:nan",
        ],
    )
    assert r.exit_code == 0, r.output
    model = json.loads(r.stdout)["model"]
    assert model["kernels"] and all(not k["breaks"] for c in model["kernels"] for k in c["kernels"])


def test_a_healthy_model_run_by_flash_attention_3_is_clean_under_fa3(tmp_path):
    """Llama with GQA, no padding (is_causal alone), bf16, SDPA with PyTorch's flash implementation set to FA3:
    every call judged by fa3, 0 errors, 0 warnings, and no kernel of the replay breaks a call."""
    from attncheck.testing import as_gpu_capture

    model, inputs = llama_gqa("sdpa", torch.bfloat16), batch()
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        model(**inputs)
    as_gpu_capture(tmp_path / "cap", "flash_attention", flash_impl="fa3")
    fail_on = "error,warning,nan,what-if:error,what-if:warning,what-if:nan"
    r = runner.invoke(app, ["run", str(tmp_path / "cap"), "--what-if", "kernels", "--json", "-", "--fail-on", fail_on])
    assert r.exit_code == 0, r.output
    model = json.loads(r.stdout)["model"]
    assert model["calls"] and all(c["cell"] == "fa3/bf16" for c in model["calls"])
    assert all(not k["breaks"] for c in model["kernels"] for k in c["kernels"])


BACKENDS = ("flash_attention", "efficient_attention", "cudnn_attention")
HEALTHY = [
    (arch, impl, dtype, BACKENDS[i % 3])
    for i, (arch, impl, dtype) in enumerate(
        (a, m, ("bf16", "fp16", "fp32")[(j + k) % 3])
        for j, a in enumerate(("gpt2", "llama", "qwen2", "bert", "t5", "vit"))
        for k, m in enumerate(("eager", "sdpa"))
    )
]


@pytest.mark.parametrize("arch, impl, dtype, backend", HEALTHY)
def test_healthy_models_captured_on_a_gpu_stay_clean_under_every_kernel(tmp_path, arch, impl, dtype, backend):
    """The healthy models (GPT-2, Llama with GQA and left padding, Qwen2, BERT, T5, ViT; eager and SDPA; fp32,
    fp16, bf16), their capture marked as made on an H100 whose SDPA calls ran each CUDA backend in turn: 0 errors,
    0 warnings in the kernel that ran and in every kernel replayed (--what-if kernels)."""
    from .test_healthy import DTYPES, run_model

    model, inputs = run_model(arch, impl, DTYPES[dtype])
    with torch.no_grad(), attncheck.capture(tmp_path / "cap"):
        model(**inputs)
    mark_cuda(tmp_path / "cap", backend)
    r = runner.invoke(
        app,
        [
            "run",
            str(tmp_path / "cap"),
            "--what-if",
            "kernels",
            "--json",
            "-",
            "--fail-on",
            "error,warning,nan,what-if:error,what-if:warning,what-if:nan",
        ],
    )
    assert r.exit_code == 0, r.output[-3000:]
    report = json.loads(r.stdout)["model"]
    assert report["kernels"], "no call was replayed"
    assert not [(c["name"], k["path"], k["outcome"]) for c in report["kernels"] for k in c["kernels"] if k["breaks"]]
