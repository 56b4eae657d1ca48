"""Watch records -> per-head series, their trends and the alerts, with the step each first held.

Pure logic over numbers (numpy for the rolling fits; no torch, no printing). The growth of a head's
largest logit is the slope of ln(max logit) over the step, fitted by least squares over the last
``window`` recorded steps (at least MIN_POINTS with a positive logit), as a factor per 100 steps.

Alerts (``codes.FIX`` has each one's fix):

- ``logit_growth``: the fitted growth per 100 steps is at least ``growth`` and the largest logit
  at least ``level``: geometric growth past a level healthy heads stay below (Wortsman et al. 2023
  see small models diverge once logits pass a few hundred; Kimi K2's QK-clip acts at 100);
- ``entropy_collapse``: at least ``collapse`` of the head's sampled rows have a top probability
  above 0.99;
- ``headroom_low``: the logit grows, has reached ``level`` (or the limit, if lower) and, at the
  fitted rate, reaches the limit of the dtype the call runs in (``limit_logit``) within
  ``horizon`` steps (the quick rise of early training, extrapolated, would reach any limit); with
  ``what_if`` dtypes, the limit of
  hand-written attention in each of them too (S = Q@K^T in that dtype: its rounding limit times
  the call's scale), reported as a what-if;
- ``nonfinite``: a call's output held NaN or inf rows, or its gradients NaN or inf entries.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from attncheck.codes import SEVERITY
from attncheck.format import num
from attncheck.results import WatchAlert, WatchReport, WatchSeries

MIN_POINTS = 5
DEFAULTS = {"window": 20, "level": 50.0, "growth": 2.0, "horizon": 1000.0, "collapse": 0.5}


def series_of(logs) -> list[WatchSeries]:
    """One series per (rank, call position, head): a module called twice in a step is two calls."""
    out: dict[tuple, WatchSeries] = {}
    for log in logs:
        for rec in log.records:
            seen: dict[str, int] = {}
            for call in rec.calls:
                n = seen.get(call.module, 0) + 1
                seen[call.module] = n
                module = call.module if n == 1 else f"{call.module}#{n}"
                for h in range(call.heads):
                    key = (log.rank, module, h)
                    s = out.get(key)
                    if s is None:
                        s = out[key] = WatchSeries(log.rank, module, h, call.kind, call.dtype, call.path, [], [], [], [], [],
                                                   None if call.limit is None else call.limit.logit,
                                                   "" if call.limit is None else call.limit.what, call.scale, None, None)
                    s.steps.append(rec.step)
                    s.max_logit.append(call.max_logit[h])
                    s.entropy_mean.append(call.entropy_mean[h] if call.entropy_mean else None)
                    s.collapsed.append(call.collapsed[h] if call.collapsed else None)
                    s.nonfinite.append(call.nonfinite_rows)
    return list(out.values())


def rolling_growth(steps: Sequence[int], values: Sequence[float | None], window: int) -> np.ndarray:
    """At each point, ln-slope per step of the positive values among the last ``window`` points
    (NaN with fewer than MIN_POINTS): least squares, from cumulative sums."""
    t = np.asarray(steps, dtype=np.float64)
    v = np.array([x if x is not None and x > 0 else np.nan for x in values], dtype=np.float64)
    ok = np.isfinite(v)
    y = np.where(ok, np.log(np.where(ok, v, 1.0)), 0.0)
    w = ok.astype(np.float64)
    tt = np.where(ok, t - t[0] if len(t) else t, 0.0)

    def roll(a):
        c = np.concatenate([[0.0], np.cumsum(a)])
        i = np.arange(1, len(a) + 1)
        return c[i] - c[np.maximum(i - window, 0)]

    n, st, sy, stt, sty = roll(w), roll(tt), roll(y), roll(tt * tt), roll(tt * y)
    den = n * stt - st * st
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = (n * sty - st * sy) / den
    return np.where((n >= MIN_POINTS) & (den > 0), slope, np.nan)


def _first(flags: np.ndarray) -> int | None:
    hit = np.flatnonzero(flags)
    return int(hit[0]) if hit.size else None


def analyse(logs, *, window: int = DEFAULTS["window"], level: float = DEFAULTS["level"], growth: float = DEFAULTS["growth"],
            horizon: float = DEFAULTS["horizon"], collapse: float = DEFAULTS["collapse"], what_if: dict[str, float] | None = None) -> WatchReport:
    """The report of watch logs (``loaders.watchlog.WatchLog``s). ``what_if``: dtype name -> its
    rounding limit, for hand-written attention's headroom in it."""
    series = series_of(logs)
    alerts: list[WatchAlert] = []
    rate_per_step = math.log(growth) / 100.0
    for s in series:
        slope = rolling_growth(s.steps, s.max_logit, window)
        x = np.array([v if v is not None else np.nan for v in s.max_logit], dtype=np.float64)
        last = slope[-1] if slope.size else np.nan
        s.growth = float(math.exp(100 * last)) if np.isfinite(last) and last * 100 < 700 else (math.inf if np.isfinite(last) else None)
        with np.errstate(invalid="ignore", divide="ignore"):
            if s.limit_logit is not None:
                to_limit = np.where((slope > 0) & (x > 0), np.log(s.limit_logit / x) / slope, np.inf)
                s.steps_to_limit = float(to_limit[-1]) if to_limit.size and np.isfinite(to_limit[-1]) else None
            growing = (slope >= rate_per_step) & (x >= level)
        i = _first(growing)
        if i is not None:
            alerts.append(_alert("logit_growth", s, i, f"the largest logit grows x{num(math.exp(100 * slope[i]))} per 100 steps "
                                 f"(over the last {window} records) and reached {num(x[i])} (level {num(level)}); now {num(x[-1])}"))
        col = np.array([v if v is not None else np.nan for v in s.collapsed], dtype=np.float64)
        with np.errstate(invalid="ignore"):
            i = _first(col >= collapse)
        if i is not None:
            ent = s.entropy_mean[i]
            alerts.append(_alert("entropy_collapse", s, i, f"{col[i]:.0%} of its sampled rows put over 0.99 of their weight on one key "
                                 f"(mean entropy {num(ent)} nats)"))
        limits = [(None, s.limit_logit, s.limit_what)] if s.limit_logit is not None else []
        for name, dtype_limit in (what_if or {}).items():
            scale = abs(s.scale) if s.scale else 1.0
            limits.append((name, dtype_limit * scale, f"hand-written attention in {name}: S = Q@K^T rounds to inf at |S| >= {dtype_limit:.6g}"))
        for name, limit, what in limits:
            with np.errstate(invalid="ignore", divide="ignore"):
                steps_left = np.where((slope > 0) & (x > 0), np.log(limit / x) / slope, np.inf)
                i = _first((steps_left < horizon) & (x >= min(level, limit)))  # early training's rise, extrapolated, is no alarm
            if i is not None:
                reached = " (already past it)" if x[i] >= limit else ""
                alerts.append(_alert("headroom_low", s, i, f"at x{num(math.exp(100 * slope[i]))} per 100 steps the largest logit "
                                     f"({num(x[i])}) reaches {num(limit)} in {num(max(steps_left[i], 0.0))} steps{reached}: {what}",
                                     what_if=name))
    for log in logs:  # NaN and inf: per call (not per head), from the output rows and the gradients
        done: set[str] = set()
        for rec in log.records:
            for call in rec.calls:
                if call.nonfinite_rows and call.module not in done:
                    done.add(call.module)
                    alerts.append(WatchAlert("nonfinite", SEVERITY["nonfinite"], log.rank, call.module, None, rec.step,
                                             f"{call.nonfinite_rows} row(s) of the attention output hold NaN or inf"))
            for g in rec.grads:
                key = g.module + " grads"
                if g.nonfinite and key not in done:
                    done.add(key)
                    alerts.append(WatchAlert("nonfinite", SEVERITY["nonfinite"], log.rank, g.module, None, rec.step,
                                             f"{g.nonfinite} gradient entries of dq, dk, dv hold NaN or inf"))
    alerts.sort(key=lambda a: (a.step, a.what_if is not None, a.rank, a.module, -1 if a.head is None else a.head))
    steps = [r.step for log in logs for r in log.records]
    losses = {log.rank: [(r.step, r.loss) for r in log.records if r.loss is not None] for log in logs}
    return WatchReport([log.path for log in logs], [log.rank for log in logs], sum(len(log.records) for log in logs), min(steps), max(steps),
                       series, alerts, {r: v for r, v in losses.items() if v}, [n for log in logs for n in log.notes],
                       {"window": window, "level": level, "growth": growth, "horizon": horizon, "collapse": collapse,
                        "what_if": sorted(what_if or {})})


