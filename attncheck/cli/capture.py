"""``attncheck capture [OPTIONS] [--] SCRIPT [ARGS]...``: run a Python script under
``attncheck.capture``, unchanged, then diagnose every attention call it made (as ``run`` does
for the capture directory). Exit codes as ``run``; a script that fails is shown once (its own
traceback), then one line, exit 2.

torch is imported only once the options are known to be good.
"""

from __future__ import annotations

import os
import traceback
from typing import List, Optional

import typer

from attncheck import params
from attncheck.cli.common import check_output_path, fail
from attncheck.cli.emit import emit
from attncheck.cli.options import (
    BlockOpt,
    BriefOpt,
    CellDtypeOpt,
    CellMethodOpt,
    DetailOpt,
    DeviceOpt,
    FailOnOpt,
    FullOpt,
    IgnoreOpt,
    JsonOpt,
    MaxMemoryOpt,
    MaxOffsetOpt,
    PartialOpt,
    PathOpt,
    QuietOpt,
    RescaleThresholdOpt,
    SummaryOpt,
    WhatIfOpt,
    notices,
    progress_shown,
)
from attncheck.cli.run_checks import Accum, Order, cell_options, check_summary, fa4_options, parse_fail_on
from attncheck.cli.run_options import AccumulateOpt
from attncheck.config.capture import DEFAULT_MAX_BYTES, DEFAULT_MAX_CALLS, DEFAULT_OUT, CaptureRequest, parse_forwards
from attncheck.config.rope import split_rope_what_if
from attncheck.config.run import chunk_elements_for, ignore_codes
from attncheck.errors import AttncheckError
from attncheck.pipelines.capture import capture_script
from attncheck.report.progress import Progress

CAPTURE = "Capture"


