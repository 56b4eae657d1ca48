"""What every format shares: the row-block source, reading helpers, checks and messages.

No math, no printing: every problem with an input file becomes an
:class:`~attncheck.errors.AttncheckError` whose message is one line naming the file
and what is wrong.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch

from attncheck.dtypes import scores_dtype_error, spec_of
from attncheck.errors import AttncheckError, param
from attncheck.format import size_text
from attncheck.sources import TensorSource, memory_source, slices  # noqa: F401  (loaders' API, defined below)

MAX_REASON = 120

ZIP_MAGIC = b"PK\x03\x04"

EMPTY_ZIP_MAGIC = b"PK\x05\x06"

NPY_MAGIC = b"\x93NUMPY"

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Largest piece read at once from a compressed stream, whose reads copy.
PIECE = 8 << 20


@dataclass
class FileListing:
    """A file opened by its format: the keys it holds (None: one bare tensor), and how to
    load selected tensors whole or as row-block sources."""

    path: str
    keys: list[str | None]
    load: Callable[[list[str | None]], list[tuple[str | None, Any]]]
    sources: Callable[[list[str | None]], list["TensorSource"]]


class Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def read_blocks(
    stream: Readable,
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


def truncation(what: str, invalid: str, expected: int) -> Callable[[int], AttncheckError]:
    def cut_short(found: int) -> AttncheckError:
        return error(f"{what}: {invalid} (truncated: expected {expected} bytes of data, found {found})")

    return cut_short


def open_at(path: str, offset: int) -> BinaryIO:
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


def read_error(what: str) -> Callable[[BaseException], AttncheckError]:
    def unreadable(exc: BaseException) -> AttncheckError:
        return error(f"{what}: cannot read the file ({reason(exc)})")

    return unreadable


def guarded(blocks: Iterator[torch.Tensor], wrap: Callable[[BaseException], AttncheckError]) -> Iterator[torch.Tensor]:
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


def read_head(path: str) -> bytes:
    """The first bytes of a file, for the formats to check their magic."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise error(f"{path}: cannot read the file ({reason(exc)})") from exc
    if not head:
        raise error(f"{path}: {invalid_text(path)} (the file is empty)")
    return head


def invalid_text(path: str) -> str:
    return f"not a valid {suffix_of(Path(path))} file"


def suffix_of(path: Path) -> str:
    return path.suffix.lower()


def qualified_name(path: str, key: str | None) -> str:
    return path if key is None else f"{path}:{key}"


def unique_names(path: str, keys: list[str | None]) -> list[str | None]:
    """The keys of a file, checked to name one tensor each (formats escape what could collide)."""
    seen: set[str | None] = set()
    for key in keys:
        if key in seen:
            raise error(f"{path}: two tensors are named {key!r}; attncheck cannot tell them apart")
        seen.add(key)
    return keys


# What a tensor is read as: 'scores' (also q and k) must be floating-point; a 'mask' may
# also be boolean (True = attend or True = masked) - the same rules in every format.
KINDS = ("scores", "mask")


def check_tensor(name: str, tensor: Any, kind: str = "scores") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):  # defensive; loaders yield tensors
        raise error(f"{name} is not a tensor (got {type(tensor).__name__})")
    if tensor.is_nested:
        raise error(
            f"{name} is a nested tensor (rows of different lengths); attncheck needs a dense tensor: pad it, or save "
            "each part"
        )
    if tensor.device.type == "meta":
        raise error(
            f"{name} is a meta tensor: it has a shape but no values (saved from a model on the meta device); save "
            "the real tensor"
        )
    if tensor.layout != torch.strided:
        raise error(f"{name} has layout {torch_name(tensor.layout)}; attncheck needs a dense tensor")
    check_dtype(name, tensor.dtype, kind)
    check_shape(name, tuple(tensor.shape))
    tensor = tensor.detach()  # plain tensor, also for nn.Parameter
    if tensor.device.type != "cpu":  # defensive; map_location="cpu" already
        tensor = tensor.cpu()
    return tensor


def is_scores_dtype(dtype: torch.dtype) -> bool:
    spec = spec_of(dtype)
    return spec is not None and spec.scores


def check_dtype(name: str, dtype: torch.dtype, kind: str = "scores") -> None:
    """Scores, q and k: a floating dtype attncheck reads; a mask: that or bool."""
    if kind == "mask" and dtype == torch.bool:
        return
    if not is_scores_dtype(dtype):
        raise dtype_error(name, torch_name(dtype), kind)


def dtype_error(name: str, shown: str, kind: str = "scores") -> AttncheckError:
    if kind == "mask":
        return error(
            f"{name} has dtype {shown}; use a boolean mask (True = attend; {param('mask_convention')} ignore for "
            "True = masked) or an additive float mask"
        )
    return error(str(scores_dtype_error(name, shown)))


def check_size(name: str, nbytes: int, max_bytes: int | None, what: str = "loading it whole") -> None:
    """Refuse, before anything is allocated, what would not fit in the memory budget."""
    if max_bytes is not None and nbytes > max_bytes:
        raise error(f"{name}: {what} needs {size_text(nbytes)}, over {param('max_memory')} {size_text(max_bytes)}")


def check_shape(name: str, shape: tuple[int, ...]) -> None:
    if len(shape) == 0:
        raise error(f"{name} is a 0-d scalar; attncheck needs at least one axis (the last axis holds the keys)")
    if 0 in shape:
        raise error(f"{name} is empty (shape {shape})")


def torch_name(obj: object) -> str:
    return str(obj).removeprefix("torch.")


def numpy_error(what: str, exc: Exception, member: bool = False) -> AttncheckError:
    # With allow_pickle=False and the magic checked, numpy mentions
    # allow_pickle only when the array holds Python objects.
    if isinstance(exc, ValueError) and "allow_pickle" in str(exc):
        return object_array_error(what)
    if member:
        return error(f"{what}: not a valid .npy member ({reason(exc)})")
    return error(f"{what}: {invalid_text(what)} ({reason(exc)})")


def object_array_error(what: str) -> AttncheckError:
    return error(
        f"{what}: holds an object array (pickled Python objects), which attncheck "
        "does not support; nothing was unpickled. Save a numeric floating-point array"
    )


def check_numpy_dtype(name: str, dtype: np.dtype, kind: str = "scores") -> None:
    if kind == "mask" and dtype.kind == "b":
        return
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8):
        shown = dtype.name if dtype.kind in "biufc" else str(dtype)
        raise dtype_error(name, shown, kind)


def from_numpy(name: str, array: np.ndarray, kind: str = "scores") -> torch.Tensor:
    dtype = array.dtype
    check_numpy_dtype(name, dtype, kind)
    if not dtype.isnative:
        array = array.astype(dtype.newbyteorder("="))
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def reason(exc: BaseException) -> str:
    """A short, single-line reason from an exception."""
    if isinstance(exc, OSError) and exc.strerror:
        return shorten(exc.strerror)
    text = ANSI.sub("", str(exc))
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return shorten(first or type(exc).__name__)


def shorten(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MAX_REASON:
        text = text[: MAX_REASON - 3].rstrip() + "..."
    return text


def error(message: str) -> AttncheckError:
    """An AttncheckError whose message is guaranteed to be one line."""
    one_line = message.replace("\r", "\\r").replace("\n", "\\n")
    return AttncheckError(one_line)
