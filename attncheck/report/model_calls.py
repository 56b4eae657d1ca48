"""The model report's calls table: one line per attention call (its verdict, error, headroom, gradients), the
facts every call shares, the backward summary, and the capture's and the ranks' blocks. Formatting only."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck.findings.rope import table_name, theta_source
from attncheck.format import fmt, plain, visible
from attncheck.report.diagnostics import Block, diagnostic
from attncheck.report.fit import Fitted, fitted, narrow_table
from attncheck.report.text import shown
from attncheck.results import ModelLine, ModelReport

VERDICT_STYLE = {
    "nan": "bold red",
    "overflow": "bold red",
    "zero": "red",
    "error": "bold red",
    "flip": "yellow",
    "ok": "green",
    "skipped": "yellow",
    "n/a": "dim",
}


def call_label(line: ModelLine, prefix: str = "") -> str:
    """The module path when the call has one (less the ``prefix`` every call shares), else
    the file (and key) it came from."""
    on = "" if line.rank is None else f"r{line.rank} "  # a capture of several processes: the rank first
    steps = f" decode x{line.steps}" if line.steps else ""  # a line standing for a module's decode steps
    if line.module:
        return on + (line.module[len(prefix) :] if prefix and line.module.startswith(prefix) else line.module) + steps
    return on + ("global" if line.kind in ("sdpa", "softmax", "flash_attn") else line.name)


def shared_prefix(modules: list[str]) -> str:
    """The dotted prefix every module path shares ('transformer.h.'), '' for fewer than two paths."""
    if len(modules) < 2 or not all(modules):
        return ""
    parts = [m.split(".") for m in modules]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    common = common[: min(len(p) for p in parts) - 1]  # keep at least one part of each name
    return ".".join(common) + "." if common else ""


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "-"


def lines_table(report: ModelReport, prefix: str = "", labels: list[str] | None = None, narrow: int = 0) -> Table:
    """One row per call; a shape or cell every call shares is said once, above the table. ``labels``:
    the calls' names as shown (default: their module paths less ``prefix``); ``narrow`` (for narrow
    terminals): 1 puts two-word headers on two lines, 2 also leaves one space between columns, 3 also
    leaves the heads out of a cause and the codes out of a verdict (the findings below name them)."""
    labels = [call_label(line, prefix) for line in report.lines] if labels is None else labels
    shapes = {line.shape for line in report.lines}
    cells = {line.cell for line in report.lines}
    columns = [("#", "right"), ("call", "left")]
    columns += [("shape", "left")] if len(shapes) > 1 else []
    columns += [("cell", "left")] if len(cells) > 1 else []
    columns += [
        ("logit", "right"),
        ("room", "right"),
        ("NaN", "right"),
        ("first cause", "left"),
        ("err", "right"),
        ("verdict", "left"),
    ]
    backward = any(line.grad_verdict is not None for line in report.lines)
    columns += [("grad", "left")] if backward else []
    t = narrow_table(narrow)
    for name, justify in columns:  # nothing wraps: ``fitted`` chooses the layout that fits
        t.add_column(name.replace(" ", "\n") if narrow else name, justify=justify, no_wrap=True)
    for i, (line, label) in enumerate(zip(report.lines, labels)):
        first = i == report.first_bad
        at = f"{line.index}" if line.last_index is None else f"{line.index}-{line.last_index}"
        mark = Text(at + (" >" if first else ""), style="bold red" if first else "")
        headroom = Text(plain(line.headroom), style="red" if line.headroom is not None and line.headroom < 0 else "")
        cause = line.first_cause or "-"
        if line.first_cause and line.heads and narrow < 3:
            cause += " h" + ",".join(map(str, line.heads[:2])) + (",…" if len(line.heads) > 2 else "")
        # the error codes beside the verdict, but those of the backward, which the grad column shows
        codes = [code for code in line.errors if not (backward and code.startswith("grad_"))]
        verdict = line.verdict + (
            f" ({', '.join(codes[:2])})" if line.verdict == "error" and codes and narrow < 3 else ""
        )
        row = [mark, shown(label)]
        row += [_shape(line.shape)] if len(shapes) > 1 else []
        row += [line.cell or "-"] if len(cells) > 1 else []
        row += [
            plain(line.max_logit),
            headroom,
            Text(str(line.nan_rows), style="bold red" if line.nan_rows else ""),
            cause,
            fmt(line.worst_err, ".0e"),
            Text(verdict, style=VERDICT_STYLE.get(line.verdict, "")),
        ]
        row += [_grad_cell(line)] if backward else []
        t.add_row(*row)
    return t


def folded_steps(report: ModelReport) -> set[tuple[int | None, int]]:
    """(rank, index) of the decode steps that went well: one line per module stands for them."""
    return {(run.rank, i) for run in report.decode for i in run.steps if i not in run.bad}


def folded(report: ModelReport) -> ModelReport:
    """The report with each module's decode steps that went well as one line (``DecodeRun.summary``); the steps
    that did not keep their own lines."""
    if not report.decode:
        return report
    good = folded_steps(report)
    summaries = {run.summary.index: run.summary for run in report.decode if run.summary is not None}
    lines = []
    first = None
    for at, line in enumerate(report.lines):
        if at == report.first_bad:
            first = len(lines)
        summary = summaries.get(line.index)
        if summary is not None and (line.rank, line.module) == (summary.rank, summary.module):
            lines.append(summary)
        elif (line.rank, line.index) not in good:
            lines.append(line)
    return replace(report, lines=lines, first_bad=first)


def decode_block(report: ModelReport, prefix: str = "") -> Block | None:
    """Each module's decode steps in one line: its prefill and the run of steps, with the keys they span."""
    if not report.decode:
        return None
    head = Text(
        "Decode steps (calls over a KV cache: fewer queries than keys, more than the module's call before, or as "
        "many in a full sliding window; the tables fold those that went well, --json lists each):"
    )
    lines: list[tuple[int, Text]] = []
    for run in report.decode[:DECODE_SHOWN]:
        name = run.module[len(prefix) :] if prefix and run.module.startswith(prefix) else run.module
        on = "" if run.rank is None else f"r{run.rank} "
        pre = (
            f"prefill #{','.join(map(str, run.prefill))} ({'/'.join(map(str, run.prefill_keys))} keys) + "
            if run.prefill
            else ""
        )
        queries = "/".join(map(str, run.queries))
        keys = run.keys_from if run.keys_from == run.keys_to else f"{run.keys_from}..{run.keys_to}"
        how = [f"{run.masked} with a mask" if run.masked else "no mask", f"{run.causal} causal" if run.causal else ""]
        text = Text()
        text.append(f"{on}{visible(name)}: ", style="bold")
        text.append(
            f"{pre}{len(run.steps)} decode steps #{run.steps[0]}-#{run.steps[-1]} ({queries} "
            f"quer{'y' if queries == '1' else 'ies'}, {keys} keys; "
            f"{', '.join(h for h in how if h)})"
        )
        if run.bad:
            text.append(f"; {len(run.bad)} not ok: #{', #'.join(map(str, run.bad[:6]))}", style="bold red")
        lines.append((2, text))
    if len(report.decode) > DECODE_SHOWN:
        lines.append((2, Text(f"... {len(report.decode) - DECODE_SHOWN} more in the JSON report")))
    return Block(head, lines)


