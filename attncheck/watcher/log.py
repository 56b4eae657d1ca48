"""The watch's output (mixed into ``Watch``): one record per recorded step, its numbers read back at once, written
as a JSON line (and as TensorBoard scalars), and a loss given after its step."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from attncheck import __version__
from attncheck.errors import AttncheckError
from attncheck.watcher.recording import _number

WATCH_SCHEMA = "attncheck.watch/1"


class LogMixin:
    """Records of a ``Watch``: written at the end of each step."""

    def _flush(self, unseen: bool = False) -> None:
        """Write the record of the step under way, if it saw any call (or, ``unseen``, a record without
        any, where one was due): one read-back of every number."""
        self._flushing = True
        try:
            self._write(unseen)
        finally:
            self._flushing = False

    def _write(self, unseen: bool) -> None:
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
        from attncheck.watcher.stats import CallStats, grad_counts_many, sdpa_stats_many

        calls, grads, loss, forwards = self._calls, self._grads, self._loss, self._forwards
        self._calls, self._grads, self._loss, self._forwards = [], [], None, 0
        self._taken.clear()
        if not calls and not grads and not (unseen and (self.sampling or not self.records)):
            return
        pending = [c for c in calls if not isinstance(c.stats, CallStats)]
        for c, st in zip(pending, sdpa_stats_many([c.stats for c in pending])):
            c.stats = st
        grads = list(zip((m for m, _ in grads), grad_counts_many([gs for _, gs in grads])))
        take = _read_back(calls, grads)
        out_calls = _call_records(calls, take)
        out_grads = _grad_records(grads, take)
        record = {
            "schema": WATCH_SCHEMA,
            "attncheck_version": __version__,
            "step": max(self.step_number, 1),
            "rank": self.rank,
            "world": self.world,
            "time": round(time.time(), 3),
            "loss": loss,
            "forwards": forwards,
            "calls": out_calls,
            "grads": out_grads,
        }
        self.records.append(record)
        if self._file is not None:
            self._last_at = self._file.tell()
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            _scalars(self._tensorboard, record)

    def annotate(self, step: int, loss) -> None:
        """Give the record of ``step``, the last one written, its loss (a Trainer logs the loss after
        its step has ended)."""
        value = _number(loss)
        if value is None or not self.records or self.records[-1]["step"] != step:
            return
        self.records[-1]["loss"] = value
        if self._file is not None and self._last_at is not None:
            self._file.seek(self._last_at)
            self._file.truncate()
            self._file.write(json.dumps(self.records[-1], allow_nan=False) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.add_scalar("attncheck/loss", value, step)


def _read_back(calls, grads):
    """Every number of the step's calls and gradients in one read-back from the device; ``take()`` then
    gives them in order, one statistic at a time (None for one not computed, non-finite values as None)."""
    import torch  # (as in _write)

    parts, shapes = [], []
    for c in calls:
        s = c.stats
        for t in (
            s.max_logit,
            s.exact,
            s.entropy_min,
            s.entropy_mean,
            s.collapsed,
            s.q_max,
            s.k_max,
            s.nonfinite_rows,
            s.first_share,
        ):
            if t is None:
                shapes.append(None)
                continue
            flat = t.reshape(-1).float().cpu()
            parts.append(flat)
            shapes.append(flat.numel())
    for _, g in grads:
        for t in (g.nonfinite, g.zeros, g.max_abs):
            flat = torch.as_tensor(t).reshape(-1).float().cpu()
            parts.append(flat)
            shapes.append(flat.numel())
    values = torch.cat(parts).tolist() if parts else []  # the one read-back of the step
    it = iter(shapes)
    pos = 0

    def take():
        nonlocal pos
        n = next(it)
        if n is None:
            return None
        out = values[pos : pos + n]
        pos += n
        return [None if not math.isfinite(x) else x for x in out]

    return take


def _call_records(calls, take) -> list[dict]:
    """Each call's entry of the record: its module, kind, dtype, path, per-head statistics, scale and limit."""
    out_calls = []
    for c in calls:
        ml, ex, emin, emean, col, qm, km, bad, first = (take() for _ in range(9))
        out_calls.append(
            {
                "module": c.module,
                "kind": c.kind,
                "dtype": c.dtype,
                "path": c.path,
                "heads": len(ml),
                "max_logit": ml,
                "exact": [bool(x) for x in ex],
                "entropy_min": emin,
                "entropy_mean": emean,
                "collapsed": col,
                "first_share": first,
                "q_max": qm,
                "k_max": km,
                "nonfinite_rows": int(bad[0] or 0),
                "scale": c.scale,
                "limit": {"logit": c.limit_logit, "what": c.limit_what},
            }
        )
    return out_calls


