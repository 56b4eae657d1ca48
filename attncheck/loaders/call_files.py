"""One capture call file: its header read, its tensors loaded by role and checked (the gradients file beside it
too), and its size; a file that does not match what its manifest lists is one problem naming the call."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import safetensors
import torch

from attncheck.errors import AttncheckError, param
from attncheck.format import size_text
from attncheck.loaders.call_info import (
    FORMAT_KEY,
    GRAD_ROLES,
    MASK_ROLES,
    ROLES,
    CallSource,
    _broken,
    _call_label,
    info_from_meta,
)
from attncheck.loaders.capture_schema import CAPTURE_SCHEMA_PREFIX, ManifestCall
from attncheck.loaders.common import check_tensor, error, reason, shorten
from attncheck.loaders.formats.safetensors import inspect_file, short_of_memory
from attncheck.results import CallInfo


def read_call_header(path: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """(metadata, {key: (dtype, shape)}) of a safetensors file, checked against its size."""
    return inspect_file(path)


def is_call_file(path: str) -> bool:
    """A .safetensors file written by a capture (its header says so)."""
    if not path.lower().endswith(".safetensors"):
        return False
    try:
        meta, _ = read_call_header(path)
    except AttncheckError:
        return False
    return meta.get(FORMAT_KEY, "").startswith(CAPTURE_SCHEMA_PREFIX)


def _load_call_tensors(path: str, label: str) -> dict[str, torch.Tensor]:
    """The tensors of a call file by role (others in the file are left out), each checked."""
    out = {}
    try:
        # safetensors.safe_open looked up when called: tests replace it to fake a failed read
        with safetensors.safe_open(path, framework="pt") as f:
            for role in ROLES:
                if role in f.keys():
                    out[role] = f.get_tensor(role)
    except Exception as exc:
        if short_of_memory(exc):  # safetensors maps the whole file: an address-space limit, not a bad file
            raise error(
                f"{label}: memory is short: the call's file could not be mapped ({reason(exc)}); "
                f"raise the address-space limit (ulimit -v)"
            ) from exc
        raise error(f"{label}: cannot read the call's tensors ({reason(exc)})") from exc
    return {
        role: check_tensor(f"{label}: {role}", t, "mask" if role in MASK_ROLES else "scores") for role, t in out.items()
    }


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "bool": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


def call_bytes(entries: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the tensors a call's diagnosis loads (its roles), from its header."""
    return sum(math.prod(shape) * _ITEMSIZE.get(dtype, 8) for role, (dtype, shape) in entries.items() if role in ROLES)


def _check_roles(
    label: str, kind: str, entries: dict[str, tuple[str, tuple[int, ...]]], meta: dict[str, str] | None = None
) -> str | None:
    need = ("q", "k") if kind in ("sdpa", "flex", "flash_attn") else ("scores",)
    missing = [r for r in need if r not in entries]
    if missing:
        return f"{label}: the {kind} call has no {' or '.join(missing)} tensor"
    mod = (meta or {}).get("score_mod", "none")
    if kind == "flex" and mod not in ("none", ""):  # judged on q.k alone, it would be judged as another attention
        lost = [r for r in ("scores_mod", "scores_mod64") if r not in entries]
        if lost:
            return (
                f"{label}: the flex call's score_mod {shorten(repr(mod))} changed its logits, but the file "
                "holds no "
                f"{' or '.join(lost)} tensor (its logits after the score_mod); its raw q.k logits are not what "
                "it computed"
            )
    return None


def call_file_source(
    path: str,
    index: int,
    meta: dict[str, str],
    entries: dict[str, tuple[str, tuple[int, ...]]],
    fallback: CallInfo | None = None,
    max_bytes: int | None = None,
) -> CallSource:
    """The call of a call file; metadata that does not check out, or tensors that would not fit in
    ``max_bytes`` once loaded, are its ``problem`` (``fallback``, or what can be read of the metadata,
    names it in the report)."""
    label = _call_label(path, meta.get("kind"), meta.get("module"), index)
    try:
        info = info_from_meta(meta, index=index, name=path, file=path)
    except AttncheckError as exc:
        info = fallback or CallInfo(index=index, name=path, kind="unknown", file=path)
        return _broken(info, f"{label}: {exc.message}")
    if "kv_base" in meta and fallback is None:  # a file alone: the calls its K and V extend are not there
        own = meta.get("call", "")
        if own.isdigit():  # named by its own index in the capture, the one kv_base counts in, not the file's place
            label = _call_label(path, meta.get("kind"), meta.get("module"), int(own))
        return _broken(
            info,
            f"{label}: a decode step stored by its new rows (its K and V extend call {meta['kv_base']}): read it in "
            "its capture directory",
        )
    size = call_bytes(entries)
    if max_bytes is not None and size > max_bytes:
        return _broken(
            info,
            f"{label}: loading the call whole needs {size_text(size)}, over {param('max_memory')} "
            f"{size_text(max_bytes)}",
        )
    return CallSource(info, lambda: _load_call_tensors(path, label), _check_roles(label, info.kind, entries, meta))


