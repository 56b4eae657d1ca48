""".safetensors: an 8-byte little-endian header length, a JSON header (dtype, shape,
data_offsets per tensor) and the raw data. Streams: the header is parsed here and
checked against the file size; blocks are read like ``.npy``. ``BF16`` is read as
raw 16-bit words and reinterpreted as ``torch.bfloat16``."""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import safetensors
import torch

from attncheck.errors import AttncheckError, param
from attncheck.format import size_text
from attncheck.loaders import jsondoc
from attncheck.loaders.common import (
    FileListing,
    TensorSource,
    check_shape,
    check_size,
    dtype_error,
    error,
    guarded,
    invalid_text,
    open_at,
    qualified_name,
    read_blocks,
    read_error,
    reason,
    truncation,
)

SUFFIXES = (".safetensors",)

# safetensors' own limit on the JSON header.
_SAFETENSORS_MAX_HEADER = 100_000_000

# safetensors dtype -> (torch name, bytes per element); unknown names are shown raw.
_SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "C64": ("complex64", 8),
}

# How the float dtypes are stored: numpy dtype of the raw elements, torch dtype.
_RAW_FLOATS: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float64": (np.dtype("<f8"), torch.float64),
    "float32": (np.dtype("<f4"), torch.float32),
    "float16": (np.dtype("<f2"), torch.float16),
    "bfloat16": (np.dtype("<u2"), torch.bfloat16),  # numpy has no bf16: raw 16-bit words
}


def short_of_memory(exc: BaseException) -> bool:
    """safetensors maps the whole file into memory: under an address-space limit (ulimit -v) a
    large valid file fails there with ENOMEM, which says nothing about the file."""
    text = str(exc)
    return (
        isinstance(exc, MemoryError)
        or getattr(exc, "errno", None) == errno.ENOMEM
        or "Cannot allocate memory" in text
        or "os error 12" in text
    )


def _memory_error(path: str, exc: BaseException) -> AttncheckError:
    size = os.path.getsize(path)
    return error(
        f"{path}: memory is short: the {size_text(size)} file could not be mapped ({reason(exc)}); "
        f"its header is valid. Raise the address-space limit (ulimit -v), or pass it as scores, "
        f"which are read in row blocks within "
        f"{param('max_memory')}, choosing tensors with {param('keys')}"
    )


def open_file(path: str, head: bytes, kind: str = "scores", max_bytes: int | None = None) -> FileListing:
    try:
        with open(path, "rb") as f:
            # bounded, before safetensors' own parser sees it
            _, entries, _ = _read_safetensors_header(f, invalid_text(path), path)
    except OSError as exc:
        raise read_error(path)(exc) from exc
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            keys = list(f.keys())
    except Exception as exc:
        if not short_of_memory(exc):
            raise error(f"{path}: {invalid_text(path)} ({reason(exc)})") from exc
        # Its header, read above, lists the tensors; scores are streamed from the file in row blocks
        # (no mapping), and a tensor loaded whole says that memory is short (load below).
        keys = sorted(entries)
    if not keys:
        raise error(f"{path}: holds no tensors")

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        try:
            with open(path, "rb") as f:
                _, entries, _ = _read_safetensors_header(f, invalid_text(path), path)
        except OSError as exc:
            raise read_error(path)(exc) from exc
        for key in selected:
            entry = entries.get(key) if key is not None else None
            if entry is not None:
                check_size(qualified_name(path, key), entry.end - entry.begin, max_bytes)
        try:
            handle = safetensors.safe_open(path, framework="pt")
        except Exception as exc:
            if short_of_memory(exc):
                raise _memory_error(path, exc) from exc
            raise error(f"{path}: {invalid_text(path)} ({reason(exc)})") from exc
        out: list[tuple[str | None, Any]] = []
        with handle as f:
            for key in selected:
                assert key is not None
                try:
                    out.append((key, f.get_tensor(key)))
                except Exception as exc:
                    raise error(f"{qualified_name(path, key)}: cannot read the tensor ({reason(exc)})") from exc
        return out

    def sources(selected: list[str | None]) -> list[TensorSource]:
        return _safetensors_sources(path, selected)

    return FileListing(path, list(keys), load, sources)


@dataclass(frozen=True)
class _SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # bytes from the start of the data buffer
    end: int


