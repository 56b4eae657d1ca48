""".pt / .pth (``torch.save``): a tensor, or nested dicts/lists/tuples of tensors, named
by dotted keys. Loaded with ``torch.load(weights_only=True)``: a dump never runs code.
Files that are plain pickles (not written by ``torch.save``) are only inspected
statically with :mod:`pickletools`, never unpickled. Cannot stream (a pickle of whole
storages): the file is loaded whole when opened."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from typing import Any

import torch

from attncheck.errors import AttncheckError
from attncheck.loaders.common import (
    ANSI,
    ZIP_MAGIC,
    FileListing,
    TensorSource,
    check_size,
    check_tensor,
    error,
    invalid_text,
    memory_source,
    qualified_name,
    reason,
    shorten,
    unique_names,
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
    {
        "GLOBAL",
        "STACK_GLOBAL",
        "INST",
        "OBJ",
        "REDUCE",
        "NEWOBJ",
        "NEWOBJ_EX",
        "BUILD",
        "EXT1",
        "EXT2",
        "EXT4",
        "PERSID",
        "BINPERSID",
    }
)

_PT_REFUSAL_NOTE = "attncheck loads .pt files with weights_only=True and never runs pickled code"

# Parts of torch's weights_only error messages that mean "this pickle holds
# objects other than tensors" rather than "this file is corrupt".
_WO_FOREIGN = re.compile(r"GLOBAL|Can only|unrecognized function|persistent_load|must be imported to load")

_WO_GLOBAL = re.compile(r"GLOBAL (\S+?)(?: was not| whose|\s|$)")

# Limits of the walk over nested containers: a pickle of a few KB can share containers
# so that they expand to 2^64 paths, or nest lists 200,000 deep.
MAX_DEPTH = 64
MAX_TENSORS = 100_000


def open_file(path: str, head: bytes, kind: str = "scores", max_bytes: int | None = None) -> FileListing:
    if head.startswith(ZIP_MAGIC):
        records, protocol = _check_torch_zip(path)
    else:
        protocol = _legacy_protocol(path)
        if protocol is None:
            # Not written by torch.save: inspect it without unpickling anything.
            _explain_plain_pickle(path)
        records = _file_size(path)
    copy = records if protocol > 2 else 0  # a rewritten copy of the file, held while torch reads it
    check_size(path, records + copy, max_bytes)
    try:
        with warnings.catch_warnings():  # torch's notes on the pickle protocol are not the user's problem
            warnings.simplefilter("ignore")
            source = path if protocol <= 2 else _as_protocol_2(path, head.startswith(ZIP_MAGIC))
            obj = torch.load(source, map_location="cpu", weights_only=True)
    except AttncheckError:
        raise
    except pickle.UnpicklingError as exc:
        inner = _weights_only_reason(str(exc))
        if _WO_FOREIGN.search(inner):
            found = _WO_GLOBAL.search(inner)
            raise _refusal(path, found.group(1) if found else None) from exc
        raise error(f"{path}: {invalid_text(path)} ({shorten(inner)})") from exc
    except Exception as exc:
        raise error(f"{path}: {invalid_text(path)} ({reason(exc)})") from exc

    tensors = _flatten(path, obj)
    if not tensors:
        raise error(f"{path}: holds no tensors (only {_describe(obj)}); save a tensor or a dict/list of tensors")
    if len(tensors) == 1 and tensors[0][0] is None:
        keys: list[str | None] = [None]
    else:
        keys = unique_names(path, [k for k, _ in tensors])
    table = dict(zip(keys, (t for _, t in tensors)))

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        return [(key, table[key]) for key in selected]

    def sources(selected: list[str | None]) -> list[TensorSource]:
        return [
            memory_source(qualified_name(path, key), check_tensor(qualified_name(path, key), tensor, kind))
            for key, tensor in load(selected)
        ]

    return FileListing(path, keys, load, sources)


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as exc:
        raise error(f"{path}: cannot read the file ({reason(exc)})") from exc


def _check_torch_zip(path: str) -> tuple[int, int]:
    """Check the archive; return the bytes its records hold once read, and data.pkl's
    pickle protocol."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            names = [i.filename for i in infos]
            pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
            head = b""
            if pkl is not None:
                with archive.open(pkl) as f:
                    head = f.read(2)
    except Exception as exc:
        raise error(f"{path}: {invalid_text(path)} (truncated or corrupt zip archive: {reason(exc)})") from exc
    # torch's archive records sit in one top-level folder: "<name>/data.pkl".
    records = {n.split("/", 1)[1] if "/" in n else n for n in names}
    if "constants.pkl" in records:
        # torch.load would warn and dispatch to torch.jit.load.
        raise error(
            f"{path}: refused to load: it is a TorchScript archive (torch.jit.save), "
            "which holds code; save the tensors with torch.save instead"
        )
    if "data.pkl" not in records:
        raise error(f"{path}: {invalid_text(path)} (a zip archive without data.pkl, so not written by torch.save)")
    protocol = head[1] if len(head) == 2 and head[0] == pickle.PROTO[0] else 2
    return sum(i.file_size for i in infos), protocol


