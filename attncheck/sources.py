"""A score tensor read on demand in row blocks (``TensorSource``), and a tensor in memory as one.

Below loaders (which open files as sources) and numerics (which read sources in chunks); ``loaders`` re-exports
these names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class TensorSource:
    """One score tensor in a file, read on demand in row blocks.

    ``name`` follows :class:`attncheck.loaders.NamedTensor`: the path for a file
    holding one bare tensor, ``path:key`` otherwise. ``shape`` and ``dtype``
    (fp16, bf16, fp32 or fp64) are known without reading the data. ``streams``
    is False where the whole tensor is held in memory (``.pt`` files, Fortran-ordered
    arrays, tensors given in memory).
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


def memory_source(name: str, tensor: torch.Tensor) -> TensorSource:
    """A tensor in memory as a source (its blocks are copies)."""
    shape = tuple(tensor.shape)

    def blocks(rows_per_block: int) -> Iterator[torch.Tensor]:
        yield from slices(tensor, rows_per_block)

    return TensorSource(name, shape, tensor.dtype, False, blocks)


def slices(tensor: torch.Tensor, rows_per_block: int) -> Iterator[torch.Tensor]:
    # Copies, like streamed blocks: a consumer that works on a block in place
    # must not change the tensor the next pass reads.
    flat = tensor.reshape(-1, tensor.shape[-1])  # (R, T); a view when contiguous
    for start in range(0, flat.shape[0], rows_per_block):
        yield flat[start : start + rows_per_block].clone()
