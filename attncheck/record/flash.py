"""The flash-attn package's calls while recording, and what a capture on a GPU says about the device.

flash-attn's functions are plain Python functions (their kernels are custom ops a torch function mode sees
only as opaque operators), so the recorder patches them: while it records, the module attributes below are
wrappers that call the original with exactly the arguments given, return its result unchanged and hand the
call to the recorder. Only where the package is installed: a package that ``importlib.util.find_spec`` does
not find is never imported. The attributes are restored on exit (also when the block fails), and so are the
names transformers bound to them (``transformers.modeling_flash_attention_utils``: its ``_flash_fn`` and
``_flash_varlen_fn`` once it has loaded an implementation). A name a program bound itself before recording
(``from flash_attn import flash_attn_func`` at the top of a script run by ``attncheck capture`` comes after,
and is recorded) keeps the original and is not recorded; one bound while recording keeps the wrapper, which
passes every call through once recording has ended.

The interfaces, as Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced defines them:

- FlashAttention-2 (``flash_attn``, ``flash_attn/flash_attn_interface.py``:1156 and :1391):
  ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)`` and
  ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, ...,
  block_table=None)``;
- FlashAttention-3 (``hopper/flash_attn_interface.py``:809 and :890, installed as the top-level module
  ``flash_attn_interface``): ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None,
  q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, ...)``;
  its varlen function adds ``seqused_q``, ``seqused_k``;
- FlashAttention-4 (``flash_attn/cute/interface.py``:3371 and :3419, ``flash_attn.cute``):
  ``flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
  window_size=(None, None), learnable_sink=None, softcap=0.0, ..., score_mod=None, mask_mod=None, ...)``.

q, k, v are (batch, seqlen, heads, headdim) (varlen: (total, heads, headdim) with cumulative sequence
lengths); the recorder stores them as (batch, heads, seqlen, headdim), attncheck's layout. A varlen call is
recorded as one call per sequence (``varlen_seq`` of ``varlen_seqs``): each sequence is an attention of its
own, and its rows are the packed rows between two cumulative lengths, so the split is exact. causal and the
window are aligned to the bottom right of the (queries, keys) matrix, as flash-attn defines them; ``window``
keeps the window as given ('-1,-1': none; FA4's None is -1).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import sys
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    import torch

# (module, package) whose flash_attn_func and flash_attn_varlen_func are patched, in the order they are looked for
FLASH_MODULES = (
    ("flash_attn", "fa2"),
    ("flash_attn.flash_attn_interface", "fa2"),
    ("flash_attn_interface", "fa3"),
    ("flash_attn.cute", "fa4"),
    ("flash_attn.cute.interface", "fa4"),
)
FLASH_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func")
TRANSFORMERS_FLASH = "transformers.modeling_flash_attention_utils"
ORIGINAL = "__attncheck_flash_original__"  # on a wrapper: the function it wraps
# Arguments that change what a call computes beyond q, k, v, the scale, causal, the window and the soft cap:
# name -> its value when not given.
EXTRAS = {
    "alibi_slopes": None,
    "qv": None,
    "attention_chunk": 0,
    "score_mod": None,
    "mask_mod": None,
    "block_sparse_tensors": None,
    "gather_kv_indices": None,
    "seqused_q": None,
    "seqused_k": None,
    "aux_tensors": None,
}
PAGED = ("block_table", "page_table")  # k and v are a paged cache: not one tensor per sequence
SINKS = ("learnable_sink", "sinks", "s_aux")
_IMPL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# --------------------------------------------------------------------------- the device


def flash_impl() -> str | None:
    """The flash implementation PyTorch's CUDA flash backend runs: 'fa2' (the one it is built with) unless another
    is activated in ``torch.nn.attention``'s registry (``activate_flash_attention_impl('FA4')`` -> 'fa4'); None
    where this torch has no such registry."""
    try:
        # optional: a torch without the flash implementation registry has no current_flash_attention_impl
        from torch.nn.attention import current_flash_attention_impl
    except ImportError:
        return None
    try:
        active = current_flash_attention_impl()
    except Exception:  # a registry of another shape: the implementation is not recorded
        return None
    if active is None:
        return "fa2"
    name = str(active).lower()
    return name if _IMPL_NAME.match(name) else "other"


_CUDA_FACTS: dict[str, dict[str, str]] = {}


def gpu_facts(
    device: "torch.device | str", capability: tuple[int, int] | None = None, name: str | None = None, sdpa: bool = False
) -> dict[str, str]:
    """What a call's metadata says about the GPU it ran on: {} off CUDA; on CUDA the compute capability
    ('9.0'), the GPU's name and, for an SDPA call (``sdpa``), the flash implementation PyTorch had active
    (``flash_impl``). ``capability`` and ``name`` stand for what torch.cuda says (asked once per device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    if capability is None:
        key = str(device)
        if key not in _CUDA_FACTS:
            _CUDA_FACTS[key] = _ask_cuda(device)
        out = dict(_CUDA_FACTS[key])
    else:
        out = {"capability": f"{int(capability[0])}.{int(capability[1])}"}
        if name:
            out["gpu_name"] = _short(name)
    if sdpa:
        impl = flash_impl()
        if impl is not None:
            out["flash_impl"] = impl
    return out


def _ask_cuda(device: "torch.device") -> dict[str, str]:
    try:
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    except Exception:  # a device torch cannot describe: its facts are not recorded
        return {}
    return {"capability": f"{major}.{minor}", "gpu_name": _short(name)}


def _short(text: str) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in str(text))[:128]


