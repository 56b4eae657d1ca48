""".pt / .pth (``torch.save``): a tensor, or nested dicts/lists/tuples of tensors, named
by dotted keys. Loaded with ``torch.load(weights_only=True)``: a dump never runs code.
Files that are plain pickles (not written by ``torch.save``) are only inspected
statically with :mod:`pickletools`, never unpickled. Cannot stream (a pickle of whole
storages): the file is loaded whole when opened."""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import zipfile
from typing import Any

import torch

from attncheck.errors import AttncheckError
from attncheck.loaders.common import (
    ANSI,
    FileListing,
    TensorSource,
    ZIP_MAGIC,
    check_tensor,
    error,
    invalid_text,
    memory_source,
    qualified_name,
    reason,
    shorten,
)

SUFFIXES = (".pt", ".pth")

# What the legacy (pre-zip) torch.save format starts with: pickle protocol 2
# followed by the pickled magic number 0x1950A86A20F9469CFC6C.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."

# How much of a plain pickle is scanned (statically) to explain a refusal.
_PICKLE_SCAN_LIMIT = 64 * 1024 * 1024

# Pickle opcodes that import or call something: a file holding any of them is
# more than plain data.
_CODE_OPCODES = frozenset(
    {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX",
     "BUILD", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"}
)

_PT_REFUSAL_NOTE = (
    "attncheck loads .pt files with weights_only=True and never runs pickled code"
)

# Parts of torch's weights_only error messages that mean "this pickle holds
# objects other than tensors" rather than "this file is corrupt".
_WO_FOREIGN = re.compile(
    r"GLOBAL|Can only|unrecognized function|persistent_load|must be imported to load"
)

_WO_GLOBAL = re.compile(r"GLOBAL (\S+?)(?: was not| whose|\s|$)")

def open_file(path: str, head: bytes) -> FileListing:
    if head.startswith(ZIP_MAGIC):
        _check_torch_zip(path)
    elif not head.startswith(_LEGACY_TORCH_MAGIC):
        # Not written by torch.save: inspect it without unpickling anything.
        _explain_plain_pickle(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        inner = _weights_only_reason(str(exc))
        if _WO_FOREIGN.search(inner):
            found = _WO_GLOBAL.search(inner)
            raise _refusal(path, found.group(1) if found else None) from exc
        raise error(f"{path}: {invalid_text(path)} ({shorten(inner)})") from exc
    except Exception as exc:
        raise error(f"{path}: {invalid_text(path)} ({reason(exc)})") from exc

    tensors = _flatten(obj)
    if not tensors:
        raise error(
            f"{path}: holds no tensors (only {_describe(obj)}); "
            "save a tensor or a dict/list of tensors"
        )
    if len(tensors) == 1 and tensors[0][0] is None:
        keys: list[str | None] = [None]
    else:
        keys = [k for k, _ in tensors]
    table = dict(tensors)

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        return [(key, table[key]) for key in selected]

    def sources(selected: list[str | None]) -> list[TensorSource]:
        return [memory_source(qualified_name(path, key), check_tensor(qualified_name(path, key), tensor)) for key, tensor in load(selected)]

    return FileListing(path, keys, load, sources)

def _check_torch_zip(path: str) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except Exception as exc:
        raise error(
            f"{path}: {invalid_text(path)} (truncated or corrupt zip archive: {reason(exc)})"
        ) from exc
    # torch's archive records sit in one top-level folder: "<name>/data.pkl".
    records = {n.split("/", 1)[1] if "/" in n else n for n in names}
    if "constants.pkl" in records:
        # torch.load would warn and dispatch to torch.jit.load.
        raise error(
            f"{path}: refused to load: it is a TorchScript archive (torch.jit.save), "
            "which holds code; save the tensors with torch.save instead"
        )
    if "data.pkl" not in records:
        raise error(
            f"{path}: {invalid_text(path)} (a zip archive without data.pkl, "
            "so not written by torch.save)"
        )

def _explain_plain_pickle(path: str) -> None:
    """Raise for a file that is not in a torch.save format, saying why.

    The file is parsed with pickletools (which never imports or calls
    anything) only to tell a pickle of arbitrary objects from garbage.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(_PICKLE_SCAN_LIMIT)
    except OSError as exc:
        raise error(f"{path}: cannot read the file ({reason(exc)})") from exc
    found: str | None = None
    strings: list[str] = []
    stream = io.BytesIO(data)
    try:
        # Every byte must belong to a pickle: random bytes often hold a short
        # run that parses up to a STOP opcode, but never the whole file.
        while stream.tell() < len(data):
            for opcode, arg, _pos in pickletools.genops(stream):
                if isinstance(arg, str):
                    strings = (strings + [arg])[-2:]
                if found is None and opcode.name in _CODE_OPCODES:
                    if opcode.name == "GLOBAL" and isinstance(arg, str):
                        found = arg.replace(" ", ".")
                    elif opcode.name == "STACK_GLOBAL" and len(strings) == 2:
                        found = ".".join(strings)
                    else:
                        found = ""
    except Exception as exc:
        if found is None or len(data) < _PICKLE_SCAN_LIMIT:
            raise error(
                f"{path}: {invalid_text(path)} (not a zip archive or pickle: {reason(exc)})"
            ) from exc
    if found is not None:
        raise _refusal(path, found or None)
    raise error(
        f"{path}: holds no tensors (it is a plain pickle of Python data, "
        "not a file written by torch.save)"
    )

def _refusal(path: str, found: str | None) -> AttncheckError:
    example = f", e.g. {found}" if found else ""
    return error(
        f"{path}: refused to load: it holds pickled objects other than tensors"
        f"{example} ({_PT_REFUSAL_NOTE})"
    )

def _weights_only_reason(message: str) -> str:
    """The WeightsUnpickler's own message inside torch.load's long wrapper."""
    message = ANSI.sub("", message)
    marker = "WeightsUnpickler error:"
    if marker in message:
        tail = message.split(marker, 1)[1].strip()
        if tail:
            return tail.split("\n\n", 1)[0].strip()
    parts = [p.strip() for p in message.split("\n\n") if p.strip()]
    if len(parts) > 1 and parts[0].startswith("Weights only load failed"):
        return parts[1]
    return message.strip()

def _flatten(obj: Any) -> list[tuple[str | None, torch.Tensor]]:
    """Tensors inside nested dicts/lists/tuples, with dotted keys, in order.

    A bare tensor gets the key None. Other leaves are skipped; containers
    seen before on the current branch (reference cycles) are not re-entered.
    """
    out: list[tuple[str | None, torch.Tensor]] = []
    stack: list[tuple[str | None, Any, frozenset[int]]] = [(None, obj, frozenset())]
    while stack:
        key, value, ancestors = stack.pop()
        if isinstance(value, torch.Tensor):
            out.append((key, value))
            continue
        if isinstance(value, dict):
            items = [(str(k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(str(i), v) for i, v in enumerate(value)]
        else:
            continue
        if id(value) in ancestors:
            continue
        inner = ancestors | {id(value)}
        for k, v in reversed(items):
            stack.append((k if key is None else f"{key}.{k}", v, inner))
    return out

def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        return "an empty dict" if not obj else "a dict without tensors"
    if isinstance(obj, (list, tuple)):
        kind = type(obj).__name__
        return f"an empty {kind}" if not obj else f"a {kind} without tensors"
    return f"a {type(obj).__name__}"
