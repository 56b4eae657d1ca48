"""``attncheck run`` results -> Rich tables and JSON. Formatting only: every number comes from ``numerics``."""

from __future__ import annotations

from typing import Any, Sequence

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from attncheck.codes import doc_link
from attncheck.format import cosine, fmt, index_text, to_jsonable, visible
from attncheck.params import MASK_SENTINEL_LIMIT
from attncheck.report.bounded import census_note, census_scope, sampling_json, sampling_section
from attncheck.report.diagnostics import findings_block
from attncheck.report.fit import Fitted, fit_table, fitted, narrow_table
from attncheck.report.lowsum import lowsum_table
from attncheck.results import Cell, TensorDiagnosis

# /2 added the model section; /3: a captured call's tensor holds its model cell, what-ifs apart; every /2 key is kept
JSON_SCHEMA = "attncheck.run/3"

NAN_HEADS_SHOWN = 3  # leading indices with NaN rows named per cell in the table; the JSON has all

VERDICT_STYLE = {"nan": "bold red", "overflow": "bold red", "zero": "red", "flip": "yellow", "ok": "green"}


# --------------------------------------------------------------------------- tables


def census_panel(d: TensorDiagnosis) -> Panel:
    c = d.census
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    for row in [("shape", f"{c.shape}  ({c.rows} rows x {c.keys} keys, softmax over the last axis)"), *census_note(d)]:
        t.add_row(*row)  # census_note: under --budget/--rows, the figures are of the rows computed
    t.add_row("finite values", f"min {fmt(c.min)}  max {fmt(c.max)}  mean {fmt(c.mean)}  std {fmt(c.std)}")
    specials = Text(f"NaN {c.nan}  +inf {c.posinf}  -inf {c.neginf}")
    if c.nan or c.posinf:
        specials.stylize("bold red")
    t.add_row("non-finite", specials)
    t.add_row(
        "masked",
        f"{c.masked} positions (-inf or <= {MASK_SENTINEL_LIMIT:.0e})".replace("e+0", "e")
        + (f"; mask values {_sentinels(d)}" if c.sentinels else ""),
    )
    fm = Text(f"{c.fully_masked_rows} rows ({c.neginf_rows} all -inf)")
    if c.fully_masked_rows:
        fm.stylize("yellow")
    t.add_row("fully masked", fm)
    return Panel(t, title=Text.assemble((visible(d.name), "bold"), f"  {d.dtype}"), title_align="left")


def _sentinels(d: TensorDiagnosis) -> str:
    """'-65504 (60 rows; row minima -65504 to -65152)': a mask constant as the mask holds it,
    and the values it became once added to the scores."""
    c = d.census
    spans = c.sentinel_spans or [(v, v) for v, _ in c.sentinels]
    parts = []
    for (v, n), (lo, hi) in zip(c.sentinels, spans):
        span = f"; row minima {lo:.6g} to {hi:.6g}" if lo != hi or lo != v else ""
        parts.append(f"{v:.6g} ({n} rows{span})")
    return ", ".join(parts)


def full_width(console: Console, table: Table, width: int) -> int:
    """The width ``table`` takes with every cell on its own lines, unwrapped."""
    return Measurement.get(console, console.options.update_width(10 * width), table).maximum


def compact_table(title: str) -> Table:
    """A table that fits 80 columns: header lines, no side borders, one space between columns."""
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True
    )


def number_column(t: Table, header: str) -> None:
    """Numbers never wrap or shrink: their headers come in short lines so that the table fits."""
    t.add_column(header, justify="right", no_wrap=True)


