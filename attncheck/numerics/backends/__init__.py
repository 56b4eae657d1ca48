"""Row backends: the per-row numbers of a chunk, computed by torch ops or by fused numba kernels.

A diagnosis works on chunks of rows. For each chunk a backend computes the facts
every cell shares (census counts and the float64 reference, ``ChunkFacts``), the
float64 softmax of the scores after the cast to a cell's dtype (``AlgoReference``),
and per cell the row metrics (``RowMetrics``). Both backends give the same numbers
(``tests/numerics/test_backends.py``); the torch one runs on any device and is the
reference, the numba one is faster on the CPU for large inputs. The types live in
``base``; this module picks a backend.
"""

from __future__ import annotations

from typing import Callable

import torch

from attncheck.errors import AttncheckError
from attncheck.numerics.backends import numba_rows
from attncheck.numerics.backends.base import FUSED_MIN_ELEMENTS, AlgoReference, ChunkFacts, RowBackend, RowMetrics
from attncheck.numerics.backends.torch_rows import TorchRows

__all__ = ["FUSED_MIN_ELEMENTS", "AlgoReference", "ChunkFacts", "RowBackend", "RowMetrics", "select_backend"]


def select_backend(
    kernels: str, device: torch.device, elements: int, notice: Callable[[str], None] | None = None
) -> RowBackend:
    """The backend ``kernels`` asks for: 'torch', 'fused' (numba; an input error without it
    or off the CPU), or 'auto' (numba for CPU inputs of FUSED_MIN_ELEMENTS or more when it
    is installed, torch otherwise). ``notice`` hears of a first compile of the kernels."""
    if kernels == "torch":
        return TorchRows()
    if kernels == "fused":
        if device.type != "cpu":
            raise AttncheckError(f"fused kernels run on the CPU only; the diagnosis runs on {device}", param="kernels")
        if not numba_rows.installed():
            raise AttncheckError(
                "fused kernels need numba, which is not installed (pip install numba)", param="kernels"
            )
        return numba_rows.NumbaRows(notice)
    if device.type == "cpu" and elements >= FUSED_MIN_ELEMENTS and numba_rows.available():
        return numba_rows.NumbaRows(notice)
    return TorchRows()