# --------------------------------------------------------------------------- patching


def _module(name: str):
    """The module ``name`` where its package is installed (imported if it was not), else None: a package
    ``find_spec`` does not find is never imported."""
    if name in sys.modules:
        return sys.modules[name]
    top = name.split(".")[0]
    if top not in sys.modules:
        try:
            if importlib.util.find_spec(top) is None:
                return None
        except (ImportError, ValueError):
            return None
    try:
        return importlib.import_module(name)
    except Exception:  # installed but broken (a missing CUDA library, another build): not recorded
        return None


class FlashPatch:
    """The flash-attn functions routed through ``call(original, package, function, args, kwargs)`` while it is
    entered; every attribute it set is put back on exit."""

    def __init__(self, call: Callable) -> None:
        self.call = call
        self.patched: list[tuple[object, str, object, object]] = []  # (owner, attribute, original, wrapper)
        self.wrappers: dict[int, object] = {}  # id(original) -> its wrapper

    def __enter__(self) -> "FlashPatch":
        try:
            for name, package in FLASH_MODULES:
                module = _module(name)
                if module is None:
                    continue
                for fn in FLASH_FUNCTIONS:
                    original = module.__dict__.get(fn)
                    if not callable(original) or hasattr(original, ORIGINAL):
                        continue
                    wrapper = self.wrappers.get(id(original))
                    if wrapper is None:
                        wrapper = self.wrappers[id(original)] = self._wrap(original, package, fn)
                    self._set(module, fn, original, wrapper)
            users = sys.modules.get(TRANSFORMERS_FLASH)  # never imported here: patched where a model loaded it
            if users is not None:
                for attr, value in list(vars(users).items()):
                    wrapper = self.wrappers.get(id(value))
                    if wrapper is not None:
                        self._set(users, attr, value, wrapper)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _set(self, owner, attr: str, original, wrapper) -> None:
        setattr(owner, attr, wrapper)
        self.patched.append((owner, attr, original, wrapper))

    def _wrap(self, original, package: str, fn: str):
        call = self.call

        @functools.wraps(original)  # inspect.signature follows __wrapped__: transformers reads the arguments off it
        def recorded(*args, **kwargs):
            return call(original, package, fn, args, kwargs)

        setattr(recorded, ORIGINAL, original)
        return recorded

    def __exit__(self, *exc) -> None:
        for owner, attr, original, wrapper in reversed(self.patched):
            if getattr(owner, attr, None) is wrapper:  # one replaced again since is left to whoever replaced it
                setattr(owner, attr, original)
        self.patched = []
        users = sys.modules.get(TRANSFORMERS_FLASH)  # transformers loaded its implementation while recording
        if users is not None:
            for attr, value in list(vars(users).items()):
                original = getattr(value, ORIGINAL, None) if callable(value) else None
                if original is not None and id(original) in self.wrappers:
                    setattr(users, attr, original)


# --------------------------------------------------------------------------- one call's facts


def bound_arguments(original, args, kwargs) -> dict | None:
    """The call's arguments by name, defaults filled in; None where they do not fit the signature."""
    try:
        sig = inspect.signature(original)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    out = dict(bound.arguments)
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(out.pop(p.name, None) or {})
    return out


def _window(value) -> tuple[int, int]:
    """window_size as given -> (left, right), -1 for unbounded (FA2/FA3's -1, FA4's None)."""
    try:
        left, right = value
    except (TypeError, ValueError):
        return (-1, -1)
    return tuple(-1 if x is None or int(x) < 0 else int(x) for x in (left, right))


def _number(x) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return float(x)
    return None


