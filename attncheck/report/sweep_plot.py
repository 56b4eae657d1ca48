"""The sweep's figure (``attncheck sweep --plot``): matplotlib, an optional dependency, imported only when a
plot is asked."""

from __future__ import annotations

import math
import os
from pathlib import Path

from attncheck.errors import AttncheckError, param
from attncheck.numerics.sweep.theory import uniform_limits
from attncheck.params import COLLAPSE_THRESHOLD
from attncheck.report.sweep import _entries, _varying
from attncheck.results.sweep import SweepPoint, SweepResult

PLOT_NEEDS = f"{param('plot')} needs matplotlib: pip install 'attncheck[plot]'"


def require_matplotlib() -> None:
    """Raise the one-line install hint when matplotlib is missing (checked before any work)."""
    try:
        import matplotlib  # noqa: F401  (only whether it is installed: an optional dependency)
    except ImportError:
        raise AttncheckError(PLOT_NEEDS) from None


def sweep_figure(result: SweepResult):
    """The sweep as a matplotlib figure. Four panels against d_k, one colour per scale (and
    seq/std when they vary): variance (log-log, measured dots on the dashed theory), max
    probability, normalised entropy and the softmax Jacobian norm (all rows, and the
    collapsed rows alone). Then per dtype two maps over d_k: the share of rows that
    overflowed (exp or row sum, the most of any method) per scale, and log10 of the max
    error against float64 per method and scale."""
    require_matplotlib()
    import matplotlib  # matplotlib: only when a plot is asked (an optional dependency, slow to import)

    matplotlib.use("Agg")
    # optional and slow to import: matplotlib only when a plot is asked
    import matplotlib.pyplot as plt

    seq_many, std_many = _varying(result)
    series: dict[tuple, list[SweepPoint]] = {}
    for p in result.points:
        series.setdefault((p.scale, p.seq, p.std), []).append(p)
    dtypes = list(result.config.dtypes)

    fig = plt.figure(figsize=(12, 8 + 3.2 * len(dtypes)), layout="constrained")
    grid = fig.add_gridspec(2 + len(dtypes), 2, height_ratios=[1, 1] + [0.8] * len(dtypes))
    handles, labels = _panels(fig, grid, result, series, seq_many, std_many)
    _maps(fig, grid, result, series, dtypes, labels)
    fig.legend(handles=handles, loc="outside right center", title="scale", fontsize=8)
    fig.suptitle(f"attncheck sweep: {_entries(result)}; {result.config.rows} rows", fontsize=10)
    return fig


