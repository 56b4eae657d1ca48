"""What ``attncheck capture`` and ``attncheck.capture`` are asked to do: the script, where the capture goes, its bounds
and the forward passes to record, with their defaults (torch-free, checked before the script runs)."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from attncheck import params
from attncheck.config.run import Options, ignore_codes
from attncheck.errors import AttncheckError

DEFAULT_OUT = "attncheck-capture"
DEFAULT_MAX_BYTES = "1GiB"
DEFAULT_MAX_CALLS = 1000


@dataclass(frozen=True)
class CaptureRequest:
    """Run ``script`` with ``args`` under capture, then diagnose what it recorded as ``run`` does
    (``options``, ``ignore``, ``partial``). ``out`` None: diagnose each call as it comes and
    write nothing."""

    script: str
    args: tuple[str, ...] = ()
    out: str | None = DEFAULT_OUT
    max_calls: int | None = DEFAULT_MAX_CALLS
    max_bytes: int | None = None
    modules: tuple[str, ...] = ()
    forwards: str | None = None  # '1', '1,3', '2-4'; None: all
    options: Options = Options()
    ignore: tuple[str, ...] = ()
    partial: bool = False
    what_if: tuple[str, ...] = ()  # as RunRequest's
    grid_asked: bool = False
    accumulate: tuple = ()  # as RunRequest's: sums kept in 16 bits (params.SumSpec), asked of the calls recorded
    grads: bool = True  # record dO and the kernels' gradients when the script runs a backward
    compile: str = (
        "eager"  # torch.compile'd code: run as its eager code and recorded, or kept compiled and not recorded
    )
    rope_what_if: tuple[str, ...] = ()  # as RunRequest's: --what-if rope:DTYPE, the rotary tables in these dtypes

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore", ignore_codes(self.ignore))
        object.__setattr__(self, "what_if", params.what_if(list(self.what_if)) if self.what_if else ())
        rope = params.dtypes(list(self.rope_what_if), "what_if", fp8=False) if self.rope_what_if else ()
        object.__setattr__(self, "rope_what_if", rope)
        try:
            os.stat(self.script)
        except OSError as e:
            why = "no such file" if isinstance(e, FileNotFoundError) else (e.strerror or str(e))
            raise AttncheckError(f"{self.script}: {why} (give the Python script to run)", param="script") from None
        if not os.path.isfile(self.script):
            what = "is a folder" if os.path.isdir(self.script) else "is not a file"
            raise AttncheckError(f"{self.script}: {what} (give the Python script to run)", param="script")
        if self.out is not None:
            parent = os.path.dirname(os.path.abspath(self.out))
            if not os.path.isdir(parent):
                raise AttncheckError(f"cannot create {self.out}: folder {parent} does not exist", param="out")
            try:
                os.stat(self.out)
            except FileNotFoundError:
                pass
            except OSError as e:  # a name longer than the file system allows
                raise AttncheckError(f"cannot create {self.out}: {e.strerror or e}", param="out") from None
            if os.path.exists(self.out) and not os.path.isdir(self.out):
                raise AttncheckError(f"{self.out} is a file; give a folder for the capture", param="out")
        # the bounds as attncheck.capture checks them (one check, one set of defaults)
        object.__setattr__(self, "max_calls", max_calls_bound(self.max_calls))
        object.__setattr__(
            self, "max_bytes", max_bytes_bound(DEFAULT_MAX_BYTES if self.max_bytes is None else self.max_bytes)
        )
        if self.forwards is not None:
            parse_forwards(self.forwards)


def max_calls_bound(value) -> int | None:
    """The most calls to record: an integer >= 1 (or its text), or None for no bound."""
    return None if value is None else params.integer(value, "max_calls", 1, from_text=isinstance(value, str))


def max_bytes_bound(value) -> int | None:
    """The most bytes of tensors to keep: a size ('1GiB', '500MB') or a number of bytes >= 1, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        return params.size(value, "max_bytes")
    return params.integer(value, "max_bytes", 1, from_text=False)


def _decimal(text: str) -> bool:
    """ASCII digits, at most 9 ('²'.isdigit() holds, but int() refuses it)."""
    return text.isascii() and text.isdigit() and len(text) <= 9


class Forwards:
    """The forward passes to record, as ranges of numbers (1-based): '2-4,9' holds 2, 3, 4 and 9. A range
    costs nothing however long it is ('1-30000000' is one pair of numbers, not thirty million)."""

    def __init__(self, spans) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.spans = tuple((lo, hi) for lo, hi in merged)
        self._starts = [lo for lo, _ in self.spans]

    def __contains__(self, n) -> bool:
        i = bisect.bisect_right(self._starts, n) - 1
        return i >= 0 and self.spans[i][0] <= n <= self.spans[i][1]

    def __eq__(self, other) -> bool:
        return isinstance(other, Forwards) and self.spans == other.spans

    def __hash__(self) -> int:
        return hash(self.spans)

    def __str__(self) -> str:
        """'1,3,5-9'."""
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.spans)

    __repr__ = __str__


def parse_forwards(value) -> Forwards:
    """1, [1, 3], '1,3', '2-4' -> the forward passes to record (1-based)."""
    if isinstance(value, Forwards):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    spans: list[tuple[int, int]] = []
    if isinstance(value, str):
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            if not _decimal(lo) or (sep and not _decimal(hi)) or int(lo) < 1 or (sep and int(hi) < int(lo)):
                raise AttncheckError(f"{part!r} is not a forward pass number or range (e.g. 1, 2-4)", param="forwards")
            spans.append((int(lo), int(hi) if sep else int(lo)))
        if not spans:
            raise AttncheckError(f"must be forward pass numbers >= 1, got {params.show(value)}", param="forwards")
        return Forwards(spans)
    values = list(value)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise AttncheckError(f"must be forward pass numbers >= 1, got {params.show(value)}", param="forwards")
    return Forwards((v, v) for v in values)