def flash_meta(package: str, fn: str, a: dict, q: "torch.Tensor", k: "torch.Tensor") -> dict[str, str]:
    """A flash_attn call's metadata (strings), from its arguments by name; q and k as flash-attn takes them
    (heads on axis -2)."""
    scale = _number(a.get("softmax_scale"))
    cap = _number(a.get("softcap")) or 0.0
    left, right = _window(a.get("window_size"))
    descales = [r for r in "qkv" if a.get(f"{r}_descale") is not None]
    extras = [name for name, default in EXTRAS.items() if name in a and not _is_default(a[name], default)]
    return {
        "dtype": str(q.dtype).removeprefix("torch."),
        "is_causal": "true" if a.get("causal") else "false",
        "scale": "none" if scale is None else repr(scale),
        "scale_source": "default" if scale is None else "argument",
        "enable_gqa": "true" if q.shape[-2] != k.shape[-2] else "false",
        "dropout_p": repr(_number(a.get("dropout_p")) or 0.0),
        "softcap": "none" if cap == 0.0 else repr(cap),
        "window": f"{left},{right}",
        "descales": ",".join(descales) or "none",
        "sinks": "true" if any(a.get(n) is not None for n in SINKS) else "false",
        "flash_extras": ",".join(extras) or "none",
        "flash_fn": fn,
        "flash_package": package,
    }


def _is_default(value, default) -> bool:
    return value is None if default is None else (not isinstance(value, bool) and value == default)


def side_tensors(a: dict) -> dict[str, "torch.Tensor"]:
    """The descale factors and the sinks a call was given (small tensors, kept beside q, k, v)."""
    out = {f"{r}_descale": a[f"{r}_descale"].detach() for r in "qkv" if isinstance(a.get(f"{r}_descale"), torch.Tensor)}
    sink = next((a[n] for n in SINKS if isinstance(a.get(n), torch.Tensor)), None)
    if sink is not None:
        out["sinks"] = sink.detach()
    return out


def sequences(fn: str, a: dict, out) -> tuple[list[tuple], str | None]:
    """The call's attentions as (q, k, v, out or None, sequence, sequences) in attncheck's (B, H, T, D) layout: one
    for flash_attn_func (sequence None), one per sequence with queries for flash_attn_varlen_func (the packed rows
    between two cumulative lengths, as batch 1); and why the call cannot be recorded (None where it can)."""
    q, k, v = a.get("q"), a.get("k"), a.get("v")
    o = out[0] if isinstance(out, (tuple, list)) and out else out
    o = o if isinstance(o, torch.Tensor) and isinstance(q, torch.Tensor) and o.shape[:-1] == q.shape[:-1] else None
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return [], "q, k and v are not tensors"
    if any(a.get(n) is not None for n in PAGED):
        return [], "a paged KV cache (block_table / page_table): k and v are not one tensor per sequence"
    cu_q, cu_k = a.get("cu_seqlens_q"), a.get("cu_seqlens_k")
    if fn == "flash_attn_varlen_func" and (cu_q is not None or cu_k is not None):
        if cu_q is None or cu_k is None or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return [], "packed sequences given for only one of q and k"
        bq, bk = cu_q.tolist(), cu_k.tolist()
        if len(bq) != len(bk) or len(bq) < 2:
            return [], f"{len(bq) - 1} query and {len(bk) - 1} key sequences"
        calls = []
        for i in range(len(bq) - 1):
            if bq[i + 1] <= bq[i]:
                continue  # a sequence without queries computes nothing
            parts = tuple(
                None if t is None else _bhtd(t[lo:hi].unsqueeze(0))
                for t, lo, hi in (
                    (q, bq[i], bq[i + 1]),
                    (k, bk[i], bk[i + 1]),
                    (v, bk[i], bk[i + 1]),
                    (o, bq[i], bq[i + 1]),
                )
            )
            calls.append((*parts, i, len(bq) - 1))
        return calls, None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return [], f"q of {q.dim()} axes, not (batch, seqlen, heads, headdim)"
    return [(_bhtd(q), _bhtd(k), _bhtd(v), None if o is None else _bhtd(o), None, None)], None


def _bhtd(t: "torch.Tensor") -> "torch.Tensor":
    """(B, T, H, D) -> (B, H, T, D), a view (copied when stored)."""
    return t.detach().transpose(1, 2)


__all__ = [
    "FLASH_FUNCTIONS",
    "FLASH_MODULES",
    "FlashPatch",
    "bound_arguments",
    "flash_impl",
    "flash_meta",
    "gpu_facts",
    "sequences",
    "side_tensors",
]
