"""The sums kept in 16 bits of ``attncheck run --accumulate`` as a table (numbers from results.lowsum)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from attncheck.format import fmt, to_jsonable, visible
from attncheck.report.diagnostics import diagnostic
from attncheck.results import CaptureSums, LayerSums, LowSumStats, SumOverflow, TensorDiagnosis


def _at(first: SumOverflow | None, rows: int) -> str:
    if first is None:
        return "0"
    return f"{rows:,} at {first.key + 1:,}"


def lowsum_table(d: TensorDiagnosis) -> Table | None:
    """Per accumulation asked: the denominator's and the output's largest relative error against float64 (and the
    denominator's mean) over rows whose sums stay finite, and the rows whose accumulator overflowed with the keys
    added when the first of them did ('2 at 65,536'; the finding names the row and head dim)."""
    if not d.lowsum:
        return None
    t = Table(
        title="Sums kept in 16 bits (--accumulate): relative error against float64, overflowed rows at keys",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("sum", "keys", "denom err", "mean", "denom ovf", "out err", "out ovf"):
        t.add_column(name, justify="left" if name == "sum" else "right", no_wrap=True)
    for st in d.lowsum:
        bad = st.denom_overflow_rows or st.out_overflow_rows
        t.add_row(
            Text(st.label, style="bold red" if bad else ""),
            f"{st.keys:,}",
            fmt(st.denom_err_max, ".2e") if st.rows > st.denom_overflow_rows else "-",  # no finite row: no error
            fmt(st.denom_err_mean, ".2e") if st.rows > st.denom_overflow_rows else "-",
            _at(st.denom_first, st.denom_overflow_rows),
            fmt(st.out_err_max, ".2e") if st.out_rows > st.out_nonfinite_rows else "-",  # no finite row: no error
            _at(st.out_first, st.out_overflow_rows) if st.out_rows else "-",
        )
    return t


SUM_ROWS = 12  # layer x sum rows shown without --full: those that overflowed, then the worst (all in the JSON)


def _layer_order(layers: list[LayerSums]) -> list[LayerSums]:
    """Rows whose accumulator overflowed first, then by the largest relative error (denominator or output)."""
    return sorted(
        layers,
        key=lambda x: (not (x.stats.denom_overflow_rows or x.stats.out_overflow_rows), -_worst(x.stats)),
    )


def _worst(st: LowSumStats) -> float:
    return max(st.denom_err_max, st.out_err_max or 0.0)  # None: no finite output row, said apart


def layer_affixes(modules: list[str]) -> tuple[str, str]:
    """The dotted parts every layer's name starts and ends with ('model.layers.', '.self_attn'), cut from the
    table's first column where two layers or more differ only between them."""
    names = [m.split(".") for m in dict.fromkeys(modules) if m]
    if len(names) < 2:
        return "", ""
    head = 0
    while all(len(n) > head + 1 and n[head] == names[0][head] for n in names):
        head += 1
    tail = 0
    while all(len(n) > head + tail + 1 and n[-1 - tail] == names[0][-1 - tail] for n in names):
        tail += 1
    prefix = ".".join(names[0][:head]) + ("." if head else "")
    suffix = ("." if tail else "") + ".".join(names[0][len(names[0]) - tail :])
    return prefix, suffix


def sums_table(report: CaptureSums, full: bool = False) -> Table:
    """Per layer (attention module) and sum: its calls, the keys, the largest errors over its calls against
    float64, and the overflowed rows with the key and the first call they went at ('2 at 1,024 #3'); a layer's
    name on its first row, less what every layer's name shares (``layer_affixes``)."""
    prefix, suffix = layer_affixes([x.module for x in report.layers])
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    t.add_column("L" if prefix or suffix else "layer", overflow="fold")  # folds where a terminal is too narrow
    for name in ("calls", "sum", "keys", "denom err", "out err", "out ovf"):
        t.add_column(name, justify="left" if name == "sum" else "right", no_wrap=True)
    shown = report.layers if full else _layer_order(report.layers)[:SUM_ROWS]
    said = None
    for layer in shown if full else sorted(shown, key=report.layers.index):  # the layers' order, as they ran
        st = layer.stats
        name = ("" if layer.rank is None else f"r{layer.rank} ") + (layer.module or "global")
        if prefix or suffix:
            name = name.replace(prefix, "", 1).removesuffix(suffix)
        name, said = ("" if name == said else name), name
        bad = st.denom_overflow_rows or st.out_overflow_rows
        first = f" #{layer.first_call}" if layer.first_call is not None and st.out_first is not None else ""
        t.add_row(
            name,
            f"{len(layer.calls):,}",
            Text(layer.label, style="bold red" if bad else ""),
            f"{layer.keys:,}",
            fmt(st.denom_err_max, ".2e") if st.rows > st.denom_overflow_rows else "-",
            fmt(st.out_err_max, ".2e") if st.out_rows > st.out_nonfinite_rows else "-",
            (_at(st.out_first, st.out_overflow_rows) + first) if st.out_rows else "-",
        )
    return t


def _layer_legend(report: CaptureSums) -> str:
    prefix, suffix = layer_affixes([x.module for x in report.layers])
    return f"L: layer {prefix}L{suffix}; " if prefix or suffix else ""


def sums_block(report: CaptureSums, brief: bool = False, full: bool = False) -> Group:
    """--accumulate on a capture: a title, the per-layer table (not with ``brief``), its legend, the findings."""
    parts: list[Any] = [
        Text(
            f"Sums kept in 16 bits per layer (--accumulate {','.join(report.labels)}; on a capture never the "
            "model's verdict: --fail-on what-if:COND)",
            style="bold",
        )
    ]
    if not brief:
        parts.append(sums_table(report, full))
        more = len(report.layers) - SUM_ROWS
        if not full and more > 0:
            parts.append(Text(f"{more} more layer x sum row{'s' if more > 1 else ''} (--full lists all)"))
        parts.append(
            Text(
                visible(
                    _layer_legend(report)
                    + "calls: the layer's calls; denom err, out err: the largest relative error against float64 of the "
                    "softmax denominator and of the output over the calls' rows that stay finite; out ovf: rows whose "
                    "P@V accumulator overflowed, at the key it went, in the first call (#) it did"
                ),
                style="dim",
            )
        )
    for f in report.findings:
        if not brief or f.severity != "info":
            parts.append(diagnostic(f.severity, f.code, f.message, None, f.fix))
    if not report.findings:
        parts.append(Text("no sum kept in 16 bits drifts or overflows in any layer"))
    return Group(*parts)


def sums_json(report: CaptureSums) -> dict[str, Any]:
    """The ``accumulate`` section of a capture's run JSON (docs/reference/json.md)."""
    return {
        "sums": list(report.labels),
        "layers": [to_jsonable(layer) for layer in report.layers],
        "calls": [to_jsonable(call) for call in report.calls],
        "findings": [to_jsonable(f) for f in report.findings],
    }
