"""Whether code runs compiled: inside a torch.compile'd callable, while dynamo traces, a compiled module (read by
the recorder and by the watch)."""

from __future__ import annotations

import functools
import os
import sys

import torch

_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


def in_compiled_code() -> bool:
    """The caller runs inside a torch.compile'd function or module (run eagerly under the
    ``force_eager`` stance), whenever it was compiled: one of the frames above is dynamo's wrapper
    of a compiled callable (``compile_wrapper``), other than the one flex_attention puts around its
    own operator to trace it."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME):
            fn = frame.f_locals.get("fn")
            internal = getattr(fn, "__module__", "") == "torch.nn.attention.flex_attention" and getattr(
                fn, "__name__", ""
            ).startswith("_flex_attention_hop_wrapper")
            if not internal:
                return True
        frame = frame.f_back
    return False


def compiling() -> bool:
    """Dynamo is tracing (the hooks and the mode then pass everything through, so that a compiled
    graph holds none of the recorder's code and its state is not mutated while tracing)."""
    return torch.compiler.is_compiling()


def compiled_module(module: torch.nn.Module) -> bool:
    """torch.compile(module) (an OptimizedModule) or module.compile()."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


class CompileMixin:
    """torch.compile while recording (mixed into ``Recorder``): the compiler's stance for compile='eager' and
    compiled functions marked so that their calls are known to run inside compiled code."""

    @property
    def compiled_runs(self) -> int:
        return self.tracker.compiled_runs

    def _force_eager(self) -> None:
        """compile='eager': compiled code runs as its Python code from now on (the compiler's force_eager stance). Set
        when the block starts where the compiler is loaded already (a module compiled before), else at the first
        torch.compile inside it, so that a script that compiles nothing never loads the compiler (which creates its
        cache folder, torchinductor_USER, in the temporary directory)."""
        with self._lock:
            if self.compile == "eager" and self._stance is None and not self._closed:
                self._stance = torch.compiler.set_stance("force_eager")

    def _compile_wrapper(self, compile_fn):
        """``torch.compile`` while recording: the same, with a compiled function marked so that its
        calls are known to run inside compiled code (a compiled module is known by its hooks)."""
        tracker = self.tracker

        def mark(compiled):
            if isinstance(compiled, torch.nn.Module) or not callable(compiled):
                return compiled

            @functools.wraps(compiled)
            def run_compiled(*args, **kwargs):
                tracker.enter_compiled(+1)
                try:
                    return compiled(*args, **kwargs)
                finally:
                    tracker.enter_compiled(-1)

            return run_compiled

        @functools.wraps(compile_fn)
        def compile_marked(model=None, *args, **kwargs):
            self._force_eager()
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "torch" or caller.startswith(
                "torch."
            ):  # torch's own use (flex_attention compiles itself to trace)
                return compile_fn(model, *args, **kwargs)
            if model is None:  # @torch.compile(fullgraph=True): a decorator
                decorate = compile_fn(*args, **kwargs)
                return lambda fn: mark(decorate(fn))
            return mark(compile_fn(model, *args, **kwargs))

        return compile_marked
