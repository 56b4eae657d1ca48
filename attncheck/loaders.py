"""Turn tensor files into named tensors.

Supported formats: ``.pt``/``.pth`` (``torch.save``), ``.npy``, ``.npz`` and
``.safetensors``. This module does no math and prints nothing: every problem
with an input file becomes an :class:`~attncheck.errors.AttncheckError` whose
message is one line naming the file and what is wrong.

Safety: ``.pt`` files are loaded with ``weights_only=True`` and files that are
plain pickles (not written by ``torch.save``) are only inspected statically
with :mod:`pickletools`, never unpickled; numpy files are loaded with
``allow_pickle=False``.
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickle
import pickletools
import re
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import torch

from attncheck.errors import AttncheckError

__all__ = ["SUPPORTED_SUFFIXES", "KeySelector", "NamedTensor", "load_tensors"]

SUPPORTED_SUFFIXES = (".pt", ".pth", ".npy", ".npz", ".safetensors")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_HINT = "attncheck needs floating-point scores (fp16, bf16, fp32 or fp64)"
_MAX_REASON = 120
_MAX_LISTED = 10

_ZIP_MAGIC = b"PK\x03\x04"
_EMPTY_ZIP_MAGIC = b"PK\x05\x06"
_NPY_MAGIC = b"\x93NUMPY"
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
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True, eq=False)
class NamedTensor:
    """One tensor read from a file.

    ``name`` is the path (as given or as found in a directory) for a file that
    holds one bare tensor (``.npy``, or a ``.pt`` holding a single tensor), and
    ``path:key`` otherwise, e.g. ``dump.pt:layers.3.scores``. ``tensor`` lives
    on the CPU in the file's own floating dtype (fp16, bf16, fp32 or fp64).
    """

    name: str
    tensor: torch.Tensor


def load_tensors(
    paths: Sequence[str | os.PathLike[str]], keys: Sequence[str] = (), *, any_dtype: bool = False
) -> list[NamedTensor]:
    """Load every tensor in ``paths`` (files or directories) that ``keys`` selects.

    ``keys`` are case-sensitive :mod:`fnmatch` patterns matched against the
    key of each tensor inside a file (a bare tensor is matched against its
    file name); empty selects everything. Every pattern must match at least
    one tensor over all files. Raises :class:`AttncheckError` for any bad
    input.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = _expand_paths(paths)
    selector = KeySelector(keys)
    result: list[NamedTensor] = []
    for file in files:
        source = _open_source(file)
        selected = selector.select(source.path, source.keys)
        if selected:
            for key, tensor in source.load(selected):
                name = _name(source.path, key)
                result.append(NamedTensor(name, _check_tensor(name, tensor, any_dtype)))
    selector.check_all_matched()
    return result


class KeySelector:
    """``--key`` patterns applied across files, as :func:`load_tensors` applies them.

    ``select`` is called once per file, in order, with the keys the file holds
    (None for a bare tensor, matched against the file name); afterwards
    ``check_all_matched`` raises for a pattern that matched nothing anywhere.
    """

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.patterns = [keys] if isinstance(keys, str) else list(keys)
        self._matched = [False] * len(self.patterns)
        self._available: list[str] = []

    def select(self, path: str, keys: Sequence[str | None]) -> list[str | None]:
        selected: list[str | None] = []
        for key in keys:
            self._available.append(_name(path, key))
            match_on = Path(path).name if key is None else key
            if not self.patterns:
                selected.append(key)
                continue
            hit = False
            for i, pattern in enumerate(self.patterns):
                if fnmatch.fnmatchcase(match_on, pattern):
                    self._matched[i] = True
                    hit = True
            if hit:
                selected.append(key)
        return selected

    def check_all_matched(self) -> None:
        available = self._available
        for pattern, ok in zip(self.patterns, self._matched):
            if not ok:
                shown = ", ".join(available[:_MAX_LISTED])
                if len(available) > _MAX_LISTED:
                    shown += f", ... ({len(available) - _MAX_LISTED} more)"
                raise _error(f"--key '{pattern}' matches no tensor (available: {shown})")


# --------------------------------------------------------------------------
# paths


def _expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    if len(paths) == 0:
        raise _error("no input files given (pass one or more tensor files or directories)")
    files: list[str] = []
    seen: set[str] = set()
    for raw in paths:
        given = os.fspath(raw)
        if isinstance(given, bytes):  # os.PathLike[bytes]
            given = os.fsdecode(given)
        path = Path(given)
        if path.is_dir():
            found = _scan_directory(path)
            if not found:
                raise _error(
                    f"{given}: directory holds no supported tensor files "
                    f"(looked for {_suffix_list()}, recursively)"
                )
            candidates = [str(p) for p in found]
        elif path.exists():
            if not path.is_file():
                raise _error(f"{given}: not a regular file")
            if _suffix(path) not in SUPPORTED_SUFFIXES:
                what = f"'{path.suffix}'" if path.suffix else "(no extension)"
                raise _error(
                    f"{given}: unsupported file type {what} (supported: {_suffix_list()})"
                )
            candidates = [given]
        else:
            raise _error(f"{given}: no such file or directory")
        for c in candidates:
            if c not in seen:
                seen.add(c)
                files.append(c)
    return files


