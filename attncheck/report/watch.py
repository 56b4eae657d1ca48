"""Watch report -> Rich tables, JSON and a plot. Formatting only: every number comes from ``watch.trends``."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Group
from rich.text import Text

from attncheck import __version__
from attncheck.format import num, plain, to_jsonable
from attncheck.report.diagnostics import diagnostic
from attncheck.report.run import compact_table
from attncheck.report.text import shown
from attncheck.results import WatchReport, WatchSeries

WATCH_JSON_SCHEMA = "attncheck.watch-report/1"
HEADS_SHOWN = 16  # rows of the heads table (the worst first); the JSON has all


def _worst_first(report: WatchReport) -> list[WatchSeries]:
    alerted = {(a.rank, a.module, a.head) for a in report.alerts}

    def key(s: WatchSeries):
        last = next((v for v in reversed(s.max_logit) if v is not None), 0.0)
        return ((s.rank, s.module, s.head) not in alerted, -(s.growth or 0.0) if s.growth and math.isfinite(s.growth) else 0.0, -last)

    return sorted(report.series, key=key)


def heads_table(report: WatchReport):
    ranks = len(report.ranks) > 1
    t = compact_table(f"Heads, worst first (largest logit now, its growth per 100 steps over the last {report.settings['window']} records, "
                      "entropy of the sampled rows, steps until the dtype's limit at that growth)")
    for name, justify in ([("rank", "right")] if ranks else []) + [("call", "left"), ("head", "right"), ("logit", "right"),
                                                                   ("x/100", "right"), ("entropy", "right"), ("collapsed", "right"),
                                                                   ("to limit", "right")]:
        t.add_column(name, justify=justify, no_wrap=name != "call", overflow="fold")
    for s in _worst_first(report)[:HEADS_SHOWN]:
        last = next((v for v in reversed(s.max_logit) if v is not None), None)
        ent = next((v for v in reversed(s.entropy_mean) if v is not None), None)
        col = next((v for v in reversed(s.collapsed) if v is not None), None)
        growth = "-" if s.growth is None else ("inf" if not math.isfinite(s.growth) else num(s.growth))
        row = ([str(s.rank)] if ranks else []) + [shown(s.module), str(s.head), plain(last), growth, num(ent), "-" if col is None else f"{col:.0%}",
                                                  "-" if s.steps_to_limit is None else plain(s.steps_to_limit)]
        t.add_row(*row)
    left = len(report.series) - HEADS_SHOWN
    if left > 0:
        t.caption = f"{left} more head(s) in the JSON report (--json)"
        t.caption_justify = "left"
    return t


def alerts_text(report: WatchReport):
    """Each alert as a compiler-style diagnostic: 'warning[logit_growth]: ...', where it held, its fix."""
    from attncheck.codes import FIX

    if not report.alerts:
        return Text("No alert: no head's logits grow past the level, collapse, near their dtype's limit, or go non-finite.", style="green")
    parts = []
    for a in report.alerts:
        where = f"rank {a.rank}, " if len(report.ranks) > 1 else ""
        where += f"{a.module}" + (f" head {a.head}" if a.head is not None else "") + f", from step {a.step}"
        tag = f"what-if {a.what_if}: " if a.what_if else ""
        parts.append(diagnostic(a.severity, a.code, tag + a.message, where, FIX.get(a.code)))
    return Group(*parts)


def closing_line(report: WatchReport) -> Text:
    ranks = f"{len(report.ranks)} rank(s), " if len(report.ranks) > 1 else ""
    head = f"{report.records} record(s), {ranks}steps {report.first_step}-{report.last_step}, {len(report.series)} head(s)"
    own = [a for a in report.alerts if a.what_if is None]
    what_if = [a for a in report.alerts if a.what_if is not None]
    tail = f"; what-if: {len(what_if)} alert(s)" if report.settings.get("what_if") else ""
    if not own:
        return Text(head + ": no alert" + tail, style="green")
    a = report.first
    where = (f"rank {a.rank}, " if len(report.ranks) > 1 else "") + a.module + (f" head {a.head}" if a.head is not None else "")
    errors = sum(x.severity == "error" for x in own)
    text = Text(f"{head}: {errors} error(s), {len(own) - errors} warning(s); first alert: {a.code} at step {a.step}, ",
                style="bold red" if errors else "yellow")
    text.append(shown(where))
    text.append(tail)
    return text


def render_watch(report: WatchReport) -> Group:
    parts: list[Any] = [shown(f"note: {n}", style="yellow") for n in report.notes]
    parts += [heads_table(report), alerts_text(report), closing_line(report)]
    return Group(*parts)


def watch_json(report: WatchReport, failed: list[str]) -> dict[str, Any]:
    return to_jsonable({
        "schema": WATCH_JSON_SCHEMA,
        "attncheck_version": __version__,
        "logs": report.logs,
        "ranks": report.ranks,
        "records": report.records,
        "first_step": report.first_step,
        "last_step": report.last_step,
        "settings": report.settings,
        "notes": report.notes,
        "alerts": report.alerts,
        "first_alert": report.first,
        "heads": [{"rank": s.rank, "module": s.module, "head": s.head, "kind": s.kind, "dtype": s.dtype, "path": s.path,
                   "steps": s.steps, "max_logit": s.max_logit, "entropy_mean": s.entropy_mean, "collapsed": s.collapsed,
                   "growth_per_100_steps": s.growth, "steps_to_limit": s.steps_to_limit, "limit_logit": s.limit_logit,
                   "limit": s.limit_what} for s in report.series],
        "failed": failed,
    })


def plot_watch(report: WatchReport, path: str) -> None:
    """Step x call heatmaps of the largest logit (log10, the max over heads) and of the mean entropy
    (the min over heads), the curves of the worst heads' largest logit, and the alert steps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ranks = report.ranks
    rank = report.first.rank if report.first is not None else ranks[0]
    series = [s for s in report.series if s.rank == rank]
    calls = list(dict.fromkeys(s.module for s in series))
    steps = sorted({t for s in series for t in s.steps})
    col = {t: i for i, t in enumerate(steps)}
    logit = np.full((len(calls), len(steps)), np.nan)
    ent = np.full((len(calls), len(steps)), np.nan)
    for s in series:
        r = calls.index(s.module)
        for t, m, e in zip(s.steps, s.max_logit, s.entropy_mean):
            if m is not None and m > 0:
                logit[r, col[t]] = np.fmax(logit[r, col[t]], np.log10(m))
            if e is not None:
                ent[r, col[t]] = np.fmin(ent[r, col[t]], e)
    fig, axes = plt.subplots(3, 1, figsize=(10, 3 + 0.25 * len(calls) * 2 + 3), constrained_layout=True)
    extent = (steps[0] - 0.5, steps[-1] + 0.5, len(calls) - 0.5, -0.5)
    for ax, data, title, cmap in ((axes[0], logit, "log10 of the largest logit (max over heads)", "magma"),
                                  (axes[1], ent, "mean entropy of the sampled rows, nats (min over heads)", "viridis")):
        im = ax.imshow(data, aspect="auto", interpolation="nearest", extent=extent, cmap=cmap)
        ax.set_yticks(range(len(calls)))
        ax.set_yticklabels(calls, fontsize=7)
        ax.set_title(title + (f" - rank {rank}" if len(ranks) > 1 else ""), fontsize=9)
        ax.set_xlabel("step")
        fig.colorbar(im, ax=ax)
    worst = _worst_first(report)
    worst = [s for s in worst if s.rank == rank][:6]
    ax = axes[2]
    for s in worst:
        ys = [v if v is not None and v > 0 else np.nan for v in s.max_logit]
        ax.plot(s.steps, ys, label=s.label, linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest logit")
    ax.set_title("the worst heads (alert steps marked)", fontsize=9)
    for a in report.alerts:
        if a.rank == rank and a.what_if is None:
            for axis in axes:
                axis.axvline(a.step, color="red" if a.severity == "error" else "orange", linestyle="--", linewidth=0.8)
    if worst:
        ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, dpi=100)
    plt.close(fig)
