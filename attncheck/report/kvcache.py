"""The KV-cache what-if's tables (per cache: the heads that matter, worst first; every head with --full), its
summary lines and findings, and its JSON. Formatting only."""

from __future__ import annotations

import os
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from attncheck.format import compact, to_jsonable, visible
from attncheck.report.diagnostics import diagnostic
from attncheck.report.fit import middle_ellipsis
from attncheck.results.kvcache import KVHead, KVReport, KVWhatIf

KV_ROWS = 5  # heads shown per cache without --full: those that saturate, then the worst by cosine (all in the JSON)
KV_LAYER = 16  # characters of a layer's name in the first column, cut in the middle of its words beyond (fit.py)


def _pair(a: float, b: float, digits: int = 3) -> str:
    return f"{compact(a, digits)}/{compact(b, digits)}"


def _counts(a: int, b: int) -> str:
    return f"{a if a < 1000 else compact(a)}/{b if b < 1000 else compact(b)}"


def _names(what: KVWhatIf) -> tuple[str, str]:
    """The module path every layer's name starts with ('model.layers.') and ends with ('.self_attn'), cut from
    the first column where the layers differ only between them."""
    names = sorted({h.module for h in what.heads if h.module})
    if len(names) < 2:
        return "", ""
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind(".") + 1]
    suffix = os.path.commonprefix([n[len(prefix) :][::-1] for n in names])[::-1]
    suffix = suffix[suffix.find(".") :] if "." in suffix else ""
    return prefix, suffix


def _order(heads: list[KVHead]) -> list[KVHead]:
    """Heads that saturate first, then by the worst row's cosine similarity against the model's kernel."""
    return sorted(heads, key=lambda h: (not (h.k_saturated or h.v_saturated), h.cosine))


def _saturates(what: KVWhatIf) -> bool:
    return any(h.k_saturated or h.v_saturated for h in what.heads)


def kv_table(what: KVWhatIf, full: bool = False) -> Table:
    """One cache's heads, worst first (``KV_ROWS`` of them, every one with ``full``): K's and V's amax, the scale
    (not at unit scale: 1), entries saturated and flushed, the worst row's cosine similarity against the model's
    kernel (and, with ``full``, against float64), and, where something saturates, the scales that would hold the
    head (2 significant digits: the finding and the JSON give more)."""
    prefix, suffix = _names(what)
    layers = len({h.module for h in what.heads}) > 1
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    t.add_column("L:kv" if layers else "kv", overflow="fold")  # the one that folds where a terminal is too narrow
    integer = what.format.startswith("int")  # min-max per group: nothing saturates, no sat column
    columns = ["amax"] + ([] if what.scaling.startswith("unit") else ["scale"]) + ([] if integer else ["sat"])
    columns += ["flush", "cos"]
    columns += (["f64"] if full else []) + (["hold"] if _saturates(what) else [])  # head:fa3 too: its K and V
    columns += ["q"] if what.scaling.endswith(":fa3") else []  # FA3's FP8 path quantises Q: its amax, its hold
    for name in columns:  # on one line at 80 columns; with --full's f64 too, folded rather than cut where too wide
        t.add_column(name, justify="right", no_wrap=not full, overflow="fold")
    heads = _order(what.heads)
    for h in heads if full else heads[:KV_ROWS]:
        layer = h.module[len(prefix) : len(h.module) - len(suffix)] if prefix or suffix else h.module
        cells = {
            "amax": _pair(h.k_amax, h.v_amax),
            "scale": _pair(h.k_scale, h.v_scale, 2),
            "sat": _counts(h.k_saturated, h.v_saturated),
            "flush": _counts(h.k_flushed, h.v_flushed),
            "cos": f"{h.cosine:.4f}",
            "f64": f"{h.cosine_f64:.4f}",
            "hold": _pair(h.hold_k_head, h.hold_v_head, 2),
            "q": _pair(h.q_amax, h.hold_q, 2),
        }
        name = f"{middle_ellipsis(layer, KV_LAYER)}:{h.kv_head}" if layers else str(h.kv_head)
        t.add_row(Text(visible(name)), *(cells[c] for c in columns))
    return t


def _legend(report: KVReport) -> str:
    """The tables' legend, once under them: what L stands for where the layers' names were cut, and each column."""
    shown = [what for what in report.caches if what.heads]
    prefix, suffix = _names(shown[0]) if shown else ("", "")
    layers = any(len({h.module for h in what.heads}) > 1 for what in shown)
    layer = f"L:kv: layer {prefix}L{suffix}, kv head; " if prefix or suffix else "L:kv: layer, kv head; "
    layer = layer if layers else "kv: kv head; "
    # e5m2's tie 61,440 rounds to inf (its max's last bit is odd): counted from it; e4m3's 464 rounds to 448
    fp8 = [w for w in shown if not w.format.startswith("int")]
    edges = sorted({(">= " if w.format == "fp8_e5m2" else "> ") + compact(w.saturation_edge) for w in fp8})
    edge = " " + " or ".join(edges) if edges else ""
    return (
        f"{layer}K/V: K's and V's; sat: entries whose |x / scale| rounds beyond the format's max,{edge} (the max "
        "plus half its last step; the saturating cast clips them to the max); flush: nonzero entries made 0; cos: "
        "the worst row's cosine similarity against the model's kernel (f64: against float64; relative L2 and max "
        "abs in the JSON); hold: amax / format max, the scale that keeps the head from saturating (its findings "
        "say whether it holds the head); q (':fa3'): Q's amax and the q_scale that holds it; int4's scale: its "
        "largest group's; k = thousands, M = millions"
    )


def _quiet(what: KVWhatIf) -> bool:
    """A cache the judgement found nothing in (nothing saturates, no head breaks): its summary line says it."""
    return not what.findings and what.worst is not None


def kv_block(report: KVReport, brief: bool = False, full: bool = False) -> Group:
    """Every cache: its summary line, its table (not with ``brief``; not for a cache with nothing found, unless
    ``full``), its findings; the calls left out."""
    parts: list[Any] = [
        Text(
            "KV-cache what-ifs (--q/--k/--v: counted under --fail-on as the cells asked are)"
            if report.dumps
            else "KV-cache what-ifs (on a capture never the model's verdict: --fail-on what-if:COND)",
            style="bold",
        ),
    ]
    tables = 0
    for what in report.caches:
        parts.append(Text(visible(what.summary), style="bold" if what.findings else ""))
        if not brief and what.heads and (full or not _quiet(what)):
            parts.append(kv_table(what, full))
            tables += 1
            more = len(what.heads) - KV_ROWS
            if not full and more > 0:
                parts.append(Text(f"{more} more head{'s' if more > 1 else ''} of {what.name} (--full lists all)"))
        for f in what.findings:
            if not brief or f.severity != "info":
                parts.append(diagnostic(f.severity, f.code, f.message, None, f.fix))
    if tables:
        parts.append(Text(visible(_legend(report)), style="dim"))
    for name, why in report.skipped:
        parts.append(Text(visible(f"not replayed: {name}: {why}"), style="dim"))
    return Group(*parts)


def kv_json(report: KVReport) -> dict[str, Any]:
    """The ``kv_cache`` section of the run's JSON (docs/reference/json.md)."""
    return {
        "caches": [
            {
                "what_if": what.name,
                "format": what.format,
                "scaling": what.scaling,
                "format_max": what.format_max,
                "summary": what.summary,
                "heads": [to_jsonable(h) for h in what.heads],
                "findings": [to_jsonable(f) for f in what.findings],
            }
            for what in report.caches
        ],
        "skipped": [{"call": name, "why": why} for name, why in report.skipped],
    }