def _scan_directory(directory: Path) -> list[Path]:
    found = [
        p for p in directory.rglob("*")
        if _suffix(p) in SUPPORTED_SUFFIXES and p.is_file()
    ]
    return sorted(found)


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _suffix_list() -> str:
    return ", ".join(SUPPORTED_SUFFIXES)


def _name(path: str, key: str | None) -> str:
    return path if key is None else f"{path}:{key}"


# --------------------------------------------------------------------------
# sources: one per file, listing keys first and loading only selected ones


@dataclass
class _Source:
    path: str
    keys: list[str | None]  # None: the file holds one bare tensor
    load: Callable[[list[str | None]], list[tuple[str | None, Any]]]


def _open_source(path: str) -> _Source:
    head = _read_head(path)
    suffix = _suffix(Path(path))
    if suffix in (".pt", ".pth"):
        return _open_torch(path, suffix, head)
    if suffix == ".npy":
        return _open_npy(path, head)
    if suffix == ".npz":
        return _open_npz(path, head)
    return _open_safetensors(path, head)


def _read_head(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise _error(f"{path}: cannot read the file ({_reason(exc)})") from exc
    if not head:
        raise _error(f"{path}: {_invalid(path)} (the file is empty)")
    return head


def _invalid(path: str) -> str:
    return f"not a valid {_suffix(Path(path))} file"


# .npy ---------------------------------------------------------------------


def _open_npy(path: str, head: bytes) -> _Source:
    if not head.startswith(_NPY_MAGIC):
        why = "it does not start with the .npy header"
        if head.startswith((_ZIP_MAGIC, _EMPTY_ZIP_MAGIC)):
            why = "it is a zip archive; .npz files must be named .npz"
        raise _error(f"{path}: {_invalid(path)} ({why})")

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        try:
            array = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise _numpy_error(path, exc) from exc
        return [(None, _from_numpy(path, array))]

    return _Source(path, [None], load)


# .npz ---------------------------------------------------------------------


def _open_npz(path: str, head: bytes) -> _Source:
    if head.startswith(_NPY_MAGIC):
        raise _error(
            f"{path}: {_invalid(path)} (it is a single .npy array; rename it to .npy)"
        )
    if not head.startswith((_ZIP_MAGIC, _EMPTY_ZIP_MAGIC)):
        raise _error(f"{path}: {_invalid(path)} (not a zip archive)")
    # np.load is given an open file, not the path: for a path it leaks the
    # file handle when the zip archive turns out to be corrupt.
    try:
        with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as npz:
            members = list(npz.files)
    except Exception as exc:
        raise _error(f"{path}: {_invalid(path)} ({_reason(exc)})") from exc
    if not members:
        raise _error(f"{path}: holds no arrays")

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        with open(path, "rb") as handle:
            try:
                npz = np.load(handle, allow_pickle=False)
            except Exception as exc:
                raise _error(f"{path}: {_invalid(path)} ({_reason(exc)})") from exc
            with npz:
                return [(key, _npz_member(path, npz, key)) for key in selected]

    return _Source(path, list(members), load)


def _npz_member(path: str, npz: Any, key: str | None) -> torch.Tensor:
    assert key is not None
    name = _name(path, key)
    try:
        array = npz[key]
    except Exception as exc:
        raise _numpy_error(name, exc, member=True) from exc
    if not isinstance(array, np.ndarray):
        raise _error(f"{name}: member is not a .npy array")
    return _from_numpy(name, array)


def _numpy_error(what: str, exc: Exception, member: bool = False) -> AttncheckError:
    # With allow_pickle=False and the magic checked, numpy mentions
    # allow_pickle only when the array holds Python objects.
    if isinstance(exc, ValueError) and "allow_pickle" in str(exc):
        return _object_array_error(what)
    if member:
        return _error(f"{what}: not a valid .npy member ({_reason(exc)})")
    return _error(f"{what}: {_invalid(what)} ({_reason(exc)})")


def _object_array_error(what: str) -> AttncheckError:
    return _error(
        f"{what}: holds an object array (pickled Python objects), which attncheck "
        "does not support; nothing was unpickled. Save a numeric floating-point array"
    )


def _check_numpy_dtype(name: str, dtype: np.dtype) -> None:
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8):
        shown = dtype.name if dtype.kind in "biufc" else str(dtype)
        raise _dtype_error(name, shown)


def _from_numpy(name: str, array: np.ndarray) -> torch.Tensor:
    dtype = array.dtype
    _check_numpy_dtype(name, dtype)
    if not dtype.isnative:
        array = array.astype(dtype.newbyteorder("="))
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