def capture(
    script: str = typer.Argument(
        ...,
        metavar="SCRIPT",
        help="The Python script to run (as 'python SCRIPT ARGS' would run it).",
        show_default=False,
    ),
    args: Optional[List[str]] = typer.Argument(
        None,
        metavar="ARGS",
        help="Arguments for the script; put '--' before the script when they look like options.",
        show_default=False,
    ),
    out: str = typer.Option(
        DEFAULT_OUT,
        "--out",
        "-o",
        metavar="DIR",
        help=(
            "Capture directory: one .safetensors per call and manifest.json (created; a previous capture there is "
            "replaced); under torchrun one per rank, DIR/rank0, DIR/rank1, ..."
        ),
        rich_help_panel=CAPTURE,
    ),
    no_save: bool = typer.Option(
        False, "--no-save", help="Write nothing: diagnose each call as it is recorded.", rich_help_panel=CAPTURE
    ),
    max_calls: str = typer.Option(
        str(DEFAULT_MAX_CALLS),
        "--max-calls",
        metavar="N",
        help="Stop recording after N calls (the script runs on).",
        rich_help_panel=CAPTURE,
    ),
    max_bytes: str = typer.Option(
        DEFAULT_MAX_BYTES,
        "--max-bytes",
        metavar="SIZE",
        help="Stop recording before the tensors recorded pass SIZE (e.g. 512MiB).",
        rich_help_panel=CAPTURE,
    ),
    module: List[str] = typer.Option(
        [],
        "--module",
        metavar="GLOB",
        help=(
            "Record only calls in modules whose path matches (repeatable), e.g. '*.layers.1.*'; a call outside any "
            "module is 'global'."
        ),
        rich_help_panel=CAPTURE,
    ),
    forward: Optional[str] = typer.Option(
        None,
        "--forward",
        metavar="N[,N|A-B]",
        help="Which forward passes of the top module to record (1-based), e.g. 1 or 2-4; default all.",
        rich_help_panel=CAPTURE,
    ),
    no_grads: bool = typer.Option(
        False,
        "--no-grads",
        help=(
            "Record the forward only: without it, when the script runs a backward, each call's output gradient and "
            "the gradients its kernel produced are recorded too (they count for --max-bytes) and every call's "
            "backward is diagnosed."
        ),
        rich_help_panel=CAPTURE,
    ),
    compile_mode: str = typer.Option(
        "eager",
        "--compile",
        metavar="eager|keep",
        help=(
            "torch.compile'd modules and functions: 'eager' runs their Python code (the compiler's force_eager "
            "stance), records its calls and says that the eager code is judged; 'keep' runs them compiled, "
            "unrecorded, and says how often."
        ),
        rich_help_panel=CAPTURE,
    ),
    dtype: CellDtypeOpt = None,
    method: CellMethodOpt = None,
    path: PathOpt = None,
    what_if: WhatIfOpt = None,
    block: BlockOpt = str(params.DEFAULT_BLOCK),
    order: Order = typer.Option("forward", "--order", help="Order in which the tiled method visits key blocks."),
    accum: Accum = typer.Option(
        "fp32", "--accum", help="Row sums of naive/stable: fp32 inside as torch does, or pairwise in the dtype."
    ),
    device: DeviceOpt = "auto",
    json_out: JsonOpt = None,
    fail_on: FailOnOpt = "",
    ignore: IgnoreOpt = "",
    summary: SummaryOpt = False,
    brief: BriefOpt = False,
    full: FullOpt = False,
    detail: DetailOpt = [],
    partial: PartialOpt = False,
    max_memory: MaxMemoryOpt = params.DEFAULT_MAX_MEMORY,
    quiet: QuietOpt = False,
    rescale_threshold: RescaleThresholdOpt = None,
    max_offset: MaxOffsetOpt = None,
    accumulate: AccumulateOpt = None,
) -> None:
    """Run a Python script under capture and diagnose every attention call it makes.

    Records each F.scaled_dot_product_attention call, each FlexAttention call (its block mask and its logits after the score_mod) and each softmax over the last axis of a 3+-D tensor inside a module (the eager path's scores, with the q, k, v of the matmuls around it), with the module path, without any change to the script or the model; when the script runs a backward (loss.backward()), each call's output gradient and the gradients its kernel produced too, so that every call's backward is judged as well. torch.compile'd code runs as its eager code by default, and the report says so (--compile). Each call is then judged by the cell its model ran, as 'attncheck run' judges the capture directory (which it can do again); --what-if asks about other dtypes and implementations apart. With --json -, what the script prints goes to stderr.

    Under torchrun (or any torch.distributed job: RANK and WORLD_SIZE set) each rank records into its own directory, OUT/rank0, OUT/rank1, ..., and judges its own calls: rank 0 prints its report, every other rank one line on stderr, and each exits by --fail-on on its own calls; --json FILE becomes one file per rank (FILE.rankN.json), --json - rank 0's. 'attncheck run OUT' then reports every rank, merged and per rank. A directory another process is writing is refused.

    Exit codes: 0 ran and nothing failed, 1 a --fail-on condition held, 2 usage or input error, or the script failed.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        conditions, ignored, request = _request(
            script,
            args,
            out,
            no_save,
            max_calls,
            max_bytes,
            module,
            forward,
            no_grads,
            compile_mode,
            dtype,
            method,
            path,
            what_if,
            block,
            order,
            accum,
            device,
            json_out,
            fail_on,
            ignore,
            summary,
            full,
            max_memory,
            rescale_threshold,
            max_offset,
            partial,
            accumulate,
        )
        say = notices(quiet)
        outcome = _run(request, quiet, say, json_out)
    except AttncheckError as e:
        raise fail(e) from None
    _emit_outcome(outcome, script, out, no_save, say, conditions, ignored, json_out, brief, full, detail, summary)


def _request(
    script,
    args,
    out,
    no_save,
    max_calls,
    max_bytes,
    module,
    forward,
    no_grads,
    compile_mode,
    dtype,
    method,
    path,
    what_if,
    block,
    order,
    accum,
    device,
    json_out,
    fail_on,
    ignore,
    summary,
    full,
    max_memory,
    rescale_threshold,
    max_offset,
    partial,
    accumulate=None,
):
    """The options checked and the capture request built from them: (--fail-on conditions, ignored codes,
    CaptureRequest). Raises AttncheckError on a bad option, before torch is imported."""
    conditions = parse_fail_on(fail_on)
    ignored = ignore_codes(ignore)
    check_output_path(json_out, "--json")
    check_summary(summary, full)
    rope_what_if, what_if = split_rope_what_if(what_if)  # rope:DTYPE asks about the rotary tables alone
    asked_what_if = params.what_if(what_if) if what_if is not None else ()
    sums = params.sum_specs(accumulate, "accumulate") if accumulate is not None else ()
    if sums and no_save:
        raise AttncheckError(
            "reads each call's tensors again after its diagnosis, and --no-save keeps none: drop --no-save (or "
            "capture first, then: attncheck run OUT --accumulate ...)",
            param="accumulate",
        )
    options, grid_asked = cell_options(
        dtype,
        method,
        path,
        block=params.integer(block, "block", 1),
        reverse=Order(order).value == "reverse",
        accum=Accum(accum).value,
        device=params.device(device),
        chunk_elements=chunk_elements_for(params.memory(max_memory, "max_memory")),
        **fa4_options(rescale_threshold, max_offset, path, asked_what_if, files=True),
    )
    if forward is not None:
        parse_forwards(forward)
    request = CaptureRequest(
        script,
        tuple(args or ()),
        None if no_save else out,
        params.integer(max_calls, "max_calls", 1),
        params.size(max_bytes, "max_bytes"),
        tuple(module),
        forward,
        options,
        ignored,
        partial,
        asked_what_if,
        grid_asked,
        grads=not no_grads,
        compile=params.choice(compile_mode, ("eager", "keep"), "compile"),
        rope_what_if=rope_what_if,
        accumulate=sums,
    )
    return conditions, ignored, request


def _run(request: CaptureRequest, quiet: bool, say, json_out: Optional[str]):
    """The script run under capture (a progress bar on a terminal) and its calls diagnosed: a CaptureOutcome."""
    show, forced = progress_shown(quiet)
    with Progress(show, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
        outcome = capture_script(request, progress.track, say, stdout_to_stderr=json_out == "-")
    return outcome


def _emit_outcome(outcome, script, out, no_save, say, conditions, ignored, json_out, brief, full, detail, summary):
    """A failed script's traceback and one line (exit 2); else the recording's notice and the report, each rank
    its own (rank 0 the report, the others their closing line; a JSON file per rank)."""
    cap = outcome.capture
    whose = "" if cap.rank is None else f"rank {cap.rank} of {cap.world}: "  # torchrun: each process says its rank
    out = out if cap.path is None else cap.path  # under torchrun: this rank's own directory, OUT/rankN
    if outcome.error is not None:
        _show_script_error(outcome.error, script)
        kept = whose + f"{len(cap.calls)} call(s) recorded" + (f" in {out} (manifest written)" if not no_save else "")
        why = (
            f"exit status {outcome.error.code}"
            if isinstance(outcome.error, SystemExit)
            else f"{type(outcome.error).__name__}{_where(outcome.error, script)}, traceback above"
        )
        raise fail(f"{script} failed ({why}); {kept}")
    if say is not None and not no_save:
        again = out if cap.rank is None else f"{cap.given_path} for every rank"
        stopped = f"; recording stopped: {cap.stopped}" if cap.stopped else ""
        say(whose + f"recorded {len(cap.calls)} call(s) in {out}{stopped} (again: attncheck run {again})")
    summary_only = None
    if cap.rank is not None:  # rank 0 prints its report, the others their closing line (stderr); JSON: a file per rank
        from attncheck.record.ranks import rank_file  # imports torch: only once the script has run

        summary_only = None if cap.rank == 0 else f"rank {cap.rank} of {cap.world}"
        if json_out == "-":
            json_out = None if cap.rank else "-"
        elif json_out is not None:
            json_out = rank_file(json_out, cap.rank)
    emit(
        outcome.result,
        conditions,
        ignored,
        json_out,
        brief=brief,
        full=full,
        detail=detail,
        summary_only=summary_only,
        summary=summary,
    )


def _where(error: BaseException, script: str) -> str:
    """' at line 3, column 7' (a syntax error: where the parser stopped), ' at line 12' (the last line of
    the script that ran), ' in other.py at line 3' (an imported file); '' when unknown."""
    target = os.path.abspath(script)
    if isinstance(error, SyntaxError) and error.lineno:
        place = f" at line {error.lineno}" + (f", column {error.offset}" if error.offset else "")
        return (
            place if not error.filename or os.path.abspath(error.filename) == target else f" in {error.filename}{place}"
        )
    line = None
    tb = error.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == target:
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f" at line {line}"


def _show_script_error(error: BaseException, script: str) -> None:
    """The script's traceback, from its own first frame on (not attncheck's or runpy's)."""
    if isinstance(error, SystemExit):
        return
    target = os.path.abspath(script)
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    text = (
        "".join(traceback.format_exception(type(error), error, tb))
        if tb is not None
        else "".join(traceback.format_exception_only(type(error), error))
    )
    typer.echo(text.rstrip(), err=True)
