"""Attention calls in files: capture directories, single call files, and files whose tensors
are named like q/k/v/mask.

A capture directory (written by ``attncheck.capture``) holds one ``.safetensors`` file per
call, named in call order with the module path (``0007-model.layers.1.self_attn.safetensors``),
each with its metadata in the safetensors header, and a ``manifest.json`` listing them.
Reading one checks the manifest against the files before any tensor is read: a missing,
unlisted, corrupt or mismatching file is an error naming the call. Nothing is read outside
the directory (file names in the manifest are plain names).

A plain file whose keys end in q/k names (``q``, ``query``, ``layers.3.key``, ...) is read as
calls too, one per key prefix: q, k and optionally v, a mask and scores.

No math and no printing: problems are :class:`~attncheck.errors.AttncheckError` lines.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attncheck.errors import AttncheckError
from attncheck.loaders.common import TensorSource, check_tensor, error, qualified_name, reason
from attncheck.loaders.paths import KeySelector, expand_paths, natural_key
from attncheck.results import CallInfo

CAPTURE_SCHEMA = "attncheck.capture/1"
MANIFEST = "manifest.json"
FORMAT_KEY = "format"  # safetensors metadata key holding CAPTURE_SCHEMA in every call file
CALL_FILE = re.compile(r"^(\d{4,})-([A-Za-z0-9._-]*)\.safetensors$")
GRADS_SUFFIX = ".grads.safetensors"  # a call's gradients, written when the backward reaches it: NNNN-<module>.grads.safetensors
KINDS = ("sdpa", "softmax")
GRAD_ROLES = ("grad_out", "grad_q", "grad_k", "grad_v")  # dO, and the gradients the call's kernel produced
ROLES = ("q", "k", "v", "attn_mask", "scores", "out", *GRAD_ROLES)
MASK_ROLES = ("attn_mask", "mask")  # boolean or float; the others are floating point

# Leaf names of tensors read as a role of an attention call (case-insensitive).
ROLE_NAMES = {
    "q": ("q", "query", "queries", "query_states", "xq"),
    "k": ("k", "key", "keys", "key_states", "xk"),
    "v": ("v", "value", "values", "value_states", "xv"),
    "attn_mask": ("mask", "attn_mask", "attention_mask", "attn_bias"),
    "scores": ("scores", "attn_scores", "logits", "attn_logits"),
    "grad_out": ("grad_out", "dout", "d_out", "grad_output", "grad_o"),
}
_ROLE_OF = {name: role for role, names in ROLE_NAMES.items() for name in names}
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


# --------------------------------------------------------------------------- metadata


def _flag(value: str | None) -> bool:
    return (value or "").lower() == "true"


def _number(value: str | None) -> float | None:
    try:
        return None if value in (None, "", "none") else float(value)
    except ValueError:
        return None


def _label(torch_name: str | None) -> str | None:
    """'float16' -> 'fp16' for the dtypes attncheck computes in; others as given."""
    labels = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
    return labels.get(torch_name or "", torch_name or None)


def info_from_meta(meta: dict[str, str], *, index: int, name: str, file: str | None) -> CallInfo:
    """A call file's metadata (strings, as safetensors keeps them) -> CallInfo."""
    forward = meta.get("forward")
    return CallInfo(
        index=index,
        name=name,
        kind=meta.get("kind", "scores"),
        module=meta.get("module", ""),
        file=file,
        dtype=_label(meta.get("dtype")),
        softmax_dtype=_label(meta.get("softmax_dtype")) if meta.get("softmax_dtype") not in (None, "", "none") else None,
        is_causal=_flag(meta.get("is_causal")),
        scale=_number(meta.get("scale")),
        enable_gqa=_flag(meta.get("enable_gqa")),
        dropout_p=_number(meta.get("dropout_p")) or 0.0,
        has_qk=_flag(meta.get("has_qk")),
        forward=int(forward) if forward and forward.isdigit() and int(forward) > 0 else None,
        meta=dict(meta),
    )


