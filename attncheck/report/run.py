"""``attncheck run`` results -> Rich tables and JSON. Formatting only: every number comes from ``numerics``."""

from __future__ import annotations

from typing import Any, Sequence

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from attncheck import __version__
from attncheck.params import MASK_SENTINEL_LIMIT
from attncheck.format import fmt, rows_text, to_jsonable
from attncheck.results import Cell, TensorDiagnosis

JSON_SCHEMA = "attncheck.run/2"  # /2 added the model section; every /1 key is kept

VERDICT_STYLE = {"nan": "bold red", "overflow": "bold red", "zero": "red", "flip": "yellow", "ok": "green"}
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


# --------------------------------------------------------------------------- tables


def census_panel(d: TensorDiagnosis) -> Panel:
    c = d.census
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("shape", f"{c.shape}  ({c.rows} rows x {c.keys} keys, softmax over the last axis)")
    t.add_row("finite values", f"min {fmt(c.min)}  max {fmt(c.max)}  mean {fmt(c.mean)}  std {fmt(c.std)}")
    specials = Text(f"NaN {c.nan}  +inf {c.posinf}  -inf {c.neginf}")
    if c.nan or c.posinf:
        specials.stylize("bold red")
    t.add_row("non-finite", specials)
    sentinels = ", ".join(f"{v:.4g} ({n} rows)" for v, n in c.sentinels)
    t.add_row("masked", f"{c.masked} positions (-inf or <= {MASK_SENTINEL_LIMIT:.0e})".replace("e+0", "e") + (f"; mask values {sentinels}" if sentinels else ""))
    fm = Text(f"{c.fully_masked_rows} rows ({c.neginf_rows} all -inf)")
    if c.fully_masked_rows:
        fm.stylize("yellow")
    t.add_row("fully masked", fm)
    return Panel(t, title=f"[bold]{d.name}[/]  {d.dtype}", title_align="left")


def headroom_table(d: TensorDiagnosis) -> Table:
    t = Table(title="Headroom per dtype (scores as given)", title_justify="left")
    t.add_column("dtype")
    t.add_column("exp overflows above", justify="right")
    t.add_column("headroom", justify="right")
    t.add_column("rows over (naive)", justify="right")
    t.add_column("exp underflows below", justify="right")
    t.add_column("rows all below", justify="right")
    t.add_column("rows spread past it", justify="right")
    t.add_column("cast -> +-inf", justify="right")
    for h in d.census.headroom:
        head = Text(fmt(h.headroom, ".4g"), style="red" if h.headroom is not None and h.headroom < 0 else "")
        cast = Text(f"{h.cast_posinf_values} / {h.cast_neginf_values}", style="red" if h.cast_posinf_values or h.cast_neginf_values else "")
        t.add_row(
            h.dtype,
            fmt(h.exp_overflow_threshold, ".4g"),
            head,
            str(h.rows_over_exp_threshold),
            fmt(h.exp_underflow_threshold, ".4g"),
            str(h.rows_all_underflow),
            str(h.rows_spread_beyond_underflow),
            cast,
        )
    return t


