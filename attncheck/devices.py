"""The device a diagnosis runs on, from its name: below numerics, pipelines, the recorder and the CLI, which all
resolve one (``numerics.cells.diagnose`` re-exports it)."""

from __future__ import annotations

import torch

from attncheck.errors import AttncheckError, param


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cuda' without CUDA is an input error."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise AttncheckError(
                f"{param('device')} cuda requested but CUDA is not available (torch.cuda.is_available() is False); "
                f"use {param('device')} cpu"
            )
        return torch.device(name)
    raise AttncheckError(f"unknown device {name!r} (choose from auto, cpu, cuda)", param="device")
