"""The rotary tables a capture recorded (``rope-NNNN.safetensors``, listed in the manifest's ``rope_tables``), read
with the calls that ran under each. A capture written before tables were recorded lists none."""

from __future__ import annotations

import os
import re

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from attncheck.errors import AttncheckError
from attncheck.loaders.call_info import MANIFEST
from attncheck.loaders.capture_schema import Manifest, ManifestCall
from attncheck.params import ROPE_TYPES

ROPE_FILE = re.compile(r"^rope-(\d{4,})\.safetensors$")
ROPE_ROLES = ("cos", "sin", "positions")


def rope_file_name(index: int) -> str:
    return f"rope-{index:04d}.safetensors"


def read_call_qk(directory: str | os.PathLike[str], call: ManifestCall) -> tuple:
    """(q, k) of a capture's call file as recorded (after the rotation; either None where the file holds none), for
    the RoPE audit. A decode step stored by its new rows gives its ``k_tail``: the keys at this call's positions,
    rotated by this call's table (its cached keys were rotated by earlier ones). A file that cannot be read is one
    line naming it."""
    path = os.path.join(os.fspath(directory), call.file)  # a bare call-file name: checked by load_manifest
    if os.path.islink(path) or not os.path.isfile(path):
        raise AttncheckError(f"{path}: the call file the manifest lists is not a file of the capture")
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            q = f.get_tensor("q") if "q" in keys else None
            k = next((f.get_tensor(key) for key in ("k", "k_tail") if key in keys), None)
    except Exception as e:  # safetensors raises its own errors, OSError and others for a damaged file
        raise AttncheckError(f"{path}: cannot read q and k ({type(e).__name__}: {e})") from None
    return q, k


def read_rope_tables(directory: str | os.PathLike[str], manifest: Manifest) -> list[dict]:
    """Each table the manifest lists: {'index', 'cos', 'sin', 'positions' (or None), 'theta' (or None),
    'rope_type', 'parameters', 'calls' (the indices of the calls under it), 'modules'}; a listed file that is
    missing, a link or not a table, or a RoPE type transformers does not name (``params.ROPE_TYPES``), is one line
    naming it."""
    given = os.fspath(directory)
    out = []
    for entry in manifest.rope_tables:
        path = os.path.join(given, entry.file)
        if (entry.rope_type or "default") not in ROPE_TYPES:
            raise AttncheckError(
                f"{os.path.join(given, MANIFEST)}: rope table {entry.index} has rope_type "
                f"{entry.rope_type!r}, not a RoPE type attncheck knows ({', '.join(ROPE_TYPES)})"
            )
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
                "parameters": dict(entry.parameters),
                "calls": [c.index for c in calls],
                "modules": list(dict.fromkeys(c.module or "global" for c in calls)),
            }
        )
    return out
