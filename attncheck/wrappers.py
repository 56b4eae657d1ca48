"""Module paths as the model names them, through the wrappers training puts around it.

DistributedDataParallel and DataParallel hold the model as ``module``, torch.compile as ``_orig_mod``, FSDP as
``_fsdp_wrapped_module``, activation checkpointing as ``_checkpoint_wrapped_module``: a call inside
``module.layers.0`` is the model's ``layers.0``. Capture and the watch name calls the same way, so that a
capture's names and a watch's agree for one model however it is wrapped. No torch at import time.
"""

from __future__ import annotations

# Attributes through which the usual wrappers hold the module they run (accelerate's ``prepare`` wraps in DDP).
WRAPPED = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
WRAPPER_PARTS = frozenset(WRAPPED[1:])  # path parts that name a wrapper's inner module, never one of the model's own


def wrapped_modules(module) -> list[tuple[str, object]]:
    """What a wrapper runs, outermost first: (the path from ``module``, the module), ``module`` itself first."""
    # torch stays off: the watcher imports this module, and imports without torch
    import torch
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    def holds(
        outer, attr: str
    ) -> bool:  # ``module`` is a wrapper's only in DDP and DataParallel: a model may name a child so
        return isinstance(getattr(outer, attr, None), torch.nn.Module) and (
            attr != "module" or isinstance(outer, (DistributedDataParallel, DataParallel))
        )

    chain = [("", module)]
    for _ in range(8):
        path, outer = chain[-1]
        attr = next((a for a in WRAPPED if holds(outer, a)), None)
        if attr is None:
            break
        inner = getattr(outer, attr)
        if any(inner is m for _, m in chain):
            break
        chain.append((f"{path}.{attr}" if path else attr, inner))
    return chain


def model_path(path: str, prefix: str | None, name: str) -> str:
    """A call's module path as the wrapped model names it: the wrapper's path to the model (``prefix``, e.g.
    'module') taken off, FSDP's and checkpointing's inner parts left out; the model itself by its class ``name``."""
    if prefix:
        if path == prefix:
            return name
        path = path.removeprefix(prefix + ".")
    parts = [p for p in path.split(".") if p and p not in WRAPPER_PARTS]
    return ".".join(parts) if parts else name


def module_names(root) -> dict[int, str]:
    """id -> the model's path of every module under a top module ``root``; the wrappers' own names left out, the
    wrapped model (and each wrapper around it) named by the model's class."""
    chain = wrapped_modules(root)
    prefix, model = chain[-1]
    top = type(model).__name__
    names = {id(m): model_path(n, prefix, top) for n, m in root.named_modules() if n}
    for _, m in chain:
        names[id(m)] = top
    if len(chain) == 1:
        names.pop(id(root), None)  # no wrapper: the top module named by its class where a call is made
    return names


__all__ = ["WRAPPED", "WRAPPER_PARTS", "model_path", "module_names", "wrapped_modules"]
