"""Watch report -> Rich tables, JSON and a plot. Formatting only: every number comes from ``watch.trends``."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from rich.console import Group
from rich.text import Text

from attncheck import __version__
from attncheck.codes import FIX
from attncheck.errors import AttncheckError
from attncheck.format import num, plain, to_jsonable
from attncheck.format import visible as plain_text
from attncheck.report.diagnostics import WHERE, Hanging, diagnostic
from attncheck.report.run import compact_table
from attncheck.report.text import shown
from attncheck.results.watch import WatchReport, WatchSeries

WATCH_JSON_SCHEMA = "attncheck.watch-report/1"
HEADS_SHOWN = 16  # rows of the heads table (the worst first); the JSON has all
PLACES_SHOWN = 6  # places listed under a code's alerts (one line per rank and call); the JSON has all
PLOT_CALLS = 40  # rows of the plot's heatmaps: the worst calls, so that a log of thousands of calls draws in seconds


def _worst_first(report: WatchReport) -> list[WatchSeries]:
    alerted = {(a.rank, a.module, a.head) for a in report.alerts}

    def key(s: WatchSeries):
        last = next((v for v in reversed(s.max_logit) if v is not None), 0.0)
        return (
            (s.rank, s.module, s.head) not in alerted,
            -(s.growth or 0.0) if s.growth and math.isfinite(s.growth) else 0.0,
            -last,
        )

    return sorted(report.series, key=key)


def heads_table(report: WatchReport):
    ranks = len(report.ranks) > 1
    t = compact_table(
        f"Heads, worst first (largest logit now, its growth per 100 steps over the last {report.settings['window']} "
        "records, entropy of the sampled rows, first: key 0's share of them, steps until the dtype's limit at that "
        "growth)"
    )
    for name, justify in ([("rank", "right")] if ranks else []) + [
        ("call", "left"),
        ("head", "right"),
        ("logit", "right"),
        ("x/100", "right"),
        ("entropy", "right"),
        ("collapsed", "right"),
        ("first", "right"),
        ("to limit", "right"),
    ]:
        t.add_column(name, justify=justify, no_wrap=name != "call", overflow="fold")
    for s in _worst_first(report)[:HEADS_SHOWN]:
        last = next((v for v in reversed(s.max_logit) if v is not None), None)
        ent = next((v for v in reversed(s.entropy_mean) if v is not None), None)
        col = next((v for v in reversed(s.collapsed) if v is not None), None)
        first = next((v for v in reversed(s.first_share) if v is not None), None)
        growth = "-" if s.growth is None else ("inf" if not math.isfinite(s.growth) else num(s.growth))
        row = ([str(s.rank)] if ranks else []) + [
            shown(s.module),
            str(s.head),
            plain(last),
            growth,
            num(ent),
            "-" if col is None else f"{col:.0%}",
            "-" if first is None else num(first, 2),
            "-" if s.steps_to_limit is None else plain(s.steps_to_limit),
        ]
        t.add_row(*row)
    left = len(report.series) - HEADS_SHOWN
    if left > 0:
        t.caption = f"{left} more head(s) in the JSON report (--json)"
        t.caption_justify = "left"
    return t


def alerts_text(report: WatchReport):
    """The alerts as compiler-style diagnostics, one per code (and what-if dtype): the first alert's
    message, every place it holds (per rank and call, the heads and the first step), one fix."""
    if not report.alerts:
        return Text(
            "No alert: no head's logits grow past the level, collapse, near their dtype's limit, differ across ranks, "
            "or go non-finite.",
            style="green",
        )
    groups: dict[tuple, list] = {}
    for a in report.alerts:  # in step order: each group's first alert is its earliest
        groups.setdefault((a.code, a.what_if), []).append(a)
    parts = []
    for (code, what_if), alerts in groups.items():
        first = alerts[0]
        tag = f"what-if {what_if}: " if what_if else ""
        count = f"{len(alerts)} alerts, the first: " if len(alerts) > 1 else ""
        places = _places(report, alerts)
        shown_places = places[:PLACES_SHOWN]
        if len(places) > PLACES_SHOWN:
            shown_places.append(f"... and {len(places) - PLACES_SHOWN} more (--json lists every alert)")
        block = diagnostic(first.severity, code, count + tag + first.message, shown_places[0], FIX.get(code))
        if len(shown_places) > 1:  # the other places go between the first and the fix
            head, where, *fix = block.renderables
            block = Group(head, where, *(diagnostic_where(p) for p in shown_places[1:]), *fix)
        parts.append(block)
    return Group(*parts)


def _places(report: WatchReport, alerts) -> list[str]:
    """'rank 1, blocks.0 heads 0, 2, 3, from step 5': one line per rank and call."""
    several = len(report.ranks) > 1
    by_place: dict[tuple, list] = {}
    for a in alerts:
        by_place.setdefault((a.rank, a.module), []).append(a)
    lines = []
    for (rank, module), group in by_place.items():
        heads = sorted({a.head for a in group if a.head is not None})
        text = f"rank {rank}" if several or not module else ""
        if module:
            text += (", " if text else "") + module
        if heads:
            text += (" head " if len(heads) == 1 else " heads ") + ", ".join(map(str, heads))
        others = sorted({a.other_rank for a in group if a.other_rank is not None})
        if others:
            text += " (against rank " + ", ".join(map(str, others)) + ")"
        text += f", from step {min(a.step for a in group)}"
        lines.append(text)
    return lines


def closing_line(report: WatchReport) -> Text:
    ranks = f"{len(report.ranks)} rank(s), " if len(report.ranks) > 1 else ""
    head = (
        f"{report.records} record(s), {ranks}steps {report.first_step}-{report.last_step}, {len(report.series)} head(s)"
    )
    own = [a for a in report.alerts if a.what_if is None]
    what_if = [a for a in report.alerts if a.what_if is not None]
    tail = f"; what-if: {len(what_if)} alert(s)" if report.settings.get("what_if") else ""
    if not own:
        return Text(head + ": no alert" + tail, style="green")
    a = report.first
    where = (
        (f"rank {a.rank}" + (", " if a.module else "") if len(report.ranks) > 1 or not a.module else "")
        + a.module
        + (f" head {a.head}" if a.head is not None else "")
    )
    errors = sum(x.severity == "error" for x in own)
    text = Text(
        f"{head}: {errors} error(s), {len(own) - errors} warning(s); first alert: {a.code} at step {a.step}, ",
        style="bold red" if errors else "yellow",
    )
    text.append(shown(where))
    text.append(tail)
    return text


def diagnostic_where(place: str):
    return Hanging(Text(WHERE, style="blue"), Text(plain_text(place)))


def render_watch(report: WatchReport) -> Group:
    parts: list[Any] = [shown(f"note: {n}", style="yellow") for n in report.notes]
    parts += [heads_table(report)] if report.series else []  # no head recorded: no table
    parts += [alerts_text(report), closing_line(report)]
    return Group(*parts)


def watch_json(report: WatchReport, failed: list[str]) -> dict[str, Any]:
    return to_jsonable(
        {
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
            "heads": [
                {
                    "rank": s.rank,
                    "module": s.module,
                    "head": s.head,
                    "kind": s.kind,
                    "dtype": s.dtype,
                    "path": s.path,
                    "steps": s.steps,
                    "max_logit": s.max_logit,
                    "entropy_mean": s.entropy_mean,
                    "collapsed": s.collapsed,
                    "first_share": s.first_share,
                    "growth_per_100_steps": s.growth,
                    "steps_to_limit": s.steps_to_limit,
                    "limit_logit": s.limit_logit,
                    "limit": s.limit_what,
                }
                for s in report.series
            ],
            "failed": failed,
        }
    )


CURVES_SHOWN = 6  # heads drawn as curves: the heads table's first rows


def plot_watch(report: WatchReport, path: str) -> str:
    """Step x call heatmaps of the largest logit (log10, the max over heads) and of the mean entropy
    (the min over heads) of one rank (the first alert's, else the first), the curves of the worst
    heads of every rank (the heads table's first CURVES_SHOWN rows, named with their rank where the
    logs hold several), and the alert steps marked; written to ``path`` (PNG). At most PLOT_CALLS calls
    (those with alerts, then the largest logits); returns what was left out ('' when nothing): the
    calls and the ranks not in the heatmaps. Names are drawn as text (never as mathtext)."""
    import matplotlib.pyplot as plt  # matplotlib: only when a plot is asked (an optional dependency, slow to import)

    fig, left_out = watch_figure(report)
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    try:  # written here, so that a full disk or a refused name is one line, never a file said written and not
        with open(path, "wb") as fh:
            fh.write(buffer.getvalue())
    except OSError as e:
        raise AttncheckError(f"cannot write --plot {path}: {e.strerror or e}") from None
    return left_out


def watch_figure(report: WatchReport):
    """The figure ``plot_watch`` writes (the caller closes it), and what it leaves out."""
    import matplotlib  # matplotlib: only when a plot is asked (an optional dependency, slow to import)

    matplotlib.use("Agg")
    # optional and slow to import: matplotlib only when a plot is asked
    import matplotlib.pyplot as plt

    ranks = report.ranks
    several = len(ranks) > 1
    rank, why, series, worst, all_calls, calls, notes = _drawn(report, ranks, several)
    left_out = "; ".join(notes)
    steps, logit, ent = _grids(series, calls)
    labels = [plain_text(c) for c in calls]
    with matplotlib.rc_context({"text.usetex": False}):  # names are text: parse_math is off on each
        fig, axes = plt.subplots(3, 1, figsize=(10, 6 + 0.5 * len(calls)), constrained_layout=True)
        try:
            _heatmaps(fig, axes, logit, ent, steps, calls, labels, all_calls, notes, rank, why, ranks, several)
            ax, curves = _curves(axes, worst, several)
            _marks(axes, report, rank, curves)
            if curves:
                for text in ax.legend(fontsize=7, loc="upper left").get_texts():
                    text.set_parse_math(False)
        except BaseException:
            plt.close(fig)
            raise
    return fig, left_out


def _drawn(report: WatchReport, ranks, several):
    """What the figure draws: the rank of the heatmaps (the first alert's, else the first with calls) and
    its series, the worst heads, the calls drawn (those with alerts, then the largest logits), the notes."""
    rank = report.first.rank if report.first is not None and report.first.module else ranks[0]
    why = "the first alert's" if report.first is not None and report.first.module else "the first"
    series = [s for s in report.series if s.rank == rank]
    if not series:  # the first alert's rank recorded nothing: the first rank that did
        rank, why = next(s.rank for s in report.series), "the first with calls"
        series = [s for s in report.series if s.rank == rank]
    worst = _worst_first(report)
    all_calls = list(dict.fromkeys(s.module for s in series))
    calls = list(dict.fromkeys(s.module for s in worst if s.rank == rank))[:PLOT_CALLS]
    notes = []
    if several:
        others = [r for r in ranks if r != rank]
        notes.append(
            f"heatmaps of rank {rank} ({why}), not of rank(s) {', '.join(map(str, others))}; "
            f"curves of the worst heads of every rank"
        )
    if len(all_calls) > len(calls):
        notes.append(f"{len(calls)} of {len(all_calls)} calls drawn: those with alerts, then the largest logits")
        keep = set(calls)
        series = [s for s in series if s.module in keep]
        calls = [c for c in all_calls if c in keep]  # in the model's order
    return rank, why, series, worst, all_calls, calls, notes


def _grids(series, calls):
    """The heatmaps' step x call grids: (steps, log10 of the largest logit, mean entropy), over heads."""
    steps = sorted({t for s in series for t in s.steps})
    col = {t: i for i, t in enumerate(steps)}
    row = {c: i for i, c in enumerate(calls)}
    logit = np.full((len(calls), len(steps)), np.nan)
    ent = np.full((len(calls), len(steps)), np.nan)
    for s in series:
        r, cols = row[s.module], [col[t] for t in s.steps]
        m = np.array([np.nan if v is None or v <= 0 else v for v in s.max_logit], dtype=np.float64)
        e = np.array([np.nan if v is None else v for v in s.entropy_mean], dtype=np.float64)
        logit[r, cols] = np.fmax(logit[r, cols], np.log10(m))
        ent[r, cols] = np.fmin(ent[r, cols], e)
    return steps, logit, ent


def _heatmaps(fig, axes, logit, ent, steps, calls, labels, all_calls, notes, rank, why, ranks, several) -> None:
    """The two step x call heatmaps (largest logit, entropy) on the first two axes."""
    extent = (steps[0] - 0.5, steps[-1] + 0.5, len(calls) - 0.5, -0.5)
    calls_note = f" ({notes[-1]})" if len(all_calls) > len(calls) else ""
    for ax, data, title, cmap in (
        (axes[0], logit, "log10 of the largest logit (max over heads)", "magma"),
        (axes[1], ent, "mean entropy of the sampled rows, nats (min over heads)", "viridis"),
    ):
        im = ax.imshow(data, aspect="auto", interpolation="nearest", extent=extent, cmap=cmap)
        ax.set_yticks(range(len(calls)))
        ax.set_yticklabels(labels, fontsize=7, parse_math=False)
        ax.set_title(
            title + (f" - rank {rank} ({why}) of ranks {', '.join(map(str, ranks))}" if several else "") + calls_note,
            fontsize=9,
        )
        ax.set_xlabel("step")
        fig.colorbar(im, ax=ax)


def _curves(axes, worst, several):
    """The worst heads' largest logit over the steps, on the third axis: (that axis, the curves drawn)."""
    curves = worst[:CURVES_SHOWN]  # the heads table's worst, of every rank
    ax = axes[2]
    for s in curves:
        ys = [v if v is not None and v > 0 else np.nan for v in s.max_logit]
        ax.plot(s.steps, ys, label=plain_text((f"rank {s.rank} " if several else "") + s.label), linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest logit")
    ax.set_title("the worst heads (alert steps marked" + (": of the ranks drawn)" if several else ")"), fontsize=9)
    return ax, curves


def _marks(axes, report: WatchReport, rank, curves) -> None:
    """The alert steps marked on each axis (of the ranks it draws), and whole-number step ticks."""
    from matplotlib.ticker import MaxNLocator  # matplotlib: only when a plot is asked (as in watch_figure)

    drawn = {s.rank for s in curves}
    for axis, of in ((axes[0], {rank}), (axes[1], {rank}), (axes[2], drawn)):
        marks = {
            (a.step, a.severity) for a in report.alerts if a.rank in of and a.what_if is None and a.step is not None
        }
        for step, severity in sorted(marks):
            axis.axvline(step, color="red" if severity == "error" else "orange", linestyle="--", linewidth=0.8)
    for axis in axes:
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
