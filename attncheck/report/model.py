"""The model report: many calls on one screen (the calls table: ``model_calls``; the head matrix: ``model_heads``;
the what-ifs and kernel replays: ``kernels``; its JSON: ``model_json``), put together here with its findings, legends,
settings grid and closing line. Formatting only."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.text import Text

from attncheck.codes import REGISTRY, SEVERITY
from attncheck.format import fmt, plain, visible
from attncheck.model import findings_in_order
from attncheck.report.bounded import model_sampling_line
from attncheck.report.diagnostics import EXPLAIN_HINT, diagnostic

# Re-exported (noqa): the CLI and the tests import the report's parts from here, where they were before the split
from attncheck.report.kernels import fitted_what_if_table, kernels_block, path_notes  # noqa: F401
from attncheck.report.model_calls import (  # noqa: F401
    backward_summary,
    call_label,
    capture_block,
    decode_block,
    fitted_lines_table,
    folded,
    folded_steps,
    ranks_block,
    shared_facts,
    shared_prefix,
)
from attncheck.report.model_heads import activity_block, fitted_head_matrix
from attncheck.report.model_json import run_json  # noqa: F401
from attncheck.report.model_sinks import sinks_block
from attncheck.report.run import settings_section
from attncheck.report.text import shown
from attncheck.results import CallReport, ModelReport

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def findings_summary(calls: list[CallReport], known: bool, first_bad: int | None = None, ignore=()) -> Group | None:
    """Each finding code once, as a diagnostic: its severity and what it means, in how many calls and
    the first of them, its fix (the model's cells' findings for a capture; every cell's for files of
    unknown implementation); causes before consequences (``model.findings_in_order``)."""
    seen = findings_in_order(calls, first_bad, ignore)
    if not seen:
        return None
    head = (
        "Findings of the cells the model runs (--detail NAME, --full: per-call reports)"
        if known
        else "Findings over all cells (--detail NAME, --full: per-call reports)"
    )
    parts: list[Any] = [Text(head, style="bold")]
    for code, severity, n, first, cause in seen:
        where = f"{n} call(s), first {first}"
        if cause:
            where += f"; after the first call that goes wrong ({cause}), whose NaN its input can carry"
        parts += [diagnostic(severity, code, REGISTRY[code].summary, where, REGISTRY[code].fix), Text("")]
    parts.append(Text(EXPLAIN_HINT, style="dim"))
    return Group(*parts)


def closing_line(report: ModelReport, calls: list[CallReport], device: str) -> Text:
    diags = [c.diagnosis for c in calls if c.diagnosis is not None]
    severities = [f.severity for d in diags for f in d.findings] + [f.severity for f in report.findings]
    errors, warnings = severities.count("error"), severities.count("warning")
    of = f" of {len(report.ranks)} ranks" if len(report.ranks) > 1 else ""
    where = f"recorded on {report.recorded_on}, judged on {device}" if report.recorded_on else f"on {device}"
    head = f"{len(report.lines)} call(s){of} {where}: {errors} error(s), {warnings} warning(s)"
    incomplete = [f for f in report.findings if f.code == "capture_incomplete"]
    gap = "".join("; " + f.message for f in incomplete)  # what was not judged, on the line CI logs show
    judged = "in the cells the model runs" if report.known else "in any cell"
    if report.what_if:
        broken = [a.cell for a in report.what_if if a.bad_calls]
        tail = f"; what-if: {', '.join(broken)} would break" if broken else "; what-if: no cell asked would break"
        warned = [
            a.cell for a in report.what_if if not a.bad_calls and any(SEVERITY.get(c) == "warning" for c in a.findings)
        ]
        if warned:  # said beside 'would break': --fail-on what-if:warning fails on them
            tail += f" (warnings in {', '.join(warned)})"
    else:
        tail = ""
    if report.first_bad is None:
        return shown(head + f"; no call goes wrong {judged}" + tail + gap, style="yellow" if warnings else "green")
    line = report.lines[report.first_bad]
    what = f"NaN in {line.nan_rows} row(s)" if line.nan_rows else line.verdict
    if line.verdict == "error":
        what = "error finding " + ", ".join(line.errors)
    cause = ""
    if line.first_cause:
        cause = f", first cause {line.first_cause}" + (
            f" in head {','.join(map(str, line.heads[:6]))}" if line.heads else ""
        )
    on = "" if line.rank is None else f" on rank {line.rank}"
    where = f"#{line.index} {call_label(line)} ({line.kind}, {line.cell or 'no cell'})"
    return shown(f"{head}; first call that goes wrong{on}: {where}: {what}{cause}{tail}{gap}", style="bold red")


LINES_LEGEND = (
    "Calls in order, judged by the cell the model runs (softmax: torch.softmax in its dtype; sdpa: the path of the "
    "kernel PyTorch chose, in its dtype: on a GPU fa2 (fa3, fa4 where PyTorch ran FlashAttention-3, -4), "
    "mem-efficient or cudnn, on a CPU flash, sdpa-math for the math backend; flash_attn: fa2-fma, fa3, fa4). "
    "logit: largest unmasked score; room: the cell's distance to its first failure{limit}; NaN: NaN rows; "
    "err: max |p - p_float64|; >: the first call that goes wrong{grad}"
)
FILES_LEGEND = (
    "Tensors and calls in order; the implementation is not known, so every cell is the question and a line's verdict "
    "counts every cell's error findings (the cell shown: torch.softmax in the tensor's dtype). "
    "logit: largest unmasked score; room: that cell's distance to its first failure{limit}; NaN: NaN rows; "
    "err: max |p - p_float64|; >: the first call that goes wrong{grad}"
)
GRAD_LEGEND = "; grad: the backward of that cell from the recorded dO (nan qkv: NaN/inf rows in dQ, dK, dV)"


def _limit_text(report: ModelReport) -> str:
    """' (S = Q@K^T in fp32 rounds to inf at |S| >= 3.40282e+38)' when every line's cell shares one
    limit; else ' (each cell's own: see the JSON report's limit)'."""
    limits = {line.limit.what for line in report.lines if line.limit is not None}
    if not limits:
        return " (none: no cell here fails from finite scores)" if report.lines else ""
    if len(limits) == 1 and all(line.limit is not None for line in report.lines):
        return f" ({next(iter(limits))})"
    return " (each cell's own: " + "; ".join(sorted(limits)) + "; '-': none)"


SETTING_CALLS_SHOWN = 12  # calls whose best settings are listed; the JSON has every call's


def call_settings_lines(report: ModelReport, prefix: str = "") -> Text | None:
    """--what-if fa4 over several calls: each call's best setting per dtype, beside its default's error."""
    if len(report.call_settings) < 2:
        return None
    text = Text("Best setting per call (its error; the default's where it is not the best):\n")
    for at, choices in report.call_settings[:SETTING_CALLS_SHOWN]:
        line = report.lines[at]
        parts = []
        for ch in choices:
            best, default = ch.point(ch.best), ch.point(ch.default)
            said = f"{ch.path}/{ch.dtype} " + ("none" if best is None else f"{best.label} {fmt(best.err, '.2g')}")
            if default is not None and default is not best:
                said += f" (default {default.label} {fmt(default.err, '.2g')})"
            parts.append(said)
        text.append(f"  #{line.index} {visible(call_label(line, prefix))}: ", style="bold")
        text.append("; ".join(parts) + "\n")
    if len(report.call_settings) > SETTING_CALLS_SHOWN:
        text.append(f"  ... {len(report.call_settings) - SETTING_CALLS_SHOWN} more in the JSON report\n")
    text.rstrip()
    return text


def render_model(report: ModelReport, calls: list[CallReport], device: str) -> Group:
    parts: list[Any] = []
    if report.capture:
        note = report.capture.get("note")
        if note:
            parts.append(shown(f"capture: {note}", style="yellow"))
    prefix = shared_prefix([line.module for line in report.lines])
    _calls_table(report, prefix, parts)
    decode = decode_block(report, prefix)
    if decode is not None:
        parts.append(decode)
    _score_mod_block(report, parts)
    good = folded_steps(report)  # decode steps that went well: the calls table's one line per module says them
    matrix = fitted_head_matrix([c for c in calls if (c.call.rank, c.call.index) not in good], report, prefix)
    if matrix is not None:
        parts.append(matrix)
    _outliers_block(report, parts)
    sinks = sinks_block(calls, prefix, report.decode)
    if sinks is not None:
        parts.append(sinks)
    activity = activity_block(report, prefix)
    if activity is not None:
        parts.append(activity)
    ranks = ranks_block(report)
    if ranks is not None:
        parts.append(ranks)
    own = capture_block(report)
    if own is not None:
        parts.append(own)
    summary = findings_summary(calls, report.known, report.first_bad, report.ignored)
    if summary is not None:
        parts.append(summary)
    grads = backward_summary(report, prefix)
    if grads is not None:
        parts.append(grads)
    table = fitted_what_if_table(report, prefix)
    if table is not None:
        parts.append(table)
    kernels = kernels_block(report, prefix)
    if kernels is not None:
        parts.append(kernels)
    settings = settings_section(report.settings)
    if settings is not None:
        parts.append(settings)
    for grid, n, why in report.settings_refused:
        parts.append(shown(f"{grid} (--what-if): not computed for {n} call(s): {why}", style="dim"))
        per_call = call_settings_lines(report, prefix)
        if per_call is not None:
            parts.append(per_call)
    notes = path_notes(report, calls, prefix)
    if notes is not None:
        parts.append(notes)
    for name, why in report.skipped:
        parts.append(shown(f"skipped {name}: {why}", style="yellow"))
    if report.ignored:
        parts.append(Text(f"ignored finding codes: {', '.join(report.ignored)}", style="dim"))
    sampled = model_sampling_line(calls)  # --budget/--rows: which figures are exact, which sampled
    if sampled is not None:
        parts.append(sampled)
    parts.append(closing_line(report, calls, device))
    return Group(*parts)


def _calls_table(report: ModelReport, prefix: str, parts: list) -> None:
    """The calls table, with its legend (the cells named, the limits, the shared facts), added to ``parts``."""
    shared = shared_facts(report)
    backward = any(line.grad_verdict is not None for line in report.lines)
    legend = (LINES_LEGEND if report.known else FILES_LEGEND).format(
        limit=_limit_text(report), grad=GRAD_LEGEND if backward else ""
    )
    if any(line.kind == "flex" for line in report.lines):
        legend = legend.replace(
            "sdpa-math for the math backend)",
            "sdpa-math for the math backend; flex: FlexAttention's fused "
            "kernel where flex_attention is torch.compile'd, flex-math where it is not)",
        )
    legend += (f"; calls named below {prefix[:-1]}" if prefix else "") + (f"; {shared}" if shared else "")
    parts.append(fitted_lines_table(folded(report), prefix, shown(legend)))


def _score_mod_block(report: ModelReport, parts: list) -> None:
    """The flex calls' score_mods, their largest logit before and after, added to ``parts``."""
    modded = [line for line in report.lines if line.score_mod is not None]
    if modded:
        text = Text("Flex score_mod (judged on the logits after it; largest unmasked logit before -> after):\n")
        for line in modded[:12]:
            before = "-" if line.logit_before_mod is None else plain(line.logit_before_mod)
            text.append(
                f"  #{line.index} {visible(line.module)}: {visible(line.score_mod)} {before} -> "
                f"{plain(line.max_logit)}\n"
            )
        if len(modded) > 12:
            text.append(f"  ... {len(modded) - 12} more in the JSON report\n")
        text.rstrip()
        parts.append(text)


def _outliers_block(report: ModelReport, parts: list) -> None:
    """The outlier heads (max|q| or max|k| far above the call's other heads), added to ``parts``."""
    if report.outliers:
        text = Text(
            "Outlier heads (max|q| or max|k| >= 10x the median over the call's other heads; k per kv head):\n",
            style="yellow",
        )
        for o in report.outliers[:12]:
            text.append(f"  {visible(o.message)}\n")
        if len(report.outliers) > 12:
            text.append(f"  ... {len(report.outliers) - 12} more in the JSON report\n")
        text.rstrip()
        parts.append(text)


def print_model(console: Console, report: ModelReport, calls: list[CallReport], device: str) -> None:
    console.print(render_model(report, calls, device))
