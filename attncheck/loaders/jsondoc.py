"""The one reader of JSON that comes from files: .safetensors headers, capture manifests, call
metadata (and the watch log). Every document is bounded before it is trusted: its size, its
nesting depth, its numbers (no integer beyond 64 bits, no float beyond float64: Python's int-string
limit and ``float('1e400')`` never come into play), and where a type is given, every field's type
and range (msgspec: typed structs, unknown fields ignored so that newer writers stay readable).

No printing, no paths: a refused document raises :class:`JSONError` with one line saying why
(``calls[3].index: expected int >= 0``); the caller names the file.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

MAX_DEPTH = 64  # containers inside containers; every format attncheck reads needs at most 4
MAX_BYTES = 64 << 20


class JSONError(ValueError):
    """A JSON document refused: the message is one line, without the file's name."""


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_PLAINER = {
    "Integer value out of range": "an integer beyond 64 bits",
    "Number out of range": "a number beyond float64's range",
}


def _why(exc: msgspec.MsgspecError) -> str:
    """msgspec's 'Expected `int` >= 0 - at `$.calls[3].index`' -> 'calls[3].index: expected int >= 0'."""
    m = _AT.match(" ".join(str(exc).split()))
    what = (m.group("what") if m else str(exc)).replace("`", "")
    what = _PLAINER.get(what, what)
    if what[1:2].islower():  # 'Expected ...' -> 'expected ...'; 'JSON is malformed' stays
        what = what[:1].lower() + what[1:]
    path = (m.group("path") or "").removeprefix(".") if m else ""
    if path.startswith("[...]"):  # a member of an untyped object: msgspec cannot name it
        path = ""
    return f"{path}: {what}" if path else what


def decode(
    data: bytes, type: Any = object, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, lax: bool = False
) -> Any:
    """The document in ``data`` as ``type`` (plain dicts, lists, str, int, float, bool and None for
    ``object``). ``lax``: strings may stand for numbers and booleans ('0.125', 'true'), as
    safetensors metadata holds them."""
    if len(data) > max_bytes:
        raise JSONError(f"{len(data)} bytes of JSON, over the limit of {max_bytes}")
    try:
        if lax:
            out = convert(msgspec.json.decode(data), type, lax=True, max_depth=max_depth)
        else:
            out = msgspec.json.decode(data, type=type, strict=True)
    except RecursionError:
        raise JSONError(f"nested deeper than {max_depth} levels") from None
    except msgspec.ValidationError as exc:
        raise JSONError(_why(exc)) from None
    except msgspec.DecodeError as exc:
        raise JSONError(f"not JSON: {_why(exc)}") from None
    except UnicodeDecodeError as exc:
        raise JSONError(f"not JSON: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    check_depth(out if isinstance(out, (dict, list)) else [out], max_depth)
    return out


def convert(obj: Any, type: Any, *, lax: bool = False, max_depth: int = MAX_DEPTH) -> Any:
    """An object already decoded (a safetensors header's metadata) checked and converted to ``type``."""
    check_depth(obj, max_depth)
    try:
        return msgspec.convert(obj, type, strict=not lax)
    except RecursionError:
        raise JSONError(f"nested deeper than {max_depth} levels") from None
    except msgspec.ValidationError as exc:
        raise JSONError(_why(exc)) from None


def check_depth(obj: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse containers nested more than ``max_depth`` deep, and integers beyond 64 bits (msgspec
    reads up to Python's int-string limit), walked without recursion."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise JSONError(f"nested deeper than {max_depth} levels")
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
            elif type(child) is int and not -(1 << 63) <= child < (1 << 64):
                raise JSONError("an integer beyond 64 bits")


__all__ = ["JSONError", "MAX_BYTES", "MAX_DEPTH", "check_depth", "convert", "decode"]
