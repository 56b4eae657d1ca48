"""Tensor files as streams of row blocks, for score tensors larger than memory.

:func:`open_sources` finds the same tensors as :func:`attncheck.loaders.load_tensors`
(same paths, directories, ``--key`` patterns, names and error messages) but reads
only headers; each :class:`TensorSource` then yields its rows in consecutive
blocks of a chosen size, so a caller holds one block at a time. The softmax axis
is the last one: a tensor of shape ``(..., T)`` is read as ``(rows, T)``.

How each format is read:

- ``.npy``: the header is parsed with :mod:`numpy.lib.format`; each block is read
  with ``readinto`` into a fresh buffer (no memory map, so no file page stays in
  the process's resident memory). Big-endian data is byte-swapped in place.
- ``.safetensors``: the header (8-byte little-endian length, then JSON with
  dtype, shape and data_offsets) is parsed here and checked against the file
  size; blocks are read like ``.npy``. ``BF16`` is read as raw 16-bit words and
  reinterpreted as ``torch.bfloat16``.
- ``.npz``: a stored (uncompressed, ``np.savez``) member is read like ``.npy`` at
  its offset inside the archive, its CRC-32 checked once the member is read to
  the end. A compressed member (``np.savez_compressed``) is decompressed
  sequentially through :mod:`zipfile`, in pieces of at most 8 MiB.

What cannot stream (the whole tensor is held in memory, ``streams`` is False):

- ``.pt``/``.pth``: a pickle plus whole storages; the file is loaded with
  ``torch.load(weights_only=True)`` by :mod:`attncheck.loaders` when it is opened,
  and its tensors stay in memory as long as their sources are referenced.
- Fortran-ordered ``.npy`` arrays and ``.npz`` members (``fortran_order: True``,
  e.g. ``np.save(path, x.T)``): rows are not contiguous in the file. They are
  loaded whole (as :mod:`attncheck.loaders` does) each time their blocks are read.

Memory: a block of ``rows_per_block * T`` elements is the one large allocation
per step (plus a piece of at most 8 MiB of decompressed bytes for a compressed
``.npz`` member); a caller that still holds the previous block while the next is
read holds two. A single row is never split, so a 1-d tensor is one block.

This module does no math and prints nothing; bad input raises
:class:`~attncheck.errors.AttncheckError` with the loaders' messages.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import numpy.lib.format as npformat
import torch

from attncheck.errors import AttncheckError

# Shared with load_tensors so that names, selection and messages stay identical.
from attncheck.loaders import (
    KeySelector,
    _check_numpy_dtype,
    _check_shape,
    _check_tensor,
    _dtype_error,
    _error,
    _expand_paths,
    _invalid,
    _name,
    _numpy_error,
    _object_array_error,
    _open_source,
    _reason,
    _suffix,
)

__all__ = ["TensorSource", "open_sources"]

# Largest piece read at once from a compressed stream, whose reads copy.
_PIECE = 8 << 20
# numpy.load's default: longer .npy headers are refused as unsafe.
_NPY_MAX_HEADER = 10000
# safetensors' own limit on the JSON header.
_SAFETENSORS_MAX_HEADER = 100_000_000
_ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes, signature PK\x03\x04

# safetensors dtype -> (torch name, bytes per element); unknown names are shown raw.
_SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "C64": ("complex64", 8),
}
# How the float dtypes are stored: numpy dtype of the raw elements, torch dtype.
_RAW_FLOATS: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float64": (np.dtype("<f8"), torch.float64),
    "float32": (np.dtype("<f4"), torch.float32),
    "float16": (np.dtype("<f2"), torch.float16),
    "bfloat16": (np.dtype("<u2"), torch.bfloat16),  # numpy has no bf16: raw 16-bit words
}
_NUMPY_TO_TORCH = {2: torch.float16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True, eq=False)
class TensorSource:
    """One score tensor in a file, read on demand in row blocks.

    ``name`` follows :class:`attncheck.loaders.NamedTensor`: the path for a file
    holding one bare tensor, ``path:key`` otherwise. ``shape`` and ``dtype``
    (fp16, bf16, fp32 or fp64) are known without reading the data. ``streams``
    is False where the whole tensor is held in memory (see the module notes).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    streams: bool
    _blocks: Callable[[int], Iterator[torch.Tensor]] = field(repr=False)

    @property
    def rows(self) -> int:
        """Rows of the ``(rows, T)`` view: the product of all axes but the last."""
        return math.prod(self.shape[:-1])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def row_blocks(self, rows_per_block: int) -> Iterator[torch.Tensor]:
        """Consecutive ``(r, T)`` CPU tensors in row order, covering every row once.

        ``r`` is ``rows_per_block`` except for a shorter last block. Every call
        starts again from the first row. Every block is a fresh tensor that the
        caller may modify. Read errors (a file that changed since it was opened, a bad
        CRC) raise :class:`AttncheckError`.
        """
        if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or rows_per_block < 1:
            raise ValueError(f"rows_per_block must be a positive int, got {rows_per_block!r}")
        return self._blocks(rows_per_block)


