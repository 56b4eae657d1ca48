"""Recording the flash-attn package's calls (mixed into ``Recorder``): the patch (``attncheck.record.flash``) calls
``_flash_call``, which runs the original and records each call (one per sequence of a varlen call)."""

from __future__ import annotations

from attncheck.record.compiled import compiling
from attncheck.record.flash import bound_arguments, flash_meta, sequences, side_tensors


class FlashMixin:
    """The flash-attn package's calls (mixed into ``Recorder``; the patch calls ``_flash_call``)."""

    def _flash_call(self, original, package: str, fn: str, args, kwargs):
        """A patched flash-attn function: the original, called as given, then the call recorded."""
        state = self._thread()
        if self._closed or compiling() or state.in_flash or (self.in_modules and not self.tracker.stack):
            return original(*args, **kwargs)
        state.in_flash = True
        try:
            out = original(*args, **kwargs)
        finally:
            state.in_flash = False
        self._flash(original, package, fn, args, kwargs, out)
        return out

    def _flash(self, original, package: str, fn: str, args, kwargs, out) -> None:
        module = self.tracker.path
        if not self._wanted(module):
            return
        a = bound_arguments(original, args, kwargs)
        if a is None:  # arguments the function took that its signature does not show
            return
        self.flush()
        calls, why = sequences(fn, a, out)
        if why is not None:
            with self._lock:
                self.flash_unrecorded += 1
            if self.notice is not None and self.flash_unrecorded == 1:
                self.notice(f"a {package} {fn} call in {module or 'global'} is not recorded: {why}")
            return
        meta = flash_meta(package, fn, a, a["q"], a["k"])
        side = side_tensors(a)
        for q, k, v, o, seq, seqs in calls:
            tensors = {"q": q, "k": k, "v": v, **side}
            if self.outputs and o is not None:
                tensors["out"] = o
            own = dict(meta)
            if seq is not None:
                own["varlen_seq"], own["varlen_seqs"] = str(seq), str(seqs)
            if not self._emit(self._new_call("flash_attn", module, tensors, own)):
                return
