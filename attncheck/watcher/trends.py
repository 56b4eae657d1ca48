"""Watch records -> per-head series, their trends and the alerts, with the step each first held.

Pure logic over numbers (numpy for the rolling fits; no torch, no printing). The growth of a head's
largest logit is the slope of ln(max logit) over the step, fitted by least squares over the last
``window`` recorded steps (at least MIN_POINTS with a positive logit), as a factor per 100 steps.
A fitted slope is a trend only where it is real: its t statistic (the slope over its standard error)
is at least MIN_T, and no single step between two records makes more than JUMP_SHARE of the fitted
rise over the window (a jump, a level shift, is not growth). Series are per rank: ranks are compared
with one another only by ``rank_divergence``.

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
- ``nonfinite``: a call's output held NaN or inf rows, or its gradients NaN or inf entries;
- ``rank_divergence``: at one step, the same head's largest logit on two ranks differs by a factor
  of at least ``rank_factor`` (magnitudes below 1 counted as 1): under DDP the ranks hold the same
  weights, and other data moves a head's largest logit by far less;
- ``no_attention``: a rank's log holds no attention call (the watched module's forward was not
  seen, or its calls were not).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from attncheck.codes import SEVERITIES, SEVERITY, WHAT_IF_PREFIX
from attncheck.findings.watch import DEFAULTS, DIVERGENCE_FLOOR  # beside their codes' prose, which quotes them
from attncheck.format import num
from attncheck.results.watch import WatchAlert, WatchReport, WatchSeries

MIN_POINTS = 5
MIN_T = 3.0  # the slope's t statistic a trend needs (over 3 degrees of freedom or more: P(t >= 3) < 3% for noise)
JUMP_SHARE = 0.5  # the most of the fitted rise one step between records may make


def factor_text(slope_per_step: float, steps: float = 100.0) -> str:
    """exp(slope * steps) for messages, without overflow: 'x2', 'x1.3e+05', 'x10^311'."""
    e = slope_per_step * steps
    if e < 700:
        return "x" + num(math.exp(e))
    return f"x10^{e / math.log(10):.0f}"


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
                        s = out[key] = WatchSeries(
                            log.rank,
                            module,
                            h,
                            call.kind,
                            call.dtype,
                            call.path,
                            [],
                            [],
                            [],
                            [],
                            [],
                            None,
                            "",
                            call.scale,
                            None,
                            None,
                        )
                    if call.limit is not None:  # the last record's limit is the one shown; each step keeps its own
                        s.limit_logit, s.limit_what, s.dtype = call.limit.logit, call.limit.what, call.dtype
                    s.limits.append(None if call.limit is None else call.limit.logit)
                    s.limit_whats.append(None if call.limit is None else call.limit.what)
                    s.steps.append(rec.step)
                    s.max_logit.append(call.max_logit[h])
                    s.entropy_mean.append(call.entropy_mean[h] if call.entropy_mean else None)
                    s.collapsed.append(call.collapsed[h] if call.collapsed else None)
                    s.first_share.append(call.first_share[h] if call.first_share else None)
                    s.nonfinite.append(call.nonfinite_rows)
    return list(out.values())


def rolling_fit(steps: Sequence[int], values: Sequence[float | None], window: int) -> tuple[np.ndarray, np.ndarray]:
    """At each point, the ln-slope per step of the positive values among the last ``window`` points
    and its t statistic (slope / standard error; inf for an exact fit), both NaN with fewer than
    MIN_POINTS: least squares, from cumulative sums (times from the first point's, so they stay small)."""
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

    n, st, sy, stt, sty, syy = roll(w), roll(tt), roll(y), roll(tt * tt), roll(tt * y), roll(y * y)
    den = n * stt - st * st
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = (n * sty - st * sy) / den
        icept = (sy - slope * st) / n
        ssr = np.maximum(syy - icept * sy - slope * sty, 0.0)  # residual sum of squares (normal equations)
        # rounding of the sums leaves ~1e-12 of syy where the fit is exact: that is an exact fit
        ssr = np.where(ssr <= 1e-12 * np.maximum(syy, 1.0), 0.0, ssr)
        se = np.sqrt(ssr / np.maximum(n - 2, 1) * n / den)
        tstat = np.where(se > 0, slope / se, np.where(slope != 0, np.inf * np.sign(slope), 0.0))
    fitted = (n >= MIN_POINTS) & (den > 0)
    return np.where(fitted, slope, np.nan), np.where(fitted, tstat, np.nan)


def jump_free(
    steps: Sequence[int], values: Sequence[float | None], slope: np.ndarray, window: int, at: np.ndarray
) -> np.ndarray:
    """For the points ``at`` (indices): no step between two consecutive positive values of the last
    ``window`` points changes ln(value) by more than JUMP_SHARE of the fitted change over them."""
    if at.size == 0:
        return np.zeros(0, dtype=bool)
    t = np.asarray(steps, dtype=np.float64)
    v = np.array([x if x is not None and x > 0 else np.nan for x in values], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.log(v)
    out = np.zeros(at.size, dtype=bool)
    span = np.arange(-window + 1, 1)
    for lo in range(0, at.size, 4096):  # bounded memory over a long log: (4096, window) at a time
        idx = at[lo : lo + 4096, None] + span  # (C, window)
        inside = idx >= 0
        idx = np.maximum(idx, 0)
        yy = np.where(inside, y[idx], np.nan)
        tw = np.where(inside & np.isfinite(yy), t[idx], np.nan)
        with np.errstate(invalid="ignore"):
            steps_up = np.abs(np.diff(yy, axis=1))  # NaN where either end is missing
            biggest = np.nanmax(np.where(np.isfinite(steps_up), steps_up, -1.0), axis=1)
            rise = np.abs(slope[at[lo : lo + 4096]]) * (np.nanmax(tw, axis=1) - np.nanmin(tw, axis=1))
        out[lo : lo + 4096] = biggest <= JUMP_SHARE * rise
    return out


def _first(flags: np.ndarray) -> int | None:
    hit = np.flatnonzero(flags)
    return int(hit[0]) if hit.size else None


def analyse(
    logs,
    *,
    window: int = DEFAULTS["window"],
    level: float = DEFAULTS["level"],
    growth: float = DEFAULTS["growth"],
    horizon: float = DEFAULTS["horizon"],
    collapse: float = DEFAULTS["collapse"],
    rank_factor: float = DEFAULTS["rank_factor"],
    what_if: dict[str, float] | None = None,
) -> WatchReport:
    """The report of watch logs (``loaders.watchlog.WatchLog``s). ``what_if``: dtype name -> its
    rounding limit, for hand-written attention's headroom in it."""
    series = series_of(logs)
    alerts: list[WatchAlert] = []
    rate_per_step = math.log(growth) / 100.0
    for s in series:
        _series_alerts(s, alerts, window, level, rate_per_step, collapse, horizon, what_if)
    alerts += divergence(series, rank_factor)
    _nonfinite_alerts(logs, alerts)
    notes = [n for log in logs for n in log.notes]
    _unseen_steps(logs, alerts, notes)
    alerts.sort(key=lambda a: (a.step, a.what_if is not None, a.rank, a.module, -1 if a.head is None else a.head))
    steps = [r.step for log in logs for r in log.records]
    losses = {log.rank: [(r.step, r.loss) for r in log.records if r.loss is not None] for log in logs}
    return WatchReport(
        [log.path for log in logs],
        [log.rank for log in logs],
        sum(len(log.records) for log in logs),
        min(steps),
        max(steps),
        series,
        alerts,
        {r: v for r, v in losses.items() if v},
        notes,
        {
            "window": window,
            "level": level,
            "growth": growth,
            "horizon": horizon,
            "collapse": collapse,
            "rank_factor": rank_factor,
            "what_if": sorted(what_if or {}),
        },
    )


def _series_alerts(s, alerts, window, level, rate_per_step, collapse, horizon, what_if) -> None:
    """One head's series: its growth fitted (s.growth, s.steps_to_limit set) and its logit_growth,
    entropy_collapse and headroom_low alerts appended to ``alerts``."""
    slope, tstat = rolling_fit(s.steps, s.max_logit, window)
    x = np.array([v if v is not None else np.nan for v in s.max_logit], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        real = np.abs(tstat) >= MIN_T
    candidates = np.flatnonzero(real)
    real[candidates] = jump_free(s.steps, s.max_logit, slope, window, candidates)
    trend = np.where(real, slope, np.nan)  # a slope that is no real trend is no growth
    last = trend[-1] if trend.size else np.nan
    s.growth = (
        float(math.exp(100 * last))
        if np.isfinite(last) and last * 100 < 700
        else (math.inf if np.isfinite(last) else None)
    )
    limit = np.array([v if v is not None else np.nan for v in s.limits], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        to_limit = np.where((trend > 0) & (x > 0), np.log(limit / x) / trend, np.inf)
        s.steps_to_limit = float(to_limit[-1]) if to_limit.size and np.isfinite(to_limit[-1]) else None
        growing = (trend >= rate_per_step) & (x >= level)
    i = _first(growing)
    if i is not None:
        alerts.append(
            _alert(
                "logit_growth",
                s,
                i,
                f"the largest logit grows {factor_text(trend[i])} per 100 steps "
                f"(over the last {window} records) and reached {num(x[i])} (level {num(level)}); now {num(x[-1])}",
            )
        )
    col = np.array([v if v is not None else np.nan for v in s.collapsed], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        i = _first(col >= collapse)
    if i is not None:
        ent = s.entropy_mean[i]
        alerts.append(
            _alert(
                "entropy_collapse",
                s,
                i,
                f"{col[i]:.0%} of its sampled rows put over 0.99 of their weight on one key "
                f"(mean entropy {num(ent)} nats)",
            )
        )
    _headroom_alerts(s, alerts, x, trend, limit, level, horizon, what_if)


def _headroom_alerts(s, alerts, x, trend, limit, level, horizon, what_if) -> None:
    """headroom_low: the step from which, at its growth, a head reaches its limit within ``horizon``
    steps: its own dtype's limit at each step, then each ``what_if`` dtype's."""
    limits = [(None, limit, s.limit_whats)] if np.isfinite(limit).any() else []  # each step's own limit and text
    for name, dtype_limit in (what_if or {}).items():
        scale = abs(s.scale) if s.scale else 1.0
        said = f"hand-written attention in {name}: S = Q@K^T rounds to inf at |S| >= {dtype_limit:.6g}"
        limits.append((name, np.full(x.shape, dtype_limit * scale), [said] * len(x)))
    for name, lim, what in limits:
        with np.errstate(invalid="ignore", divide="ignore"):
            steps_left = np.where((trend > 0) & (x > 0), np.log(lim / x) / trend, np.inf)
            # early training's rise, extrapolated, is no alarm
            i = _first((steps_left < horizon) & (x >= np.fmin(level, lim)))
        if i is not None:
            reached = " (already past it)" if x[i] >= lim[i] else ""
            alerts.append(
                _alert(
                    "headroom_low",
                    s,
                    i,
                    f"at {factor_text(trend[i])} per 100 steps the largest logit ({num(x[i])}) reaches "
                    f"{num(lim[i])} in {num(max(steps_left[i], 0.0))} steps{reached}: {what[i]}",
                    what_if=name,
                )
            )


def _nonfinite_alerts(logs, alerts) -> None:
    """nonfinite: per call (not per head), the first step whose output rows or gradients held NaN or inf."""
    for log in logs:  # NaN and inf: per call (not per head), from the output rows and the gradients
        done: set[str] = set()
        for rec in log.records:
            for call in rec.calls:
                if call.nonfinite_rows and call.module not in done:
                    done.add(call.module)
                    alerts.append(
                        WatchAlert(
                            "nonfinite",
                            SEVERITY["nonfinite"],
                            log.rank,
                            call.module,
                            None,
                            rec.step,
                            f"{call.nonfinite_rows} row(s) of the attention output hold NaN or inf",
                        )
                    )
            for g in rec.grads:
                key = g.module + " grads"
                if g.nonfinite and key not in done:
                    done.add(key)
                    alerts.append(
                        WatchAlert(
                            "nonfinite",
                            SEVERITY["nonfinite"],
                            log.rank,
                            g.module,
                            None,
                            rec.step,
                            f"{g.nonfinite} gradient entries of dq, dk, dv hold NaN or inf",
                        )
                    )


def _unseen_steps(logs, alerts, notes) -> None:
    """no_attention for a log without any call; a note of the steps that ran no training forward."""
    for log in logs:
        unseen = [r.step for r in log.records if r.forwards == 0]
        if not any(r.calls for r in log.records):
            why = (
                f"attncheck.watch saw no training forward of the watched module (steps {_steps_text(unseen)})"
                if unseen
                else "the watched module's forwards ran, but no attention call was recorded in them"
            )
            alerts.append(
                WatchAlert(
                    "no_attention",
                    SEVERITY["no_attention"],
                    log.rank,
                    "",
                    None,
                    log.records[0].step,
                    f"no attention recorded: {why}",
                )
            )
        elif unseen:
            notes.append(
                f"rank {log.rank}: {len(unseen)} step(s) ran no training forward of the watched module "
                f"(steps {_steps_text(unseen)}): nothing was recorded for them"
            )


def divergence(series: list[WatchSeries], factor: float) -> list[WatchAlert]:
    """``rank_divergence``: per head recorded on several ranks, the first step at which its largest
    logit on one rank is at least ``factor`` times another's (magnitudes below DIVERGENCE_FLOOR
    counted as it); the alert is the larger rank's, naming the smaller."""
    by_head: dict[tuple[str, int], list[WatchSeries]] = {}
    for s in series:
        by_head.setdefault((s.module, s.head), []).append(s)
    out = []
    for (module, head), group in by_head.items():
        if len(group) < 2:
            continue
        steps = sorted({t for s in group for t in s.steps})
        col = {t: i for i, t in enumerate(steps)}
        m = np.full((len(steps), len(group)), np.nan)  # (steps, ranks)
        for j, s in enumerate(group):
            rows = [col[t] for t in s.steps]
            m[rows, j] = [np.nan if v is None else v for v in s.max_logit]
        mag = np.where(np.isfinite(m), np.fmax(np.abs(m), DIVERGENCE_FLOOR), np.nan)
        both = np.isfinite(mag).sum(axis=1) >= 2
        with np.errstate(invalid="ignore", divide="ignore"):  # rows without two ranks hold 1 / 1
            ratio = np.where(
                both,
                np.nanmax(np.where(both[:, None], mag, 1.0), axis=1)
                / np.nanmin(np.where(both[:, None], mag, 1.0), axis=1),
                np.nan,
            )
        i = _first(ratio >= factor)
        if i is None:
            continue
        row = np.where(np.isfinite(mag[i]), mag[i], np.nan)
        hi, lo = int(np.nanargmax(row)), int(np.nanargmin(row))
        a, b = group[hi], group[lo]
        floored = any(mag[i, j] != m[i, j] for j in (hi, lo))

        def shown(j: int) -> str:  # the logit, and the magnitude the ratio divides where that differs
            return num(m[i, j]) if mag[i, j] == m[i, j] else f"{num(m[i, j])}, taken as {num(mag[i, j])}"

        out.append(
            WatchAlert(
                "rank_divergence",
                SEVERITY["rank_divergence"],
                a.rank,
                module,
                head,
                steps[i],
                f"its largest logit on rank {a.rank} ({shown(hi)}) is {num(ratio[i])} times rank {b.rank}'s "
                f"({shown(lo)}) at step {steps[i]} (factor {num(factor)}"
                + (
                    f"; magnitudes compared, those below {num(DIVERGENCE_FLOOR)} as {num(DIVERGENCE_FLOOR)}"
                    if floored
                    else ""
                )
                + "): the ranks do not hold the same weights",
                other_rank=b.rank,
            )
        )
    return out


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(str(t) for t in steps[:5])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > 5 else "")


def _alert(code: str, s: WatchSeries, i: int, message: str, what_if: str | None = None) -> WatchAlert:
    return WatchAlert(code, SEVERITY[code], s.rank, s.module, s.head, s.steps[i], message, what_if)


def failed(report: WatchReport, conditions: list[str], ignore=()) -> list[str]:
    """The --fail-on conditions that hold: an alert code, 'error' / 'warning' (an alert of that
    severity or worse), 'nan' (nonfinite); 'what-if:CODE' for the what-if alerts."""
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
            where = f"{cond}: {a.code} at step {a.step} on rank {a.rank}" + (f", {a.module}" if a.module else "")
            held.append(where + (f" head {a.head}" if a.head is not None else ""))
    return held
