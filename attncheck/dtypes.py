"""Torch dtypes by their registered names, and the one message for a dtype that cannot hold scores.

Below loaders and numerics alike (both read a tensor's dtype); ``numerics.precision`` re-exports these names.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from attncheck.errors import AttncheckError
from attncheck.registry import DTYPES, DtypeSpec, cell_dtype


def torch_dtype(spec: DtypeSpec) -> torch.dtype:
    """The torch dtype of a registered format; an input error where this torch lacks it."""
    dt = getattr(torch, spec.torch_name, None)
    if not isinstance(dt, torch.dtype):
        raise AttncheckError(
            f"dtype {spec.name} needs torch.{spec.torch_name}, which torch {torch.__version__} does not have"
        )
    return dt


def dtype_from_name(name: str, where=cell_dtype, param: str | None = None) -> torch.dtype:
    """'fp16' / 'float16' / 'half' -> torch.float16; unknown names raise AttncheckError."""
    return torch_dtype(DTYPES.get(name, where=where, param=param))


@lru_cache(maxsize=None)
def _labels() -> dict[torch.dtype, str]:
    out = {}
    for spec in DTYPES:
        dt = getattr(torch, spec.torch_name, None)
        if isinstance(dt, torch.dtype):
            out[dt] = spec.name
    return out


def dtype_label(dtype: torch.dtype) -> str:
    """torch.float16 -> 'fp16'; dtypes outside the registry fall back to their torch name."""
    return _labels().get(dtype) or str(dtype).removeprefix("torch.")


def spec_of(dtype: torch.dtype) -> DtypeSpec | None:
    label = _labels().get(dtype)
    return None if label is None else DTYPES.get(label)


def scores_dtype_error(name: str, dtype: object) -> AttncheckError:
    """The one message for a tensor whose dtype cannot hold scores (or q, k)."""
    names = DTYPES.names(lambda s: s.scores)
    allowed = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    shown = str(dtype).removeprefix("torch.")
    return AttncheckError(f"{name} has dtype {shown}; attncheck needs floating-point scores ({allowed})")


def check_scores_dtype(name: str, dtype: torch.dtype) -> None:
    spec = spec_of(dtype)
    if spec is None or not spec.scores:
        raise scores_dtype_error(name, dtype)
