""".npy: one bare tensor. Streams: the header is parsed with :mod:`numpy.lib.format`;
each block is read with ``readinto`` into a fresh buffer (no memory map, so no file
page stays in the process's resident memory); big-endian data is byte-swapped in
place. Fortran-ordered arrays (rows not contiguous in the file) are loaded whole.
Never unpickles: ``allow_pickle=False``, object arrays are refused."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    check_numpy_dtype,
    check_shape,
    check_size,
    check_tensor,
    error,
    from_numpy,
    guarded,
    invalid_text,
    numpy_error,
    object_array_error,
    open_at,
    read_blocks,
    read_error,
    slices,
    truncation,
)

SUFFIXES = (".npy",)

# numpy.load's default: longer .npy headers are refused as unsafe.
_NPY_MAX_HEADER = 10000

NUMPY_TO_TORCH = {2: torch.float16, 4: torch.float32, 8: torch.float64}


def open_file(path: str, head: bytes, kind: str = "scores", max_bytes: int | None = None) -> FileListing:
    if not head.startswith(NPY_MAGIC):
        why = "it does not start with the .npy header"
        if head.startswith((ZIP_MAGIC, EMPTY_ZIP_MAGIC)):
            why = "it is a zip archive; .npz files must be named .npz"
        raise error(f"{path}: {invalid_text(path)} ({why})")

    def load(selected: list[str | None]) -> list[tuple[str | None, Any]]:
        return [(None, _load(path, kind, max_bytes))]

    def sources(selected: list[str | None]) -> list[TensorSource]:
        return [_npy_source(path, max_bytes)]

    return FileListing(path, [None], load, sources)


def _read_header(path: str) -> tuple[NpyHeader, int]:
    try:
        with open(path, "rb") as f:
            header = read_npy_header(f)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise read_error(path)(exc) from exc
    except Exception as exc:
        raise numpy_error(path, exc) from exc
    return header, size


def _load(path: str, kind: str = "scores", max_bytes: int | None = None) -> torch.Tensor:
    """The whole array, checked (dtype, size against the file and the budget) before its
    buffer is allocated."""
    header, size = _read_header(path)
    check_npy(path, header, size - header.data_offset, invalid_text(path), kind)
    check_size(path, header.nbytes, max_bytes)
    try:
        f = open_at(path, header.data_offset)
    except OSError as exc:
        raise read_error(path)(exc) from exc
    with f:
        array = read_array(f, header, truncation(path, invalid_text(path), header.nbytes), read_error(path))
    return from_numpy(path, array, kind)


def read_array(
    stream: Any, header: "NpyHeader", truncated: Callable[[int], Any], unreadable: Callable[[BaseException], Any]
) -> np.ndarray:
    """The array ``header`` describes, read from ``stream`` in pieces into one buffer of its
    size (the header's size was checked before: nothing larger is ever allocated)."""
    buffer = np.empty(math.prod(header.shape), dtype=header.dtype)
    view = memoryview(buffer.reshape(-1).view(np.uint8))
    got = 0
    try:
        while got < len(view):
            n = stream.readinto(view[got : got + PIECE])
            if not n:
                raise truncated(got)
            got += n
    except AttncheckError:
        raise
    except Exception as exc:
        raise unreadable(exc) from exc
    return buffer.reshape(header.shape, order="F" if header.fortran else "C")


@dataclass(frozen=True)
class NpyHeader:
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    data_offset: int  # bytes from the start of the .npy data to the array data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_npy_header(fp: Any) -> NpyHeader:
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
    return NpyHeader(tuple(int(n) for n in shape), bool(fortran), dtype, fp.tell())


def check_npy(name: str, header: NpyHeader, available: int, invalid: str, kind: str = "scores") -> torch.dtype:
    """Validate in load_tensors' order: objects, size against the data, dtype, shape."""
    if header.dtype.hasobject:
        raise object_array_error(name)
    if available < header.nbytes:
        raise truncation(name, invalid, header.nbytes)(max(available, 0))
    if available > header.nbytes:
        order = ", Fortran order" if header.fortran else ""
        raise error(
            f"{name}: {invalid} (the header's shape {header.shape}{order} of {header.dtype.name} accounts for "
            f"{header.nbytes} bytes of data, but {available} follow it)"
        )
    check_numpy_dtype(name, header.dtype, kind)
    check_shape(name, header.shape)
    return torch.bool if header.dtype.kind == "b" else NUMPY_TO_TORCH[header.dtype.itemsize]


def _npy_source(path: str, max_bytes: int | None = None) -> TensorSource:
    invalid = invalid_text(path)
    header, size = _read_header(path)
    dtype = check_npy(path, header, size - header.data_offset, invalid)
    if header.fortran and len(header.shape) > 1:
        check_size(path, header.nbytes, max_bytes, "a Fortran-ordered array is read whole: it")
        return fortran_source(path, header, dtype, lambda: _load(path))

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        truncated = truncation(path, invalid, header.nbytes)
        try:
            f = open_at(path, header.data_offset)
        except OSError as exc:
            raise read_error(path)(exc) from exc
        with f:
            reader = read_blocks(f, header.shape, header.dtype, dtype, rows_per_block, truncated)
            yield from guarded(reader, read_error(path))

    return TensorSource(path, header.shape, dtype, True, blocks)


def fortran_source(name: str, header: NpyHeader, dtype: torch.dtype, load: Callable[[], Any]) -> TensorSource:
    """Rows of a Fortran-ordered array are not contiguous: load it whole, when asked."""

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        tensor = check_tensor(name, load())
        yield from slices(tensor, rows_per_block)

    return TensorSource(name, header.shape, dtype, False, blocks)
