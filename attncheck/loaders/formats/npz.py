""".npz: named .npy members of a zip archive. Streams: a stored (uncompressed,
``np.savez``) member is read like ``.npy`` at its offset inside the archive, its
CRC-32 checked once the member is read to the end; a compressed member
(``np.savez_compressed``) is decompressed sequentially through :mod:`zipfile`, in
pieces of at most 8 MiB. Never unpickles (``allow_pickle=False``)."""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any, BinaryIO

import numpy.lib.format as npformat
import torch

from attncheck.errors import AttncheckError
from attncheck.loaders.common import (
    EMPTY_ZIP_MAGIC,
    NPY_MAGIC,
    PIECE,
    ZIP_MAGIC,
    FileListing,
    TensorSource,
    check_size,
    error,
    from_numpy,
    guarded,
    invalid_text,
    numpy_error,
    qualified_name,
    read_blocks,
    reason,
    truncation,
    unique_names,
)
from attncheck.loaders.formats.npy import check_npy, fortran_source, read_array, read_npy_header

SUFFIXES = (".npz",)

_ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes, signature PK\x03\x04


def open_file(path: str, head: bytes, kind: str = "scores", max_bytes: int | None = None) -> FileListing:
    if head.startswith(NPY_MAGIC):
        raise error(f"{path}: {invalid_text(path)} (it is a single .npy array; rename it to .npy)")
    if not head.startswith((ZIP_MAGIC, EMPTY_ZIP_MAGIC)):
        raise error(f"{path}: {invalid_text(path)} (not a zip archive)")
    try:
        with open(path, "rb") as handle, zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
    except Exception as exc:
        raise error(f"{path}: {invalid_text(path)} ({reason(exc)})") from exc
    if not infos:
        raise error(f"{path}: holds no arrays")
    members = _member_keys(path, infos)

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        return [(key, _load_member(path, key, members[key], kind, max_bytes)) for key in selected if key is not None]

    def sources(selected: list[str | None]) -> list[TensorSource]:
        return [_npz_member_source(path, key, members[key], max_bytes) for key in selected if key is not None]

    return FileListing(path, list(members), load, sources)


def _member_keys(path: str, infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
    """Key -> member. As numpy names them: 'x.npy' is 'x', 'x.npy.npy' (np.savez(x.npy=...))
    is 'x.npy', a member without the suffix keeps its name. Where two members would get one
    key ('x' and 'x.npy'), both are named by their member name in brackets: "['x']",
    "['x.npy']". Each key then reads exactly its own member."""
    names = [i.filename for i in infos]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise error(f"{path}: {invalid_text(path)} (two members are named {repeated[0]!r})")
    plain = [n.removesuffix(".npy") for n in names]
    keys = [f"[{n!r}]" if plain.count(k) > 1 else k for n, k in zip(names, plain)]
    unique_names(path, list(keys))
    return dict(zip(keys, infos))


def _load_member(path: str, key: str, info: zipfile.ZipInfo, kind: str, max_bytes: int | None) -> torch.Tensor:
    """One member whole: its .npy header is read and checked (dtype, size against the member
    and the budget) before the array's buffer is allocated; a compressed member is
    decompressed in pieces into that buffer, never beyond the size its header declares."""
    name = qualified_name(path, key)
    member_error = lambda exc: numpy_error(name, exc, member=True)  # noqa: E731
    invalid = "not a valid .npy member"
    try:
        with ExitStack() as stack:
            reader = _open_member(path, info, stack)
            header = _member_header(name, reader)
            check_npy(name, header, info.file_size - header.data_offset, invalid, kind)
            check_size(name, header.nbytes, max_bytes)
            array = read_array(reader, header, truncation(name, invalid, header.nbytes), member_error)
            reader.drain()  # the CRC is checked at the end of the member
    except AttncheckError:
        raise
    except Exception as exc:
        raise member_error(exc) from exc
    return from_numpy(name, array, kind)


def _member_header(name: str, reader: Any) -> Any:
    if reader.read(len(npformat.MAGIC_PREFIX)) != npformat.MAGIC_PREFIX:
        raise error(f"{name}: member is not a .npy array")
    return read_npy_header(_Rewound(reader, npformat.MAGIC_PREFIX))


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
        return self._stream.readinto(buffer[:PIECE]) or 0

    def read(self, n: int) -> bytes:
        return self._stream.read(n)

    def tell(self) -> int:
        return self._stream.tell()

    def drain(self) -> None:
        while self._stream.read(PIECE):  # zipfile checks the CRC at the end
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
        # As zipfile checks it: the local header names the member the central directory does.
        raw = f.read(name_length)
        local_name = raw.decode("utf-8" if _ZIP_LOCAL_HEADER.unpack(local)[2] & 0x800 else "cp437", "replace")
        if local_name != info.orig_filename:
            raise zipfile.BadZipFile(f"File name in directory {info.orig_filename!r} and header {local_name!r} differ.")
        if info.compress_size != info.file_size:
            raise zipfile.BadZipFile(
                f"stored member {info.filename!r}: the directory says {info.compress_size} bytes stored, "
                f"{info.file_size} bytes of data"
            )
        f.seek(info.header_offset + _ZIP_LOCAL_HEADER.size + name_length + extra_length)
        return _StoredMember(f, info)
    archive = stack.enter_context(zipfile.ZipFile(path))
    return _CompressedMember(stack.enter_context(archive.open(info)))


def _npz_member_source(path: str, key: str, info: zipfile.ZipInfo, max_bytes: int | None = None) -> TensorSource:
    name = qualified_name(path, key)
    member_error = lambda exc: numpy_error(name, exc, member=True)  # noqa: E731
    try:
        with ExitStack() as stack:
            header = _member_header(name, _open_member(path, info, stack))
    except AttncheckError:
        raise
    except Exception as exc:
        raise member_error(exc) from exc
    invalid = "not a valid .npy member"
    dtype = check_npy(name, header, info.file_size - header.data_offset, invalid)
    if header.fortran and len(header.shape) > 1:
        check_size(name, header.nbytes, max_bytes, "a Fortran-ordered array is read whole: it")
        return fortran_source(name, header, dtype, lambda: _load_member(path, key, info, "scores", max_bytes))

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        truncated = truncation(name, invalid, header.nbytes)
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
            reader_blocks = read_blocks(reader, header.shape, header.dtype, dtype, rows_per_block, truncated)
            yield from guarded(_then(reader_blocks, reader.drain), member_error)

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
