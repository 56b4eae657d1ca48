"""The rotary tables a capture recorded (``rope-NNNN.safetensors``, listed in the manifest's ``rope_tables``), read
with the calls that ran under each. A capture written before tables were recorded lists none."""

from __future__ import annotations

import os
import re

from safetensors import SafetensorError
from safetensors.torch import load_file

from attncheck.errors import AttncheckError
from attncheck.loaders.capture_schema import Manifest

ROPE_FILE = re.compile(r"^rope-(\d{4,})\.safetensors$")
ROPE_ROLES = ("cos", "sin", "positions")


def rope_file_name(index: int) -> str:
    return f"rope-{index:04d}.safetensors"


def read_rope_tables(directory: str | os.PathLike[str], manifest: Manifest) -> list[dict]:
    """Each table the manifest lists: {'index', 'cos', 'sin', 'positions' (or None), 'theta' (or None),
    'rope_type', 'calls' (the indices of the calls under it), 'modules'}; a listed file that is missing, a link or
    not a table is one line naming it."""
    given = os.fspath(directory)
    out = []
    for entry in manifest.rope_tables:
        path = os.path.join(given, entry.file)
        if ROPE_FILE.match(entry.file) is None or int(ROPE_FILE.match(entry.file).group(1)) != entry.index:
            raise AttncheckError(f"{given}: rope table {entry.index} names {entry.file!r}, not its table file")
        if os.path.islink(path) or not os.path.isfile(path):
            raise AttncheckError(f"{path}: the rope table the manifest lists is not a file of the capture")
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise AttncheckError(f"{path}: not a rope table ({e})") from None
        cos, sin = tensors.get("cos"), tensors.get("sin")
        if cos is None or sin is None or cos.shape != sin.shape or cos.dim() < 2 or cos.shape[-1] % 2:
            raise AttncheckError(f"{path}: a rope table holds cos and sin of one shape (..., positions, even d)")
        positions = tensors.get("positions")
        if positions is not None and (positions.shape != cos.shape[:-1] or positions.is_floating_point()):
            positions = None
        calls = [c for c in manifest.calls if c.rope == entry.index]
        out.append(
            {
                "index": entry.index,
                "cos": cos,
                "sin": sin,
                "positions": positions,
                "theta": entry.theta,
                "rope_type": entry.rope_type or "default",
                "calls": [c.index for c in calls],
                "modules": list(dict.fromkeys(c.module or "global" for c in calls)),
            }
        )
    return out