def open_sources(
    paths: Sequence[str | os.PathLike[str]], keys: Sequence[str] = ()
) -> list[TensorSource]:
    """A source for every tensor in ``paths`` that ``keys`` selects.

    Same files, order, names, ``--key`` semantics and errors as
    :func:`attncheck.loaders.load_tensors`; reads only headers (but loads
    ``.pt`` files whole). Raises :class:`AttncheckError` for any bad input.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = _expand_paths(paths)
    selector = KeySelector(keys)
    result: list[TensorSource] = []
    for file in files:
        listing = _open_source(file)  # checks the file as load_tensors does; .pt: loads it
        selected = selector.select(listing.path, listing.keys)
        if not selected:
            continue
        suffix = _suffix(Path(file))
        if suffix == ".npy":
            result.append(_npy_source(file))
        elif suffix == ".npz":
            result.extend(_npz_sources(file, selected))
        elif suffix == ".safetensors":
            result.extend(_safetensors_sources(file, selected))
        else:
            for key, tensor in listing.load(selected):
                name = _name(file, key)
                result.append(_memory_source(name, _check_tensor(name, tensor)))
    selector.check_all_matched()
    return result


# --------------------------------------------------------------------------
# block readers


class _Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def _memory_source(name: str, tensor: torch.Tensor) -> TensorSource:
    shape = tuple(tensor.shape)

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        yield from _slices(tensor, rows_per_block)

    return TensorSource(name, shape, tensor.dtype, False, blocks)


def _slices(tensor: torch.Tensor, rows_per_block: int) -> Iterator[torch.Tensor]:
    # Copies, like streamed blocks: a consumer that works on a block in place
    # must not change the tensor the next pass reads.
    flat = tensor.reshape(-1, tensor.shape[-1])  # (R, T); a view when contiguous
    for start in range(0, flat.shape[0], rows_per_block):
        yield flat[start : start + rows_per_block].clone()


def _read_blocks(
    stream: _Readable,
    shape: tuple[int, ...],
    raw: np.dtype,
    dtype: torch.dtype,
    rows_per_block: int,
    truncated: Callable[[int], AttncheckError],
) -> Iterator[torch.Tensor]:
    """Blocks of ``shape`` read from ``stream``, element type ``raw`` in the file."""
    keys = shape[-1]
    rows = math.prod(shape[:-1])
    done = 0  # bytes read so far
    for start in range(0, rows, rows_per_block):
        r = min(rows_per_block, rows - start)
        buffer = np.empty(r * keys, dtype=raw)  # the block: the one large allocation
        view = memoryview(buffer).cast("B")
        got = 0
        while got < len(view):
            n = stream.readinto(view[got:])
            if not n:
                raise truncated(done + got)
            got += n
        done += got
        if not raw.isnative:
            buffer = buffer.byteswap(inplace=True).view(raw.newbyteorder("="))
        yield torch.from_numpy(buffer).view(dtype).view(r, keys)  # (r, T)


def _truncated(what: str, invalid: str, expected: int) -> Callable[[int], AttncheckError]:
    def error(found: int) -> AttncheckError:
        return _error(f"{what}: {invalid} (truncated: expected {expected} bytes of data, found {found})")

    return error


def _open_at(path: str, offset: int) -> BinaryIO:
    """The file, unbuffered (reads go straight into the block), at ``offset``."""
    f = open(path, "rb", buffering=0)
    try:
        f.seek(offset)
    except BaseException:
        f.close()
        raise
    if hasattr(os, "posix_fadvise"):
        with suppress(OSError):  # a hint for read-ahead; some file systems refuse it
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return f  # type: ignore[return-value]


def _read_error(what: str) -> Callable[[BaseException], AttncheckError]:
    def error(exc: BaseException) -> AttncheckError:
        return _error(f"{what}: cannot read the file ({_reason(exc)})")

    return error


# --------------------------------------------------------------------------
# .npy


@dataclass(frozen=True)
class _NpyHeader:
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    data_offset: int  # bytes from the start of the .npy data to the array data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_npy_header(fp: Any) -> _NpyHeader:
    """Parse a .npy header from ``fp`` as numpy.load does; numpy's errors propagate."""
    version = npformat.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = npformat.read_array_header_1_0(fp, max_header_size=_NPY_MAX_HEADER)
    elif version in ((2, 0), (3, 0)):
        # 3.0 differs from 2.0 only in allowing UTF-8 field names (structured
        # dtypes, refused anyway); an ASCII header reads the same either way.
        shape, fortran, dtype = npformat.read_array_header_2_0(fp, max_header_size=_NPY_MAX_HEADER)
    else:
        raise ValueError(f"we only support format version (1,0), (2,0), and (3,0), not {version}")
    return _NpyHeader(tuple(int(n) for n in shape), bool(fortran), dtype, fp.tell())


