"""Decode steps stored by their new rows (``record.kvdedup``): a call file holding ``k_tail``, ``v_tail`` (and
``attn_mask_tail``) and the metadata ``kv_base`` is rebuilt whole, K and V being its base call's (rebuilt the same
way) with the tail appended: rows along axis -2 for K and V, columns along axis -1 for the mask. A step of a full
sliding window (``kv_drop``) first drops that many rows (columns) from the front of its base's.

Calls are read in order, so the last rebuilt K, V and mask of each chain are kept (a few per module): rebuilding
the next step reads one file. Reading a call out of order walks its chain back to the nearest rebuilt or whole call.
A rebuilt tensor must have the shape the call's metadata recorded for it (``shapes``), and every link the dtype of
its base: anything else is a problem naming the call.
"""

from __future__ import annotations

import json
import os
import threading

import safetensors
import torch

from attncheck.errors import AttncheckError
from attncheck.loaders.capture_schema import ManifestCall
from attncheck.loaders.common import check_tensor, error, reason

TAILS = {"k": ("k_tail", -2), "v": ("v_tail", -2), "attn_mask": ("attn_mask_tail", -1)}
CHAINS_KEPT = 4  # rebuilt calls kept per module (each the last of its chain)


def logical_entries(meta: dict[str, str], entries: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """A dedup'd call's header entries as the whole call's: each tail replaced by its role with the shape the
    metadata recorded (what a diagnosis loads)."""
    try:
        shapes = json.loads(meta.get("shapes") or "{}")
    except ValueError:
        shapes = {}
    out = {}
    for key, (dtype, shape) in entries.items():
        role = next((r for r, (tail, _) in TAILS.items() if tail == key), None)
        if role is None:
            out[key] = (dtype, shape)
        elif isinstance(shapes.get(role), list):
            out[role] = (dtype, tuple(shapes[role]))
    return out


def _read(path: str, keys: tuple[str, ...], label: str) -> dict[str, torch.Tensor]:
    try:
        # safetensors.safe_open looked up when called: tests replace it to fake a failed read
        with safetensors.safe_open(path, framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys if key in f.keys()}
    except Exception as exc:
        raise error(f"{label}: cannot read {os.path.basename(path)}, which its K and V extend ({reason(exc)})") from exc


class KvChain:
    """The whole K, V and mask of a capture's calls, rebuilt from their tails; the last of each module kept."""

    def __init__(self, directory: str, calls: list[ManifestCall]) -> None:
        self.dir = directory
        self.entries = {c.index: c for c in calls}
        # the last rebuilt call of each chain (keyed by its index), a few per module: several threads' generations
        # through one module make several chains, read interleaved
        self._last: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def problem(self, entry: ManifestCall, label: str) -> str | None:
        """Why ``entry``'s base cannot be rebuilt (listed in the manifest, earlier, of the same module), or None."""
        base = self.entries.get(entry.kv_base)
        if base is None or entry.kv_base >= entry.index:
            return f"{label}: its K and V extend call {entry.kv_base}, which is not an earlier call of the capture"
        if base.module != entry.module:
            return f"{label}: its K and V extend call {entry.kv_base}, which is of another module ({base.module!r})"
        return None

    def whole(self, index: int, label: str) -> dict[str, torch.Tensor]:
        """Call ``index``'s whole k, v (and attn_mask, where it has one)."""
        with self._lock:
            chain = []
            at = index
            while True:  # back to the nearest call rebuilt already or stored whole
                if at in self._last:
                    tensors = self._last.pop(at)  # the chain moves on: its newer call is kept instead
                    break
                entry = self.entries[at]
                if entry.kv_base is None:
                    path = os.path.join(self.dir, entry.file)
                    tensors = _read(path, tuple(TAILS), label)
                    break
                chain.append(at)
                at = entry.kv_base
            for at in reversed(chain):
                tensors = self._extend(at, tensors, label)
            self._keep(index, tensors)
            return dict(tensors)

    def _keep(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        module = self.entries[index].module
        mine = [i for i in self._last if self.entries[i].module == module]
        for i in mine[: max(0, len(mine) + 1 - CHAINS_KEPT)]:  # the oldest go: a finished generation's last step
            del self._last[i]
        self._last[index] = tensors

    def _extend(self, index: int, base: dict[str, torch.Tensor], label: str) -> dict[str, torch.Tensor]:
        entry = self.entries[index]
        path = os.path.join(self.dir, entry.file)
        tails = _read(path, tuple(tail for tail, _ in TAILS.values()), label)
        out = {}
        drop = entry.kv_drop or 0  # a full sliding window: the base's first rows are gone
        for role, (tail, axis) in TAILS.items():
            if tail in tails:
                t = tails[tail]
                b = base.get(role)
                if b is not None and drop:
                    if drop > b.shape[axis]:
                        raise AttncheckError(
                            f"{label}: call {index} drops {drop} rows of call {entry.kv_base}'s {role}, which has "
                            f"{b.shape[axis]}"
                        )
                    b = b.narrow(axis, drop, b.shape[axis] - drop)
                if b is None or b.dtype != t.dtype or b.dim() != t.dim():
                    raise AttncheckError(
                        f"{label}: call {index}'s {tail} does not extend call {entry.kv_base}'s {role} "
                        f"({'absent' if b is None else f'{b.dtype} of {b.dim()} axes'} there, {t.dtype} of "
                        f"{t.dim()} axes here)"
                    )
                try:
                    out[role] = torch.cat([b, t], dim=axis)
                except RuntimeError as exc:
                    raise AttncheckError(
                        f"{label}: call {index}'s {tail} {tuple(t.shape)} does not extend call {entry.kv_base}'s "
                        f"{role} {tuple(b.shape)} ({reason(exc)})"
                    ) from None
        return out

    def loader(self, load, index: int, label: str, meta: dict[str, str]):
        """``load`` (the call file's own roles) with the whole k, v and mask rebuilt, each of the shape the
        call's metadata recorded."""
        try:
            shapes = json.loads(meta.get("shapes") or "{}")
        except ValueError:
            shapes = None
        if not isinstance(shapes, dict):
            shapes = {}

        def both() -> dict[str, torch.Tensor]:
            tensors = load()
            for role, t in self.whole(index, label).items():
                if list(t.shape) != shapes.get(role):
                    raise AttncheckError(
                        f"{label}: its {role} rebuilt from its base calls has shape {tuple(t.shape)}, the call "
                        f"recorded {shapes.get(role)}"
                    )
                tensors[role] = check_tensor(f"{label}: {role}", t, "mask" if role == "attn_mask" else "scores")
            return tensors

        return both
