"""The recorder's threads (mixed into ``Recorder``): what it traces around a softmax is kept per thread, a thread
started while recording runs with the mode on its stack, and an SDPA call from a thread that was running before
recording began is recorded through the module attribute."""

from __future__ import annotations

from torch.overrides import _pop_mode, _push_mode

from attncheck.record.compiled import compiling
from attncheck.record.ops import SDPA
from attncheck.record.state import ThreadState


class ThreadsMixin:
    """Per-thread state and the threads' way into the recorder (reads the ``Recorder``'s lock and tracker)."""

    # The last matmul of 3+-D operands: {'a', 'b', 'shape', 'path'}; q and k^T are alive in the
    # model until its softmax anyway. What derives from its result is followed by weak reference
    # (id -> (tensor, scale so far)), so that recording keeps no tensor alive the model has let go.
    def _thread(self) -> ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = ThreadState()
            with self._lock:
                self._threads.append(state)
        return state

    _qk = property(lambda self: self._thread().qk, lambda self, v: setattr(self._thread(), "qk", v))

    _scores = property(lambda self: self._thread().scores, lambda self, v: setattr(self._thread(), "scores", v))

    _pending = property(lambda self: self._thread().pending, lambda self, v: setattr(self._thread(), "pending", v))

    _patched = property(lambda self: self._thread().patched, lambda self, v: setattr(self._thread(), "patched", v))

    _mha_info = property(lambda self: self._thread().mha_info, lambda self, v: setattr(self._thread(), "mha_info", v))

    def _thread_start(self, start):
        """``Thread.start`` while recording: the thread's ``run`` (its own, for a subclass) runs with
        the mode on the thread's stack, taken off when it returns (after the capture the mode passes
        every call through)."""
        recorder = self

        def start_with_mode(thread, *args, **kwargs):
            run = thread.run

            def run_with_mode():
                state = recorder._thread()
                state.mode = True
                _push_mode(recorder)
                try:
                    return run()
                finally:
                    _pop_mode()
                    state.mode = False

            thread.run = run_with_mode
            return start(thread, *args, **kwargs)

        return start_with_mode

    def _sdpa_any_thread(self, *args, **kwargs):
        """``F.scaled_dot_product_attention`` while recording: a thread without the mode (one that ran
        before recording began) is recorded here; elsewhere the mode records the call."""
        state = self._thread()
        if compiling() or self._closed or state.mode or state.in_flash or (self.in_modules and not self.tracker.stack):
            return SDPA(*args, **kwargs)
        return self._sdpa(SDPA, args, kwargs)