def _grad_records(grads, take) -> list[dict]:
    """Each module's gradient entry: NaN/inf count, share of zeros, largest magnitude."""
    out_grads = []
    for module, g in grads:
        nonfinite, zeros, peak = (take()[0] for _ in range(3))
        out_grads.append(
            {
                "module": module,
                "nonfinite": int(nonfinite or 0),
                "zero_frac": (zeros or 0) / g.total if g.total else None,
                "max_abs": peak if not (nonfinite or 0) else None,
            }
        )
    return out_grads


def _summary_writer(where, rank: int, world: int):
    """``tensorboard=``: the user's SummaryWriter, or one writing to that folder (``rankN`` inside it
    under torchrun)."""
    if hasattr(where, "add_scalar"):
        return where
    try:
        # inside: attncheck.watcher imports without torch ('attncheck watch LOG' reads a log through watcher.trends)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise AttncheckError(
            "TensorBoard scalars need the tensorboard package: pip install tensorboard", param="tensorboard"
        ) from None
    folder = Path(where) / f"rank{rank}" if world > 1 else Path(where)
    try:
        return SummaryWriter(log_dir=os.fspath(folder))
    except OSError as e:
        raise AttncheckError(
            f"cannot write TensorBoard scalars to {folder}: {e.strerror or e}", param="tensorboard"
        ) from None


def _scalars(writer, record: dict) -> None:
    """A record as TensorBoard scalars, per call: ``attncheck/MODULE/max_logit`` (its largest head),
    ``headroom`` (the limit over that logit), ``entropy_min``, ``entropy_mean`` (over heads),
    ``collapsed`` (its worst head), ``nonfinite_rows``; per call's gradients ``grad_nonfinite``,
    ``grad_zero_frac``, ``grad_max_abs``; and the loss. A module called twice in a step: ``MODULE#2``."""
    step = record["step"]
    seen: dict[str, int] = {}

    def tag(module: str) -> str:
        seen[module] = seen.get(module, 0) + 1
        return f"attncheck/{module}" + (f"#{seen[module]}" if seen[module] > 1 else "")

    def finite(xs):
        return [x for x in xs if x is not None]

    for c in record["calls"]:
        t = tag(c["module"])
        ml, emin, emean, col = (
            finite(c["max_logit"]),
            finite(c["entropy_min"]),
            finite(c["entropy_mean"]),
            finite(c["collapsed"]),
        )
        if ml:
            writer.add_scalar(f"{t}/max_logit", max(ml), step)
            if max(ml) > 0:
                writer.add_scalar(f"{t}/headroom", c["limit"]["logit"] / max(ml), step)
        if emin:
            writer.add_scalar(f"{t}/entropy_min", min(emin), step)
        if emean:
            writer.add_scalar(f"{t}/entropy_mean", sum(emean) / len(emean), step)
        if col:
            writer.add_scalar(f"{t}/collapsed", max(col), step)
        writer.add_scalar(f"{t}/nonfinite_rows", c["nonfinite_rows"], step)
    seen.clear()
    for g in record["grads"]:
        t = tag(g["module"])
        writer.add_scalar(f"{t}/grad_nonfinite", g["nonfinite"], step)
        if g["zero_frac"] is not None:
            writer.add_scalar(f"{t}/grad_zero_frac", g["zero_frac"], step)
        if g["max_abs"] is not None:
            writer.add_scalar(f"{t}/grad_max_abs", g["max_abs"], step)
    if record["loss"] is not None:
        writer.add_scalar("attncheck/loss", record["loss"], step)
