"""Sweep results -> Rich tables, JSON and a plot. Formatting only: every number comes from ``numerics.sweep``."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck import __version__
from attncheck.format import fmt, pct, plain, to_jsonable
from attncheck.numerics.sweep.theory import uniform_limits
from attncheck.params import COLLAPSE_THRESHOLD, SCALE_MEANINGS
from attncheck.results.sweep import PresetGrid, PresetResult, SweepCell, SweepOutput, SweepPoint, SweepResult

JSON_SCHEMA = "attncheck.sweep/1"
FAIL_STYLE = "bold red"


TITLES = {
    "variance": "1. Var(q.k) grows as d_k",
    "scaling": "2. Effect of the scaling factor on x = factor * q.k",
    "overflow": "3. Naive softmax exp(x) / sum(exp(x)): rows with an exp overflow",
    "error": "4. Max |p - p_float64| by dtype and method; columns: d_k",
    "output": "5. Output O = P@V: RMSE against float64 by dtype and attention path; columns: d_k",
}


def _table() -> Table:
    # Titles are printed above the table, not inside it: a narrow table would wrap them.
    return Table(
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )


def _varying(result: SweepResult) -> tuple[bool, bool]:
    """Whether the grid has more than one seq / std: only then do tables name them."""
    return len(result.config.seqs) > 1, len(result.config.stds) > 1


def _series_cells(p: SweepPoint, seq: bool, std: bool) -> list[str]:
    """The seq and std of a point, in one column when both vary (keeps tables within 80 columns)."""
    parts = ([str(p.seq)] if seq else []) + ([fmt(p.std, ".3g")] if std else [])
    return [" ".join(parts)] if parts else []


def _series_columns(t: Table, seq: bool, std: bool) -> None:
    header = " ".join((["seq"] if seq else []) + (["std"] if std else []))
    if header:
        t.add_column(header, justify="right", no_wrap=True)


def _distinct(points: Iterable[SweepPoint], key: Callable[[SweepPoint], Any]) -> list[SweepPoint]:
    seen, out = set(), []
    for p in points:
        if key(p) not in seen:
            seen.add(key(p))
            out.append(p)
    return out


def _entries(result: SweepResult) -> str:
    c = result.config
    stds = ", ".join(fmt(s, ".3g") for s in c.stds)
    if c.dist == "outliers":
        return f"entries of q, k: std {stds} x (N(0,1) + N(0,100) on a 0.1% mask)"
    return f"entries of q, k: N(0, std^2), std {stds}"


def _note(text: str) -> Text:
    return Text(text, style="italic")


# --------------------------------------------------------------------------- tables


def variance_table(result: SweepResult) -> Table:
    seq, std = _varying(result)
    t = _table()
    _series_columns(t, seq, std)
    t.add_column("d_k", justify="right")
    t.add_column("Var(q.k)", justify="right")
    t.add_column("theory", justify="right")
    t.add_column("measured/theory", justify="right")
    t.add_column("z", justify="right")
    for p in _distinct(result.points, lambda p: (p.seq, p.std, p.dk)):
        z = (p.var_qk - p.var_qk_theory) / p.var_qk_stderr
        t.add_row(
            *_series_cells(p, seq, std),
            str(p.dk),
            fmt(p.var_qk, ".4g"),
            fmt(p.var_qk_theory, ".4g"),
            fmt(p.var_qk / p.var_qk_theory, ".4f"),
            Text(f"{z:+.1f}", style="" if abs(z) < 3 else "yellow"),
        )
    return t


def variance_note(result: SweepResult) -> Text:
    c = result.config
    return _note(
        f"{_entries(result)}; {c.rows} rows x {', '.join(map(str, c.seqs))} keys. "
        "Theory: Var(q.k) = d_k E[q^2] E[k^2]. z = (measured - theory) / standard error of the "
        "estimate; |z| < 3 means the measurement agrees with the theory."
    )


def scaling_table(result: SweepResult) -> Table:
    seq, std = _varying(result)
    t = _table()
    _series_columns(t, seq, std)
    t.add_column("d_k", justify="right")
    t.add_column("scale")
    t.add_column("Var(x)", justify="right")
    t.add_column("theory", justify="right")
    t.add_column("max p", justify="right")
    t.add_column("H/lnS", justify="right")
    t.add_column("|J|", justify="right")
    t.add_column("collapsed", justify="right")
    t.add_column("|J| coll.", justify="right")
    points = result.points
    for i, p in enumerate(points):
        last = i + 1 == len(points) or (points[i + 1].seq, points[i + 1].std, points[i + 1].dk) != (p.seq, p.std, p.dk)
        t.add_row(
            *_series_cells(p, seq, std),
            str(p.dk),
            p.scale,
            plain(p.var_scaled),
            plain(p.var_scaled_theory),
            fmt(p.max_prob_mean, ".3f"),
            fmt(p.entropy_norm_mean, ".3f"),
            fmt(p.jacobian_norm_mean, ".3f"),
            pct(p.collapsed_rate),
            fmt(p.jacobian_norm_collapsed_mean, ".3f"),
            end_section=last and i + 1 < len(points),
        )
    return t


def scaling_note(result: SweepResult) -> Text:
    seqs = result.config.seqs
    if len(seqs) == 1:
        u_p, u_j = uniform_limits(seqs[0])
        uniform = f"a uniform row over {seqs[0]} keys has max p {u_p:.3g} and |J| {u_j:.3g}"
    else:
        uniform = "a uniform row has max p = 1/seq"
    return _note(
        "Var(x) theory = factor^2 Var(q.k): 1 for sqrt, 1/d_k for dk, 1/d_k^3 for dk2. "
        "max p: mean largest probability; H/lnS: mean entropy / log(seq), 1 = uniform, 0 = one-hot; "
        "|J|: mean Frobenius norm of the softmax Jacobian diag(p) - p p^T, the size of the gradient "
        f"through the softmax ({uniform}). collapsed: rows with max p >= {COLLAPSE_THRESHOLD:g}, attention on one key; "
        "|J| coll.: their mean |J|, near 0: no gradient flows back through them. A row split over two "
        "or three keys has a larger |J| than a spread-out one, so the mean |J| of unscaled logits falls "
        "below the sqrt-scaled one only once most rows have collapsed."
    )


def _by_key(result: SweepResult) -> dict[tuple, SweepPoint]:
    """Points keyed by (seq, std, scale, d_k)."""
    return {(p.seq, p.std, p.scale, p.dk): p for p in result.points}


def _cell(p: SweepPoint | None, method: str, dtype: str) -> SweepCell | None:
    if p is None:
        return None
    for c in p.cells:
        if c.method == method and c.dtype == dtype:
            return c
    return None


def _sections(result: SweepResult) -> list[SweepPoint]:
    """First point of every (seq, std, scale) series, in grid order."""
    return _distinct(result.points, lambda p: (p.seq, p.std, p.scale))


def _predicted(x: float | None) -> str:
    """Predictions below one row in a million read '~0': 1e-29 and 0 say the same thing."""
    return "~0" if x is not None and x < 1e-6 else pct(x)


def overflow_table(result: SweepResult) -> Table | None:
    """Naive softmax: share of rows with an exp overflow, measured and predicted, per scale x d_k x dtype."""
    if "naive" not in result.config.methods:
        return None
    seq, std = _varying(result)
    points = _by_key(result)
    t = _table()
    _series_columns(t, seq, std)
    t.add_column("scale")
    t.add_column("d_k", justify="right")
    for dtype in result.config.dtypes:
        t.add_column(dtype, justify="right", no_wrap=True)
        t.add_column("(pred.)", justify="right", no_wrap=True)
    sections = _sections(result)
    for i, first in enumerate(sections):
        for j, dk in enumerate(result.config.dks):
            p = points.get((first.seq, first.std, first.scale, dk))
            row: list[Any] = [*(_series_cells(first, seq, std) if j == 0 else [""] * bool(seq or std))]
            row += [first.scale if j == 0 else "", str(dk)]
            for dtype in result.config.dtypes:
                c = _cell(p, "naive", dtype)
                if c is None:
                    row += ["-", "-"]
                    continue
                row.append(Text(pct(c.exp_overflow_rate), style=FAIL_STYLE if c.exp_overflow_rate else ""))
                row.append(f"({_predicted(c.exp_overflow_rate_theory)})")
            t.add_row(*row, end_section=j + 1 == len(result.config.dks) and i + 1 < len(sections))
    return t


def overflow_note(result: SweepResult) -> Text:
    points = ", ".join(f"{d} {result.limits[d].exp_overflow:.2f}" for d in result.config.dtypes)
    return _note(
        "Share of rows where exp of some logit is inf in the dtype (each such row is NaN: inf/inf), measured, and "
        "in brackets the Gaussian-tail prediction (~0: below one row in a million): P(some x_j exceeds the dtype's "
        f"exp overflow point: {points}), x_j ~ N(0, factor^2 |q|^2 E[k^2]) given q, averaged over |q|."
        + (
            " With --dist outliers the logits are heavy-tailed and this Gaussian approximation "
            "underestimates the overflows."
            if result.config.dist == "outliers"
            else ""
        )
    )


def _short_pct(x: float) -> str:
    """0.4265 -> '43%', 0.00684 -> '0.68%': two digits keep the error map narrow."""
    v = 100 * x
    if v < 0.01:
        return "<0.01%"
    return f"{v:.0f}%" if v >= 9.5 else f"{v:.2g}%"


def _error_text(c: SweepCell) -> Text:
    if c.overflow_rate:
        return Text(f"ovf {_short_pct(c.overflow_rate)}", style=FAIL_STYLE)
    if c.nan_rate:
        return Text(f"NaN {_short_pct(c.nan_rate)}", style=FAIL_STYLE)
    return Text(fmt(c.max_abs_err, ".1e"))


def error_table(result: SweepResult) -> Table:
    """Max abs error against float64 per scale x dtype x method, one column per d_k."""

    def text(p, dtype: str, method: str) -> Text | None:
        c = _cell(p, method, dtype)
        return None if c is None else _error_text(c)

    return _dk_grid(result, result.config.methods, text)


def _dk_grid(result: SweepResult, kinds, text) -> Table:
    """One row per scale x dtype x kind (a method or a path), one column per d_k; ``text(point,
    dtype, kind)`` gives a cell, None for '-'."""
    seq, std = _varying(result)
    points = _by_key(result)
    t = _table()
    _series_columns(t, seq, std)
    t.add_column("scale")
    t.add_column("cell")
    for dk in result.config.dks:
        t.add_column(str(dk), justify="right", no_wrap=True)
    dtypes = result.config.dtypes
    sections = _sections(result)
    for i, first in enumerate(sections):
        for j, dtype in enumerate(dtypes):
            for k, kind in enumerate(kinds):
                head = j == 0 and k == 0
                row: list[Any] = [*(_series_cells(first, seq, std) if head else [""] * bool(seq or std))]
                row += [first.scale if head else "", f"{dtype} {kind}"]
                for dk in result.config.dks:
                    p = points.get((first.seq, first.std, first.scale, dk))
                    cell = None if p is None else text(p, dtype, kind)
                    row.append("-" if cell is None else cell)
                last = j + 1 == len(dtypes) and k + 1 == len(kinds)
                t.add_row(*row, end_section=last and i + 1 < len(sections))
    return t


def error_note(result: SweepResult) -> Text:
    return _note(
        "Error against the float64 softmax of the logits, over the rows that came out finite. "
        "ovf: rows where an exp or the row sum overflowed (NaN or all-zero output, as `attncheck run` "
        "counts them); NaN: rows with a NaN probability."
    )


def output_table(result: SweepResult) -> Table | None:
    """RMSE of O = P@V against float64 per scale x dtype x path, one column per d_k."""
    if not result.config.paths:
        return None

    def text(p, dtype: str, path: str) -> Text | None:
        o = next((o for o in p.outputs if o.path == path and o.dtype == dtype), None)
        return None if o is None else _output_text(o)

    return _dk_grid(result, result.config.paths, text)


def _output_text(o: SweepOutput) -> Text:
    if o.nan_rate:
        return Text(f"NaN {_short_pct(o.nan_rate)}", style=FAIL_STYLE)
    return Text(fmt(o.rmse, ".1e"))


def output_note(result: SweepResult) -> Text:
    rows = next((o.rows for p in result.points for o in p.outputs), 0)
    return _note(
        "V drawn like q and k; each path computes O from q, k, v in the dtype (eager: torch.softmax on the dtype's "
        "scores; sdpa-math: PyTorch's math backend; flash: FlashAttention-2's recurrence, key blocks of --block), "
        f"against float64 softmax(scale q.k) @ v, over the first {rows} rows of each point (whole heads). NaN: rows "
        "of O holding NaN."
    )


def render_sweep(result: SweepResult) -> Group:
    sections = [
        ("variance", variance_table(result), variance_note(result)),
        ("scaling", scaling_table(result), scaling_note(result)),
        ("overflow", overflow_table(result), overflow_note(result)),
        ("error", error_table(result), error_note(result)),
        ("output", output_table(result), output_note(result)),
    ]
    parts: list[Any] = []
    for key, table, note in sections:
        if table is None:
            continue
        if parts:
            parts.append(Text())
        parts += [Text(TITLES[key], style="bold"), table, note]
    return Group(*parts)


def print_sweep(console: Console, result: SweepResult) -> None:
    console.print(render_sweep(result))
    console.print()
    c = result.config
    line = (
        f"{len(result.points)} grid points x {len(c.dtypes)} dtypes x {len(c.methods)} methods "
        f"on {result.device}, {c.rows} rows each, seed {c.seed}"
    )
    if result.seconds:
        line += f", {result.seconds:.1f} s"
    console.print(Text(line, style="dim"))


# --------------------------------------------------------------------------- JSON


def sweep_json(result: SweepResult) -> dict[str, Any]:
    c = result.config
    return {
        "schema": JSON_SCHEMA,
        "attncheck_version": __version__,
        "device": result.device,
        "options": {
            "dk": list(c.dks),
            "scale": [s.name for s in c.scales],
            "scale_meaning": {s.name: SCALE_MEANINGS.get(s.name, s.name) for s in c.scales},
            "dtype": list(c.dtypes),
            "method": list(c.methods),
            "seq": list(c.seqs),
            "std": list(c.stds),
            "rows": c.rows,
            "dist": c.dist,
            "seed": c.seed,
            "block": c.block,
            "path": list(c.paths),
        },
        "points": [to_jsonable(p) for p in result.points],
    }


# --------------------------------------------------------------------------- presets


def preset_table(result: PresetResult) -> Table:
    t = _table()
    for name in ("published figure", "attncheck cell", "paper", "attncheck"):
        t.add_column(name, justify="left" if name in ("published figure", "attncheck cell") else "right")
    for r in result.rows:
        t.add_row(r.label, r.cell, fmt(r.paper, ".2e"), fmt(r.measured, ".2e"))
    return t


def grid_table(grid: PresetGrid) -> Table:
    t = _table()
    for name in grid.columns:
        t.add_column(name, justify="right")
    for row in grid.rows:
        t.add_row(*(v if isinstance(v, str) else fmt(v, ".3g") for v in row))
    return t


def render_preset(result: PresetResult) -> Group:
    checks = Table.grid(padding=(0, 2))
    for c in result.checks:
        checks.add_row(
            Text("ok" if c.holds else "OFF", style="green" if c.holds else FAIL_STYLE),
            c.claim,
            f"{fmt(c.value, '.3g')} (range {c.low:g} to {c.high:g})",
        )
    parts: list[Any] = [Text(f"{result.source}: {result.metric}", style="bold")]
    if result.rows:
        parts.append(preset_table(result))
    for grid in result.grids:
        parts += [Text(grid.title), grid_table(grid)]
    parts += [checks, _note(f"Setup: {result.setup}.")]
    parts += [_note(n) for n in result.notes]
    return Group(*parts)


def print_preset(console: Console, result: PresetResult) -> None:
    console.print(render_preset(result))
    console.print(Text(f"preset {result.name}, {result.seconds:.1f} s", style="dim"))


def preset_json(result: PresetResult, device: str) -> dict[str, Any]:
    doc = to_jsonable(result)
    doc.pop("seconds", None)
    for c, j in zip(result.checks, doc["checks"]):
        j["holds"] = c.holds
    return {"schema": JSON_SCHEMA, "attncheck_version": __version__, "device": device, "preset": doc}


# --------------------------------------------------------------------------- plot
