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

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from attncheck.errors import AttncheckError, param
from attncheck.format import size_text, visible
from attncheck.loaders import jsondoc
from attncheck.loaders.capture_schema import (
    CAPTURE_SCHEMA_PREFIX,
    FIELD_HELP,
    CallMeta,
    Manifest,
    ManifestCall,
    meta_fields,
)
from attncheck.loaders.common import TensorSource, check_tensor, error, qualified_name, reason, shorten
from attncheck.loaders.paths import KeySelector, expand_paths, natural_key
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
# scores_mod, scores_mod64: a flex call's logits after its score_mod, as flex computes them (fp32) and in float64
ROLES = ("q", "k", "v", "attn_mask", "scores", "out", "scores_mod", "scores_mod64", *GRAD_ROLES)
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
    import json

    why = []
    from attncheck.registry import PATHS

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
    return meta.get(FORMAT_KEY, "").startswith(CAPTURE_SCHEMA_PREFIX)


def _load_call_tensors(path: str, label: str) -> dict[str, torch.Tensor]:
    """The tensors of a call file by role (others in the file are left out), each checked."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            for role in ROLES:
                if role in f.keys():
                    out[role] = f.get_tensor(role)
    except Exception as exc:
        from attncheck.loaders.formats.safetensors import short_of_memory

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
    size = call_bytes(entries)
    if max_bytes is not None and size > max_bytes:
        return _broken(
            info,
            f"{label}: loading the call whole needs {size_text(size)}, over {param('max_memory')} "
            f"{size_text(max_bytes)}",
        )
    return CallSource(info, lambda: _load_call_tensors(path, label), _check_roles(label, info.kind, entries, meta))


# --------------------------------------------------------------------------- capture directories


def is_capture_dir(path: str | os.PathLike[str]) -> bool:
    """A directory holding a capture's manifest; False for anything that cannot be stat'ed
    (a name too long, a path through a file): the file loaders then say what is wrong."""
    try:
        return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


RANK_DIR = re.compile(r"^rank(\d{1,7})$")
OWNER = ".attncheck-owner.json"  # the process writing a capture directory (removed when it is done)


def read_owner(owner: str | os.PathLike[str]) -> dict | None:
    """The owner file's contents ({pid, host, rank}); None where it is missing, being written or garbage."""
    import json

    try:
        with open(owner, encoding="utf-8") as fh:
            doc = json.loads(fh.read(4096))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def owner_alive(holder: dict) -> bool:
    """Whether the process an owner file names is running (another host's: assumed so, it cannot be asked)."""
    import socket

    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def unfinished_capture(path: str | os.PathLike[str]) -> str | None:
    """Why a directory without a manifest is a capture that has not finished, or None: the owner file of its
    writer (running still, or gone without writing the manifest: killed), or call files named as a capture
    names them (its manifest was never written). Such a folder is not read as a folder of tensors: its calls
    would be judged as if they were the whole run."""
    d = Path(path)
    try:
        if not d.is_dir() or (d / MANIFEST).is_file():
            return None
        owner = d / OWNER
        if owner.is_file():
            holder = read_owner(owner) or {}
            pid = holder.get("pid")
            who = f"process {pid}" if isinstance(pid, int) else "a process"
            if owner_alive(holder):
                return (
                    f"{path}: is a capture {who} is writing still (no {MANIFEST} yet): "
                    "read it once that capture has finished"
                )
            return (
                f"{path}: holds no {MANIFEST}: its capture did not finish ({who} stopped before writing it: "
                f"killed?); capture again, or name its call files ({os.path.join(path, '*.safetensors')}) "
                "to read those alone"
            )
        calls = sorted(p.name for p in d.iterdir() if CALL_FILE.match(p.name) and p.is_file())
    except (OSError, ValueError):
        return None
    if calls:
        return (
            f"{path}: holds call files ({calls[0]}, ...) and no {MANIFEST}: its capture did not finish; "
            f"capture again, or name its call files ({os.path.join(path, '*.safetensors')}) to read those alone"
        )
    return None