def _check_npy(name: str, header: _NpyHeader, available: int, invalid: str) -> torch.dtype:
    """Validate in load_tensors' order: objects, truncation, dtype, shape."""
    if header.dtype.hasobject:
        raise _object_array_error(name)
    if available < header.nbytes:
        raise _truncated(name, invalid, header.nbytes)(max(available, 0))
    _check_numpy_dtype(name, header.dtype)
    _check_shape(name, header.shape)
    return _NUMPY_TO_TORCH[header.dtype.itemsize]


def _npy_source(path: str) -> TensorSource:
    invalid = _invalid(path)
    try:
        with open(path, "rb") as f:
            header = _read_npy_header(f)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise _read_error(path)(exc) from exc
    except Exception as exc:
        raise _numpy_error(path, exc) from exc
    dtype = _check_npy(path, header, size - header.data_offset, invalid)
    if header.fortran and len(header.shape) > 1:
        return _fortran_source(path, header, dtype, lambda: _open_source(path).load([None])[0][1])

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        truncated = _truncated(path, invalid, header.nbytes)
        try:
            f = _open_at(path, header.data_offset)
        except OSError as exc:
            raise _read_error(path)(exc) from exc
        with f:
            reader = _read_blocks(f, header.shape, header.dtype, dtype, rows_per_block, truncated)
            yield from _guarded(reader, _read_error(path))

    return TensorSource(path, header.shape, dtype, True, blocks)


def _fortran_source(
    name: str, header: _NpyHeader, dtype: torch.dtype, load: Callable[[], Any]
) -> TensorSource:
    """Rows of a Fortran-ordered array are not contiguous: load it whole, when asked."""

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        tensor = _check_tensor(name, load())
        yield from _slices(tensor, rows_per_block)

    return TensorSource(name, header.shape, dtype, False, blocks)


def _guarded(
    blocks: Iterator[torch.Tensor], wrap: Callable[[BaseException], AttncheckError]
) -> Iterator[torch.Tensor]:
    """Re-raise read errors as AttncheckError; never wrap what the consumer throws in."""
    while True:
        try:
            block = next(blocks)
        except StopIteration:
            return
        except AttncheckError:
            raise
        except Exception as exc:
            raise wrap(exc) from exc
        yield block


# --------------------------------------------------------------------------
# .npz


