"""Which module is running while the recorder records: a per-thread stack kept by global forward hooks, and the
names of a top module's modules as the model names them."""

from __future__ import annotations

import threading

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from attncheck.record.compiled import compiled_module, compiling
from attncheck.wrappers import module_names


class ModuleStack:
    """Which module is running: a stack kept by global forward pre- and post-hooks, one per thread
    (a model run in several threads has a module path in each)."""

    def __init__(self, on_top=None) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.on_top = on_top  # called with True when a top module's forward begins, False when it ends (in its thread)
        self.compiled_runs = (
            0  # forwards of torch.compile'd modules (OptimizedModule, Module.compile()) seen, over every thread
        )
        self.forward = 0  # forward passes of a top module so far, over every thread
        self._names: dict[int, str] = {}
        self._root: int | None = None
        self._handles: list = []
        self.on_root = None  # called with a top module the first time it runs (hooks that need its modules)

    @property
    def stack(self) -> list[tuple[torch.nn.Module, str]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> "ModuleStack":
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: torch.nn.Module, args) -> None:
        if compiling():  # dynamo traces the hooks into a compiled graph: nothing of ours goes in it
            return
        stack = self.stack
        if compiled_module(module):
            with self._lock:
                self.compiled_runs += 1
            self._local.compiled = getattr(self._local, "compiled", 0) + 1
        if not stack:
            with self._lock:
                self.forward += 1
                if self._root != id(module):
                    self._root = id(module)
                    self._names = module_names_of(module)
                    if self.on_root is not None:
                        self.on_root(module)
            path = self._names.get(id(module)) or type(module).__name__
            if self.on_top is not None:
                self.on_top(True)
        else:
            path = self._names.get(id(module)) or f"{stack[-1][1]}.{type(module).__name__}"
        stack.append((module, path))

    def _post(self, module: torch.nn.Module, args, output) -> None:
        if compiling():
            return
        stack = self.stack
        if compiled_module(module) and getattr(self._local, "compiled", 0) > 0:
            self._local.compiled -= 1
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is module:
                del stack[i:]
                if not stack and self.on_top is not None:
                    self.on_top(False)
                return

    @property
    def path(self) -> str | None:
        """The deepest running module's path; None outside any module."""
        return self.stack[-1][1] if self.stack else None

    @property
    def in_compiled(self) -> bool:
        """This thread runs inside a torch.compile'd module or function (run eagerly: see ``Recorder``)."""
        return getattr(self._local, "compiled", 0) > 0

    def enter_compiled(self, delta: int) -> None:
        """A torch.compile'd function starts (+1) or ends (-1) in this thread."""
        self._local.compiled = max(0, getattr(self._local, "compiled", 0) + delta)
        if delta > 0:
            with self._lock:
                self.compiled_runs += 1


def module_names_of(root: torch.nn.Module) -> dict[int, str]:
    """id -> path of the modules under a top module, as the model names them: the wrappers of DDP, DataParallel,
    FSDP, checkpointing and torch.compile left out of the paths (``module.layers.0`` and ``_orig_mod.h.0.attn``
    -> ``layers.0``, ``h.0.attn``), the wrapped model named as the top one (the watch names calls the same way)."""
    return module_names(root)
