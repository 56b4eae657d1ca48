"""A capture directory's manifest: read and checked against the files before any tensor is read, its facts
(script, compile) as one line, and the directory opened as its calls in order."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from attncheck.errors import AttncheckError
from attncheck.format import visible
from attncheck.loaders import jsondoc
from attncheck.loaders.call_files import _mismatch, _strip_path, _with_grads, call_file_source, read_call_header
from attncheck.loaders.call_info import (
    CALL_FILE,
    CAPTURE_SCHEMA,
    MANIFEST,
    CallSource,
    _broken,
    _call_label,
    grads_file_name,
)
from attncheck.loaders.capture_schema import CAPTURE_SCHEMA_PREFIX, Manifest
from attncheck.loaders.common import error, reason, shorten
from attncheck.loaders.kv_chain import KvChain, logical_entries
from attncheck.loaders.paths import KeySelector, natural_key
from attncheck.results import CallInfo


def is_capture_dir(path: str | os.PathLike[str]) -> bool:
    """A directory holding a capture's manifest; False for anything that cannot be stat'ed
    (a name too long, a path through a file): the file loaders then say what is wrong."""
    try:
        return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


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
    chain: KvChain | None = None
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
        if entry.kv_base is not None or "kv_base" in meta:  # a decode step stored by its new rows
            chain = chain or KvChain(given, manifest.calls)
            problem = problem or _base_mismatch(label, entry, meta) or chain.problem(entry, label)
            entries = logical_entries(meta, entries)
        source = call_file_source(path, index, meta, entries, fallback=info, max_bytes=max_bytes)
        load, grads_problem = source.load, None
        if entry.kv_base is not None and not (problem or source.problem):
            load = chain.loader(load, index, label, meta)
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
    listed.update(r.file for r in manifest.rope_tables)  # the rotary tables: read by ``loaders.rope``
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


def _base_mismatch(label: str, entry, meta: dict[str, str]) -> str | None:
    """The call file and its manifest entry must name the same base call."""
    if meta.get("kv_base") != (None if entry.kv_base is None else str(entry.kv_base)):
        return (
            f"{label}: its file and the manifest name different base calls (kv_base "
            f"{shorten(repr(meta.get('kv_base')))} in the file, {entry.kv_base} in the manifest)"
        )
    if meta.get("kv_drop") != (None if entry.kv_drop is None else str(entry.kv_drop)):
        return (
            f"{label}: its file and the manifest drop different rows of its base call (kv_drop "
            f"{shorten(repr(meta.get('kv_drop')))} in the file, {entry.kv_drop} in the manifest)"
        )
    return None


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