def _alert(code: str, s: WatchSeries, i: int, message: str, what_if: str | None = None) -> WatchAlert:
    return WatchAlert(code, SEVERITY[code], s.rank, s.module, s.head, s.steps[i], message, what_if)


def failed(report: WatchReport, conditions: list[str], ignore=()) -> list[str]:
    """The --fail-on conditions that hold: an alert code, 'error' / 'warning' (an alert of that
    severity or worse), 'nan' (nonfinite); 'what-if:CODE' for the what-if alerts."""
    from attncheck.codes import SEVERITIES, WHAT_IF_PREFIX

    held = []
    for cond in conditions:
        asked_what_if = cond.startswith(WHAT_IF_PREFIX)
        word = cond.removeprefix(WHAT_IF_PREFIX)
        pool = [a for a in report.alerts if (a.what_if is not None) == asked_what_if and a.code not in ignore]
        if word in ("error", "warning"):
            hit = [a for a in pool if SEVERITIES.index(a.severity) <= SEVERITIES.index(word)]
        elif word == "nan":
            hit = [a for a in pool if a.code == "nonfinite"]
        else:
            hit = [a for a in pool if a.code == word]
        if hit:
            a = hit[0]
            held.append(f"{cond}: {a.code} at step {a.step} on rank {a.rank}, {a.module}" + (f" head {a.head}" if a.head is not None else ""))
    return held
