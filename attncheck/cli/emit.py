"""The end of ``attncheck run`` and ``attncheck capture``: the report a result asks for (the model report, the
per-tensor one or the one-screen summary), the JSON, the --fail-on verdict and the exit code."""

from __future__ import annotations

import fnmatch
import json

import typer

from attncheck.cli.common import EXIT_FAILED, EXIT_OK, fail, report_console, say, write_json
from attncheck.codes import WHAT_IF_PREFIX
from attncheck.errors import AttncheckError
from attncheck.findings import failed_by_findings, failed_conditions
from attncheck.report.kvcache import kv_block, kv_json


def emit(
    result,
    conditions: list[str],
    ignored: tuple[str, ...],
    json_out: str | None,
    *,
    brief: bool,
    full: bool,
    detail: list[str],
    summary: bool = False,
    summary_only: str | None = None,
    silent: bool = False,
) -> None:
    """Print the report (the model report for several calls, else the per-tensor one; with ``summary``
    the one-screen answer), write the JSON, and exit 0, or 1 when a --fail-on condition holds, or 2
    when calls were skipped. ``summary_only``: a label; only the closing line is said, on stderr, under it
    (one rank of several). ``silent``: nothing printed or written, the same exit code (a rank other than rank 0 of
    a run split over torchrun's ranks, whose report rank 0 prints)."""
    failed, what_ifs, kv = _failed(result, conditions, ignored)
    chosen = _chosen(result, detail)
    if silent:
        raise typer.Exit(2 if result.model is not None and result.model.skipped else EXIT_FAILED if failed else EXIT_OK)
    if json_out is not None:
        _write_json(result, failed, kv, json_out)
    if summary_only is not None and result.model is not None:  # one process of several (torchrun): its closing line
        from attncheck.report.model import closing_line  # ~0.1 s to import: not for --help or a bad argument

        say(f"attncheck: {summary_only}: {closing_line(result.model, result.calls, result.device).plain}")
    elif json_out != "-":
        _print_report(result, what_ifs, chosen, brief=brief, full=full, summary=summary)
    if kv is not None and json_out != "-" and summary_only is None:
        report_console().print(kv_block(kv, brief=brief or summary, full=full))
    sums = getattr(result, "sums", None)
    if sums is not None and json_out != "-" and summary_only is None:
        from attncheck.report.lowsum import sums_block  # ~0.1 s to import: not for --help or a bad argument

        report_console().print(sums_block(sums, brief=brief or summary, full=full))
    _exit(result, failed)


def _failed(result, conditions: list[str], ignored: tuple[str, ...]):
    """The --fail-on conditions that hold: (those failed, the what-if diagnoses, the KV-cache what-ifs or None). The
    model's conditions on its cells, what-if:COND on the what-ifs; a what-if condition with no what-if computed is
    refused."""
    # attncheck.model (~27 ms): not for --help or a bad argument
    from attncheck.model import INHERITED

    failed = failed_conditions(result.tensors, [c for c in conditions if not c.startswith(WHAT_IF_PREFIX)], ignored)
    what_ifs = [c.what_if for c in result.calls if c.what_if is not None]
    asked = [c.removeprefix(WHAT_IF_PREFIX) for c in conditions if c.startswith(WHAT_IF_PREFIX)]
    failed += [
        WHAT_IF_PREFIX + f for f in failed_conditions(what_ifs, asked, (*ignored, *INHERITED))
    ]  # inherited NaN is the model's
    kv = getattr(result, "kv", None)  # --what-if kv:...
    if kv is not None:
        # On a capture the cache is a what-if, failing only what-if:COND; on --q/--k/--v, whose implementation is
        # not known, it is one more computation asked of the tensors, counted as their cells are
        counted = result.model is None or not result.model.known
        own = [c for c in conditions if not c.startswith(WHAT_IF_PREFIX)] if counted else []
        for what in kv.caches:
            failed += [WHAT_IF_PREFIX + f for f in failed_by_findings(what.findings, asked, ignored, what.name)]
            failed += failed_by_findings(what.findings, own, ignored, what.name)
    sums = getattr(result, "sums", None)  # --accumulate on a capture: a what-if, failing only what-if:COND
    if sums is not None:
        failed += [WHAT_IF_PREFIX + f for f in failed_by_findings(sums.findings, asked, ignored, "--accumulate")]
    if (
        asked
        and not what_ifs
        and kv is None
        and sums is None
        and not any(c.sinks is not None and c.sinks.nosinks for c in result.calls)
    ):
        # a what-if condition with no what-if computed would pass whatever the model does: refused, not passed
        raise fail(
            AttncheckError(
                f"--fail-on {WHAT_IF_PREFIX}{asked[0]} judges nothing: no what-if was computed (none given, or none "
                "that applies: --what-if nosinks on calls without learned sinks)"
            )
        )
    if result.model is not None and result.model.findings:  # the capture's own (capture_incomplete)
        own = [c for c in conditions if not c.startswith(WHAT_IF_PREFIX)]
        failed += failed_by_findings(result.model.findings, own, ignored)
    return failed, what_ifs, kv


