"""What a capture's call files say about each call: the capture format's names (schema, file names, tensor
roles), its metadata typed and checked, the ``CallInfo`` built from it (with the flash_attn call checks: whether a
path computes the call), and ``CallSource``, one call found in the inputs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attncheck.loaders import jsondoc
from attncheck.loaders.capture_schema import FIELD_HELP, CallMeta, meta_fields
from attncheck.loaders.common import TensorSource, error, shorten
from attncheck.registry import PATHS
from attncheck.results import CallInfo

CAPTURE_SCHEMA = "attncheck.capture/1"


MANIFEST = "manifest.json"


FORMAT_KEY = "format"  # safetensors metadata key holding CAPTURE_SCHEMA in every call file


CALL_FILE = re.compile(r"^(\d{4,})-([A-Za-z0-9._-]*)\.safetensors$")


GRADS_SUFFIX = (
    ".grads.safetensors"  # a call's gradients, written when the backward reaches it: NNNN-<module>.grads.safetensors
)


KINDS = ("sdpa", "softmax")


GRAD_ROLES = ("grad_out", "grad_q", "grad_k", "grad_v")  # dO, and the gradients the call's kernel produced


# scores_mod, scores_mod64: a flex call's logits after its score_mod, as flex computes them (fp32) and in float64;
# sinks: a call's learned sink logits, one per query head (gpt-oss's eager softmax over [S, sink], FA4's learnable_sink)
ROLES = ("q", "k", "v", "attn_mask", "scores", "out", "scores_mod", "scores_mod64", "sinks", *GRAD_ROLES)


MASK_ROLES = ("attn_mask", "mask")  # boolean or float; the others are floating point


_MAX_MODULE_CHARS = 120


def file_part(module: str) -> str:
    """A module path as a file name part: safe characters only, never a path ('' -> 'global')."""
    text = re.sub(r"[^A-Za-z0-9._-]", "_", module).strip(".") or "global"
    return text[:_MAX_MODULE_CHARS]


def call_file_name(index: int, module: str) -> str:
    """'0007-model.layers.1.self_attn.safetensors'."""
    return f"{index:04d}-{file_part(module)}.safetensors"


def grads_file_name(index: int, module: str) -> str:
    """'0007-model.layers.1.self_attn.grads.safetensors': the gradients of call 7."""
    return call_file_name(index, module).removesuffix(".safetensors") + GRADS_SUFFIX


@dataclass(frozen=True, eq=False)
class CallSource:
    """One attention call found in the inputs: what is known about it, and how to load its tensors
    (role -> tensor: q, k, v, attn_mask, scores). ``problem``: why it cannot be diagnosed,
    found while opening (the load is then never called)."""

    info: CallInfo
    load: Callable[[], dict[str, torch.Tensor]]
    problem: str | None = None


Input = TensorSource | CallSource


def _label(torch_name: str | None) -> str | None:
    """'float16' -> 'fp16' for the dtypes attncheck computes in; others as given."""
    labels = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
    return labels.get(torch_name or "", torch_name or None)


def call_meta(meta: dict[str, str]) -> CallMeta:
    """A call file's metadata, typed and checked (``capture_schema.CallMeta``); a field of the
    wrong type or out of range is an error naming it and its value:
    'metadata: scale: expected float > 0.0, got '-1' (a positive finite number)'."""
    try:
        return jsondoc.convert(meta_fields(meta), CallMeta, lax=True)
    except jsondoc.JSONError as exc:
        why = str(exc)
        key = why.split(":", 1)[0]
        value = meta.get(key)
        if isinstance(value, str):
            shown = shorten(repr(value))
            why = why + f" {shown}" if why.endswith("got str") else (why if shown in why else f"{why}, got {shown}")
        raise error(f"metadata: {why}" + (f" ({FIELD_HELP[key]})" if key in FIELD_HELP else "")) from None


def info_from_meta(meta: dict[str, str], *, index: int, name: str, file: str | None) -> CallInfo:
    """A call file's metadata (strings, as safetensors keeps them), checked -> CallInfo."""
    m = call_meta(meta)
    kind = m.kind
    if kind == "flash_attn":
        _flash_judged(m, meta)
    return CallInfo(
        index=index,
        name=name,
        kind=kind,
        module=m.module,
        file=file,
        dtype=_label(m.dtype),
        softmax_dtype=_label(m.softmax_dtype),
        is_causal=m.is_causal,
        scale=m.scale,
        enable_gqa=m.enable_gqa,
        dropout_p=m.dropout_p,
        has_qk=m.has_qk,
        forward=m.forward or None,
        meta=dict(meta),
    )


def _flash_judged(m: CallMeta, meta: dict[str, str]) -> None:
    """A flash_attn call a path computes: a package generation some path stands for (fa2-fma: FlashAttention-2;
    fa3: FlashAttention-3's ``flash_attn_interface``), with no soft cap, window, sinks, FP8 descales (FA3's FP8
    calls stay refused: their descales are not read from the capture yet) or other arguments; causal only with
    as many queries as keys (flash-attn's causal mask is aligned to the bottom right, the mask the diagnosis
    builds to the top left); anything else is one line saying why it is not judged."""
    why = []
    package = m.flash_package or "fa2"
    if not any(st.matches("flash_attn", package, "") for spec in PATHS for st in spec.stands_for):
        why.append(f"{package}'s kernel")  # no path stands for this package's kernel yet
    if m.softcap not in (None, "none", ""):
        try:
            cap = float(m.softcap)
        except ValueError:
            raise error(f"metadata: softcap: expected a number or none, got {shorten(repr(m.softcap))}") from None
        if cap != 0.0:
            why.append(f"softcap {cap!r}")
    if m.window is not None:
        left, right = (int(x) for x in m.window.split(","))
        if left >= 0 or (right >= 0 and not m.is_causal):
            why.append(f"window ({left}, {right})")
    if m.sinks:
        why.append("sinks")
    if m.descales not in (None, "none"):
        why.append(f"descales of {m.descales}")
    if m.flash_extras not in (None, "none", ""):
        why.append(m.flash_extras)
    if m.is_causal:
        try:
            shapes = json.loads(m.shapes or "")
            tq, tk = shapes["q"][-2], shapes["k"][-2]
        except (ValueError, KeyError, TypeError, IndexError):
            tq = tk = None
        if tq is None or tq != tk:
            why.append(
                "causal with "
                + (f"{tq} queries and {tk} keys (bottom-right aligned)" if tq is not None else "no shapes recorded")
            )
    if why:
        fn = f"{m.flash_package or 'flash-attn'} {m.flash_fn or 'call'}"
        raise error(
            f"a flash_attn call ({fn}) with {', '.join(why)}: attncheck has no path for it yet "
            "(judged by FlashAttention-2's path without them it would be judged wrong)"
        )


def _clip(name: str, limit: int = 200) -> str:
    """A name from a file in a message: itself, cut short when very long (control characters are
    kept: the message's printer shows them)."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _call_label(path: str, kind: object = None, module: object = None, index: int | None = None) -> str:
    """'DIR/0003-m.safetensors (call 3, sdpa in model.layers.1.self_attn)'."""
    parts = []
    if index is not None:
        parts.append(f"call {index}")
    if isinstance(kind, str) and kind:
        parts.append(f"{_clip(kind, 40)} in {_clip(module)}" if isinstance(module, str) and module else _clip(kind, 40))
    return f"{path} ({', '.join(parts)})" if parts else path


def _broken(info: CallInfo, problem: str) -> CallSource:
    def load() -> dict[str, torch.Tensor]:
        raise error(problem)

    return CallSource(info, load, problem)
