"""Watch logs (``attncheck.watch``: one JSON record per line) -> typed records, checked.

Every line is decoded by the bounded JSON reader into the structs below (types, ranges, sizes),
then checked for consistency (one value per head, steps increasing). A last line cut short (a run
stopped while writing) is left out and said; any other bad line is an error naming the file and
the line. No math, no printing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

from msgspec import Meta, Struct

from attncheck.errors import AttncheckError
from attncheck.format import visible
from attncheck.loaders import jsondoc

WATCH_SCHEMA_PREFIX = "attncheck.watch/"
MAX_LINE = 16 << 20  # bytes of one record
MAX_LINES = 10_000_000
MAX_HEADS = 1 << 16
MAX_CALLS = 100_000

Name = Annotated[str, Meta(max_length=4096)]
Short = Annotated[str, Meta(max_length=128)]
Message = Annotated[str, Meta(max_length=1 << 16)]
Count = Annotated[int, Meta(ge=0, le=1 << 62)]
Number = Optional[Annotated[float, Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]]
Share = Optional[Annotated[float, Meta(ge=0.0, le=1.0)]]
PerHead = Annotated[list[Number], Meta(max_length=MAX_HEADS)]


class WatchLimit(Struct):
    logit: Annotated[float, Meta(gt=0.0, le=1.7976931348623157e308)]
    what: Message = ""


class WatchCall(Struct):
    module: Name
    kind: Literal["sdpa", "softmax", "flex"]
    heads: Annotated[int, Meta(ge=1, le=MAX_HEADS)]
    max_logit: PerHead
    dtype: Short = ""
    path: Short = ""
    exact: Annotated[list[bool], Meta(max_length=MAX_HEADS)] = []
    entropy_min: PerHead = []
    entropy_mean: PerHead = []
    collapsed: Annotated[list[Share], Meta(max_length=MAX_HEADS)] = []
    first_share: Optional[Annotated[list[Share], Meta(max_length=MAX_HEADS)]] = None  # logs before it have none
    q_max: Optional[PerHead] = None
    k_max: Optional[PerHead] = None
    nonfinite_rows: Count = 0
    scale: Number = None
    limit: Optional[WatchLimit] = None


class WatchGrad(Struct):
    module: Name
    nonfinite: Count = 0
    zero_frac: Share = None
    max_abs: Number = None


class WatchRecord(Struct):
    schema: Annotated[str, Meta(pattern=r"^attncheck\.watch/", max_length=64)]
    step: Annotated[int, Meta(ge=1, le=1 << 62)]
    calls: Annotated[list[WatchCall], Meta(max_length=MAX_CALLS)]
    rank: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    world: Annotated[int, Meta(ge=1, le=1 << 20)] = 1
    time: Number = None
    loss: Number = None
    forwards: Optional[Count] = None  # training forwards of the watched module in the step (0: none was seen)
    grads: Annotated[list[WatchGrad], Meta(max_length=MAX_CALLS)] = []
    attncheck_version: Optional[Short] = None


@dataclass
class WatchLog:
    path: str
    rank: int
    records: list[WatchRecord]
    notes: list[str] = field(default_factory=list)  # lines left out (a last line cut short)


def _check(rec: WatchRecord) -> str | None:
    for i, c in enumerate(rec.calls):
        for name in ("max_logit", "exact", "entropy_min", "entropy_mean", "collapsed", "first_share", "q_max", "k_max"):
            values = getattr(c, name)
            if values is None or (not values and name != "max_logit"):
                continue
            if len(values) != c.heads:
                return f"calls[{i}].{name}: {len(values)} values for {c.heads} heads"
    return None


def read_watch_log(path: str | os.PathLike[str]) -> WatchLog:
    """One watch log, checked: its records in step order, one rank."""
    p = os.fspath(path)
    shown = visible(p)
    if os.path.isdir(p):
        raise AttncheckError(f"{shown} is a folder; give the watch log (a .jsonl file attncheck.watch wrote)")
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise AttncheckError(f"{shown}: no such file") from None
    except (OSError, ValueError) as e:  # a name too long, a loop of links
        raise AttncheckError(f"{shown}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(mode):  # a FIFO or a device would be read forever
        raise AttncheckError(f"{shown}: not a regular file")
    try:
        fh = open(p, "rb")
    except FileNotFoundError:
        raise AttncheckError(f"{shown}: no such file") from None
    except OSError as e:
        raise AttncheckError(f"{shown}: cannot read it ({e.strerror or e})") from None
    records: list[WatchRecord] = []
    notes: list[str] = []
    with fh:
        number = 0
        while True:
            raw = fh.readline(MAX_LINE + 1)
            if not raw:
                break
            number += 1
            if number > MAX_LINES:
                raise AttncheckError(
                    f"{shown}: more than {MAX_LINES} lines; a watch log holds one line per recorded step"
                )
            if len(raw) > MAX_LINE:
                raise AttncheckError(f"{shown}, line {number}: longer than {MAX_LINE} bytes; not a watch record")
            last = not raw.endswith(b"\n")
            line = raw.strip()
            if not line:
                continue
            try:
                rec = jsondoc.decode(line, WatchRecord)
            except jsondoc.JSONError as e:
                if last and records:  # the run stopped while writing its last record
                    notes.append(f"{shown}: its last line (line {number}) is cut short and left out ({e})")
                    break
                what = "not a watch log" if not records else "not a watch record"
                raise AttncheckError(f"{shown}, line {number}: {what} ({e})") from None
            problem = _check(rec)
            if problem:
                raise AttncheckError(f"{shown}, line {number}: {problem}")
            if records and rec.rank != records[0].rank:
                raise AttncheckError(
                    f"{shown}, line {number}: rank {rec.rank} in a log of rank {records[0].rank}; each rank writes "
                    "its own log"
                )
            if records and rec.step <= records[-1].step:
                raise AttncheckError(
                    f"{shown}, line {number}: step {rec.step} after step {records[-1].step}; a log's steps increase"
                )
            records.append(rec)
    if not records:
        raise AttncheckError(f"{shown}: holds no watch record (write one with attncheck.watch(model, log=...))")
    return WatchLog(p, records[0].rank, records, notes)


def read_watch_logs(paths) -> list[WatchLog]:
    """Several logs, one per rank (a rank given twice is an error), in rank order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    logs = [read_watch_log(p) for p in paths]
    if not logs:
        raise AttncheckError("give the watch log to read (a .jsonl file attncheck.watch wrote)")
    seen: dict[int, str] = {}
    for log in logs:
        if log.rank in seen:
            raise AttncheckError(f"{visible(log.path)} and {visible(seen[log.rank])} are both logs of rank {log.rank}")
        seen[log.rank] = log.path
    return sorted(logs, key=lambda log: log.rank)