def headroom_table(d: TensorDiagnosis) -> Table:
    t = compact_table("Headroom per dtype (scores as each dtype holds them)")
    t.add_column("dtype", no_wrap=True)
    for header in (
        "exp = inf\nabove",
        "headroom",
        "rows\nover\n(naive)",
        "exp = 0\nbelow",
        "rows all\nbelow",
        "rows\nspread\npast it",
        "cast to\n+/-inf",
    ):
        number_column(t, header)
    for h in d.census.headroom:
        head = Text(fmt(h.headroom, ".4g"), style="red" if h.headroom is not None and h.headroom < 0 else "")
        cast = Text(
            f"{h.cast_posinf_values}/{h.cast_neginf_values}",
            style="red" if h.cast_posinf_values or h.cast_neginf_values else "",
        )
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
    t = compact_table("Q/K pipeline per dtype (scores as the model computes them)")
    t.add_column("dtype", no_wrap=True)
    for name in ("Q@K^T\n-> inf", "rows", "max\n|score|"):
        number_column(t, name)
    t.add_column("mask\nvalue", justify="right")  # one or two values: wraps between them
    for name in ("mask\n-> -inf", "add\noverflow", "planes\noverflow", "rows\nbroken\nby mask"):
        number_column(t, name)
    for dt, x in a.dtypes.items():
        if x.fp8_scaling is not None:  # FP8 dtypes: no eager scores; their quantisation is under the P cast table
            continue
        bad = "red"
        t.add_row(
            dt,
            Text(str(x.qk_overflow_values), style=bad if x.qk_overflow_values else ""),
            str(x.qk_overflow_rows),
            fmt(x.qk_max_abs, ".4g"),
            ", ".join(fmt(v, ".6g") for v in x.mask_values) or "-",
            Text(
                str(x.mask_not_representable + (1 if x.sentinel_not_representable else 0)),
                style=bad if x.mask_not_representable or x.sentinel_not_representable else "",
            ),
            Text(str(x.overflow_on_add), style=bad if x.overflow_on_add else ""),
            Text(str(x.summed_planes_overflow), style=bad if x.summed_planes_overflow else ""),
            Text(str(x.mask_sentinel_rows), style=bad if x.mask_sentinel_rows else ""),
        )
    fitted = "" if a.fitted_scale is None else f"; fitted scale of the given scores {a.fitted_scale:.4g}"
    if a.softcap is not None:
        c = a.softcap
        said = "" if not c.overflow else ", hidden by the cap" if c.saturated else ", logits changed by the cap"
        fitted += (
            f"; soft cap {c.cap:g} after the scale (S = Q@K^T held in {c.dtype} before it: {c.overflow} "
            f"score(s) -> inf{said})"
        )
    line = Text(
        f"d {a.d}, {a.heads} query heads / {a.kv_heads} kv heads, scale {a.scale:.4g} ({a.scale_name}) applied to "
        f"the {a.scale_order}; max|q| {a.q_max_abs:.4g}, max|k| {a.k_max_abs:.4g}, max|q.k| {a.raw_max_abs:.4g}; "
        f"spread of q {a.q_std:.3g}, k {a.k_std:.3g}, scaled scores {fmt(a.scores_std)}; masked keys "
        f"{a.masked_keys}, float64 mass on masked keys up to {a.leak_max:.3g}{fitted}"
    )
    return Group(t, line) if t.row_count else Group(line)


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


def matrix_table(d: TensorDiagnosis, dtypes: list[str] | None = None, title: bool = True) -> Table:
    """Method (or path) x dtype, the verdict of each cell; ``dtypes``: those of the columns (default
    all), the rows then only the labels with a cell among them."""
    dtypes = list(dict.fromkeys(c.dtype for c in d.cells)) if dtypes is None else dtypes
    by = {(c.label, c.dtype): c for c in d.cells}
    paths = any(c.path for c in d.cells)
    heading = "Path x dtype (max |p - p_float64|)" if paths else "Method x dtype (max |p - p_float64|)"
    t = Table(title=heading if title else None, title_justify="left", show_lines=True)
    t.add_column("path" if paths else "method", style="bold", no_wrap=True)
    for dt in dtypes:
        t.add_column(dt)
    for label in dict.fromkeys(c.label for c in d.cells):
        if any((label, dt) in by for dt in dtypes):
            t.add_row(
                label,
                *(_cell_summary(by[(label, dt)]) if (label, dt) in by else Text("-", style="dim") for dt in dtypes),
            )
    return t


def matrix_tables(d: TensorDiagnosis) -> Fitted:
    """The method (path) x dtype table, split into tables of consecutive dtypes where all of them
    would not fit the terminal (every cell on its lines, nothing cut)."""
    dtypes = list(dict.fromkeys(c.dtype for c in d.cells))

    def build(console: Console, width: int) -> list:
        groups: list[list[str]] = [[]]
        for dt in dtypes:
            trial = groups[-1] + [dt]
            if groups[-1] and full_width(console, matrix_table(d, trial), width) > width:
                groups.append([dt])
            else:
                groups[-1] = trial
        return [matrix_table(d, group, title=i == 0) for i, group in enumerate(groups)]

    return Fitted(build)