DECODE_SHOWN = 24  # modules whose decode runs are listed; the JSON has every one


def fitted_lines_table(report: ModelReport, prefix: str, legend: Text) -> Fitted:
    """The legend and the calls' table, built for the terminal's width: two-word headers on two lines
    and names shortened (the parts no name differs in left out, then the middle) only where the
    table would not fit otherwise."""
    labels = [call_label(line, prefix) for line in report.lines]

    def build(console: Console, width: int) -> list:
        table, dropped = fitted(
            console, width, labels, lambda names, narrow: lines_table(report, labels=names, narrow=narrow)
        )
        note = legend.copy()
        if dropped:
            note.append(f"; names without {', '.join(repr(p) for p in dropped)}")
        if any("…" in cell for cell in _column_texts(table, 1)):
            note.append("; … marks a shortened name (--json has each in full)")
        return [note, table]

    return Fitted(build)


def _column_texts(table: Table, index: int) -> list[str]:
    return [getattr(cell, "plain", str(cell)) for cell in table.columns[index].cells]


def _grad_cell(line: ModelLine) -> Text:
    """'ok', 'nan q,k,v', 'error' or '-' (no backward) for the grad column."""
    verdict = line.grad_verdict
    if verdict is None:
        return Text("-")
    if verdict == "nan":
        return Text("nan " + "".join(name[1:] for name in line.grad_which), style="bold red")
    return Text(verdict, style=VERDICT_STYLE.get(verdict, ""))


def backward_summary(report: ModelReport, prefix: str = "") -> Text | None:
    """The first call whose gradients go wrong, and the least loss-scale headroom over the calls."""
    with_grads = [line for line in report.lines if line.grad_verdict is not None]
    if not with_grads:
        return None
    text = Text(f"Backward of {len(with_grads)} call(s) (dO recorded): ")
    if report.first_grad_bad is None:
        text.append("gradients finite in every call", style="green")
    else:
        line = report.lines[report.first_grad_bad]
        what = (
            f"NaN/inf in {line.grad_nan_rows} row(s) of {', '.join(line.grad_which)}, first cause {line.grad_cause}"
            if line.grad_nan_rows
            else "error finding " + ", ".join(code for code in line.errors if code.startswith("grad_"))
        )
        text.append(
            f"first call whose gradients go wrong: #{line.index} {call_label(line, prefix)}: {what}", style="bold red"
        )
    rooms = [line for line in with_grads if line.grad_headroom is not None]
    if rooms:
        least = min(rooms, key=lambda line: line.grad_headroom)
        text.append(
            f"; least loss-scale headroom: dO may grow {plain(least.grad_headroom)}x before {least.grad_headroom_at} "
            f"overflows (#{least.index} {call_label(least, prefix)})",
            style="red" if least.grad_headroom < 1 else ("yellow" if least.grad_headroom < 2 else ""),
        )
    return text


