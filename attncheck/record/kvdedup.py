"""Decode steps stored by what is new (``Recorder(dedup_kv=True)``, the capture directory's default).

With transformers' default cache (``DynamicCache``) each decode step of ``generate()`` hands the attention its whole
K and V again: the cache so far with the new token's rows appended. Written whole, a generation of N tokens over a
prompt of P stores about N * (P + N / 2) rows of K and V instead of P + N. When a call's K and V (and its mask, where
it has one) extend those of the previous call of the same module, bit for bit, only the new rows are written: the
roles ``k_tail``, ``v_tail`` (rows appended along the sequence axis, -2) and ``attn_mask_tail`` (columns appended
along the key axis, -1), and the metadata ``kv_base`` (the index of the call they extend). The loader rebuilds the
whole tensors by concatenation (``loaders.kv_chain``), bit-exactly.

The check is bit-equality of the prefix (the tensors' bits compared as integers: NaN and -0.0 too) against a CPU
copy of what the previous call of that module passed: one copy per module (and thread) is kept (about one KV
cache of host memory), never a view of the model's own memory, which a static or rolling cache overwrites in
place. A cache whose K and V keep their length (``StaticCache``: fixed-size buffers that fill up) never extends:
its calls are written whole, as before. A full sliding window (gpt-oss's or Mistral's ``sliding_window`` layers:
transformers' ``DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1`` rows and hands each step those
plus its new one) slides: the call's first rows are the previous call's last, bit for bit, and it appends one row
per query. It is stored by its new rows too, with ``kv_drop``: the rows of the base dropped from its front. A new
prompt does not extend the previous step: it is written whole and becomes the module's new reference; another
thread's calls are compared with that thread's own.
"""

from __future__ import annotations

import threading

import torch

from attncheck.record.ops import Recorded

# role -> (the role its new part is stored as, the axis it grows along)
TAILS = {"k": ("k_tail", -2), "v": ("v_tail", -2), "attn_mask": ("attn_mask_tail", -1)}
BASE_KEY = "kv_base"  # metadata: the index of the call whose tensors these extend
DROP_KEY = "kv_drop"  # metadata: the rows of that call's K and V (columns of its mask) dropped from the front

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width: equal exactly when the bits are (NaN equals itself, -0.0 is not 0.0)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_BITS[t.element_size()])


def extends(new: torch.Tensor, ref: torch.Tensor, axis: int) -> bool:
    """``new`` is ``ref`` with entries appended along ``axis``: same dtype and other axes, longer along ``axis``,
    and its first ``ref.shape[axis]`` entries there bit-identical to ``ref``."""
    if new.dtype != ref.dtype or new.dim() != ref.dim() or new.dim() == 0:
        return False
    a = axis % new.dim()
    if any(n != r for i, (n, r) in enumerate(zip(new.shape, ref.shape)) if i != a) or new.shape[a] <= ref.shape[a]:
        return False
    return torch.equal(_bits(new.narrow(a, 0, ref.shape[a])), _bits(ref))


def slides(new: torch.Tensor, ref: torch.Tensor, axis: int, keep: int) -> bool:
    """``new`` is ``ref`` less its first rows along ``axis``, ``keep`` of them left, then entries appended: a full
    sliding window (transformers' ``DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1`` rows and hands
    the attention those and the new token's)."""
    if new.dtype != ref.dtype or new.dim() != ref.dim() or new.dim() == 0:
        return False
    a = axis % new.dim()
    if any(n != r for i, (n, r) in enumerate(zip(new.shape, ref.shape)) if i != a):
        return False
    if not 0 < keep < ref.shape[a] or keep >= new.shape[a]:
        return False
    return torch.equal(_bits(new.narrow(a, 0, keep)), _bits(ref.narrow(a, ref.shape[a] - keep, keep)))


class KvDedup:
    """The previous call's K, V and mask of each module in each thread (CPU copies), and the compaction of a call
    against them. Per thread: two threads generating through one model each extend their own previous call."""

    def __init__(self) -> None:
        self.refs: dict[tuple[str, int], tuple[int, dict[str, torch.Tensor]]] = {}

    def compact(self, call: Recorded) -> dict[str, torch.Tensor] | None:
        """Rewrite ``call`` to store only what extends its module's previous call (its ``tensors`` and ``meta``
        changed in place); returns the CPU copies to keep as the module's reference once the call is recorded
        (``keep``), or None for a call with no K and V."""
        if "k" not in call.tensors or "v" not in call.tensors:
            return None
        full = {  # contiguous CPU copies, whatever the model's layout (one copy each)
            role: torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
            for role, t in call.tensors.items()
            if role in TAILS
        }
        prev = self.refs.get((call.module, threading.get_ident()))
        drop = None if prev is None else self._drop(call, full, prev[1])
        if drop is None:
            call.tensors.update(full)  # written whole, from the copy made here (on a GPU: one transfer, not two)
            return full
        base, ref = prev
        tensors = {}
        for role, t in call.tensors.items():
            if role in full:
                tail, axis = TAILS[role]
                start = ref[role].shape[axis] - drop
                tensors[tail] = full[role].narrow(axis, start, full[role].shape[axis] - start)
            else:
                tensors[role] = t
        call.tensors = tensors
        call.meta[BASE_KEY] = str(base)
        if drop:
            call.meta[DROP_KEY] = str(drop)
        return full

    def _drop(self, call: Recorded, full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> int | None:
        """0 where K, V and the mask extend the reference; the rows dropped from its front where they slide (a full
        window: as many new rows as the call has queries); None where neither."""
        if self._extends(full, ref):
            return 0
        q = call.tensors.get("q", call.tensors.get("scores"))
        if q is None or q.dim() < 2 or set(ref) != set(full):
            return None
        new = q.shape[-2]  # the rows a step appends: one per query
        drops = {ref[role].shape[TAILS[role][1]] - (t.shape[TAILS[role][1]] - new) for role, t in full.items()}
        if len(drops) != 1:
            return None
        drop = drops.pop()
        ok = all(
            slides(t, ref[role], TAILS[role][1], ref[role].shape[TAILS[role][1]] - drop) for role, t in full.items()
        )
        return drop if ok and drop > 0 else None

    @staticmethod
    def _extends(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> bool:
        """K, V and the mask (where both calls have one; a mask on one of them only: no) extend the reference."""
        return set(ref) == set(full) and all(extends(t, ref[role], TAILS[role][1]) for role, t in full.items())

    def keep(self, call: Recorded, full: dict[str, torch.Tensor] | None) -> None:
        """``call`` was recorded: its whole K, V (and mask) are what the module's next call may extend."""
        if full is not None:
            self.refs[(call.module, threading.get_ident())] = (call.index, full)
