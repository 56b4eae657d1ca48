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

import os
from collections.abc import Callable, Sequence

import torch

from attncheck.loaders import open_file

# Re-exported (noqa): the recorder, the pipelines and the tests import the capture format's names and readers from
# here, where they were before the split
from attncheck.loaders.call_files import call_file_source, is_call_file, read_call_header  # noqa: F401
from attncheck.loaders.call_info import (  # noqa: F401
    CALL_FILE,
    CAPTURE_SCHEMA,
    FORMAT_KEY,
    GRAD_ROLES,
    KINDS,
    MANIFEST,
    MASK_ROLES,
    ROLES,
    CallSource,
    Input,
    call_file_name,
    file_part,
    grads_file_name,
    info_from_meta,
)
from attncheck.loaders.capture_ranks import (  # noqa: F401
    OWNER,
    check_one_job,
    open_ranks,
    owner_alive,
    rank_dirs,
    read_owner,
    unfinished_capture,
)
from attncheck.loaders.common import check_tensor, error, qualified_name
from attncheck.loaders.manifest import (  # noqa: F401
    check_manifest_message,
    compile_message,
    is_capture_dir,
    open_capture,
    read_manifest,
)
from attncheck.loaders.paths import KeySelector, expand_paths, natural_key
from attncheck.results import CallInfo

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


def open_inputs(
    paths: Sequence[str | os.PathLike[str]], keys: Sequence[str] = (), max_bytes: int | None = None
) -> tuple[list[Input], list[dict]]:
    """Every input in ``paths``: score tensors as row-block sources, attention calls as
    ``CallSource``s; capture directories by their manifest. Files and calls in natural order.
    Also returns the manifests read. ``keys`` picks tensors inside plain files and calls
    by their module path. ``max_bytes`` bounds what a file must hold whole (a .pt file)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    selector = KeySelector(keys)
    found: list[Input] = []
    manifests: list[dict] = []
    plain: list[str] = []
    rank_named: list[tuple[str, dict]] = []  # ranks of a torchrun capture named one by one
    for raw in paths:
        if is_capture_dir(raw):
            calls, doc = open_capture(raw, selector, max_bytes)
            found.extend(calls)
            manifests.append(doc)
            if isinstance(doc.get("rank"), int) and (doc.get("world") or 1) > 1:
                rank_named.append((os.fspath(raw), doc))
        elif rank_dirs(raw):
            calls, docs = open_ranks(raw, selector, max_bytes)
            found.extend(calls)
            manifests.extend(docs)
        elif (why := unfinished_capture(raw)) is not None:
            raise error(why)
        else:
            plain.append(os.fspath(raw))
    if len(rank_named) > 1:
        check_one_job([n for n, _ in rank_named], [d for _, d in rank_named])
    files = expand_paths(plain) if plain else []
    order = len(found)
    for file in files:
        if is_call_file(file):
            meta, entries = read_call_header(file)
            if selector.select(file, [meta.get("module") or "global"]):
                found.append(call_file_source(file, order, meta, entries, max_bytes=max_bytes))
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
                key = src.name[len(listing.path) + 1 :] if src.name.startswith(listing.path + ":") else ""
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
    if len(manifests) > 1 and all(isinstance(item, CallSource) and item.info.rank is not None for item in found):
        found.sort(key=lambda item: (item.info.index, item.info.rank))  # ranks named one by one: in call order too
    return found, manifests


def _group_loader(listing, roles: dict[str, str]) -> Callable[[], dict[str, torch.Tensor]]:
    def load() -> dict[str, torch.Tensor]:
        by_key = dict(listing.load(list(roles.values())))
        return {
            role: check_tensor(
                qualified_name(listing.path, key), by_key[key], "mask" if role in MASK_ROLES else "scores"
            )
            for role, key in roles.items()
        }

    return load


__all__ = [
    "CAPTURE_SCHEMA",
    "MANIFEST",
    "CallSource",
    "Input",
    "call_file_name",
    "compile_message",
    "file_part",
    "grads_file_name",
    "is_call_file",
    "is_capture_dir",
    "open_capture",
    "open_inputs",
    "qk_groups",
    "read_manifest",
    "role_of",
]