def _npz_sources(path: str, selected: list[str | None]) -> list[TensorSource]:
    try:
        with open(path, "rb") as handle, zipfile.ZipFile(handle) as archive:
            names = archive.namelist()
            infos = {n: archive.getinfo(n) for n in names}
    except Exception as exc:  # listed fine by loaders a moment ago
        raise _error(f"{path}: {_invalid(path)} ({_reason(exc)})") from exc
    # As numpy's NpzFile: "x" names member "x.npy", and "x.npy" names itself.
    members = {n.removesuffix(".npy"): n for n in names}
    members.update({n: n for n in names})
    out = []
    for key in selected:
        assert key is not None
        out.append(_npz_member_source(path, key, infos[members[key]]))
    return out


class _StoredMember:
    """Reads of an uncompressed zip member straight from the file, CRC-checked."""

    def __init__(self, f: BinaryIO, info: zipfile.ZipInfo) -> None:
        self._f = f
        self._info = info
        self._left = info.file_size
        self._crc = 0

    def readinto(self, buffer: memoryview) -> int:
        want = min(len(buffer), self._left)
        if want == 0:
            return 0
        n = self._f.readinto(buffer[:want]) or 0
        self._crc = zlib.crc32(buffer[:n], self._crc)
        self._left -= n
        if n == 0:
            raise EOFError(f"zip member {self._info.filename!r} is cut short")
        if self._left == 0 and self._crc != self._info.CRC:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {self._info.filename!r}")
        return n

    def read(self, n: int) -> bytes:
        buffer = bytearray(min(n, self._left))
        got = 0
        while got < len(buffer):
            k = self.readinto(memoryview(buffer)[got:])
            if not k:
                break
            got += k
        return bytes(buffer[:got])

    def tell(self) -> int:
        return self._info.file_size - self._left

    def drain(self) -> None:
        """Read what follows the array so the CRC gets checked."""
        scratch = memoryview(bytearray(min(self._left, 1 << 20)))
        while self._left:
            self.readinto(scratch)


class _CompressedMember:
    """A compressed member through zipfile, read in bounded pieces."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def readinto(self, buffer: memoryview) -> int:
        return self._stream.readinto(buffer[:_PIECE]) or 0

    def read(self, n: int) -> bytes:
        return self._stream.read(n)

    def tell(self) -> int:
        return self._stream.tell()

    def drain(self) -> None:
        while self._stream.read(_PIECE):  # zipfile checks the CRC at the end
            pass


def _open_member(path: str, info: zipfile.ZipInfo, stack: ExitStack) -> Any:
    """A reader at the start of the member's bytes; ``stack`` closes what it opens."""
    if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:  # not encrypted
        f = stack.enter_context(open(path, "rb", buffering=0))
        f.seek(info.header_offset)
        local = f.read(_ZIP_LOCAL_HEADER.size)
        if len(local) < _ZIP_LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile("Bad magic number for file header")
        *_, name_length, extra_length = _ZIP_LOCAL_HEADER.unpack(local)
        f.seek(info.header_offset + _ZIP_LOCAL_HEADER.size + name_length + extra_length)
        return _StoredMember(f, info)
    archive = stack.enter_context(zipfile.ZipFile(path))
    return _CompressedMember(stack.enter_context(archive.open(info)))


def _npz_member_source(path: str, key: str, info: zipfile.ZipInfo) -> TensorSource:
    name = _name(path, key)
    member_error = lambda exc: _numpy_error(name, exc, member=True)  # noqa: E731
    try:
        with ExitStack() as stack:
            reader = _open_member(path, info, stack)
            if reader.read(len(npformat.MAGIC_PREFIX)) != npformat.MAGIC_PREFIX:
                raise _error(f"{name}: member is not a .npy array")
            header = _read_npy_header(_Rewound(reader, npformat.MAGIC_PREFIX))
    except AttncheckError:
        raise
    except Exception as exc:
        raise member_error(exc) from exc
    invalid = "not a valid .npy member"
    dtype = _check_npy(name, header, info.file_size - header.data_offset, invalid)
    if header.fortran and len(header.shape) > 1:
        return _fortran_source(name, header, dtype, lambda: _open_source(path).load([key])[0][1])

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        truncated = _truncated(name, invalid, header.nbytes)
        with ExitStack() as stack:
            try:
                reader = _open_member(path, info, stack)
                skip = reader.read(header.data_offset)
                if len(skip) != header.data_offset:
                    raise truncated(0)
            except AttncheckError:
                raise
            except Exception as exc:
                raise member_error(exc) from exc
            reader_blocks = _read_blocks(reader, header.shape, header.dtype, dtype, rows_per_block, truncated)
            yield from _guarded(_then(reader_blocks, reader.drain), member_error)

    return TensorSource(name, header.shape, dtype, True, blocks)