def inspect_file(path: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """(the header's ``__metadata__``, {key: (dtype, shape)}) without reading any data;
    a header that does not fit the file's size is an error."""
    invalid = invalid_text(path)
    try:
        with open(path, "rb") as f:
            data_start, entries, meta = _read_safetensors_header(f, invalid, path)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise read_error(path)(exc) from exc
    needed = max((e.end for e in entries.values()), default=0)
    if needed > size - data_start:
        raise truncation(path, invalid, needed)(size - data_start)
    shown = {key: (_SAFETENSORS_DTYPES.get(e.dtype, (e.dtype, 0))[0], e.shape) for key, e in entries.items()}
    return meta, shown


def _safetensors_sources(path: str, selected: list[str | None]) -> list[TensorSource]:
    invalid = invalid_text(path)
    try:
        with open(path, "rb") as f:
            data_start, entries, _ = _read_safetensors_header(f, invalid, path)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise read_error(path)(exc) from exc
    available = size - data_start
    needed = max((e.end for e in entries.values()), default=0)
    if needed > available:
        raise truncation(path, invalid, needed)(available)
    out = []
    for key in selected:
        assert key is not None
        entry = entries.get(key)
        if entry is None:  # listed by safetensors itself, so never absent
            raise error(f"{path}: {invalid} (no tensor {key!r} in the header)")
        out.append(_safetensors_source(path, key, entry, data_start))
    return out


def _read_safetensors_header(
    f: BinaryIO, invalid: str, path: str
) -> tuple[int, dict[str, _SafetensorsEntry], dict[str, str]]:
    """(where the data starts, the tensors' entries, ``__metadata__``), the header read by
    ``jsondoc`` (size, depth and numbers bounded) and checked against the file's size."""

    def bad(why: str) -> AttncheckError:
        return error(f"{path}: {invalid} ({why})")

    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise bad("shorter than the 8-byte header length")
    n = int.from_bytes(prefix, "little")
    if n > _SAFETENSORS_MAX_HEADER:
        raise bad(f"header length {n} is over the {_SAFETENSORS_MAX_HEADER}-byte limit")
    if 8 + n > size:
        raise bad(f"header length {n} runs past the end of the {size}-byte file")
    try:
        header = jsondoc.decode(f.read(n), max_bytes=_SAFETENSORS_MAX_HEADER)
    except jsondoc.JSONError as exc:
        why = str(exc)
        raise bad(f"header is {why}" if why.startswith("not JSON") else f"header: {why}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    try:
        meta = jsondoc.convert(header.get("__metadata__") or {}, dict[str, str])
    except jsondoc.JSONError as exc:
        raise bad(f"header: __metadata__{'' if str(exc).startswith('[') else ': '}{exc}") from None
    entries: dict[str, _SafetensorsEntry] = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        entries[key] = _safetensors_entry(key, value, bad)
    return 8 + n, entries, meta


def _safetensors_entry(key: str, value: Any, bad: Callable[[str], AttncheckError]) -> _SafetensorsEntry:
    if not isinstance(value, dict):
        raise bad(f"header entry {key!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"tensor {key!r} has no dtype")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise bad(f"tensor {key!r} has a bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(n) is int for n in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"tensor {key!r} has bad data_offsets {offsets!r}")
    known = _SAFETENSORS_DTYPES.get(dtype)
    if known is not None and offsets[1] - offsets[0] != math.prod(shape) * known[1]:
        raise bad(
            f"tensor {key!r}: data_offsets span {offsets[1] - offsets[0]} bytes, "
            f"but {dtype} {tuple(shape)} needs {math.prod(shape) * known[1]}"
        )
    return _SafetensorsEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _safetensors_source(path: str, key: str, entry: _SafetensorsEntry, data_start: int) -> TensorSource:
    name = qualified_name(path, key)
    torch_name = _SAFETENSORS_DTYPES.get(entry.dtype, (entry.dtype, 0))[0]
    if torch_name not in _RAW_FLOATS:
        raise dtype_error(name, torch_name)
    check_shape(name, entry.shape)
    raw, dtype = _RAW_FLOATS[torch_name]
    invalid = invalid_text(path)

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        truncated = truncation(name, invalid, entry.end - entry.begin)
        try:
            f = open_at(path, data_start + entry.begin)
        except OSError as exc:
            raise read_error(name)(exc) from exc
        with f:
            reader = read_blocks(f, entry.shape, raw, dtype, rows_per_block, truncated)
            yield from guarded(reader, read_error(name))

    return TensorSource(name, entry.shape, dtype, True, blocks)
