"""Paths and ``keys`` patterns -> the files and tensors a command reads."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from pathlib import Path

from attncheck.errors import param
from attncheck.loaders.common import error, qualified_name, reason, suffix_of
from attncheck.loaders.formats import SUPPORTED_SUFFIXES

MAX_LISTED = 10
_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple:
    """Sort key that orders numbers by value: 'layer_2' before 'layer_10'."""
    parts = _DIGITS.split(text)
    return tuple((0, int(p), "") if i % 2 else (1, 0, p) for i, p in enumerate(parts)), text


class KeySelector:
    """``--key`` patterns applied across files, as :func:`load_tensors` applies them.

    ``select`` is called once per file, in order, with the keys the file holds
    (None for a bare tensor, matched against the file name); afterwards
    ``check_all_matched`` raises for a pattern that matched nothing anywhere.
    """

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.patterns = [keys] if isinstance(keys, str) else list(keys)
        self._matched = [False] * len(self.patterns)
        self._available: list[str] = []

    def select(self, path: str, keys: Sequence[str | None]) -> list[str | None]:
        selected: list[str | None] = []
        keyset = set(keys)
        exact = {p for p in self.patterns if p in keyset}  # patterns that are a key of this file
        for key in keys:
            self._available.append(qualified_name(path, key))
            match_on = Path(path).name if key is None else key
            if not self.patterns:
                selected.append(key)
                continue
            hit = False
            for i, pattern in enumerate(self.patterns):
                # A pattern that is a key of this file names that key alone ("['a.b']",
                # 'scores[0]'); any other pattern is a glob.
                if pattern == match_on or (pattern not in exact and fnmatch.fnmatchcase(match_on, pattern)):
                    self._matched[i] = True
                    hit = True
            if hit:
                selected.append(key)
        return selected

    def check_all_matched(self) -> None:
        available = self._available
        for pattern, ok in zip(self.patterns, self._matched):
            if not ok:
                shown = ", ".join(available[:MAX_LISTED])
                if len(available) > MAX_LISTED:
                    shown += f", ... ({len(available) - MAX_LISTED} more)"
                raise error(f"{param('keys')} '{pattern}' matches no tensor (available: {shown})")


def expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    if len(paths) == 0:
        raise error("no input files given (pass one or more tensor files or directories)")
    files: list[str] = []
    seen: set[str] = set()
    for raw in paths:
        given = os.fspath(raw)
        if isinstance(given, bytes):  # os.PathLike[bytes]
            given = os.fsdecode(given)
        path = Path(given)
        try:
            path.stat()
        except FileNotFoundError:
            raise error(f"{given}: no such file or directory{_key_hint(given)}") from None
        except (OSError, ValueError) as exc:  # a name too long, a loop of links, a NUL byte
            raise error(f"{given}: cannot read it ({reason(exc)})") from None
        if path.is_dir():
            found = scan_directory(path)
            if not found:
                raise error(
                    f"{given}: directory holds no supported tensor files (looked for {suffix_list()}, recursively)"
                )
            candidates = [str(p) for p in found]
        elif path.exists():
            if not path.is_file():
                raise error(f"{given}: not a regular file")
            if suffix_of(path) not in SUPPORTED_SUFFIXES:
                what = f"'{path.suffix}'" if path.suffix else "(no extension)"
                raise error(f"{given}: unsupported file type {what} (supported: {suffix_list()})")
            candidates = [given]
        else:
            raise error(f"{given}: no such file or directory")
        for c in candidates:
            if c not in seen:
                seen.add(c)
                files.append(c)
    return files


def _key_hint(given: str) -> str:
    """For 'file.pt:name', where file.pt exists: how to pick one tensor of a file here (the
    FILE:KEY form is that of --q, --k, --v and --mask)."""
    head, sep, key = given.rpartition(":")
    if sep and key and Path(head).is_file():
        return f" (to diagnose the tensor '{key}' of {head}, pass {head} --key '{key}')"
    return ""


def scan_directory(directory: Path) -> list[Path]:
    found = [p for p in directory.rglob("*") if suffix_of(p) in SUPPORTED_SUFFIXES and p.is_file()]
    return sorted(found, key=lambda p: natural_key(str(p.relative_to(directory))))


def suffix_list() -> str:
    return ", ".join(SUPPORTED_SUFFIXES)