def attention_table(d: TensorDiagnosis) -> Group:
    """The Q/K -> scores pipeline per dtype, and the scale facts."""
    a = d.attention
    t = Table(title="Q/K pipeline per dtype (scores as the model computes them)", title_justify="left")
    for name in ("dtype", "Q@K^T -> inf", "rows", "max |score|", "mask value", "mask -> -inf", "add overflow", "planes overflow", "rows broken by mask"):
        t.add_column(name, justify="left" if name == "dtype" else "right")
    for dt, x in a.dtypes.items():
        bad = "red"
        t.add_row(
            dt,
            Text(str(x.qk_overflow_values), style=bad if x.qk_overflow_values else ""),
            str(x.qk_overflow_rows),
            fmt(x.qk_max_abs, ".4g"),
            fmt(x.sentinel_value, ".4g") if x.sentinel_value else "-",
            Text(str(x.mask_not_representable + (1 if x.sentinel_not_representable else 0)), style=bad if x.mask_not_representable or x.sentinel_not_representable else ""),
            Text(str(x.overflow_on_add), style=bad if x.overflow_on_add else ""),
            Text(str(x.summed_planes_overflow), style=bad if x.summed_planes_overflow else ""),
            Text(str(x.mask_sentinel_rows), style=bad if x.mask_sentinel_rows else ""),
        )
    fitted = "" if a.fitted_scale is None else f"; fitted scale of the given scores {a.fitted_scale:.4g}"
    line = Text(
        f"d {a.d}, {a.heads} query heads / {a.kv_heads} kv heads, scale {a.scale:.4g} ({a.scale_name}) applied to the {a.scale_order}; "
        f"max|q| {a.q_max_abs:.4g}, max|k| {a.k_max_abs:.4g}, max|q.k| {a.raw_max_abs:.4g}; spread of q {a.q_std:.3g}, k {a.k_std:.3g}, "
        f"scaled scores {fmt(a.scores_std)}; masked keys {a.masked_keys}, float64 mass on masked keys up to {a.leak_max:.3g}{fitted}"
    )
    return Group(t, line)


def _cell_summary(c: Cell) -> Text:
    v = c.verdict
    if v == "nan":
        causes = ", ".join(f"{k} {n}" for k, n in sorted(c.nan_causes.items(), key=lambda kv: -kv[1]))
        s = f"NaN {c.nan_rows} rows\n({causes})"
    elif v == "overflow":
        s = f"overflow {c.overflow_rows} rows"
    elif v == "zero":
        s = f"all-zero {c.zero_rows} rows"
    elif v == "flip":
        s = f"top-1 flips {c.argmax_flips}\nerr {fmt(c.max_abs_err)}"
    else:
        s = f"ok  err {fmt(c.max_abs_err)}"
        if c.zero_rows:
            s += f"\n(masked rows -> 0: {c.zero_rows})"
    return Text(s, style=VERDICT_STYLE[v])


def matrix_table(d: TensorDiagnosis) -> Table:
    dtypes = list(d.options.dtypes)
    methods = list(d.options.methods)
    t = Table(title="Method x dtype (max |p - p_float64|)", title_justify="left", show_lines=True)
    t.add_column("method", style="bold")
    for dt in dtypes:
        t.add_column(dt)
    for m in methods:
        t.add_row(m, *(_cell_summary(d.cell(m, dt)) for dt in dtypes))
    return t