def _then(blocks: Iterator[torch.Tensor], last: Callable[[], None]) -> Iterator[torch.Tensor]:
    """``blocks``, with ``last()`` run before the final block is handed out.

    The final block waits until the member's CRC has been checked, so a corrupt
    member fails before its last rows are used.
    """
    pending = None
    for block in blocks:
        if pending is not None:
            yield pending
        pending = block
    last()
    if pending is not None:
        yield pending


class _Rewound:
    """``reader`` as if ``prefix`` (already read from it) had not been read yet."""

    def __init__(self, reader: Any, prefix: bytes) -> None:
        self._reader = reader
        self._prefix = prefix
        self._pos = 0

    def read(self, n: int) -> bytes:
        head = self._prefix[self._pos : self._pos + n]
        self._pos += len(head)
        rest = self._reader.read(n - len(head)) if n > len(head) else b""
        return head + rest

    def tell(self) -> int:
        return self._reader.tell()


# --------------------------------------------------------------------------
# .safetensors


@dataclass(frozen=True)
class _SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # bytes from the start of the data buffer
    end: int


def _safetensors_sources(path: str, selected: list[str | None]) -> list[TensorSource]:
    invalid = _invalid(path)
    try:
        with open(path, "rb") as f:
            data_start, entries = _read_safetensors_header(f, invalid, path)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise _read_error(path)(exc) from exc
    available = size - data_start
    needed = max((e.end for e in entries.values()), default=0)
    if needed > available:
        raise _truncated(path, invalid, needed)(available)
    out = []
    for key in selected:
        assert key is not None
        entry = entries.get(key)
        if entry is None:  # listed by safetensors itself, so never absent
            raise _error(f"{path}: {invalid} (no tensor {key!r} in the header)")
        out.append(_safetensors_source(path, key, entry, data_start))
    return out


def _read_safetensors_header(
    f: BinaryIO, invalid: str, path: str
) -> tuple[int, dict[str, _SafetensorsEntry]]:
    def bad(why: str) -> AttncheckError:
        return _error(f"{path}: {invalid} ({why})")

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
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"header is not JSON: {_reason(exc)}") from exc
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    entries: dict[str, _SafetensorsEntry] = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        entries[key] = _safetensors_entry(key, value, bad)
    return 8 + n, entries


def _safetensors_entry(
    key: str, value: Any, bad: Callable[[str], AttncheckError]
) -> _SafetensorsEntry:
    if not isinstance(value, dict):
        raise bad(f"header entry {key!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"tensor {key!r} has no dtype")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise bad(f"tensor {key!r} has a bad shape {shape!r}")
    if not (
        isinstance(offsets, list) and len(offsets) == 2
        and all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1]
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
    name = _name(path, key)
    torch_name = _SAFETENSORS_DTYPES.get(entry.dtype, (entry.dtype, 0))[0]
    if torch_name not in _RAW_FLOATS:
        raise _dtype_error(name, torch_name)
    _check_shape(name, entry.shape)
    raw, dtype = _RAW_FLOATS[torch_name]
    invalid = _invalid(path)

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        truncated = _truncated(name, invalid, entry.end - entry.begin)
        try:
            f = _open_at(path, data_start + entry.begin)
        except OSError as exc:
            raise _read_error(name)(exc) from exc
        with f:
            reader = _read_blocks(f, entry.shape, raw, dtype, rows_per_block, truncated)
            yield from _guarded(reader, _read_error(name))

    return TensorSource(name, entry.shape, dtype, True, blocks)