def rank_dirs(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """A capture of several processes (torchrun): a directory without a manifest holding ``rankN``
    directories, one of them at least a capture; [(rank, directory)] in rank order, [] for anything else."""
    try:
        if not Path(path).is_dir() or (Path(path) / MANIFEST).is_file():
            return []
        found = [
            (int(m.group(1)), os.path.join(os.fspath(path), p.name))
            for p in Path(path).iterdir()
            if (m := RANK_DIR.match(p.name)) and p.is_dir() and not p.is_symlink() and any(True for _ in p.iterdir())
        ]  # an empty rankN folder is no rank's capture: left out
        if not any((Path(sub) / MANIFEST).is_file() for _, sub in found):  # folders named rankN holding no capture
            return []
    except (OSError, ValueError):
        return []
    return sorted(found)


def open_ranks(
    directory: str | os.PathLike[str], selector: KeySelector | None = None, max_bytes: int | None = None
) -> tuple[list[CallSource], list[dict]]:
    """Every rank's calls of a capture of several processes, each call naming its rank, in call order
    (rank order within one index: the ranks run the same program); and each rank's manifest. The ranks
    must be one job's: ranks 0 .. world-1, each once, one world size and one run id."""
    given = os.fspath(directory)
    found = rank_dirs(given)
    out: list[CallSource] = []
    docs: list[dict] = []
    worlds_seen = {d.get("world") for _, sub in found if (d := _manifest_doc(sub)) is not None}
    world_known = worlds_seen.pop() if len(worlds_seen) == 1 else None
    for rank, sub in found:
        if not (Path(sub) / MANIFEST).is_file():
            if isinstance(world_known, int) and rank >= world_known:
                raise error(
                    f"{sub}: is not a rank of this capture of {world_known} processes (ranks 0 to "
                    f"{world_known - 1}) and holds no {MANIFEST}: remove it, or read the ranks one by one"
                )
            running = unfinished_capture(sub) or ""
            if "writing still" in running:
                raise error(running)
            raise error(f"{sub}: holds no {MANIFEST}: rank {rank}'s capture did not finish (did that process fail?)")
        calls, doc = open_capture(sub, selector, max_bytes)
        if doc.get("rank") != rank or not isinstance(doc.get("world"), int):
            raise error(
                f"{os.path.join(sub, MANIFEST)}: is rank {doc.get('rank')}'s capture, not rank {rank}'s "
                "(each rank writes its own DIR/rankN)"
            )
        out += calls
        docs.append(doc)
    worlds = {d["world"] for d in docs}
    runs = {d.get("run_id") for d in docs}
    if len(worlds) > 1 or len(runs) > 1:
        what = (
            f"world sizes {sorted(worlds)}" if len(worlds) > 1 else "run ids " + ", ".join(sorted(str(r) for r in runs))
        )
        raise error(f"{given}: its ranks come from different jobs ({what}): capture into a new or empty folder")
    world = worlds.pop()
    ranks = [d["rank"] for d in docs]
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        extra = sorted(set(ranks) - set(range(world)))
        if missing:
            there = " ".join(os.path.join(given, f"rank{r}") for r in ranks)
            raise error(
                f"{given}: a capture of {world} processes lacks rank {missing[0]} "
                f"({os.path.join(given, f'rank{missing[0]}')}): capture again, or read the ranks "
                f"it holds by name (attncheck run {there})"
            )
        raise error(
            f"{given}: a capture of {world} processes holds rank {extra[0]}, beyond its world: "
            "capture into a new or empty folder"
        )
    out.sort(key=lambda s: (s.info.index, s.info.rank))
    return out, docs


def _manifest_doc(directory: str) -> dict | None:
    """A rank's manifest as plain JSON (None where it is missing or unreadable), to learn the job's world
    size before each rank is read in full."""
    from attncheck.loaders import jsondoc

    try:
        with open(os.path.join(directory, MANIFEST), "rb") as fh:
            doc = jsondoc.decode(fh.read(jsondoc.MAX_BYTES + 1))
    except (OSError, jsondoc.JSONError):
        return None
    return doc if isinstance(doc, dict) else None


def check_one_job(given: Sequence[str], docs: Sequence[dict]) -> None:
    """Rank captures named one by one must be one job's: one world size, one run id, each rank once."""
    worlds = {d.get("world") for d in docs}
    runs = {d.get("run_id") for d in docs}
    if len(worlds) > 1 or len(runs) > 1:
        what = (
            f"world sizes {sorted(worlds)}" if len(worlds) > 1 else "run ids " + ", ".join(sorted(str(r) for r in runs))
        )
        raise error(f"{', '.join(given)}: these ranks come from different jobs ({what}): name the ranks of one capture")
    seen: dict[int, str] = {}
    for name, d in zip(given, docs):
        if d["rank"] in seen:
            raise error(f"{name}: rank {d['rank']} is named twice ({seen[d['rank']]} too)")
        seen[d["rank"]] = name


def load_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The manifest of a capture directory: read within ``jsondoc``'s bounds and every field
    checked (``capture_schema.Manifest``); anything wrong is one line naming the manifest."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    if os.path.islink(path):
        raise error(
            f"{path}: is a symbolic link; a capture's manifest is a plain file of its directory (nothing is read "
            "outside it)"
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read(jsondoc.MAX_BYTES + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read the manifest ({reason(exc)})") from exc
    try:
        doc = jsondoc.decode(data)
    except jsondoc.JSONError as exc:
        raise error(f"{path}: not a valid capture manifest ({exc})") from None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("schema"), str)
        or not doc["schema"].startswith(CAPTURE_SCHEMA_PREFIX)
    ):
        raise error(f"{path}: not an attncheck capture manifest (no schema {CAPTURE_SCHEMA!r})")
    if not isinstance(doc.get("calls"), list) or not all(isinstance(c, dict) for c in doc["calls"]):
        raise error(f"{path}: not a valid capture manifest ('calls' is not a list of objects)")
    for i, entry in enumerate(doc["calls"]):
        name = entry.get("file")
        if not isinstance(name, str) or not CALL_FILE.match(name) or os.path.basename(name) != name:
            raise error(f"{path}: call entry {i} names {shorten(repr(name))}, not a call file of this directory")
    try:
        manifest = jsondoc.convert(doc, Manifest)
    except jsondoc.JSONError as exc:
        raise error(f"{path}: not a valid capture manifest ({exc})") from None
    _check_listing(path, manifest)
    return manifest


def _check_listing(path: str, manifest: Manifest) -> None:
    """Every call once: no file or index listed twice, each file named by its index; at least one call."""
    if not manifest.calls:
        why = check_manifest_message(manifest_facts(manifest))
        raise error(f"{path}: the capture holds no calls" + (f" ({why})" if why else ""))
    files: dict[str, int] = {}
    indices: dict[int, int] = {}
    for i, entry in enumerate(manifest.calls):
        if entry.file in files:
            raise error(
                f"{path}: call entry {i} lists {entry.file} again (entry {files[entry.file]} lists it): each call is "
                "listed once"
            )
        if entry.index in indices:
            raise error(
                f"{path}: call entry {i} has index {entry.index} again (entry {indices[entry.index]} has it): each "
                "call is listed once"
            )
        number = int(CALL_FILE.match(entry.file).group(1))
        if number != entry.index:
            raise error(f"{path}: call entry {i} has index {entry.index}, but its file {entry.file} is call {number}")
        files[entry.file], indices[entry.index] = i, i


def manifest_facts(manifest: Manifest) -> dict:
    """The checked manifest as plain data (the fields this version knows)."""
    return msgspec.to_builtins(manifest)


def read_manifest(directory: str | os.PathLike[str]) -> dict:
    """The manifest of a capture directory, checked (``load_manifest``), as plain data."""
    return manifest_facts(load_manifest(directory))


def open_capture(
    directory: str | os.PathLike[str], selector: KeySelector | None = None, max_bytes: int | None = None
) -> tuple[list[CallSource], dict]:
    """The calls of a capture directory in call order, each checked against its manifest entry
    and its file header (and its size against ``max_bytes``); and the manifest. Per-call problems
    are kept in ``problem``; a manifest that cannot be read raises."""
    given = os.fspath(directory)
    manifest = load_manifest(given)
    where = os.path.join(given, MANIFEST)
    listed = {entry.file for entry in manifest.calls}
    out: list[CallSource] = []
    for entry in manifest.calls:
        name, index = entry.file, entry.index
        if selector is not None and not selector.select(given, [entry.module or "global"]):
            continue
        path = os.path.join(given, name)
        label = _call_label(path, entry.kind, entry.module, index)
        info = CallInfo(
            index=index, name=path, kind=entry.kind, module=entry.module, file=path, forward=entry.forward or None
        )
        if os.path.islink(path):
            out.append(
                _broken(
                    info,
                    f"{label}: is a symbolic link; a capture's call files are plain files of its directory (nothing "
                    "is read outside it)",
                )
            )
            continue
        if not os.path.isfile(path):
            out.append(
                _broken(
                    info, f"{label}: listed in {where} but " + ("not a file" if os.path.lexists(path) else "missing")
                )
            )
            continue
        try:
            meta, entries = read_call_header(path)
        except AttncheckError as exc:
            out.append(_broken(info, f"{label}: {_strip_path(exc.message, path)}"))
            continue
        problem = _mismatch(label, where, entry, meta, entries)
        source = call_file_source(path, index, meta, entries, fallback=info, max_bytes=max_bytes)
        load, grads_problem = source.load, None
        if entry.grads is not None:
            gname = entry.grads.file
            if gname != grads_file_name(index, entry.module or "") or os.path.basename(gname) != gname:
                raise error(
                    f"{where}: call {index} names the gradients file {visible(gname)}, not this call's "
                    f"({grads_file_name(index, entry.module or '')})"
                )
            listed.add(gname)
            load, grads_problem = _with_grads(
                source.load, os.path.join(given, gname), label, index, entry.module or "", entries
            )
        out.append(CallSource(source.info, load, problem or source.problem or grads_problem))
    unlisted = sorted((p.name for p in Path(given).glob("*.safetensors") if p.name not in listed), key=natural_key)
    if unlisted:
        raise error(
            f"{where} does not match the files: {os.path.join(given, unlisted[0])} is not listed in it"
            + (f" ({len(unlisted) - 1} more)" if len(unlisted) > 1 else "")
        )
    out.sort(key=lambda s: s.info.index)
    if manifest.rank is not None and (manifest.world or 1) > 1:  # one rank of a torchrun capture: its calls say so
        for src in out:
            src.info.rank = manifest.rank
    return out, manifest_facts(manifest)


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


def _broken(info: CallInfo, problem: str) -> CallSource:
    def load() -> dict[str, torch.Tensor]:
        raise error(problem)

    return CallSource(info, load, problem)


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
    from attncheck.loaders import open_file

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


def check_manifest_message(doc: dict) -> str | None:
    """What a manifest says about an incomplete capture: stopped early, or the script failed."""
    parts = []
    if doc.get("stopped"):
        parts.append(f"recording stopped: {doc['stopped']}")
    script = doc.get("script") or {}
    if isinstance(script, dict) and script.get("error"):
        parts.append(f"the script failed: {script['error']}")
    compiled = compile_message(doc)
    if compiled:
        parts.append(compiled)
    return "; ".join(parts) or None


def compile_message(doc: dict) -> str | None:
    """What a capture says about torch.compile'd code: judged as its eager code, or not recorded."""
    facts = doc.get("compile")
    if not isinstance(facts, dict) or not (facts.get("compiled_runs") or facts.get("compiled_calls")):
        return None
    runs, calls = facts.get("compiled_runs") or 0, facts.get("compiled_calls") or 0
    if facts.get("mode") == "keep":
        return (
            f"torch.compile'd code ran {runs} time(s) compiled (--compile keep): its attention calls were not "
            "recorded; --compile eager records them as its eager code"
        )
    return (
        f"{calls} call(s) ran inside torch.compile'd code, captured as its eager code (--compile eager): they are "
        "judged as the eager code computes, not as the compiled kernels do"
    )


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
