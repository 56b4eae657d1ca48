"""Capture directories of a distributed job: the rank<N> directories of one job (checked: one world size, one run,
every rank present), and the owner file of a capture still being written."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path

from attncheck.loaders import jsondoc
from attncheck.loaders.call_info import CALL_FILE, MANIFEST, CallSource
from attncheck.loaders.common import error
from attncheck.loaders.manifest import open_capture
from attncheck.loaders.paths import KeySelector

RANK_DIR = re.compile(r"^rank(\d{1,7})$")


OWNER = ".attncheck-owner.json"  # the process writing a capture directory (removed when it is done)


def read_owner(owner: str | os.PathLike[str]) -> dict | None:
    """The owner file's contents ({pid, host, rank}); None where it is missing, being written or garbage."""
    try:
        with open(owner, encoding="utf-8") as fh:
            doc = json.loads(fh.read(4096))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def owner_alive(holder: dict) -> bool:
    """Whether the process an owner file names is running (another host's: assumed so, it cannot be asked)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def unfinished_capture(path: str | os.PathLike[str]) -> str | None:
    """Why a directory without a manifest is a capture that has not finished, or None: the owner file of its
    writer (running still, or gone without writing the manifest: killed), or call files named as a capture
    names them (its manifest was never written). Such a folder is not read as a folder of tensors: its calls
    would be judged as if they were the whole run."""
    d = Path(path)
    try:
        if not d.is_dir() or (d / MANIFEST).is_file():
            return None
        owner = d / OWNER
        if owner.is_file():
            holder = read_owner(owner) or {}
            pid = holder.get("pid")
            who = f"process {pid}" if isinstance(pid, int) else "a process"
            if owner_alive(holder):
                return (
                    f"{path}: is a capture {who} is writing still (no {MANIFEST} yet): "
                    "read it once that capture has finished"
                )
            return (
                f"{path}: holds no {MANIFEST}: its capture did not finish ({who} stopped before writing it: "
                f"killed?); capture again, or name its call files ({os.path.join(path, '*.safetensors')}) "
                "to read those alone"
            )
        calls = sorted(p.name for p in d.iterdir() if CALL_FILE.match(p.name) and p.is_file())
    except (OSError, ValueError):
        return None
    if calls:
        return (
            f"{path}: holds call files ({calls[0]}, ...) and no {MANIFEST}: its capture did not finish; "
            f"capture again, or name its call files ({os.path.join(path, '*.safetensors')}) to read those alone"
        )
    return None


def rank_dirs(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """A capture of several processes (torchrun): a directory without a manifest holding ``rankN``
    directories, one of them at least a capture; [(rank, directory)] in rank order, [] for anything else."""
    try:
        if not Path(path).is_dir() or (Path(path) / MANIFEST).is_file():
            return []
        found = [
            (int(m.group(1)), os.path.join(os.fspath(path), p.name))
            for p in Path(path).iterdir()
            if (m := RANK_DIR.match(p.name)) and p.is_dir() and not p.is_symlink() and any(True for _ in p.iterdir())
        ]  # an empty rankN folder is no rank's capture: left out
        if not any((Path(sub) / MANIFEST).is_file() for _, sub in found):  # folders named rankN holding no capture
            return []
    except (OSError, ValueError):
        return []
    return sorted(found)


def open_ranks(
    directory: str | os.PathLike[str], selector: KeySelector | None = None, max_bytes: int | None = None
) -> tuple[list[CallSource], list[dict]]:
    """Every rank's calls of a capture of several processes, each call naming its rank, in call order
    (rank order within one index: the ranks run the same program); and each rank's manifest. The ranks
    must be one job's: ranks 0 .. world-1, each once, one world size and one run id."""
    given = os.fspath(directory)
    found = rank_dirs(given)
    out: list[CallSource] = []
    docs: list[dict] = []
    worlds_seen = {d.get("world") for _, sub in found if (d := _manifest_doc(sub)) is not None}
    world_known = worlds_seen.pop() if len(worlds_seen) == 1 else None
    for rank, sub in found:
        if not (Path(sub) / MANIFEST).is_file():
            if isinstance(world_known, int) and rank >= world_known:
                raise error(
                    f"{sub}: is not a rank of this capture of {world_known} processes (ranks 0 to "
                    f"{world_known - 1}) and holds no {MANIFEST}: remove it, or read the ranks one by one"
                )
            running = unfinished_capture(sub) or ""
            if "writing still" in running:
                raise error(running)
            raise error(f"{sub}: holds no {MANIFEST}: rank {rank}'s capture did not finish (did that process fail?)")
        calls, doc = open_capture(sub, selector, max_bytes)
        if doc.get("rank") != rank or not isinstance(doc.get("world"), int):
            raise error(
                f"{os.path.join(sub, MANIFEST)}: is rank {doc.get('rank')}'s capture, not rank {rank}'s "
                "(each rank writes its own DIR/rankN)"
            )
        out += calls
        docs.append(doc)
    worlds = {d["world"] for d in docs}
    runs = {d.get("run_id") for d in docs}
    if len(worlds) > 1 or len(runs) > 1:
        what = (
            f"world sizes {sorted(worlds)}" if len(worlds) > 1 else "run ids " + ", ".join(sorted(str(r) for r in runs))
        )
        raise error(f"{given}: its ranks come from different jobs ({what}): capture into a new or empty folder")
    world = worlds.pop()
    ranks = [d["rank"] for d in docs]
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        extra = sorted(set(ranks) - set(range(world)))
        if missing:
            there = " ".join(os.path.join(given, f"rank{r}") for r in ranks)
            raise error(
                f"{given}: a capture of {world} processes lacks rank {missing[0]} "
                f"({os.path.join(given, f'rank{missing[0]}')}): capture again, or read the ranks "
                f"it holds by name (attncheck run {there})"
            )
        raise error(
            f"{given}: a capture of {world} processes holds rank {extra[0]}, beyond its world: "
            "capture into a new or empty folder"
        )
    out.sort(key=lambda s: (s.info.index, s.info.rank))
    return out, docs


def _manifest_doc(directory: str) -> dict | None:
    """A rank's manifest as plain JSON (None where it is missing or unreadable), to learn the job's world
    size before each rank is read in full."""
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as fh:
            doc = jsondoc.decode(fh.read(jsondoc.MAX_BYTES + 1))
    except (OSError, jsondoc.JSONError):
        return None
    return doc if isinstance(doc, dict) else None


def check_one_job(given: Sequence[str], docs: Sequence[dict]) -> None:
    """Rank captures named one by one must be one job's: one world size, one run id, each rank once."""
    worlds = {d.get("world") for d in docs}
    runs = {d.get("run_id") for d in docs}
    if len(worlds) > 1 or len(runs) > 1:
        what = (
            f"world sizes {sorted(worlds)}" if len(worlds) > 1 else "run ids " + ", ".join(sorted(str(r) for r in runs))
        )
        raise error(f"{', '.join(given)}: these ranks come from different jobs ({what}): name the ranks of one capture")
    seen: dict[int, str] = {}
    for name, d in zip(given, docs):
        if d["rank"] in seen:
            raise error(f"{name}: rank {d['rank']} is named twice ({seen[d['rank']]} too)")
        seen[d["rank"]] = name
