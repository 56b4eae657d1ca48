"""The model report's learned sinks (gpt-oss): per call, each head's share of the denominator, whether the sink
changes the output in the call's dtype, and (``--what-if nosinks`` or ``kernels``) what a kernel that drops the sinks
would compute instead. Formatting only."""

from __future__ import annotations

import statistics

from rich.text import Text

from attncheck.format import plain, visible
from attncheck.results import CallReport

HEADS_LISTED = 16  # a call with more heads shows the range of their shares (each head's is in the JSON)
CALLS_LISTED = 12


def _shares(report: CallReport) -> str:
    facts = report.sinks
    heads = facts.heads
    if len(heads) <= HEADS_LISTED:
        return "  ".join(f"h{h.head} {plain(h.share_max)}" for h in heads)
    top = [h.share_max for h in heads]
    return f"{len(heads)} heads: min {plain(min(top))}, median {plain(statistics.median(top))}, max {plain(max(top))}"


def sinks_block(calls: list[CallReport], prefix: str = "") -> Text | None:
    """The calls with learned sinks, one line each (and one for the what-if where asked); None without any."""
    sunk = [c for c in calls if c.sinks is not None and c.sinks.heads]
    if not sunk:
        return None
    first = sunk[0].sinks
    text = Text(
        "Learned sinks: each head's share of the float64 denominator, exp(sink - m) / (sum exp(s - m) + exp(sink - "
        f"m)), max over rows ({first.dtype} rounding: {plain(first.rounding)}); output error of the model's cell "
        "against float64:\n"
    )
    for c in sunk[:CALLS_LISTED]:
        f = c.sinks
        name = visible(c.call.module.removeprefix(prefix) or c.call.name)
        dead = sum(1 for h in f.heads if h.changed == 0)
        effect = (
            "changes nothing in any head"
            if dead == len(f.heads)
            else f"changes the output in {len(f.heads) - dead} of {len(f.heads)} heads"
        )
        err = max(h.err_model for h in f.heads)
        if f.ignored:  # the call computed the cell without them: say so, with what they would have changed
            text.append(
                f"  #{c.call.index} {name} ({f.dtype}): {_shares(c)}; DROPPED by its SDPA call: the sink {effect} "
                f"(up to {plain(max(h.diff_nosinks for h in f.heads))}); the call's err against float64 with them "
                f"{plain(max(h.err_nosinks for h in f.heads))}\n",
                style="red" if dead < len(f.heads) else "",
            )
            continue
        text.append(f"  #{c.call.index} {name} ({f.dtype}): {_shares(c)}; the sink {effect}; output err {plain(err)}\n")
        if f.nosinks:
            changed = sum(h.changed for h in f.heads)
            text.append(
                f"    what if a kernel drops them (nosinks): err {plain(max(h.err_nosinks for h in f.heads))} "
                f"against float64, {plain(max(h.diff_nosinks for h in f.heads))} from the model's cell "
                f"({changed} of {f.elements * len(f.heads)} outputs differ)\n",
                style="yellow" if changed else "",
            )
    left = sum(1 for c in sunk if c.sinks.grads_left_out)
    if left:
        text.append(
            f"  the gradients of {left} call(s) with sinks were recorded; their backward with the sinks is not "
            "computed yet (not judged)\n",
            style="yellow",
        )
    if len(sunk) > CALLS_LISTED:
        text.append(f"  ... {len(sunk) - CALLS_LISTED} more in the JSON report\n")
    text.rstrip()
    return text