def detail_table(d: TensorDiagnosis) -> Table:
    t = Table(
        title="Cells in detail: errors against float64 over rows where both are finite; "
        "'algo' against float64 of the scores after the cast to the cell's dtype",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    # RMSE and KL mean are in the JSON report; the table keeps to 80 columns.
    for name in ("cell", "NaN/ovf/0", "max err", "algo", "|sum-1|", "KL max", "flush", "flips"):
        t.add_column(name, justify="left" if name == "cell" else "right", no_wrap=True)
    for c in d.cells:
        t.add_row(
            Text(c.name, style=VERDICT_STYLE[c.verdict]),
            f"{c.nan_rows}/{c.overflow_rows}/{c.zero_rows}",
            fmt(c.max_abs_err, ".1e"),
            fmt(c.max_abs_err_algo, ".1e"),
            fmt(c.max_row_sum_err, ".1e"),
            fmt(c.kl_max, ".1e"),
            "-" if c.flushed_frac is None else f"{c.flushed_frac:.1%}",
            str(c.argmax_flips),
        )
    return t


def distribution_line(d: TensorDiagnosis) -> Text:
    s = d.distribution
    if not s.rows:
        return Text("Reference distribution: no row has a defined softmax", style="yellow")
    frac = "-" if s.collapsed_frac is None else f"{s.collapsed_frac:.1%}"
    return Text(
        f"Reference distribution over {s.rows} rows: entropy mean {fmt(s.entropy_mean)} nats "
        f"(min {fmt(s.entropy_min)}, max {fmt(s.entropy_max)}; normalised {fmt(s.entropy_norm_mean)}), "
        f"max prob mean {fmt(s.max_prob_mean)}, rows with max prob >= {s.collapse_threshold:g}: {s.collapsed_rows} ({frac}), "
        f"softmax Jacobian norm mean {fmt(s.jacobian_norm_mean)}"
    )


def nan_by_head_line(d: TensorDiagnosis) -> Text | None:
    """Where the NaN rows sit, per index of the leading axes (e.g. (batch, head))."""
    parts = []
    for c in d.cells:
        if c.nan_rows_by_head:
            where = ", ".join(f"({','.join(map(str, i))}) {n}" for i, n in c.nan_rows_by_head[:3])
            parts.append(f"{c.name}: {where}")
    if not parts:
        return None
    axes = "x".join(str(n) for n in d.shape[:-2])
    return Text(f"NaN rows by leading index ({axes}, most first): " + "; ".join(parts), style="red")


def findings_table(d: TensorDiagnosis) -> Table | Text:
    if not d.findings:
        return Text("No findings: every cell is finite and close to the float64 reference.", style="green")
    t = Table(title="Findings", title_justify="left", show_lines=True)
    t.add_column("severity")
    t.add_column("code", style="bold")
    t.add_column("what happened", ratio=3)
    t.add_column("fix", ratio=2)
    for f in d.findings:
        what = f.message + (f"\nrows e.g. {rows_text(f.examples)}" if f.examples else "")
        t.add_row(Text(f.severity, style=SEVERITY_STYLE[f.severity]), f.code, what, f.fix)
    return t


def render_diagnosis(d: TensorDiagnosis, verbose: bool = True) -> Group:
    parts: list[Any] = [census_panel(d)]
    if d.attention is not None:
        parts.append(attention_table(d))
    parts += [headroom_table(d), matrix_table(d)]
    if verbose:
        parts.append(detail_table(d))
    where = nan_by_head_line(d)
    parts += [distribution_line(d)] + ([where] if where is not None else []) + [findings_table(d)]
    return Group(*parts)


def print_report(console: Console, diags: Sequence[TensorDiagnosis], device: str, verbose: bool = True) -> None:
    for d in diags:
        console.print(render_diagnosis(d, verbose=verbose))
        console.print()
    errors = sum(f.severity == "error" for d in diags for f in d.findings)
    warnings = sum(f.severity == "warning" for d in diags for f in d.findings)
    style = "bold red" if errors else ("yellow" if warnings else "green")
    console.print(Text(f"{len(diags)} tensor(s) on {device}: {errors} error(s), {warnings} warning(s)", style=style))


# --------------------------------------------------------------------------- JSON


def diagnosis_json(d: TensorDiagnosis) -> dict[str, Any]:
    cells = []
    for c in d.cells:
        cell = to_jsonable(c)
        cell["name"] = c.name
        cell["verdict"] = c.verdict
        cells.append(cell)
    census = to_jsonable(d.census)
    census["sentinels"] = [{"value": v, "rows": n} for v, n in d.census.sentinels]
    return {
        "name": d.name,
        "shape": list(d.shape),
        "dtype": d.dtype,
        "census": census,
        "distribution": to_jsonable(d.distribution),
        "cells": cells,
        "findings": to_jsonable(d.findings),
        "attention": None if d.attention is None else to_jsonable(d.attention),
    }


def run_json(diags: Sequence[TensorDiagnosis], device: str, failed: Sequence[str] = (), model=None, calls=()) -> dict[str, Any]:
    """The run's JSON: every tensor's diagnosis and, for files, the ``model`` section (one entry
    per call, the first that goes wrong, outlier heads)."""
    from attncheck.report.model import model_json

    opts = diags[0].options if diags else None
    return {
        "schema": JSON_SCHEMA,
        "attncheck_version": __version__,
        "device": device,
        "options": None if opts is None else to_jsonable(opts),
        "tensors": [diagnosis_json(d) for d in diags],
        "failed": list(failed),
        "model": None if model is None else model_json(model, list(calls)),
    }
