"""Whether code runs compiled: inside a torch.compile'd callable, while dynamo traces, a compiled module (read by
the recorder and by the watch)."""

from __future__ import annotations

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