def _call_label(path: str, meta: dict[str, str] | None, index: int | None = None) -> str:
    """'DIR/0003-m.safetensors (call 3, sdpa in model.layers.1.self_attn)'."""
    parts = []
    if index is not None:
        parts.append(f"call {index}")
    if meta:
        kind, module = meta.get("kind"), meta.get("module")
        if kind:
            parts.append(f"{kind} in {module}" if module else kind)
    return f"{path} ({', '.join(parts)})" if parts else path


# --------------------------------------------------------------------------- call files


def read_call_header(path: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """(metadata, {key: (dtype, shape)}) of a safetensors file, checked against its size."""
    from attncheck.loaders.formats.safetensors import inspect_file

    return inspect_file(path)


def is_call_file(path: str) -> bool:
    """A .safetensors file written by a capture (its header says so)."""
    if not path.lower().endswith(".safetensors"):
        return False
    try:
        meta, _ = read_call_header(path)
    except AttncheckError:
        return False
    return meta.get(FORMAT_KEY, "").startswith("attncheck.capture/")


def _load_call_tensors(path: str, label: str) -> dict[str, torch.Tensor]:
    """The call's tensors by role (others in the file are left out), each checked."""
    from safetensors.torch import load_file

    try:
        raw = load_file(path)
    except Exception as exc:
        raise error(f"{label}: cannot read the call's tensors ({reason(exc)})") from exc
    out = {}
    for role, t in raw.items():
        if role not in ROLES:
            continue
        out[role] = check_tensor(f"{label}: {role}", t, "mask" if role in MASK_ROLES else "scores")
    return out


def _check_roles(label: str, meta: dict[str, str], entries: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    kind = meta.get("kind")
    if kind not in KINDS:
        return f"{label}: unknown call kind {kind!r} (expected {', '.join(KINDS)})"
    need = ("q", "k") if kind == "sdpa" else ("scores",)
    missing = [r for r in need if r not in entries]
    if missing:
        return f"{label}: the {kind} call has no {' or '.join(missing)} tensor"
    return None


def call_file_source(path: str, index: int, meta: dict[str, str], entries: dict[str, tuple[str, tuple[int, ...]]]) -> CallSource:
    label = _call_label(path, meta, index)
    info = info_from_meta(meta, index=index, name=path, file=path)
    problem = _check_roles(label, meta, entries)
    return CallSource(info, lambda: _load_call_tensors(path, label), problem)


# --------------------------------------------------------------------------- capture directories


def is_capture_dir(path: str | os.PathLike[str]) -> bool:
    """A directory holding a capture's manifest; False for anything that cannot be stat'ed
    (a name too long, a path through a file): the file loaders then say what is wrong."""
    try:
        return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def read_manifest(directory: str | os.PathLike[str]) -> dict:
    """The manifest of a capture directory, checked for its schema and call list."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise error(f"{path}: cannot read the manifest ({reason(exc)})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not a valid capture manifest (not JSON: {reason(exc)})") from exc
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("attncheck.capture/"):
        raise error(f"{path}: not an attncheck capture manifest (no schema {CAPTURE_SCHEMA!r})")
    calls = doc.get("calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise error(f"{path}: not a valid capture manifest ('calls' is not a list of objects)")
    return doc


def open_capture(directory: str | os.PathLike[str], selector: KeySelector | None = None) -> tuple[list[CallSource], dict]:
    """The calls of a capture directory in call order, each checked against its manifest entry
    and its file header; and the manifest. Per-call problems are kept in ``problem``;
    a manifest that cannot be read raises."""
    given = os.fspath(directory)
    doc = read_manifest(given)
    manifest = os.path.join(given, MANIFEST)
    listed: dict[str, dict] = {}
    out: list[CallSource] = []
    for i, entry in enumerate(doc["calls"]):
        name = entry.get("file")
        index = entry.get("index")
        if not isinstance(name, str) or not CALL_FILE.match(name) or os.path.basename(name) != name:
            raise error(f"{manifest}: call entry {i} names {name!r}, not a call file of this directory")
        if not isinstance(index, int) or isinstance(index, bool):
            raise error(f"{manifest}: call entry {i} ({name}) has no integer index")
        listed[name] = entry
        path = os.path.join(given, name)
        label = _call_label(path, entry, index)
        if selector is not None and not selector.select(given, [entry.get("module") or "global"]):
            continue
        if not os.path.isfile(path):
            out.append(_broken(path, index, entry, f"{label}: listed in {manifest} but missing"))
            continue
        try:
            meta, entries = read_call_header(path)
        except AttncheckError as exc:
            out.append(_broken(path, index, entry, f"{label}: {_strip_path(exc.message, path)}"))
            continue
        problem = _mismatch(label, manifest, entry, index, meta, entries)
        source = call_file_source(path, index, meta, entries)
        load, grads_problem = source.load, None
        grads = entry.get("grads")
        if isinstance(grads, dict):
            gname = grads.get("file")
            if not isinstance(gname, str) or gname != grads_file_name(index, entry.get("module") or "") or os.path.basename(gname) != gname:
                raise error(f"{manifest}: call entry {i} names the gradients file {gname!r}, not this call's")
            listed[gname] = grads
            load, grads_problem = _with_grads(source.load, os.path.join(given, gname), label)
        out.append(CallSource(source.info, load, problem or source.problem or grads_problem))
    unlisted = sorted((p.name for p in Path(given).glob("*.safetensors") if p.name not in listed), key=natural_key)
    if unlisted:
        raise error(f"{manifest} does not match the files: {os.path.join(given, unlisted[0])} is not listed in it"
                    + (f" ({len(unlisted) - 1} more)" if len(unlisted) > 1 else ""))
    out.sort(key=lambda s: s.info.index)
    return out, doc


def _with_grads(load: Callable[[], dict[str, torch.Tensor]], path: str, label: str) -> tuple[Callable[[], dict[str, torch.Tensor]], str | None]:
    """A call's loader that adds the tensors of its gradients file (only the gradient roles)."""
    if not os.path.isfile(path):
        return load, f"{label}: its gradients file {path} is listed in the manifest but missing"
    try:
        meta, _ = read_call_header(path)
    except AttncheckError as exc:
        return load, f"{label}: its gradients file: {_strip_path(exc.message, path)}"
    if meta.get("grads") != "true":
        return load, f"{label}: {path} is not a gradients file (no 'grads' in its metadata)"

    def both() -> dict[str, torch.Tensor]:
        tensors = load()
        tensors.update({role: t for role, t in _load_call_tensors(path, label + " gradients").items() if role in GRAD_ROLES})
        return tensors

    return both, None


def _strip_path(message: str, path: str) -> str:
    return message[len(path) + 2:] if message.startswith(path + ": ") else message


def _broken(path: str, index: int, entry: dict, problem: str) -> CallSource:
    meta = {k: str(v) for k, v in entry.items() if isinstance(v, (str, int, float, bool))}
    info = info_from_meta(meta, index=index, name=path, file=path)

    def load() -> dict[str, torch.Tensor]:
        raise error(problem)

    return CallSource(info, load, problem)


def _mismatch(label: str, manifest: str, entry: dict, index: int, meta: dict[str, str], entries: dict) -> str | None:
    if not meta.get(FORMAT_KEY, "").startswith("attncheck.capture/"):
        return f"{label}: not a capture call file (no {FORMAT_KEY!r} in its metadata)"
    for key, want in (("kind", entry.get("kind")), ("module", entry.get("module")), ("call", str(index))):
        if want is not None and meta.get(key) != str(want):
            return f"{label}: does not match {manifest} ({key} {meta.get(key)!r} in the file, {want!r} in the manifest)"
    shapes = entry.get("tensors")
    if isinstance(shapes, dict):
        for role, spec in shapes.items():
            got = entries.get(role)
            want = tuple(spec.get("shape", ())) if isinstance(spec, dict) else None
            if got is None or (want is not None and tuple(got[1]) != want):
                found = "absent" if got is None else f"shape {tuple(got[1])}"
                return f"{label}: does not match {manifest} (tensor {role!r}: {found} in the file, shape {want} in the manifest)"
    return None


# --------------------------------------------------------------------------- q/k files


def role_of(key: str) -> tuple[str, str | None]:
    """'layers.3.query' -> ('layers.3', 'q'); 'scores' -> ('', 'scores'); others -> (key, None)."""
    for sep in (".", "/", ":"):
        if sep in key:
            prefix, leaf = key.rsplit(sep, 1)
            break
    else:
        prefix, leaf = "", key
    role = _ROLE_OF.get(leaf.lower())
    return (prefix, role) if role else (key, None)


def qk_groups(keys: Sequence[str | None]) -> tuple[list[tuple[str, dict[str, str]]], list[str | None]]:
    """Keys -> ([(prefix, {role: key})] for prefixes holding q and k, in natural order;
    the keys left, read as score tensors)."""
    by_prefix: dict[str, dict[str, str]] = {}
    for key in keys:
        if key is None:
            continue
        prefix, role = role_of(key)
        if role is not None and role not in by_prefix.setdefault(prefix, {}):
            by_prefix[prefix][role] = key
    groups = [(p, roles) for p, roles in by_prefix.items() if "q" in roles and "k" in roles]
    groups.sort(key=lambda g: natural_key(g[0]))
    used = {key for _, roles in groups for key in roles.values()}
    return groups, [k for k in keys if k not in used]


# --------------------------------------------------------------------------- everything


def open_inputs(paths: Sequence[str | os.PathLike[str]], keys: Sequence[str] = (), max_bytes: int | None = None) -> tuple[list[Input], list[dict]]:
    """Every input in ``paths``: score tensors as row-block sources, attention calls as
    ``CallSource``s; capture directories by their manifest. Files and calls in natural order.
    Also returns the manifests read. ``keys`` picks tensors inside plain files and calls
    by their module path. ``max_bytes`` bounds what a file must hold whole (a .pt file)."""
    from attncheck.loaders import open_file

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    selector = KeySelector(keys)
    found: list[Input] = []
    manifests: list[dict] = []
    plain: list[str] = []
    for raw in paths:
        if is_capture_dir(raw):
            calls, doc = open_capture(raw, selector)
            found.extend(calls)
            manifests.append(doc)
        else:
            plain.append(os.fspath(raw))
    files = expand_paths(plain) if plain else []
    order = len(found)
    for file in files:
        if is_call_file(file):
            meta, entries = read_call_header(file)
            if selector.select(file, [meta.get("module") or "global"]):
                found.append(call_file_source(file, order, meta, entries))
                order += 1
            continue
        listing = open_file(file, "scores", max_bytes)
        selected = selector.select(listing.path, listing.keys)
        if not selected:
            continue
        groups, rest = qk_groups(selected)
        items: list[tuple[str, Input | None, list]] = []
        for prefix, roles in groups:
            name = qualified_name(listing.path, prefix) if prefix else listing.path
            items.append((prefix, None, [name, roles]))
        if rest:
            for src in listing.sources(rest):
                key = src.name[len(listing.path) + 1:] if src.name.startswith(listing.path + ":") else ""
                items.append((key, src, []))
        if listing.path.lower().endswith(".safetensors"):  # its keys have no order of their own
            items.sort(key=lambda item: natural_key(item[0]))
        for _, src, group in items:
            if src is not None:
                found.append(src)
                continue
            name, roles = group
            info = CallInfo(index=order, name=name, kind="qk", has_qk=True)
            found.append(CallSource(info, _group_loader(listing, roles)))
            order += 1
    selector.check_all_matched()
    return found, manifests


def _group_loader(listing, roles: dict[str, str]) -> Callable[[], dict[str, torch.Tensor]]:
    def load() -> dict[str, torch.Tensor]:
        by_key = dict(listing.load(list(roles.values())))
        return {role: check_tensor(qualified_name(listing.path, key), by_key[key], "mask" if role in MASK_ROLES else "scores") for role, key in roles.items()}

    return load


def check_manifest_message(doc: dict) -> str | None:
    """What a manifest says about an incomplete capture: stopped early, or the script failed."""
    parts = []
    if doc.get("stopped"):
        parts.append(f"recording stopped: {doc['stopped']}")
    script = doc.get("script") or {}
    if isinstance(script, dict) and script.get("error"):
        parts.append(f"the script failed: {script['error']}")
    return "; ".join(parts) or None


__all__ = [
    "CAPTURE_SCHEMA", "MANIFEST", "CallSource", "Input", "call_file_name", "file_part", "grads_file_name", "is_call_file",
    "is_capture_dir", "open_capture", "open_inputs", "qk_groups", "read_manifest", "role_of",
]