def pcast_table(d: TensorDiagnosis) -> Table | None:
    """FP8 cells: what the P cast flushed, and how Q, K, V were quantised."""
    cells = [c for c in d.cells if c.pcast_flushed_frac is not None or c.p_scale is not None]
    if not cells:
        return None
    t = Table(
        title="FP8 P cast: probabilities the reference has that the cast flushed to 0",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("cell", "S", "flushed", "before / max / after", "rows >= 0.1%", "max loss"):
        t.add_column(name, justify="left" if name == "cell" else "right", no_wrap=True)
    for c in cells:
        pos = c.pcast_flushed_by_position or {}
        t.add_row(
            Text(c.name, style="bold red" if c.pcast_mass_rows else ""),
            fmt(c.p_scale, ".4g"),
            _pct(c.pcast_flushed_frac),
            " / ".join(_pct(pos.get(k), ".1%") for k in ("before_max", "max_block", "after_max")),
            str(c.pcast_mass_rows),
            fmt(c.pcast_mass_max, ".1e"),
        )
    notes = [
        "flushed by position: keys in blocks visited before the block holding the row max, in that block, after it;",
        "max loss: the most probability one row lost to the flush",
    ]
    if d.attention is not None:
        for dt, a in d.attention.dtypes.items():
            if a.fp8_values:
                parts = [
                    f"{k} amax {a.fp8_amax.get(k, 0):.4g}, clipped {a.fp8_clipped.get(k, 0)}, subnormal "
                    f"{a.fp8_subnormal.get(k, 0)}, flushed {a.fp8_flushed.get(k, 0)} of {n}"
                    for k, n in a.fp8_values.items()
                ]
                notes.append(f"flash-fp8 quantisation to {dt} ({a.fp8_scaling}): " + "; ".join(parts))
    for c in cells:
        if c.fp8_accum is not None:
            others = "; ".join(f"{k} {fmt(v, '.3g')}" for k, v in (c.fp8_accum_rmse or {}).items())
            notes.append(
                f"{c.name} accumulates on the FP8 tensor cores in {c.fp8_accum} over {c.fp8_accum_keys} keys: O RMSE "
                f"{fmt(c.out_rmse, '.3g')}" + (f" (same kernel, {others})" if others else "")
            )
    t.caption = "\n".join(notes)
    t.caption_justify = "left"
    return t


def _pct(x: float | None, spec: str = ".2%") -> str:
    return "-" if x is None else format(x, spec)


def output_table(d: TensorDiagnosis) -> Table | None:
    """The output O = P@V of each cell against float64 (with V given)."""
    cells = [c for c in d.cells if c.out_rows is not None]
    if not cells:
        return None
    t = Table(
        title="Output O = P@V against float64 P64 @ V64 (rows where both are finite)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("cell", "NaN rows", "max err", "RMSE", "rel L1", "cos min", "bias"):
        t.add_column(name, justify="left" if name == "cell" else "right", no_wrap=True)
    for c in cells:
        t.add_row(
            Text(c.name, style="bold red" if c.out_nan_rows else ""),
            str(c.out_nan_rows),
            fmt(c.out_max_abs_err, ".2e"),
            fmt(c.out_rmse, ".2e"),
            fmt(c.out_rel_l1, ".2e"),
            cosine(c.out_cos_min),
            fmt(c.out_bias, ".1e"),
        )
    notes = ["bias: mean signed error of O against float64 of the path's own scores and V as the dtype holds it"]
    tied = [c for c in cells if c.tied_rows]
    if tied:
        notes.append(
            "rows whose maximum is tied: "
            + ", ".join(
                f"{c.name} {c.tied_rows}"
                + (
                    f" (bias {fmt(c.out_bias_tied, '.1e')}, {fmt(c.out_bias_tied_z, '.1f')} standard errors)"
                    if c.out_bias_tied_z is not None
                    else ""
                )
                for c in tied
            )
        )
    t.caption = "\n".join(notes)
    t.caption_justify = "left"
    return t


def backward_table(d: TensorDiagnosis) -> Table | None:
    """The backward of each cell that has one: per gradient its NaN/inf rows and their first cause,
    its error against float64, the share flushed to 0, FlashAttention's 2x rule and, for the model's
    cell, the gradients the model's kernel really produced."""
    cells = [c for c in d.cells if c.backward is not None]
    if not cells:
        return None
    t = compact_table("Backward: dQ, dK, dV against float64 autograd (entries where both are finite)")
    # rel err is in the JSON report; the table keeps to 80 columns.
    for name in ("cell", "grad", "NaN rows", "max err", "flush", "2x rule", "real"):
        t.add_column(name, justify="left" if name in ("cell", "grad", "NaN rows") else "right", no_wrap=True)
    notes = []
    for c in cells:
        b = c.backward
        for i, (name, g) in enumerate(b.grads()):
            nan = str(g.nan_rows) + (f" {g.first_cause}" if g.first_cause else "")
            rule = (
                "-"
                if g.rule_holds is None
                else (
                    f"{'ok' if g.rule_holds else 'FAIL'} {g.max_abs_err / g.baseline_err:.1f}x"
                    if g.baseline_err
                    else ("ok" if g.rule_holds else "FAIL")
                )
            )
            real = "-" if g.real_agrees is None else "agrees" if g.real_agrees else "near" if g.real_near else "DIFFERS"
            t.add_row(
                Text(c.name if i == 0 else "", style="bold red" if b.nan_rows else ""),
                name,
                Text(nan, style="bold red" if g.nan_rows else ""),
                fmt(g.max_abs_err, ".1e"),
                "-" if g.flushed_frac is None else f"{g.flushed_frac:.1%}",
                rule,
                Text(real, style="bold red" if g.real_agrees is False and not g.real_near else ""),
            )
        room = "-" if b.scale_headroom is None else f"{b.scale_headroom:.3g}x ({b.headroom_at})"
        notes.append(f"{c.name}: {b.how + '; ' if b.how else ''}dO may grow {room} before an intermediate overflows")
    t.caption = "\n".join(
        notes
        + [
            "2x rule: max err against 2x plain attention's in the same dtype (eager, no upcast); "
            "real: the gradients the model's kernel produced, within the path's rounding bound"
        ]
    )
    t.caption_justify = "left"
    return t


def detail_table(d: TensorDiagnosis, names: list[str] | None = None, narrow: int = 0) -> Table:
    """``names``: the cells' names as shown; ``narrow``: a layout of ``fit.narrow_table``."""
    t = narrow_table(narrow)
    t.title = (
        "Cells in detail: errors against float64 over rows where both are finite; "
        "'algo' against float64 of the scores after the cast to the cell's dtype"
    )
    t.title_justify = "left"
    # RMSE and KL mean are in the JSON report; the table keeps to 80 columns.
    for name in ("cell", "NaN/ovf/0", "max err", "algo", "|sum-1|", "KL max", "flush", "flips"):
        header = name.replace(" ", "\n").replace("NaN/", "NaN/\n") if narrow else name
        t.add_column(header, justify="left" if name == "cell" else "right", no_wrap=True)
    for c, name in zip(d.cells, names or [c.name for c in d.cells]):
        t.add_row(
            Text(name, style=VERDICT_STYLE[c.verdict]),
            f"{c.nan_rows}/{c.overflow_rows}/{c.zero_rows}",
            fmt(c.max_abs_err, ".1e"),
            fmt(c.max_abs_err_algo, ".1e"),
            fmt(c.max_row_sum_err, ".1e"),
            fmt(c.kl_max, ".1e"),
            "-" if c.flushed_frac is None else f"{c.flushed_frac:.1%}",
            str(c.argmax_flips),
        )
    return t


def fitted_detail_table(d: TensorDiagnosis) -> Fitted:
    """The cells in detail, in the first layout that fits the terminal (``fit.fitted``)."""
    names = [c.name for c in d.cells]
    return Fitted(
        lambda console, width: [fitted(console, width, names, lambda shown, narrow: detail_table(d, shown, narrow))[0]]
    )


def distribution_line(d: TensorDiagnosis) -> Text:
    s = d.distribution
    if not s.rows:
        return Text("Reference distribution: no row has a defined softmax", style="yellow")
    frac = "-" if s.collapsed_frac is None else f"{s.collapsed_frac:.1%}"
    return Text(
        f"Reference distribution over {s.rows} rows: entropy mean {fmt(s.entropy_mean)} nats (min "
        f"{fmt(s.entropy_min)}, max {fmt(s.entropy_max)}; normalised {fmt(s.entropy_norm_mean)}), max prob mean "
        f"{fmt(s.max_prob_mean)}, rows with max prob >= {s.collapse_threshold:g}: {s.collapsed_rows} ({frac}), "
        f"softmax Jacobian norm mean {fmt(s.jacobian_norm_mean)}"
    )


def nan_by_head_line(d: TensorDiagnosis) -> Text | None:
    """Where the NaN rows sit, per index of the leading axes (e.g. (batch, head))."""
    parts = []
    for c in d.cells:
        if c.nan_rows_by_head:
            where = ", ".join(f"{index_text(i)} {n}" for i, n in c.nan_rows_by_head[:NAN_HEADS_SHOWN])
            left = len(c.nan_rows_by_head) - NAN_HEADS_SHOWN
            parts.append(f"{c.name}: {where}" + (f" and {left} more" if left > 0 else ""))
    if not parts:
        return None
    axes = "x".join(str(n) for n in d.shape[:-2])
    return Text(f"NaN rows by leading index ({axes}, most first): " + "; ".join(parts), style="red")


def findings_section(d: TensorDiagnosis) -> Group | Text:
    """Each finding as a compiler diagnostic: headline, where, fix (``report.diagnostics``)."""
    if not d.findings:
        return Text("No findings: every cell is finite and close to the float64 reference.", style="green")
    return findings_block(d.name, d.findings)


def limits_line(d: TensorDiagnosis) -> Text | None:
    """A captured call's cells (the model's, the what-ifs): each one's first failure and how far
    the input is from it."""
    cells = [c for c in d.cells if c.role != "asked"]
    if not cells:
        return None
    parts = []
    for c in cells:
        if c.limit is None:
            parts.append(f"{c.name} ({c.role}): nothing fails from finite scores")
        else:
            parts.append(
                f"{c.name} ({c.role}): {c.limit.what}; largest {fmt(c.limit.value, '.4g')}, headroom "
                f"{fmt(c.limit.headroom, '.4g')}"
            )
    return Text("First failure: " + "; ".join(parts))


METRIC_WORDS = {"out_rel_l1": "rel L1 of O", "rmse": "RMSE of P"}


def settings_table(choice) -> Table:
    """A kernel's settings grid in one dtype (``--what-if fa4``): each point's numbers, error against float64,
    headroom (how far P may grow before its dtype runs out), findings, and which is the default and the best."""
    over = f" over {choice.calls} calls" if choice.calls > 1 else ""
    t = compact_table(f"{choice.path} settings in {choice.dtype} (--what-if {choice.path}){over}")
    t.add_column("setting", no_wrap=True)
    number_column(t, METRIC_WORDS.get(choice.metric, choice.metric))
    number_column(t, "headroom")
    t.add_column("result", overflow="fold")
    for p in choice.points:
        notes = [n for n, hit in (("default", p.default), ("best", p.label == choice.best)) if hit]
        shown = [*p.findings, *(f"{e} ({n} rows)" for e, n in p.events.items() if e not in p.findings)]
        result = ", ".join(shown) or p.verdict
        if p.calls_bad and choice.calls > 1:
            result += f" ({p.calls_bad} call{'s' if p.calls_bad > 1 else ''})"
        if p.refused is not None:
            notes.append("kernel asserts")
        style = "bold" if p.label == choice.best else ("dim" if p.refused else "")
        t.add_row(
            Text(p.label + (f" ({', '.join(notes)})" if notes else ""), style=style),
            fmt(p.err, ".3g"),
            Text(fmt(p.headroom, ".3g"), style="red" if p.headroom is not None and p.headroom < 0 else ""),
            Text(result, style="red" if p.calls_bad else ("green" if result == "ok" else "")),
        )
    return t


def settings_line(choice) -> Text:
    """'fa4/e4m3: best t0,o4 (rel L1 of O 0.012); the kernel's default t0,o8: 0.034'."""
    metric = METRIC_WORDS.get(choice.metric, choice.metric)
    best, default = choice.point(choice.best), choice.point(choice.default)
    text = Text(f"{choice.path}/{choice.dtype}: ", style="bold")
    if best is None:
        text.append("no setting of the grid runs without breaking", style="red")
    else:
        text.append(f"best {best.label} ({metric} {fmt(best.err, '.3g')})", style="green")
    if default is not None and default is not best:
        text.append(f"; the kernel's default {default.label}: {fmt(default.err, '.3g')}")
    elif default is not None:
        text.append(" = the kernel's default")
    refused = [p for p in choice.points if p.refused]
    if refused:
        text.append(f"; the kernel (at the commit followed) asserts against {', '.join(p.label for p in refused)}")
    return text


def settings_section(choices) -> Group | None:
    """Every settings grid of a diagnosis or a model, each with its line naming the best."""
    if not choices:
        return None
    parts: list[Any] = []
    for choice in choices:
        parts += [settings_table(choice), settings_line(choice)]
    parts.append(
        Text(
            "setting: t the lazy rescale threshold, o the max offset (log2 units); headroom: how far a logit may "
            "pass the row max the kernel holds before P runs out of its dtype (ln 2 per power of 2); best: the "
            "least error among the settings the kernel takes that break nothing, "
            f"a tie (within {choices[0].tie:.0%}) going to the default",
            style="dim",
        )
    )
    return Group(*parts)


def render_diagnosis(d: TensorDiagnosis, verbose: bool = True) -> Group:
    parts: list[Any] = [census_panel(d)]
    if d.attention is not None:
        parts.append(attention_table(d))
    parts += [headroom_table(d)] if d.census.headroom else []
    parts += [matrix_tables(d)]
    if verbose:
        parts.append(fitted_detail_table(d))
    for build in (output_table, pcast_table, backward_table, lowsum_table):
        if build(d) is not None:
            parts.append(fit_table(lambda build=build: build(d)))
    settings = settings_section(d.choices)
    if settings is not None:
        parts.append(settings)
    sampled = sampling_section(d)  # --budget/--rows: which figures are exact, which sampled
    if sampled is not None:
        parts.append(sampled)
    where = nan_by_head_line(d)
    limits = limits_line(d)
    parts += (
        [distribution_line(d)]
        + ([limits] if limits is not None else [])
        + ([where] if where is not None else [])
        + [findings_section(d)]
    )
    return Group(*parts)


def print_report(
    console: Console,
    diags: Sequence[TensorDiagnosis],
    device: str,
    verbose: bool = True,
    what_ifs: Sequence[TensorDiagnosis] = (),
) -> None:
    """Each diagnosis in full, then the what-if diagnoses (their findings are not counted)."""
    for d in diags:
        console.print(render_diagnosis(d, verbose=verbose))
        console.print()
    for d in what_ifs:
        console.print(Text("What if (not the model's: never counted)", style="bold"))
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
        if c.limit is not None:
            cell["limit"]["headroom"] = to_jsonable(c.limit.headroom)  # the property, beside the fields
        cells.append(cell)
    census = to_jsonable(d.census) | census_scope(d)  # --budget/--rows: the census is of the rows computed
    spans = d.census.sentinel_spans or [(v, v) for v, _ in d.census.sentinels]
    census["sentinels"] = [
        {"value": v, "rows": n, "min": lo, "max": hi} for (v, n), (lo, hi) in zip(d.census.sentinels, spans)
    ]
    census.pop("sentinel_spans", None)
    return {
        "name": d.name,
        "shape": list(d.shape),
        "dtype": d.dtype,
        "census": census,
        "distribution": to_jsonable(d.distribution),
        "cells": cells,
        "findings": [dict(to_jsonable(f), doc=doc_link(f.code)) for f in d.findings],
        "attention": None if d.attention is None else to_jsonable(d.attention),
        "settings": [to_jsonable(c) for c in d.choices],  # --what-if fa4: each settings grid and its best
        "accumulate": [to_jsonable(s) for s in d.lowsum],  # --accumulate: each sum kept in 16 bits
        **sampling_json(d),  # --budget/--rows: exact and sampled figures
    }
