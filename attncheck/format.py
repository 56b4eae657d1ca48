"""How numbers, rows and results are written in every message, report and JSON: one place
for each form (no torch)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

# What a terminal acts on instead of showing: C0 and C1 control characters (escape sequences start
# with one), DEL, the Unicode line and paragraph separators, the bidirectional overrides, and lone
# surrogates (undecodable bytes of a file name), which no output encoding can write.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match) -> str:
    ch = match.group()
    return _ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def visible(text: object) -> str:
    """Text that came from a file (a tensor, member, key or module name, a path, a message
    quoting one) as it may be printed: every character a terminal would act on is written
    as its escape ('\\x1b', '\\n', '\\u202e'), so a name prints on one line, as itself.
    Renderers wrap the result in ``rich.text.Text``, never in markup."""
    return _UNSHOWN.sub(_escape, str(text))


def fmt(x: float | None, spec: str = ".3g") -> str:
    """A number in a table: '-' when missing, 'inf'/'nan' as such, else ``spec``."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def num(x: float | int | None, digits: int = 3) -> str:
    """Short form for messages: 28, 0.0312, 1e-05, n/a."""
    if x is None:
        return "n/a"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}"


def plain(x: float | None) -> str:
    """3 significant digits without exponents for 100..1e6: 1239 reads better than 1.24e+03."""
    if x is not None and 100 <= abs(x) < 1e6:
        return f"{x:.0f}"
    return fmt(x, ".3g")


def compact(x: float | int | None, digits: int = 3) -> str:
    """``digits`` significant digits in about 7 characters, for narrow table cells: 0, 2.41, 0.0264, 448, 2.86k,
    28.6M, 5.79e-3 (below 0.01), 1.2e+15 (from 1e12); '-' when missing, 'inf'/'nan' as such."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    r = float(f"{x:.{digits}g}")  # rounded first, so that 999.6 reads 1k, not 1e+03
    a = abs(r)
    if a == 0:
        return "0"
    if a < 0.01:
        mantissa, exponent = f"{r:.{digits - 1}e}".split("e")
        return f"{float(mantissa):.{digits}g}e{int(exponent)}"
    if a < 1000:
        return f"{r:.{digits}g}" if a < 10**digits else f"{r:.0f}"
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if a < scale * 1000:
            return f"{r / scale:.{digits}g}{unit}"
    return f"{r:.2g}"


def size_text(nbytes: float) -> str:
    """Bytes for messages: '512 bytes', '300 MiB', '2.5 GiB', '1.001 MiB', '6,104 GiB'."""
    if nbytes < 1024:
        return f"{nbytes:.0f} bytes"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        v = nbytes / scale
        if v < 1024 or unit == "GiB":
            return f"{v:,.0f} {unit}" if v >= 1000 else f"{v:.4g} {unit}"
    raise AssertionError("unreachable")


def pct(x: float | None) -> str:
    """Shares of rows: 0 -> '0', 1e-30 -> '<0.01%', 0.3263 -> '32.6%'."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if x < 1e-4:
        return "<0.01%"
    return f"{100 * x:.3g}%"


def index_text(index: Sequence[int]) -> str:
    """An index into the leading axes, everywhere the same: (0, 3, 17) -> '(0,3,17)'."""
    return "(" + ",".join(map(str, index)) + ")"


def row_text(row: Sequence[int]) -> str:
    """A row of the scores: (0, 3, 17) -> '(0,3,17)'; a 2-D input's row (5,) -> '5'."""
    return str(row[0]) if len(row) == 1 else index_text(row)


def rows_text(idx: Sequence[Sequence[int]], limit: int = 4) -> str:
    """Row indices: '(0,5,1), (0,5,2), ...' or '5, 6'."""
    shown = ", ".join(row_text(i) for i in idx[:limit])
    return shown + (", ..." if len(idx) > limit else "")


def to_jsonable(x: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, non-finite floats -> None."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_jsonable(getattr(x, f.name)) for f in dataclasses.fields(x) if not f.name.startswith("_")}
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def cosine(x: float | None) -> str:
    """A cosine similarity near 1 with the digits that tell it apart from 1: '0.999987'."""
    return "-" if x is None else f"{x:.6f}"