_TORCH_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # what torch.save's legacy format pickles first


def _legacy_protocol(path: str) -> int | None:
    """The pickle protocol of a legacy (pre-zip) torch.save file, which starts with a pickle
    of torch's magic number; None for any other file. Parsed with pickletools only."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise error(f"{path}: cannot read the file ({reason(exc)})") from exc
    if head.startswith(_LEGACY_TORCH_MAGIC):
        return 2
    try:
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(io.BytesIO(head))]
    except Exception:
        return None
    protocol = next((arg for name, arg in ops[:1] if name == "PROTO"), None)
    values = [arg for name, arg in ops if name not in ("PROTO", "FRAME", "STOP")]
    return protocol if values == [_TORCH_MAGIC_NUMBER] else None


def _as_protocol_2(path: str, is_zip: bool) -> io.BytesIO:
    """The file with its pickles rewritten to the opcodes of protocol 2, which torch's
    weights_only unpickler reads (torch 2.13 refuses FRAME, MEMOIZE, SHORT_BINUNICODE and
    STACK_GLOBAL of protocols 4 and 5 as "Unsupported operand"). Nothing is unpickled: the
    opcodes are parsed with pickletools and re-encoded; every global still goes through
    torch's allow-list."""
    out = io.BytesIO()
    try:
        if is_zip:
            with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
                for info in src.infolist():
                    data = src.read(info)
                    if info.filename.rsplit("/", 1)[-1] == "data.pkl":
                        data = _transcode(data)
                    dst.writestr(info.filename, data)
        else:
            with open(path, "rb") as f:
                data = f.read()
            # magic number, protocol version, system info, the object, the storage keys; then raw storages
            stream, end = io.BytesIO(data), 0
            for _ in range(5):
                start = stream.tell()
                for _op in pickletools.genops(stream):
                    pass
                end = stream.tell()
                out.write(_transcode(data[start:end]))
            out.write(data[end:])
    except AttncheckError:
        raise
    except Exception as exc:
        raise error(f"{path}: {invalid_text(path)} (unreadable pickle: {reason(exc)})") from exc
    out.seek(0)
    return out


class _Pushed:
    """A value on the symbolic pickle stack: the opcode that pushed it, and its text when it is a string."""

    __slots__ = ("op", "text", "drop")

    def __init__(self, op: int, text: str | None = None) -> None:
        self.op, self.text, self.drop = op, text, False


_MARK = object()
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE")
_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
_GETS = ("GET", "BINGET", "LONG_BINGET")