def _chosen(result, detail: list[str]) -> list:
    """The calls --detail names (fnmatch on module or name), each once; a pattern that matches none is refused."""
    chosen = []
    for pattern in detail:
        hit = [
            c
            for c in result.calls
            if c.diagnosis is not None
            and (fnmatch.fnmatchcase(c.call.module, pattern) or fnmatch.fnmatchcase(c.call.name, pattern))
        ]
        if not hit:
            names = ", ".join((c.call.module or c.call.name) for c in result.calls[:6])
            raise fail(
                AttncheckError(
                    f"'{pattern}' matches no call (calls: {names}{', ...' if len(result.calls) > 6 else ''})",
                    param="detail",
                )
            )
        chosen += [c for c in hit if c not in chosen]
    return chosen


def _write_json(result, failed: list[str], kv, json_out: str) -> None:
    """The run's JSON (with the KV-cache what-ifs) to --json."""
    # the report modules take ~0.1 s to import: inside, not for --help or a bad argument
    from attncheck.report.model import run_json

    try:
        doc = run_json(result.tensors, result.device, failed, result.model, result.calls)
        if kv is not None:
            doc["kv_cache"] = kv_json(kv)
        if getattr(result, "sums", None) is not None:
            from attncheck.report.lowsum import sums_json  # ~0.1 s to import: not for --help or a bad argument

            doc["accumulate"] = sums_json(result.sums)
        write_json(json.dumps(doc, indent=2, allow_nan=False), json_out)
    except AttncheckError as e:
        raise fail(e) from None


def _print_report(result, what_ifs, chosen, *, brief: bool, full: bool, summary: bool) -> None:
    """The report on standard output: the one-screen summary, the per-tensor report (one call, or --full) or the
    model report, and the --detail calls' diagnoses."""
    # the report modules take ~0.1 s to import: inside, not for --help or a bad argument
    from attncheck.report.run import print_report, render_diagnosis

    console = report_console()
    if summary:
        from attncheck.report.summary import (
            model_summary,
            tensors_summary,
        )  # ~0.1 s to import: not for --help or a bad argument

        if result.model is not None and result.model.known:  # a capture: judged by the model's cells
            console.print(model_summary(result.model, result.calls, result.device))
        else:
            console.print(tensors_summary(result.tensors, result.device, what_ifs))
        for c in chosen:
            console.print()
            console.print(render_diagnosis(c.diagnosis, verbose=not brief))
    elif full or result.model is None or (len(result.calls) <= 1 and not result.model.what_if):
        print_report(console, result.tensors, result.device, verbose=not brief, what_ifs=what_ifs)
        if result.model is not None:
            from attncheck.report.model import capture_block  # ~0.1 s to import: not for --help or a bad argument

            own = capture_block(result.model)  # its findings, and the RoPE what-ifs
            if own is not None:
                console.print(own)
        if result.model is not None:
            from attncheck.report.model import path_notes  # ~0.1 s to import: not for --help or a bad argument

            notes = path_notes(result.model, result.calls)
            if notes is not None:
                console.print(notes)
    else:
        from attncheck.report.model import print_model  # ~0.1 s to import: not for --help or a bad argument

        print_model(console, result.model, result.calls, result.device)
        for c in chosen:
            console.print()
            console.print(render_diagnosis(c.diagnosis, verbose=not brief))
            if c.what_if is not None:
                console.print(render_diagnosis(c.what_if, verbose=not brief))


def _exit(result, failed: list[str]) -> None:
    """The conditions that held said, the skipped calls' errors; exit 2 (skipped calls), 1 (a condition held), or 0."""
    for reason in failed:
        say(f"attncheck: --fail-on {reason}")
    if result.model is not None and result.model.skipped:
        for name, why in result.model.skipped:
            say(f"attncheck: error: {why}")
        raise typer.Exit(2)
    raise typer.Exit(EXIT_FAILED if failed else EXIT_OK)
