"""A bounded diagnosis (``attncheck run --budget/--rows``): which figures are exact and which sampled, as a
panel and a table (numbers from results.bounded)."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from attncheck.format import fmt, to_jsonable
from attncheck.results import TensorDiagnosis


def sampling_lines(d: TensorDiagnosis) -> Text | None:
    """What was computed in full, what certified, what sampled."""
    s = d.sampling
    if s is None:
        return None
    why = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in s.exact_why.items()) or "none"
    bound = "" if s.bound_max is None else f" (largest certified bound on |logit|: {fmt(s.bound_max, '.4g')})"
    lines = [
        f"Bounded diagnosis: {s.rows:,} score rows; {s.certified_rows:,} certified free of overflow and NaN by "
        f"|s_ij| <= scale |q_i| max_j |k_j| + max mask{bound}; {s.exact_rows:,} computed in full ({why}); "
        f"{s.sampled_rows:,} sampled (seed {s.seed}, {s.groups} groups)"
        + (f"; the causal call's first {s.head_rows:,} certified rows computed in full." if s.head_rows else "."),
        "Exact: the counts of failing rows (NaN, overflow, fully masked, Q@K^T and cast overflow) and their examples. "
        "Sampled: the cells' error figures, the distribution and the key shares (sinks), over the rows computed; "
        "the table below estimates the call's "
        f"({s.estimator}).",
    ]
    computed = d.census.rows
    lines.append(
        f"The census above counts the {computed:,} score rows computed (exact and sampled), not the call's "
        f"{s.rows:,}: its shape, values and counts are of those rows."
    )
    if s.estimated_exact_s is not None:
        lines.append(f"Every row would take about {s.estimated_exact_s:.3g} s (budget {s.budget_s:g} s).")
    return Text("\n".join(lines), style="dim")


def sampling_table(d: TensorDiagnosis) -> Table | None:
    """The sampled estimates: a mean with its 95% interval, a max as a lower bound (the share of rows that may lie
    above it said once, in the caption: the column stays narrow enough for 80 columns)."""
    s = d.sampling
    if s is None or not s.figures:
        return None
    exceed = max((f.exceed for f in s.figures if f.kind == "max" and f.exceed is not None), default=None)
    caption = (
        None
        if exceed is None
        else f"max: the largest over the rows computed, a lower bound; at 95%, at most {exceed:.2%} of the rows "
        "not computed lie above it"
    )
    t = Table(
        title=f"Sampled figures ({s.sampled_rows:,} of {s.rows:,} rows): 95% interval, or a lower bound",
        title_justify="left",
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("of", "figure", "estimate", "95% interval"):
        t.add_column(name, justify="left" if name in ("of", "figure") else "right", no_wrap=name != "of")
    for f in s.figures:
        interval = f"[{fmt(f.low, '.3g')}, {fmt(f.high, '.3g')}]" if f.kind == "mean" else "max: lower bound"
        t.add_row(f.owner, f.figure, fmt(f.estimate, ".3g"), interval)
    return t


def sampling_section(d: TensorDiagnosis) -> Group | None:
    lines, table = sampling_lines(d), sampling_table(d)
    if lines is None:
        return None
    return Group(lines, *([table] if table is not None else []))


def sampling_json(d: TensorDiagnosis) -> dict:
    """``sampling`` of a diagnosis in the JSON report: present only for a bounded diagnosis."""
    return {} if d.sampling is None else {"sampling": to_jsonable(d.sampling)}


def census_note(d: TensorDiagnosis) -> list[tuple[str, str]]:
    """The census box's line under a bounded diagnosis (none otherwise): its figures are of the rows computed."""
    if d.sampling is None:
        return []
    return [("computed", f"the rows above of the call's {tuple(d.shape)}: counts below are of them")]


def census_scope(d: TensorDiagnosis) -> dict:
    """A bounded diagnosis's census is of the rows computed: ``scope`` and the call's shape say so in the JSON."""
    if d.sampling is None:
        return {}
    return {"scope": "rows computed (exact and sampled), not the whole call", "call_shape": list(d.shape)}


def model_sampling_line(calls) -> Text | None:
    """The model report's line for calls diagnosed in bounded time (their diagnoses and what-ifs): which calls, and
    that their largest logit and error in the calls table and the layer x head table are over the rows computed."""
    diags = [d for c in calls for d in (c.diagnosis, c.what_if) if d is not None and d.sampling is not None]
    if not diags:
        return None
    rows = sum(d.sampling.rows for d in diags)
    exact = sum(d.sampling.exact_rows for d in diags)
    sampled = sum(d.sampling.sampled_rows for d in diags)
    sampled_calls = [c.call for c in calls if c.diagnosis is not None and c.diagnosis.sampling is not None]
    names = list(dict.fromkeys(call.module or call.name for call in sampled_calls))
    named = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return Text(
        f"Bounded diagnosis (--budget/--rows) of {len(diags)} diagnosis(es): {rows:,} score rows, "
        f"{rows - exact:,} certified free of overflow and NaN by the row bound, {exact:,} computed in full, "
        f"{sampled:,} sampled. Counts of failing rows are exact; error figures are over the rows computed "
        "(each tensor's 'Sampled figures' table and JSON 'sampling' give the estimates with 95% intervals). "
        + (
            f"Sampled calls ({named}): their 'logit' and 'err' in the calls table, and their heads' largest logit "
            "in the layer x head table, are maxima over the rows computed, lower bounds of the calls'."
            if names
            else ""
        ),
        style="dim",
    )
