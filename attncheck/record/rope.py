"""The rotary embedding each attention call used, where the model passes it to the attention module.

transformers computes cos and sin once per forward (``LlamaRotaryEmbedding``) and passes them to every attention
layer as ``position_embeddings=(cos, sin)``, with ``position_ids`` beside them. A global forward hook sees no keyword
arguments, so when the module stack meets a new top module, every module whose ``forward`` takes
``position_embeddings`` gets a forward pre-hook with kwargs (and a forward hook that pops it): while it runs, its
table is this thread's current one. A recorded call names the table it ran under by number; each distinct table
(shape, dtype, contents) is handed to the sink once per capture.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import threading
import weakref

import torch

from attncheck.record.compiled import compiling

ROPE_ARGUMENT = "position_embeddings"


def takes_position_embeddings(module: torch.nn.Module) -> bool:
    try:
        return ROPE_ARGUMENT in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a C++ module)
        return False


# The rope parameters the non-default types' frequencies are computed from (transformers' modeling_rope_utils):
# recorded with each table where the config has them (numbers and flags only).
ROPE_PARAMETERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "partial_rotary_factor",
)


ROPE_FACTOR_LISTS = ("long_factor", "short_factor")  # longrope's per-frequency factors
MAX_FACTORS = 4096  # entries of a factor list kept (d/2 of the widest head recorded)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scalars(source: dict, keys) -> dict:
    """The finite numbers (as floats), flags and lists of finite numbers (longrope's factors) of ``source`` under
    ``keys``; anything else left out."""
    out: dict = {}
    for key in keys:
        value = source.get(key)
        if isinstance(value, bool):
            out[key] = value
        elif _number(value):
            out[key] = float(value)
        elif isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_FACTORS and all(map(_number, value)):
            out[key] = [float(v) for v in value]
    return out


def rope_facts(module: torch.nn.Module) -> dict[str, str]:
    """theta, the RoPE type and its parameters (JSON) from the module's config, where it has one (transformers:
    ``config.rope_parameters`` in 5.x, ``rope_theta`` and ``rope_scaling`` before; parameters nested by layer type
    are read under the module's ``layer_type`` where it has one)."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    rp = getattr(config, "rope_parameters", None)
    rp = rp if isinstance(rp, dict) else {}
    layer_type = getattr(module, "layer_type", None)
    if isinstance(layer_type, str) and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    scaling = getattr(config, "rope_scaling", None)
    scaling = scaling if isinstance(scaling, dict) else {}
    theta = rp.get("rope_theta", getattr(config, "rope_theta", None))
    kind = rp.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    out = {"rope_type": str(kind)}
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        out["theta"] = repr(float(theta))
    keys = (*ROPE_PARAMETERS, *ROPE_FACTOR_LISTS)
    parameters = {**_scalars(scaling, keys), **_scalars(rp, keys)}
    longest = getattr(config, "max_position_embeddings", None)  # yarn's factor where the config gives none
    parameters.update(_scalars({"max_position_embeddings": longest}, ("max_position_embeddings",)))
    if kind != "default" and parameters:
        out["parameters"] = json.dumps(parameters, sort_keys=True)
    return out


class RopeWatch:
    """Hooks the modules that take ``position_embeddings``; numbers the distinct tables."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._handles: list = []
        self._hooked: set[int] = set()
        self._by_object: dict[tuple, tuple] = {}  # the same tensors passed to every layer: hashed once
        self._by_content: dict[tuple, int] = {}
        self.count = 0

    @property
    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def attach(self, root: torch.nn.Module) -> None:
        for module in root.modules():
            if id(module) in self._hooked or not takes_position_embeddings(module):
                continue
            self._hooked.add(id(module))
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._hooked = [], set()

    def _pre(self, module, args, kwargs) -> None:
        if compiling():  # dynamo traces module hooks into its graph: nothing of ours goes in it (as ModuleStack)
            return
        pe = kwargs.get(ROPE_ARGUMENT)
        ok = (
            isinstance(pe, (tuple, list))
            and len(pe) == 2
            and all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in pe)
            and pe[0].shape == pe[1].shape
            and pe[0].dim() >= 2
            and pe[0].shape[-1] % 2 == 0
        )
        positions = kwargs.get("position_ids")
        positions = positions if isinstance(positions, torch.Tensor) and not positions.is_floating_point() else None
        self._stack.append((module, (pe[0], pe[1], positions) if ok else None))

    def _post(self, module, args, output) -> None:
        if compiling():
            return
        stack = self._stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is module:
                del stack[i:]
                return

    def current(self) -> tuple[int, dict | None] | None:
        """(the table's number, its tensors and facts where new to this capture, else None); None outside any
        module given a table."""
        found = next(((m, e) for m, e in reversed(self._stack) if e is not None), None)
        if found is None:
            return None
        module, (cos, sin, positions) = found
        # the same tensors, unchanged (an id alone may be a freed table's, reused by the next forward's)
        obj = (id(cos), cos._version, id(sin), sin._version, None if positions is None else id(positions))
        with self._lock:
            seen = self._by_object.get(obj)
            if seen is not None and all(r() is t for r, t in zip(seen[1], (cos, sin, positions)) if t is not None):
                return seen[0], None
        tensors = {"cos": cos.detach(), "sin": sin.detach()}
        if positions is not None and positions.shape == cos.shape[:-1]:
            tensors["positions"] = positions.detach()
        digest = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name].contiguous().cpu()
            digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        key = (tuple(cos.shape), cos.dtype, digest.hexdigest())
        refs = tuple(weakref.ref(t) for t in (cos, sin, positions) if t is not None)
        with self._lock:
            number = self._by_content.get(key, self.count)
            self._by_object[obj] = (number, refs)
            if number != self.count:
                return number, None
            self._by_content[key] = number
            self.count += 1
        return number, {"tensors": tensors, "facts": rope_facts(module)}
