"""One capture per process: under torchrun (or any torch.distributed job) each rank writes its own
directory, ``DIR/rank0``, ``DIR/rank1``, ..., with its rank and the world size in its manifest; and a
capture directory is written by one process at a time, which holds it with an owner file created
exclusively (``O_EXCL``) naming its pid and rank, so two processes writing one directory is refused
before either writes a call.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path

import torch.distributed as dist

from attncheck.errors import AttncheckError
from attncheck.loaders import jsondoc
from attncheck.loaders.calls import CALL_FILE, MANIFEST, OWNER, owner_alive, read_owner
from attncheck.loaders.rope import ROPE_FILE

RANK_DIR = "rank{}"


def capture_rank() -> tuple[int, int] | None:
    """(rank, world size) of this process in a job of several processes: torch.distributed's where it is
    initialised, else torchrun's environment (RANK, WORLD_SIZE); None for a single process."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        size, rank_text = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
        if size is None:
            return None
        try:
            world, rank = int(size), int(rank_text if rank_text is not None else "-1")
        except ValueError:
            raise AttncheckError(
                f"the environment's RANK={rank_text!r} and WORLD_SIZE={size!r} are not a process's rank in a job "
                "(torchrun sets both to integers)",
                param="path",
            ) from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise AttncheckError(
            f"rank {rank} is not a rank of a world of {world} processes (RANK, WORLD_SIZE in the environment)",
            param="path",
        )
    return rank, world


def run_id() -> str | None:
    """The job's id as torchrun gives it (the same on every rank), to tell one job's ranks from another's."""
    value = os.environ.get("TORCHELASTIC_RUN_ID")
    return value[:128] if value else None


def rank_directory(path: str | os.PathLike[str], rank: int, world: int | None = None) -> Path:
    """``path/rankN``, the parent created where it is missing (every rank may create it: no race); a
    single-process capture left in the parent is removed (each rank removes what is still there), and rank 0
    removes the captures of ranks beyond ``world`` a larger job left (no rank of this job writes there), so
    that reading the parent finds this job's ranks alone."""
    parent = Path(os.path.abspath(path))
    try:
        if parent.exists() and not parent.is_dir():
            raise AttncheckError(f"capture directory {parent} is a file", param="path")
        if not parent.parent.is_dir():
            raise AttncheckError(
                f"cannot create capture directory {parent}: folder {parent.parent} does not exist", param="path"
            )
        parent.mkdir(exist_ok=True)
        if (parent / MANIFEST).is_file():
            _check_previous(parent / MANIFEST, parent)
            for p in list(parent.iterdir()):
                if p.name == MANIFEST or CALL_FILE.match(p.name) or ROPE_FILE.match(p.name):
                    with contextlib.suppress(FileNotFoundError):  # another rank removed it first
                        p.unlink()
        if rank == 0 and world is not None:
            _remove_ranks_beyond(parent, world)
    except OSError as e:
        raise AttncheckError(f"cannot use capture directory {parent}: {e.strerror or e}", param="path") from None
    return parent / RANK_DIR.format(rank)


def _remove_ranks_beyond(parent: Path, world: int) -> None:
    """Remove ``rankN`` (N >= world) directories holding only a capture's own files (its manifest, call files,
    the owner file of a process that is gone); anything else there stays, and reading the parent then says so."""
    for d in parent.iterdir():
        m = re.fullmatch(r"rank(\d{1,7})", d.name)
        if not m or int(m.group(1)) < world or d.is_symlink() or not d.is_dir():
            continue
        files = list(d.iterdir())
        owner = d / OWNER
        holder = read_owner(owner) if owner in files else {}
        if owner in files and (holder is None or owner_alive(holder)):
            continue  # another job's process writes it
        own = all(
            p.is_file()
            and not p.is_symlink()
            and (p.name in (MANIFEST, OWNER) or CALL_FILE.match(p.name) or ROPE_FILE.match(p.name))
            for p in files
        )
        if own:
            for p in files:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            with contextlib.suppress(OSError):
                d.rmdir()


def _check_previous(manifest: Path, parent: Path) -> None:
    try:
        with open(manifest, "rb") as fh:
            doc = jsondoc.decode(fh.read(jsondoc.MAX_BYTES + 1))
    except FileNotFoundError:
        return
    except (OSError, jsondoc.JSONError):
        doc = None
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("attncheck.capture/"):
        raise AttncheckError(
            f"capture directory {parent} is not empty and its manifest.json is not a capture's; "
            "give a new or empty folder",
            param="path",
        )


def rank_file(path: str, rank: int) -> str:
    """One rank's file of a file named once for the job: '{rank}' in the name replaced, else '.rankN'
    before the suffix ('report.json' -> 'report.rank1.json')."""
    p = Path(path)
    if "{rank}" in p.name:
        return str(p.with_name(p.name.replace("{rank}", str(rank))))
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def claim(directory: Path, rank: int | None) -> Path:
    """Make this process the one writing ``directory`` (which exists): its owner file, created exclusively.
    Another live process holding it is refused with one line; an owner file left by a process that is gone
    is taken over."""
    owner = directory / OWNER
    me = {"pid": os.getpid(), "host": socket.gethostname(), "rank": rank}
    for _ in range(3):
        try:
            fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = read_owner(owner)
            if holder is None and _recent(owner):  # created this instant by another process, not yet written
                holder = {"pid": None}
            if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == me["host"]:
                raise AttncheckError(
                    f"capture directory {directory}: this process is already capturing into it (a capture inside "
                    "another of the same folder): give the inner capture another folder",
                    param="path",
                ) from None
            if holder is not None and (holder.get("pid") is None or owner_alive(holder)):
                who = (f"process {holder.get('pid')}" if holder.get("pid") else "another process") + (
                    f" (rank {holder['rank']})" if isinstance(holder.get("rank"), int) else ""
                )
                raise AttncheckError(
                    f"capture directory {directory} is being written by {who}: two processes cannot write one capture "
                    f"(under torchrun each rank writes its own DIR/rankN); give another folder, or remove {owner} "
                    "if no capture is running",
                    param="path",
                ) from None
            with contextlib.suppress(FileNotFoundError):  # left by a process that is gone
                owner.unlink()
            continue
        except OSError as e:
            raise AttncheckError(f"cannot use capture directory {directory}: {e.strerror or e}", param="path") from None
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(me, fh)
        return owner
    raise AttncheckError(
        f"capture directory {directory}: cannot take its owner file {owner} (other processes keep taking it)",
        param="path",
    )


def release(owner: Path) -> None:
    """Give the directory up (only the owner file this process wrote)."""
    holder = read_owner(owner)
    if holder is not None and holder.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            owner.unlink()


def _recent(owner: Path, seconds: float = 5.0) -> bool:
    try:
        return time.time() - owner.stat().st_mtime < seconds
    except OSError:
        return False


__all__ = ["OWNER", "capture_rank", "claim", "rank_directory", "rank_file", "release", "run_id"]