def _unicode(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _transcode(data: bytes) -> bytes:
    """One pickle (ending in STOP) re-encoded with protocol 2 opcodes: FRAME dropped,
    SHORT_BINUNICODE/BINUNICODE8 as BINUNICODE, MEMOIZE as LONG_BINPUT, and STACK_GLOBAL as
    GLOBAL, whose module and name strings are then not pushed (a memo entry of one is
    re-emitted as a string where it is used for anything else)."""
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [ops[-1][2] + 1]
    # Pass 1: follow the stack to find the two strings each STACK_GLOBAL takes.
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    memoized: dict[int, tuple[int, Any]] = {}  # op -> (memo index, value)
    pushed: dict[int, _Pushed] = {}
    globals_at: dict[int, str] = {}
    for i, (op, arg, _pos) in enumerate(ops):
        name = op.name
        if name == "MEMOIZE" or name in _PUTS:
            index = len(memo) if name == "MEMOIZE" else arg
            memo[index] = stack[-1]
            memoized[i] = (index, stack[-1])
            continue
        if name in _GETS:
            got = memo[arg]
            pushed[i] = _Pushed(i, got.text if isinstance(got, _Pushed) else None)
            stack.append(pushed[i])
            continue
        if name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            if (
                not (isinstance(module, _Pushed) and isinstance(attr, _Pushed) and module.text and attr.text)
                or "\n" in module.text + attr.text
            ):
                raise ValueError("STACK_GLOBAL without two plain strings")
            module.drop = attr.drop = True
            globals_at[i] = f"{module.text}\n{attr.text}\n"
            stack.append(_Pushed(i))
            continue
        before, after = op.stack_before, op.stack_after
        if pickletools.markobject in before:
            while stack.pop() is not _MARK:
                pass
            del stack[len(stack) - (len(before) - 2) :]  # what sits below the mark (the list of APPENDS)
        elif before:
            del stack[-len(before) :]
        for kind in after:
            if kind is pickletools.markobject:
                stack.append(_MARK)
            else:
                pushed[i] = _Pushed(i, arg if name in _STRINGS else None)
                stack.append(pushed[i])
    # Pass 2: emit.
    out = bytearray()
    dropped: dict[int, str] = {}  # memo index -> the string its (not emitted) entry held
    for i, (op, arg, pos) in enumerate(ops):
        name = op.name
        if name == "FRAME" or (i in pushed and pushed[i].drop):
            continue
        if name == "PROTO":
            out += b"\x80\x02"
        elif i in memoized:
            index, value = memoized[i]
            if isinstance(value, _Pushed) and value.drop:
                dropped[index] = value.text
                continue
            dropped.pop(index, None)
            out += b"q" + bytes([index]) if index < 256 else b"r" + index.to_bytes(4, "little")
        elif name in _GETS and arg in dropped:
            out += _unicode(dropped[arg])
        elif name in ("SHORT_BINUNICODE", "BINUNICODE8"):
            out += _unicode(arg)
        elif i in globals_at:
            out += b"c" + globals_at[i].encode("utf-8")
        else:
            out += data[pos : ends[i]]
    return bytes(out)


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
            raise error(f"{path}: {invalid_text(path)} (not a zip archive or pickle: {reason(exc)})") from exc
    if found is not None:
        raise _refusal(path, found or None)
    raise error(f"{path}: holds no tensors (it is a plain pickle of Python data, not a file written by torch.save)")


def _refusal(path: str, found: str | None) -> AttncheckError:
    example = f", e.g. {found}" if found else ""
    return error(f"{path}: refused to load: it holds pickled objects other than tensors{example} ({_PT_REFUSAL_NOTE})")


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


def _flatten(path: str, obj: Any) -> list[tuple[str | None, torch.Tensor]]:
    """Tensors inside nested dicts/lists/tuples, with their keys (``key_text``), in order.

    A bare tensor gets the key None. Other leaves are skipped. Each container is walked
    once: one reached again (a reference cycle, or a container shared by several
    parents) is not re-entered, so its tensors are named by the first path to it.
    Deeper nesting than MAX_DEPTH and more than MAX_TENSORS tensors are errors.
    """
    out: list[tuple[str | None, torch.Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[tuple[Any, ...], Any]] = [((), obj)]
    while stack:
        path_keys, value = stack.pop()
        if isinstance(value, torch.Tensor):
            if len(out) == MAX_TENSORS:
                raise error(f"{path}: holds more than {MAX_TENSORS} tensors; save the attention tensors alone")
            out.append((key_text(path_keys) if path_keys else None, value))
            continue
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(path_keys) >= MAX_DEPTH:
            raise error(
                f"{path}: containers nested more than {MAX_DEPTH} deep (at {key_text(path_keys[:3])}...); save the "
                "tensors in a flat dict"
            )
        for k, v in reversed(items):
            stack.append(((*path_keys, k), v))
    return out


_PLAIN_KEY = re.compile(r"[^.\[\]'\"\\\x00-\x1f\x7f]+")
_INT_KEY = re.compile(r"-?[0-9]+")


def key_text(keys: tuple[Any, ...]) -> str:
    """How a tensor inside a .pt is named: dotted keys, 'layers.0.scores'. A list index or an
    int dict key is its number; a str key is itself unless it holds '.', brackets, quotes,
    a backslash or a control character, is empty, or reads as an int; such keys and keys of
    other types are written as Python literals in brackets: "a['b.c']", "['1']", "x[(0, 1)]".
    Distinct paths get distinct names."""
    out = ""
    for k in keys:
        if isinstance(k, int) and not isinstance(k, bool):
            part = str(k)
        elif isinstance(k, str) and _PLAIN_KEY.fullmatch(k) and not _INT_KEY.fullmatch(k):
            part = k
        else:
            out += f"[{k!r}]"
            continue
        out += f".{part}" if out else part
    return out


def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        return "an empty dict" if not obj else "a dict without tensors"
    if isinstance(obj, (list, tuple)):
        kind = type(obj).__name__
        return f"an empty {kind}" if not obj else f"a {kind} without tensors"
    return f"a {type(obj).__name__}"