# .safetensors -------------------------------------------------------------


def _open_safetensors(path: str, head: bytes) -> _Source:
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            keys = list(f.keys())
    except Exception as exc:
        raise _error(f"{path}: {_invalid(path)} ({_reason(exc)})") from exc
    if not keys:
        raise _error(f"{path}: holds no tensors")

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        try:
            handle = safetensors.safe_open(path, framework="pt")
        except Exception as exc:
            raise _error(f"{path}: {_invalid(path)} ({_reason(exc)})") from exc
        out: list[tuple[str | None, Any]] = []
        with handle as f:
            for key in selected:
                assert key is not None
                try:
                    out.append((key, f.get_tensor(key)))
                except Exception as exc:
                    raise _error(
                        f"{_name(path, key)}: cannot read the tensor ({_reason(exc)})"
                    ) from exc
        return out

    return _Source(path, list(keys), load)


# .pt / .pth ---------------------------------------------------------------


def _open_torch(path: str, suffix: str, head: bytes) -> _Source:
    if head.startswith(_ZIP_MAGIC):
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
        raise _error(f"{path}: {_invalid(path)} ({_shorten(inner)})") from exc
    except Exception as exc:
        raise _error(f"{path}: {_invalid(path)} ({_reason(exc)})") from exc

    tensors = _flatten(obj)
    if not tensors:
        raise _error(
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

    return _Source(path, keys, load)


def _check_torch_zip(path: str) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except Exception as exc:
        raise _error(
            f"{path}: {_invalid(path)} (truncated or corrupt zip archive: {_reason(exc)})"
        ) from exc
    # torch's archive records sit in one top-level folder: "<name>/data.pkl".
    records = {n.split("/", 1)[1] if "/" in n else n for n in names}
    if "constants.pkl" in records:
        # torch.load would warn and dispatch to torch.jit.load.
        raise _error(
            f"{path}: refused to load: it is a TorchScript archive (torch.jit.save), "
            "which holds code; save the tensors with torch.save instead"
        )
    if "data.pkl" not in records:
        raise _error(
            f"{path}: {_invalid(path)} (a zip archive without data.pkl, "
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
        raise _error(f"{path}: cannot read the file ({_reason(exc)})") from exc
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
            raise _error(
                f"{path}: {_invalid(path)} (not a zip archive or pickle: {_reason(exc)})"
            ) from exc
    if found is not None:
        raise _refusal(path, found or None)
    raise _error(
        f"{path}: holds no tensors (it is a plain pickle of Python data, "
        "not a file written by torch.save)"
    )


def _refusal(path: str, found: str | None) -> AttncheckError:
    example = f", e.g. {found}" if found else ""
    return _error(
        f"{path}: refused to load: it holds pickled objects other than tensors"
        f"{example} ({_PT_REFUSAL_NOTE})"
    )


def _weights_only_reason(message: str) -> str:
    """The WeightsUnpickler's own message inside torch.load's long wrapper."""
    message = _ANSI.sub("", message)
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


# --------------------------------------------------------------------------
# validation and messages


def _check_tensor(name: str, tensor: Any, any_dtype: bool = False) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):  # defensive; loaders yield tensors
        raise _error(f"{name} is not a tensor (got {type(tensor).__name__})")
    if tensor.layout != torch.strided:
        raise _error(f"{name} has layout {_torch_name(tensor.layout)}; attncheck needs a dense tensor")
    if tensor.dtype not in _FLOAT_DTYPES and not any_dtype:  # masks may be boolean: checked by their user
        raise _dtype_error(name, _torch_name(tensor.dtype))
    _check_shape(name, tuple(tensor.shape))
    tensor = tensor.detach()  # plain tensor, also for nn.Parameter
    if tensor.device.type != "cpu":  # defensive; map_location="cpu" already
        tensor = tensor.cpu()
    return tensor


def _dtype_error(name: str, shown: str) -> AttncheckError:
    return _error(f"{name} has dtype {shown}; {_DTYPE_HINT}")


def _check_shape(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) == 0:
        raise _error(
            f"{name} is a 0-d scalar; attncheck needs at least one axis "
            "(the last axis holds the keys)"
        )
    if 0 in shape:
        raise _error(f"{name} is empty (shape {shape})")


def _torch_name(obj: object) -> str:
    return str(obj).removeprefix("torch.")


def _reason(exc: BaseException) -> str:
    """A short, single-line reason from an exception."""
    if isinstance(exc, OSError) and exc.strerror:
        return _shorten(exc.strerror)
    text = _ANSI.sub("", str(exc))
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return _shorten(first or type(exc).__name__)


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > _MAX_REASON:
        text = text[: _MAX_REASON - 3].rstrip() + "..."
    return text


def _error(message: str) -> AttncheckError:
    """An AttncheckError whose message is guaranteed to be one line."""
    one_line = message.replace("\r", "\\r").replace("\n", "\\n")
    return AttncheckError(one_line)