def _with_grads(
    load: Callable[[], dict[str, torch.Tensor]],
    path: str,
    label: str,
    index: int,
    module: str,
    call_entries: dict[str, tuple[str, tuple[int, ...]]],
) -> tuple[Callable[[], dict[str, torch.Tensor]], str | None]:
    """A call's loader that adds the tensors of its gradients file (only the gradient roles). The file must be this
    call's: its metadata names the call and its module, and each gradient has the shape of what it is the gradient of
    (dq of q, dO of the output): another call's gradients would be judged as this kernel's and read as attncheck's
    emulation being wrong."""
    if os.path.islink(path):
        return (
            load,
            f"{label}: its gradients file {path} is a symbolic link; a capture's files are plain files of its "
            "directory (nothing is read outside it)",
        )
    if not os.path.isfile(path):
        return load, f"{label}: its gradients file {path} is listed in the manifest but " + (
            "not a file" if os.path.lexists(path) else "missing"
        )
    try:
        meta, grad_entries = read_call_header(path)
    except AttncheckError as exc:
        return load, f"{label}: its gradients file: {_strip_path(exc.message, path)}"
    if not str(meta.get(FORMAT_KEY, "")).startswith(CAPTURE_SCHEMA_PREFIX) or meta.get("grads") != "true":
        return (
            load,
            f"{label}: {path} is not a capture's gradients file (its metadata needs {FORMAT_KEY} "
            f"{CAPTURE_SCHEMA_PREFIX}... and grads true)",
        )
    for key, want in (("call", str(index)), ("module", module)):
        if meta.get(key) != want:
            got = shorten(repr(meta.get(key)))
            return load, (
                f"{label}: its gradients file {path} belongs to another call ({key} {got} in it, "
                f"{shorten(repr(want))} for this call)"
            )
    problem = _grad_shapes(label, path, grad_entries, call_entries)
    if problem:
        return load, problem

    def both() -> dict[str, torch.Tensor]:
        tensors = load()
        tensors.update(
            {role: t for role, t in _load_call_tensors(path, label + " gradients").items() if role in GRAD_ROLES}
        )
        return tensors

    return both, None


def _grad_shapes(label: str, path: str, grads: dict, call: dict) -> str | None:
    """Why the gradients in ``grads`` cannot be those of the call whose tensors are ``call`` (header entries)."""
    shapes = {role: tuple(spec[1]) for role, spec in call.items()}
    want = {"grad_q": shapes.get("q"), "grad_k": shapes.get("k"), "grad_v": shapes.get("v")}
    if "out" in shapes:
        want["grad_out"] = shapes["out"]
    elif shapes.get("q") and shapes.get("v"):  # O = P@V: q's rows, v's width
        want["grad_out"] = (*shapes["q"][:-1], shapes["v"][-1])
    for role in GRAD_ROLES:
        got, expected = grads.get(role), want.get(role)
        if got is not None and expected is not None and tuple(got[1]) != tuple(expected):
            return (
                f"{label}: its gradients file {path} belongs to another call ({role} has shape {tuple(got[1])}; "
                f"this call's is {tuple(expected)})"
            )
    return None


def _strip_path(message: str, path: str) -> str:
    return message[len(path) + 2 :] if message.startswith(path + ": ") else message


def _mismatch(label: str, manifest: str, entry: ManifestCall, meta: dict[str, str], entries: dict) -> str | None:
    if not meta.get(FORMAT_KEY, "").startswith(CAPTURE_SCHEMA_PREFIX):
        return f"{label}: not a capture call file (no {FORMAT_KEY!r} in its metadata)"
    for key, want in (("kind", entry.kind), ("module", entry.module), ("call", str(entry.index))):
        if meta.get(key) != want:
            return (
                f"{label}: does not match {manifest} ({key} {shorten(repr(meta.get(key)))} in the file, "
                f"{shorten(repr(want))} in the manifest)"
            )
    for role, spec in entry.tensors.items():
        got = entries.get(role)
        want = tuple(spec.shape)
        if got is None or tuple(got[1]) != want:
            found = "absent" if got is None else f"shape {tuple(got[1])}"
            return (
                f"{label}: does not match {manifest} (tensor {role!r}: {found} in the file, shape {want} in the "
                "manifest)"
            )
    return None
