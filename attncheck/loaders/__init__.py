"""Files -> named tensors, whole or as row-block sources.

Supported formats: ``.pt``/``.pth`` (``torch.save``), ``.npy``, ``.npz`` and
``.safetensors``, one module each in ``formats``. This package does no math and
prints nothing: every problem with an input file becomes an
:class:`~attncheck.errors.AttncheckError` whose message is one line naming the file
and what is wrong.

Safety: ``.pt`` files are loaded with ``weights_only=True`` and files that are
plain pickles (not written by ``torch.save``) are only inspected statically
with :mod:`pickletools`, never unpickled; numpy files are loaded with
``allow_pickle=False``.

Memory: :func:`open_sources` reads only headers; a source's ``row_blocks`` then
holds one block of ``rows_per_block * T`` elements at a time (``.pt`` files and
Fortran-ordered arrays are held whole). :func:`iter_sources` opens one file at a
time, so several ``.pt`` files need not be resident together.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from attncheck.loaders.common import (
    KINDS,
    FileListing,
    TensorSource,
    check_tensor,
    error,
    memory_source,
    qualified_name,
    read_head,
)
from attncheck.loaders.formats import SUPPORTED_SUFFIXES, format_for
from attncheck.loaders.paths import KeySelector, expand_paths, suffix_list

__all__ = [
    "SUPPORTED_SUFFIXES",
    "KeySelector",
    "NamedTensor",
    "TensorSource",
    "iter_sources",
    "load_tensors",
    "memory_source",
    "open_file",
    "open_sources",
]


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


def open_file(path: str, kind: str = "scores", max_bytes: int | None = None) -> FileListing:
    """Open one file by its format: its keys, and how to load or stream them. ``kind``
    ('scores' or 'mask') sets the dtypes accepted; ``max_bytes`` bounds what is read whole."""
    fmt = format_for(path)
    if fmt is None:
        raise error(f"{path}: unsupported file type (supported: {suffix_list()})")
    return fmt.open_file(path, read_head(path), kind, max_bytes)


def load_tensors(
    paths: Sequence[str | os.PathLike[str]],
    keys: Sequence[str] = (),
    *,
    kind: str = "scores",
    max_bytes: int | None = None,
) -> list[NamedTensor]:
    """Load every tensor in ``paths`` (files or directories) that ``keys`` selects.

    ``keys`` are case-sensitive :mod:`fnmatch` patterns matched against the
    key of each tensor inside a file (a bare tensor is matched against its
    file name); a pattern equal to a key selects that key alone. Empty selects
    everything. Every pattern must match at least one tensor over all files.
    ``kind`` is 'scores' (floating-point) or 'mask' (floating-point or boolean).
    A tensor (or a .pt file) larger than ``max_bytes`` is refused before it is read.
    Raises :class:`AttncheckError` for any bad input.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    selector = KeySelector(keys)
    result: list[NamedTensor] = []
    for file in expand_paths(paths):
        listing = open_file(file, kind, max_bytes)
        selected = selector.select(listing.path, listing.keys)
        if selected:
            for key, tensor in listing.load(selected):
                name = qualified_name(listing.path, key)
                result.append(NamedTensor(name, check_tensor(name, tensor, kind)))
    selector.check_all_matched()
    return result


def open_sources(
    paths: Sequence[str | os.PathLike[str]], keys: Sequence[str] = (), *, max_bytes: int | None = None
) -> list[TensorSource]:
    """A source for every tensor in ``paths`` that ``keys`` selects.

    Same files, order, names, ``keys`` semantics and errors as :func:`load_tensors`;
    reads only headers (but loads ``.pt`` files whole, and Fortran-ordered arrays when
    read; ``max_bytes`` bounds both). Raises :class:`AttncheckError` for any bad input.
    """
    return list(iter_sources(paths, keys, max_bytes=max_bytes))


def iter_sources(
    paths: Sequence[str | os.PathLike[str]], keys: Sequence[str] = (), *, max_bytes: int | None = None
) -> Iterator[TensorSource]:
    """The sources of :func:`open_sources`, one file at a time: a file is opened (a ``.pt``
    loaded whole) only once every source of the file before it has been taken, and this
    generator keeps no reference to a source it has handed out, so a caller that drops
    each source before asking for the next holds one file's tensors at a time.

    A file's errors come when it is reached; a ``keys`` pattern that matched nothing,
    after the last file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    selector = KeySelector(keys)
    for file in expand_paths(paths):
        listing = open_file(file, "scores", max_bytes)  # checks the file as load_tensors does; .pt: loads it
        selected = selector.select(listing.path, listing.keys)
        pending = listing.sources(selected) if selected else []
        del listing  # a .pt file's table of tensors: its sources hold what was selected
        pending.reverse()
        while pending:
            yield pending.pop()
    selector.check_all_matched()
