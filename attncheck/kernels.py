"""Fused per-row kernels for the CPU (numba): the numbers of diagnose's torch code path
in one pass over each row instead of a dozen whole-tensor passes.

Used for large inputs on the CPU when numba is installed; the torch path in
``diagnose`` is the reference, runs everywhere else (CUDA, small inputs, no
numba, or ATTNCHECK_KERNELS=torch), and tests check that both give the same
numbers. The kernels live in ``kernels_numba``, imported (and JIT-compiled, with
numba's on-disk cache) on first use, so that nothing here imports numba.
Rows are processed in parallel; each row is read in key order, so a row's
values never depend on the chunking.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import numpy as np
import torch

_compiled: dict | None = None


def available() -> bool:
    """numba is installed and not switched off with ATTNCHECK_KERNELS=torch (imports nothing)."""
    return os.environ.get("ATTNCHECK_KERNELS", "auto") != "torch" and importlib.util.find_spec("numba") is not None


def compiled() -> dict:
    """The kernels by name: reference_rows, own_reference_rows, cell_rows (see kernels_numba)."""
    global _compiled
    if _compiled is None:
        mod = importlib.import_module("attncheck.kernels_numba")
        _compiled = {name: getattr(mod, name) for name in ("reference_rows", "own_reference_rows", "cell_rows")}
    return _compiled


def as_rows(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a C-contiguous numpy array without conversion: fp32/fp64 as they
    are, fp16 as its uint16 bit patterns and bf16 as int16 ones (the kernels widen both)."""
    x = x.detach().contiguous()
    if x.dtype == torch.float16:
        return x.view(torch.int16).numpy().view(np.uint16)
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy()
    return x.numpy()
