"""The KV-cache what-if's table (one row per cache, layer and kv head that matters), its summary lines and
findings, and its JSON. Formatting only."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from attncheck.format import plain, to_jsonable, visible
from attncheck.report.diagnostics import diagnostic
from attncheck.results.kvcache import KVReport, KVWhatIf

KV_ROWS = 8  # heads shown per cache: the worst by cosine similarity (every head is in the JSON)


def _pct(n: int, total: int) -> str:
    return "0" if not n else f"{n:,} ({100 * n / max(1, total):.2g}%)"


def kv_table(what: KVWhatIf) -> Table:
    """One cache's heads, worst first: K and V amax against the format's max at the scale, entries saturated and
    flushed, O's error against the model's cell and float64, and the scales that would hold the head."""
    t = Table(
        title=f"{what.name}: {visible(what.summary)}",
        title_justify="left",
        caption="scale: the cache's; hold: amax / format max (this head's; the layer's)",
        caption_justify="left",
    )
    for name in ("layer", "kv", "K amax", "V amax", "scale K/V", "sat K/V", "flush K/V", "cos", "rel L2", "cos f64"):
        t.add_column(name, justify="left" if name == "layer" else "right", overflow="fold")
    t.add_column("hold K/V", justify="right")
    for h in sorted(what.heads, key=lambda h: h.cosine)[:KV_ROWS]:
        t.add_row(
            Text(visible(h.module or "-")),
            str(h.kv_head),
            plain(h.k_amax),
            plain(h.v_amax),
            f"{plain(h.k_scale)}/{plain(h.v_scale)}",
            f"{_pct(h.k_saturated, h.k_entries)}/{_pct(h.v_saturated, h.v_entries)}",
            f"{_pct(h.k_flushed, h.k_entries)}/{_pct(h.v_flushed, h.v_entries)}",
            f"{h.cosine:.4f}",
            f"{h.rel_l2:.3g}",
            f"{h.cosine_f64:.4f}",
            f"{plain(h.hold_k_head)}/{plain(h.hold_v_head)} ({plain(h.hold_k_tensor)}/{plain(h.hold_v_tensor)})",
        )
    return t


def kv_block(report: KVReport, brief: bool = False) -> Group:
    """Every cache: its summary line, its table (not with ``brief``), its findings; the calls left out."""
    parts: list[Any] = [
        Text("KV-cache what-ifs (not counted as the model's; --fail-on what-if:COND)", style="bold"),
    ]
    for what in report.caches:
        parts.append(Text(visible(what.summary)) if brief else kv_table(what))
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