def _panels(fig, grid, result: SweepResult, series, seq_many: bool, std_many: bool):
    """The four panels against d_k (variance with its theory, max probability, entropy, Jacobian norm), one
    colour per series: (the legend's handles, the series' labels)."""
    from matplotlib.lines import Line2D  # matplotlib: only when a plot is asked (as in sweep_figure)

    ax_var, ax_p, ax_h, ax_j = (fig.add_subplot(grid[i // 2, i % 2]) for i in range(4))
    handles = []
    labels = []
    for (scale, seq, std), pts in series.items():
        pts = sorted(pts, key=lambda p: p.dk)
        dks = [p.dk for p in pts]
        label = scale + (f" seq {seq}" if seq_many else "") + (f" std {std:g}" if std_many else "")
        labels.append(label)
        line = ax_var.plot(dks, [p.var_scaled for p in pts], "o", label=label)[0]
        colour = line.get_color()
        handles.append(Line2D([], [], color=colour, marker="o", label=label))
        ax_var.plot(dks, [p.var_scaled_theory for p in pts], "--", color=colour)
        ax_p.plot(dks, [p.max_prob_mean for p in pts], "o-", color=colour)
        ax_h.plot(dks, [p.entropy_norm_mean for p in pts], "o-", color=colour)
        ax_j.plot(dks, [p.jacobian_norm_mean for p in pts], "o-", color=colour)
        coll = [(p.dk, p.jacobian_norm_collapsed_mean) for p in pts if p.jacobian_norm_collapsed_mean is not None]
        if coll:
            ax_j.plot(*zip(*coll), "x:", color=colour)
    ax_var.set(xscale="log", yscale="log", title="Var(factor * q.k): measured (dots), theory (dashed)", xlabel="d_k")
    ax_p.set(xscale="log", yscale="log", title="mean max probability (1 = one-hot)", xlabel="d_k")
    ax_h.set(xscale="log", title="mean entropy / log(seq) (1 = uniform, 0 = one-hot)", xlabel="d_k", ylim=(0, 1.02))
    ax_j.set(xscale="log", title="mean ||diag(p) - p p^T||_F (0 = no gradient)", xlabel="d_k", ylim=(0, None))
    if len(result.config.seqs) == 1:
        u_p, u_j = uniform_limits(result.config.seqs[0])
        ax_p.axhline(u_p, color="grey", lw=0.8, ls=":")
        ax_j.axhline(u_j, color="grey", lw=0.8, ls=":")
        handles.append(Line2D([], [], color="grey", lw=0.8, ls=":", label="uniform softmax"))
    handles.append(
        Line2D(
            [], [], color="black", marker="x", ls=":", label=f"|J| of collapsed rows\n(max p >= {COLLAPSE_THRESHOLD:g})"
        )
    )
    for ax in (ax_var, ax_p, ax_h, ax_j):
        ax.set_xticks(list(result.config.dks), [str(d) for d in result.config.dks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    return handles, labels


def _maps(fig, grid, result: SweepResult, series, dtypes, labels) -> None:
    """Per dtype two maps over d_k: the share of rows that overflowed per series, log10 of the max error per
    method and series."""
    dks = sorted({p.dk for p in result.points})
    keys = list(series)
    by_point = {(p.scale, p.seq, p.std, p.dk): p for p in result.points}
    methods = list(result.config.methods)
    for row, dtype in enumerate(dtypes, start=2):
        ax_o, ax_e = fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])
        over = [[_map_value(by_point.get((*key, dk)), dtype, methods, "overflow") for dk in dks] for key in keys]
        err = [
            [_map_value(by_point.get((*key, dk)), dtype, [m], "error") for dk in dks] for m in methods for key in keys
        ]
        _heatmap(
            fig,
            ax_o,
            over,
            dks,
            labels,
            f"{dtype}: share of rows that overflow (any method)",
            "share of rows",
            vmin=0.0,
            vmax=1.0,
        )
        _heatmap(
            fig,
            ax_e,
            err,
            dks,
            [f"{m} {label}" for m in methods for label in labels],
            f"{dtype}: log10 max |p - p_float64|",
            "log10 error",
        )


def _map_value(p: SweepPoint | None, dtype: str, methods: list[str], what: str) -> float:
    """One square of a map: the most overflowed share of rows of ``methods``, or log10 of the
    method's max error (NaN where nothing was measured)."""
    cells = [c for c in (p.cells if p is not None else []) if c.dtype == dtype and c.method in methods]
    if what == "overflow":
        return max((c.overflow_rate for c in cells), default=math.nan)
    errs = [c.max_abs_err for c in cells if c.max_abs_err is not None]
    return math.log10(max(max(errs), 1e-300)) if errs else math.nan


def _heatmap(
    fig, ax, values: list[list[float]], dks: list[int], rows: list[str], title: str, label: str, **scale
) -> None:
    image = ax.imshow(
        values, aspect="auto", interpolation="nearest", cmap="magma_r" if "vmax" in scale else "viridis", **scale
    )
    ax.set_xticks(range(len(dks)), [str(d) for d in dks])
    ax.set_yticks(range(len(rows)), rows, fontsize=7 if len(rows) > 8 else 9)
    ax.set(title=title, xlabel="d_k")
    fig.colorbar(image, ax=ax, label=label)


def check_plot_path(path: str | Path) -> None:
    """Refuse, before the sweep runs, a picture matplotlib cannot write: a suffix that names no
    format it has (p.txt, p.json), or something that is not a file (a FIFO: savefig needs to seek)."""
    from matplotlib.backend_bases import FigureCanvasBase  # matplotlib: only when a plot is asked

    target = Path(path)
    suffix = target.suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise AttncheckError(
            f"cannot write {param('plot')} {path}: matplotlib writes no '.{suffix}' pictures "
            f"(give .png, .svg or .pdf; no suffix writes PNG)"
        )
    if target.exists() and not target.is_file() and str(target) != os.devnull:
        raise AttncheckError(f"cannot write {param('plot')} {path}: not a regular file; give a file name")


def plot_sweep(result: SweepResult, path: str | Path) -> None:
    """Write ``sweep_figure`` to ``path`` (PNG unless the suffix names another format)."""
    fig = sweep_figure(result)
    import matplotlib.pyplot as plt  # matplotlib: only when a plot is asked (an optional dependency, slow to import)

    target = Path(path)
    try:
        fig.savefig(target, dpi=110, format=None if target.suffix else "png")
    except (OSError, ValueError) as e:
        raise AttncheckError(f"cannot write {param('plot')} {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)
