"""Which calls the recorder takes and within what bounds (mixed into ``Recorder``): the module and forward filters,
max_calls and max_bytes, stopping for good, and numbering a call with its metadata."""

from __future__ import annotations

import fnmatch
import json

import torch

from attncheck import __version__
from attncheck.errors import AttncheckError
from attncheck.loaders.calls import CAPTURE_SCHEMA, FORMAT_KEY
from attncheck.record.compiled import in_compiled_code
from attncheck.record.flash import gpu_facts
from attncheck.record.ops import Recorded, dtype_name


class BoundsMixin:
    """Filters, bounds and call numbering (reads the ``Recorder``'s settings, counters and lock)."""

    def _wanted(self, module: str | None) -> bool:
        if self.stopped is not None:
            return False
        forward = self.tracker.forward if module is not None else None
        if self.forwards is not None and (forward is None or forward not in self.forwards):
            self.outside_forwards += 1  # one attention call, in a forward pass not asked for
            return False
        name = module if module is not None else "global"
        return not self.modules or any(fnmatch.fnmatchcase(name, g) for g in self.modules)

    def _emit(self, call: Recorded) -> bool:
        """Hand a call to the sink within the bounds; whether it was recorded."""
        with self._lock:
            return self._emit_locked(call)

    def _emit_locked(self, call: Recorded) -> bool:
        if self.stopped is not None:
            return False
        full = self.dedup.compact(call) if self.dedup is not None else None  # max_bytes bounds what is stored
        size = call.nbytes
        if self.max_calls is not None and self.recorded >= self.max_calls:
            where = f"{call.kind} in {call.module or 'global'}"
            self._stop(f"max_calls {self.max_calls} reached at call {call.index} ({where})", call)
            return False
        if self.max_bytes is not None and self.bytes + size > self.max_bytes:
            self._stop(
                f"max_bytes {self.max_bytes} would be passed by call {call.index} ({call.kind} in "
                f"{call.module or 'global'}, {size} bytes; {self.bytes} recorded)",
                call,
            )
            return False
        try:
            self.sink(call)
        except AttncheckError as e:  # e.g. the disk is full: the model runs on, recording stops
            self._stop(e.render(), call)
            return False
        self.recorded += 1
        self.bytes += size
        if self.dedup is not None:
            self.dedup.keep(call, full)
        return True

    def _stop(
        self,
        why: str,
        call: Recorded | None = None,
        what: str = "call",
        kind: str = "",
        module: str = "",
        index: int | None = None,
    ) -> None:
        self.stopped = why
        if call is not None:
            index, kind, module = call.index, call.kind, call.module
        if index is not None:
            self.first_missed = {"index": index, "kind": kind, "module": module or "", "what": what}
        self._pending = None
        self._qk, self._scores = None, {}
        if self.notice is not None:
            self.notice(f"recording stopped: {why}; {self.recorded} call(s) recorded")

    def _new_call(self, kind: str, module: str | None, tensors: dict, meta: dict) -> Recorded:
        with self._lock:
            index = self.seen
            self.seen += 1
        device = next(iter(tensors.values())).device
        base = {
            FORMAT_KEY: CAPTURE_SCHEMA,
            "kind": kind,
            "module": module or "",
            "call": str(index),
            "forward": str(self.tracker.forward if module is not None else 0),
            "dtypes": json.dumps({role: dtype_name(t.dtype) for role, t in tensors.items()}),
            "shapes": json.dumps({role: list(t.shape) for role, t in tensors.items()}),
            "device": str(device),
            "torch_version": torch.__version__,
            "attncheck_version": __version__,
            **gpu_facts(device, sdpa=kind == "sdpa"),
        }
        base.update(meta)
        rope = self.rope.current() if module is not None and hasattr(self.sink, "rope") else None
        if rope is not None:  # the rotary table it ran under: handed to the sink once per distinct table
            base["rope"] = str(rope[0])
            if rope[1] is not None:
                self.sink.rope(rope[0], rope[1]["tensors"], rope[1]["facts"])
        if self.tracker.in_compiled or in_compiled_code():
            base["compiled"] = "eager"  # torch.compile'd code, run as its Python code (compile='eager')
            with self._lock:
                self.compiled_calls += 1
        return Recorded(index, kind, module or "", self.tracker.forward if module is not None else None, tensors, base)
