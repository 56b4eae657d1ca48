"""Softmax budgets as a pytest assertion, for tests over your own modules.

    from attncheck.testing import assert_softmax_ok

    def test_attention_logits_fit_bf16():
        scores = my_block.attention_scores(x)  # (B, H, T, T) pre-softmax logits
        assert_softmax_ok(scores, dtype="bf16", method="stable", max_abs_err=1e-2, relative_to_torch=2.0)

The numbers are ``attncheck check``'s (``diagnose`` against a float64 reference);
a broken budget raises ``AssertionError`` naming the cell, the budget, the
measured value and the worst row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attncheck.config.check import Budget, parse_budget
from attncheck.config.run import Options
from attncheck.errors import AttncheckError
from attncheck.params import DEFAULT_BLOCK

__all__ = ["as_gpu_capture", "assert_softmax_ok"]


def _as_tensor(scores: Any):
    # imports torch: attncheck.testing is torch-free at import (tests/test_layers.py)
    import numpy as np
    import torch

    if isinstance(scores, torch.Tensor):
        return scores.detach()
    if isinstance(scores, np.ndarray) and scores.dtype.kind == "f":
        return torch.from_numpy(np.ascontiguousarray(scores))
    if isinstance(scores, np.ndarray):
        # imports torch: attncheck.testing is torch-free at import (tests/test_layers.py)
        from attncheck.numerics.precision import scores_dtype_error

        raise scores_dtype_error("scores", scores.dtype)
    raise AttncheckError(f"scores must be a torch.Tensor or a numpy array, got {type(scores).__name__}")


def _dtype_name(dtype: Any) -> str:
    # imports torch: attncheck.testing is torch-free at import (tests/test_layers.py)
    import torch

    from attncheck.numerics.precision import dtype_label

    if isinstance(dtype, torch.dtype):
        return dtype_label(dtype)
    if not isinstance(dtype, str):
        raise AttncheckError(f"dtype must be a name such as 'bf16' or a torch.dtype, got {dtype!r}")
    return dtype


def assert_softmax_ok(
    scores: Any,
    dtype: Any = "bf16",
    method: str = "stable",
    *,
    nan: int | None = 0,
    overflow: int | None = 0,
    zero_rows: int | None = None,
    argmax_flips: int | None = None,
    max_abs_err: float | None = None,
    max_abs_err_algo: float | None = None,
    rmse: float | None = None,
    kl_max: float | None = None,
    relative_to_torch: float | None = None,
    relative_to_torch_atol: float = 0.0,
    block: int = DEFAULT_BLOCK,
    accum: str = "fp32",
    name: str = "scores",
):
    """Assert that ``method``'s softmax of ``scores`` (last axis) in ``dtype`` keeps its budget.

    ``scores``: pre-softmax logits, a torch tensor (any device) or a numpy array.
    ``dtype``: 'fp16', 'bf16', 'fp32' or a torch dtype; ``method``: 'naive',
    'stable', 'tiled' (alias 'online') or 'torch'. Budgets as in ``[tool.attncheck.budget]``;
    ``None`` leaves one unchecked (``nan`` and ``overflow`` default to 0).
    Returns the ``results.CaseResult`` when every budget holds; raises
    ``AssertionError`` otherwise, and ``AttncheckError`` for unusable arguments.
    """
    given = {
        "nan": nan,
        "overflow": overflow,
        "zero_rows": zero_rows,
        "argmax_flips": argmax_flips,
        "max_abs_err": max_abs_err,
        "max_abs_err_algo": max_abs_err_algo,
        "rmse": rmse,
        "kl_max": kl_max,
        "relative_to_torch": relative_to_torch,
    }
    table = {k: v for k, v in given.items() if v is not None}
    if not table:
        raise AttncheckError("assert_softmax_ok: every budget is None, so nothing would be checked")
    if relative_to_torch is not None or relative_to_torch_atol != 0.0:
        table["relative_to_torch_atol"] = relative_to_torch_atol
    # Unset budgets are None here, not the config defaults: start from an all-None budget.
    empty = Budget(nan=None, overflow=None)
    budget = parse_budget(table, "", "assert_softmax_ok", base=empty)

    # imports torch: attncheck.testing is torch-free at import (tests/test_layers.py)
    from attncheck.pipelines.budgets import check_tensor
    from attncheck.report.check import describe_case

    x = _as_tensor(scores)
    if not isinstance(method, str):
        raise AttncheckError(f"method must be a name such as 'stable', got {method!r}")
    device = str(x.device) if x.device.type != "meta" else "cpu"
    try:
        options = Options(dtypes=(_dtype_name(dtype),), methods=(method,), block=block, accum=accum, device=device)
    except AttncheckError as e:  # name this function's arguments
        raise AttncheckError(e.render(lambda p: {"dtypes": "dtype", "methods": "method"}.get(p, p))) from None
    (case,) = check_tensor(name, x, budget, options)
    if not case.passed:
        shape = "x".join(map(str, case.shape))
        raise AssertionError(f"attncheck: {case.name} of {name} ({shape}) broke its budget: {describe_case(case)}")
    return case


SDPA_BACKENDS = ("flash_attention", "efficient_attention", "cudnn_attention", "math")  # torch's SDPBackend names


def as_gpu_capture(
    capture_dir: Any,
    backend: str,
    capability: str = "9.0",
    gpu_name: str = "NVIDIA H100 80GB HBM3",
    flash_impl: str = "fa2",
) -> None:
    """Rewrite a capture made on a CPU as a capture on a GPU writes it: each call file says device
    cuda:0, the GPU's compute capability ('9.0': an H100), and for SDPA calls the backend PyTorch chose
    ('flash_attention', 'efficient_attention', 'cudnn_attention', 'math'). For tests (and examples) of how
    attncheck judges a GPU's calls on a machine without one: the calls are then judged by that kernel's
    path (fa2, mem-efficient, cudnn, sdpa-math). The GPU's name is written too, and the flash implementation
    PyTorch was set to (``flash_impl``: its default 'fa2'; 'fa3' or 'fa4' as ``torch.nn.attention``'s
    ``activate_flash_attention_impl`` sets it: a flash_attention call is then judged by fa3 or fa4). The tensors
    are left as they are."""
    # imports torch: attncheck.testing is torch-free at import (tests/test_layers.py)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if backend not in SDPA_BACKENDS:
        raise AttncheckError(f"backend must be one of {', '.join(SDPA_BACKENDS)}; got {backend!r}")
    if flash_impl not in ("fa2", "fa3", "fa4"):
        raise AttncheckError(f"flash_impl must be one of fa2, fa3, fa4; got {flash_impl!r}")
    major, _, minor = capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise AttncheckError(f"capability must be MAJOR.MINOR, e.g. 9.0; got {capability!r}")
    files = [f for f in sorted(Path(capture_dir).rglob("*.safetensors")) if not f.name.endswith(".grads.safetensors")]
    if not files:
        raise AttncheckError(f"{capture_dir}: no call files (a directory attncheck.capture wrote)")
    for f in files:
        with safe_open(str(f), "pt") as h:
            meta = h.metadata() or {}
        tensors = load_file(str(f))
        meta.update(device="cuda:0", capability=capability, gpu_name=gpu_name)
        if meta.get("kind") == "sdpa":
            meta.update(sdpa_backend=backend, flash_impl=flash_impl)
        save_file(tensors, str(f), metadata=meta)