def shared_facts(report: ModelReport) -> str:
    """'every call: shape 2x8x16x16, cell torch/fp16' for what the table leaves out."""
    facts = []
    shapes = {line.shape for line in report.lines}
    cells = {line.cell for line in report.lines}
    if len(shapes) == 1:
        facts.append(f"shape {_shape(next(iter(shapes)))}")
    if len(cells) == 1:
        facts.append(f"cell {next(iter(cells)) or '-'}")
    return ("every call: " + ", ".join(facts)) if facts else ""


def ranks_block(report: ModelReport) -> Text | None:
    """A capture of several processes (torchrun): each rank's own account, one line each."""
    if len(report.ranks) < 2:  # one rank's own report says so in its capture note
        return None
    world = (report.capture or {}).get("world")
    of = f" of {world}" if world else ""
    text = Text(f"Ranks ({len(report.ranks)}{of}; the calls above are every rank's, r0, r1, ...):\n")
    for r in report.ranks:
        head = f"  rank {r.rank}: {r.calls} call(s), {r.errors} error(s), {r.warnings} warning(s)"
        head += "" if r.complete else ", incomplete"
        if r.first_bad is None:
            text.append(head + "; no call goes wrong\n", style="yellow" if r.warnings or not r.complete else "green")
        else:
            line = report.lines[r.first_bad]
            cause = f", first cause {line.first_cause}" if line.first_cause else ""
            said = f"{head}; first call that goes wrong: #{line.index} {call_label(line)}: {line.verdict}{cause}"
            text.append(visible(said) + "\n", style="bold red")
    text.rstrip()
    return text


def rope_what_if_lines(capture: dict | None) -> list[str]:
    """--what-if rope:DTYPE: each recorded rotary table recomputed in the dtype, one line each; a capture with no
    rotary table says so."""
    out = []
    unanswered = (capture or {}).get("rope_what_if_unanswered")
    if unanswered:
        asked = ", ".join(f"rope:{d}" for d in unanswered)
        out.append(
            f"no rotary tables in this capture: {asked} has nothing to recompute (no call recorded a rotary table: "
            "a model without RoPE, or one whose attention is not passed position_embeddings)"
        )
    for check in (capture or {}).get("rope") or ():
        for w in check.what_if:
            distinct = (
                f"positions stop being distinct at {w.first_indistinct:,}"
                if w.first_indistinct is not None
                else "positions stay distinct"
            )
            affected = (
                f"first position affected {w.first_affected:,} ({w.affected_positions:,} positions past "
                f"{check.tolerance:g} rad)"
                if w.first_affected is not None
                else "no position past the tolerance"
            )
            error = "not finite" if w.max_angle_error is None else f"{w.max_angle_error:.3g} rad"
            out.append(
                f"{table_name(check)} computed in {w.dtype} (positions {check.first_position:,} .. "
                f"{check.last_position:,}): {distinct}; {affected}; angle error up to {error}"
            )
    return out


def rope_not_judged_lines(capture: dict | None) -> list[str]:
    """The recorded rotary tables that were not judged (a RoPE type not modelled, theta unknown, ...), one line each
    with the reason, which names the type."""
    return [
        f"{table_name(check)} ({len(check.calls)} call(s)): {check.note}"
        for check in (capture or {}).get("rope") or ()
        if not check.judged
    ]


def rope_fitted_lines(capture: dict | None) -> list[str]:
    """The rotary tables judged against a theta fitted to them (no config recorded), with how well it fits."""
    return [
        f"{table_name(check)} ({len(check.calls)} call(s)): theta {check.theta:g} ({theta_source(check)})"
        for check in (capture or {}).get("rope") or ()
        if check.judged and check.theta_from == "fitted"
    ]


def capture_block(report: ModelReport) -> Group | None:
    """The capture's own findings (capture_incomplete, rope_precision), each a diagnostic; the rotary tables not
    judged; and the RoPE what-ifs."""
    what_ifs = rope_what_if_lines(report.capture)
    unjudged = rope_not_judged_lines(report.capture)
    fitted = rope_fitted_lines(report.capture)
    if not report.findings and not what_ifs and not unjudged and not fitted:
        return None
    parts: list[Any] = [Text("Findings of the capture itself", style="bold")] if report.findings else []
    for f in report.findings:
        parts += [diagnostic(f.severity, f.code, f.message, None, f.fix), Text("")]
    if unjudged:
        parts.append(_titled("Rotary tables not judged:", unjudged, "yellow"))
    if fitted:
        parts.append(_titled("Rotary tables judged against a theta fitted to them (no config recorded):", fitted))
    if what_ifs:
        parts.append(
            _titled("What if the rotary tables were computed in another dtype (--what-if rope:DTYPE):", what_ifs)
        )
    return Group(*parts)


def _titled(title: str, lines: list[str], style: str = "") -> Text:
    """A bold title and its lines, indented, in ``style``."""
    text = Text(title + "\n", style="bold")
    for line in lines:
        text.append(f"  {visible(line)}\n", style=style)
    text.rstrip()
    return text
