"""The config's input globs, resolved to files relative to its folder (a glob that matches nothing is an input
error before any tensor is read)."""

from __future__ import annotations

import fnmatch
import glob
import os
import stat
from typing import TYPE_CHECKING

from attncheck.errors import AttncheckError

if TYPE_CHECKING:
    from attncheck.config.check import CheckConfig


def resolve_inputs(config: CheckConfig) -> tuple[str, ...]:
    """Every input glob -> the files and folders it matches (absolute, sorted, no duplicates)."""
    files: dict[str, None] = {}
    for pattern in config.inputs:
        if not pattern.strip():
            raise AttncheckError(f"{config.key('inputs')} holds an empty glob")
        matched = sorted(glob_inputs(pattern, config.root))
        if not matched:
            raise AttncheckError(f"{config.key('inputs')}: {pattern!r} matches no file (relative to {config.root})")
        for m in matched:
            files[os.path.normpath(os.path.join(config.root, m))] = None
    return tuple(files)


def glob_inputs(pattern: str, root: str) -> list[str]:
    """``glob.glob(pattern, root_dir=root, recursive=True)``, but a ``**`` enters each real folder once.

    Python's recursive glob follows links to folders and never stops on a folder that links to
    itself or to a parent (``ln -s . loop``): its walk grows without end. Here every ``**`` walks the
    folders below it keeping the (device, inode) of each one entered, so a loop is entered once; links
    to folders are followed (as glob does) after the real folders, so a file is found by its own path
    and once, where glob lists it again under every link. Patterns without ``**`` cannot loop and keep glob's own
    answer. Hidden names match only a part that starts with '.', as in glob."""
    if "**" not in pattern:
        return glob.glob(pattern, root_dir=root, recursive=True)
    absolute = os.path.isabs(pattern)
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    start = os.sep if absolute else ""
    out: dict[str, None] = {}

    def real(folder: str) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(root, folder) if folder else root)
        except (OSError, ValueError):
            return None
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    def children(folder: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(root, folder) if folder else root))
        except (OSError, ValueError):
            return []

    def walk(folder: str, i: int, state: tuple[set, list] | None) -> None:
        if i == len(parts):
            if folder:
                out[folder] = None
            return
        part = parts[i]
        if part == "**":
            if state is None:  # a '**' starts here: its own folders seen, and the links to folders it left for last
                state = (set(), [])
                expand(folder, i, state)
                while state[1]:  # links after the real folders, so that a folder is found by its own name first
                    expand(state[1].pop(0), i, state)
            else:
                expand(folder, i, state)
            return
        if part == "..":
            walk(os.path.join(folder, part), i + 1, None)
            return
        if not glob.has_magic(part):
            sub = os.path.join(folder, part)
            if os.path.lexists(os.path.join(root, sub)) and (i + 1 == len(parts) or real(sub) is not None):
                walk(sub, i + 1, None)
            return
        for name in children(folder):
            if name.startswith(".") and not part.startswith("."):
                continue
            if fnmatch.fnmatch(name, part):
                sub = os.path.join(folder, name)
                if i + 1 == len(parts) or real(sub) is not None:
                    walk(sub, i + 1, None)

    def expand(folder: str, i: int, state: tuple[set, list]) -> None:
        """'**' at ``folder``: no folder at all, then every folder below it (each real one once)."""
        seen, links = state
        key = real(folder)
        if key is None or key in seen:
            return
        seen.add(key)
        walk(folder, i + 1, None)  # '**' as no folder at all
        for name in children(folder):
            if name.startswith("."):
                continue
            sub = os.path.join(folder, name)
            if real(sub) is None:
                if i + 1 == len(parts):  # a final '**' lists files too
                    out[sub] = None
            elif os.path.islink(os.path.join(root, sub)):
                links.append(sub)
            else:
                expand(sub, i, state)

    walk(start, 0, None)
    return list(out)
