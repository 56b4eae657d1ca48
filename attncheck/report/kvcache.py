"""The KV-cache what-if's table (one row per cache, layer and kv head that matters), its summary lines and
findings, and its JSON. Formatting only."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from attncheck.format import fmt, plain, to_jsonable, visible
from attncheck.report.diagnostics import diagnostic
from attncheck.results.kvcache import KVReport, KVWhatIf

KV_ROWS = 8  # heads shown per cache: the worst by cosine similarity (every head is in the JSON)


def _pair(a: float, b: float) -> str:
    return f"{plain(a)}/{plain(b)}"


def _layers(what: KVWhatIf) -> tuple[str, int]:
    """The module path every layer's name starts with ('model.layers.'), and how much of it to cut."""
    names = [h.module for h in what.heads if h.module]
    prefix = os.path.commonprefix(names) if len(set(names)) > 1 else ""
    prefix = prefix[: prefix.rfind(".") + 1]
    return prefix, len(prefix)


def kv_table(what: KVWhatIf) -> Table:
    """One cache's heads, worst first: K and V amax against the format's max at the scale, entries saturated and
    flushed, O's error against the model's cell and float64, and the scales that would hold the head."""
    prefix, cut = _layers(what)
    t = Table(
        caption=(f"layers below {prefix}; " if prefix else "")
        + "sat: entries clipped; flush: nonzero entries made 0; cos: the worst row's against the model's kernel "
        "(f64: against float64; relative L2 and max abs in the JSON); hold: amax / format max, this head's",
        caption_justify="left",
    )
    widest = max((len(h.module[cut:]) for h in what.heads), default=1)
    t.add_column("layer", min_width=min(widest, 24), overflow="fold")
    for name in ("kv", "amax K/V", "scale K/V", "sat K/V", "flush K/V", "cos", "cos f64", "hold K/V"):
        t.add_column(name, justify="right", overflow="fold")
    for h in sorted(what.heads, key=lambda h: h.cosine)[:KV_ROWS]:
        t.add_row(
            Text(visible(h.module[cut:] or "-")),
            str(h.kv_head),
            _pair(h.k_amax, h.v_amax),
            _pair(h.k_scale, h.v_scale),
            f"{h.k_saturated:,}/{h.v_saturated:,}",
            f"{h.k_flushed:,}/{h.v_flushed:,}",
            f"{h.cosine:.4f}",
            f"{h.cosine_f64:.4f}",
            f"{fmt(h.hold_k_head, '.2g')}/{fmt(h.hold_v_head, '.2g')}",
        )
    return t


def kv_block(report: KVReport, brief: bool = False) -> Group:
    """Every cache: its summary line, its table (not with ``brief``), its findings; the calls left out."""
    parts: list[Any] = [
        Text("KV-cache what-ifs (on a capture never the model's verdict: --fail-on what-if:COND)", style="bold"),
    ]
    for what in report.caches:
        parts.append(Text(visible(what.summary), style="bold" if what.findings else ""))
        if not brief:
            parts.append(kv_table(what))
        for f in what.findings:
            if not brief or f.severity != "info":
                parts.append(diagnostic(f.severity, f.code, f.message, None, f.fix))
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
