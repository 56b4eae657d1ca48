"""``attncheck run``: parse the options, call ``pipelines.run``, render, exit 0 / 1 / 2.

torch is imported inside the command only, so ``--help`` and argument errors stay fast.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Optional

from attncheck import params
from attncheck.cli.common import (
    check_output_path,
    fail,
    require_stdout,
)
from attncheck.cli.emit import emit
from attncheck.cli.options import (
    DEFAULT_DTYPES,
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
    ScaleOpt,
    SummaryOpt,
    WhatIfOpt,
    notices,
    progress_shown,
)
from attncheck.cli.run_checks import (
    Accum,
    MaskConvention,
    MaskOp,
    Order,
    ScaleOrder,
    cell_options,
    check_summary,
    fa4_options,
    fp8_options,
    parse_fail_on,
)
from attncheck.cli.run_options import (
    AccumOpt,
    AccumulateOpt,
    BudgetOpt,
    CausalOpt,
    ExactOpt,
    ExampleOpt,
    Fp8AccumOpt,
    Fp8FlushOpt,
    Fp8ScalingOpt,
    GradOutOpt,
    IncoherentOpt,
    KeyOpt,
    KOpt,
    MaskConventionOpt,
    MaskOpOpt,
    MaskOpt,
    MaskValueOpt,
    OrderOpt,
    PadLeftOpt,
    PadRightOpt,
    PathsArg,
    PScaleOpt,
    QOpt,
    RowsOpt,
    ScaleOrderOpt,
    VOpt,
)
from attncheck.config.rope import split_rope_what_if
from attncheck.config.run import QKSpec, RunRequest, chunk_elements_for, ignore_codes
from attncheck.errors import AttncheckError, param
from attncheck.options import Bounded
from attncheck.report.progress import Progress


def run(
    paths: PathsArg = None,
    example: ExampleOpt = False,
    dtype: CellDtypeOpt = None,
    method: CellMethodOpt = None,
    what_if: WhatIfOpt = None,
    block: BlockOpt = str(params.DEFAULT_BLOCK),
    order: OrderOpt = "forward",
    accum: AccumOpt = "fp32",
    device: DeviceOpt = "auto",
    key: KeyOpt = [],
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
    q: QOpt = None,
    k: KOpt = None,
    v: VOpt = None,
    path: PathOpt = None,
    mask: MaskOpt = None,
    scale: Annotated[Optional[str], ScaleOpt.__metadata__[0]] = None,
    scale_order: ScaleOrderOpt = None,
    causal: CausalOpt = False,
    pad_left: PadLeftOpt = "",
    pad_right: PadRightOpt = "",
    mask_value: MaskValueOpt = None,
    mask_convention: MaskConventionOpt = None,
    grad_out: GradOutOpt = None,
    mask_op: MaskOpOpt = None,
    p_scale: PScaleOpt = None,
    fp8_scaling: Fp8ScalingOpt = None,
    incoherent: IncoherentOpt = False,
    fp8_accum: Fp8AccumOpt = None,
    fp8_flush: Fp8FlushOpt = None,
    rescale_threshold: RescaleThresholdOpt = None,
    max_offset: MaxOffsetOpt = None,
    accumulate: AccumulateOpt = None,
    budget: BudgetOpt = None,
    rows: RowsOpt = None,
    exact: ExactOpt = False,
) -> None:
    """Diagnose saved attention scores (pre-softmax logits), the scores Q and K produce, or a capture.

    Every method x dtype cell is judged against a float64 softmax of the scores as given. With --q/--k, every attention path (eager, sdpa-math, flash) x dtype is judged against float64 softmax of Q@K^T, scale and mask, with --v its output O = P@V against P64 @ V64, and with --grad-out its backward (dQ, dK, dV) against float64 autograd. With scores files and --q/--k together, the scale that maps q.k onto the scores is fitted and checked.

    A capture directory (attncheck capture) or a call file is read as attention calls, and each call is judged by the cell its model ran (softmax: torch.softmax in its dtype; SDPA: the path of the backend PyTorch chose, in the call's dtype): that cell alone decides the verdict, the findings and --fail-on. --what-if DTYPES (or all), and --dtype/--method/--path when given, ask other cells as what-ifs, reported apart. A file of q/k/v/mask tensors is read as a call of unknown implementation: every cell is asked. More than one call gets the model report (--full for every table).

    Under torchrun (torchrun --nproc-per-node N -m attncheck run CAPTURE) the calls are split over the ranks, each computing on its own device (--device cuda: the rank's GPU, LOCAL_RANK), and rank 0 prints the report and writes the JSON a single process would; the other ranks print nothing but errors, and every rank exits with the same code.

    Exit codes: 0 ran and nothing failed, 1 a --fail-on condition held, 2 usage or input error.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        conditions, ignored, request = _request(
            paths,
            example,
            dtype,
            method,
            what_if,
            block,
            order,
            accum,
            device,
            key,
            json_out,
            fail_on,
            ignore,
            summary,
            full,
            partial,
            max_memory,
            q,
            k,
            v,
            path,
            mask,
            scale,
            scale_order,
            causal,
            pad_left,
            pad_right,
            mask_value,
            mask_convention,
            grad_out,
            mask_op,
            p_scale,
            fp8_scaling,
            incoherent,
            fp8_accum,
            fp8_flush,
            rescale_threshold,
            max_offset,
            accumulate,
            budget,
            rows,
            exact,
        )
        # this imports torch: not for --help or a bad argument
        from attncheck.pipelines.ranks import split_job

        job = split_job()  # under torchrun the ranks split the calls, and rank 0 alone reports
    except AttncheckError as e:
        raise fail(e) from None
    _run(request, job, quiet, conditions, ignored, json_out, brief, full, detail, summary)


def _request(
    paths,
    example,
    dtype,
    method,
    what_if,
    block,
    order,
    accum,
    device,
    key,
    json_out,
    fail_on,
    ignore,
    summary,
    full,
    partial,
    max_memory,
    q,
    k,
    v,
    path,
    mask,
    scale,
    scale_order,
    causal,
    pad_left,
    pad_right,
    mask_value,
    mask_convention,
    grad_out,
    mask_op,
    p_scale,
    fp8_scaling,
    incoherent,
    fp8_accum,
    fp8_flush,
    rescale_threshold,
    max_offset,
    accumulate,
    budget,
    rows,
    exact,
):
    """The options checked (every value, whether or not it applies; then what does not apply is named) and the
    RunRequest built: (the --fail-on conditions, the codes ignored, the request). Raises AttncheckError on a bad
    option, before torch is imported."""
    require_stdout()  # every report ends on standard output: refuse a closed one before any work
    conditions = parse_fail_on(fail_on)
    ignored = ignore_codes(ignore)
    memory = params.memory(max_memory, "max_memory")
    check_output_path(json_out, "--json")
    check_summary(summary, full)
    rope_what_if, what_if = split_rope_what_if(what_if)  # rope:DTYPE asks about the rotary tables alone
    asked_what_if = params.what_if(what_if) if what_if is not None else ()
    sums = params.sum_specs(accumulate, "accumulate") if accumulate is not None else ()
    options, grid_asked = _cell_options(
        dtype,
        method,
        path,
        block,
        order,
        accum,
        device,
        memory,
        p_scale,
        fp8_scaling,
        incoherent,
        q,
        k,
        fp8_accum,
        fp8_flush,
        asked_what_if,
        paths,
        rescale_threshold,
        max_offset,
        example,
        budget,
        rows,
        exact,
    )
    qk = _qk_spec(
        paths,
        example,
        path,
        q,
        k,
        v,
        mask,
        scale,
        scale_order,
        causal,
        pad_left,
        pad_right,
        mask_value,
        mask_convention,
        grad_out,
        mask_op,
    )
    _check_what_if(asked_what_if, example, qk, paths, rope_what_if)
    request = RunRequest(
        tuple(paths or ()),
        tuple(key),
        example,
        qk,
        options,
        max_memory=memory,
        ignore=ignored,
        partial=partial,
        what_if=asked_what_if,
        grid_asked=grid_asked,
        accumulate=sums,
        rope_what_if=rope_what_if,
    )
    return conditions, ignored, request


def _cell_options(
    dtype,
    method,
    path,
    block,
    order,
    accum,
    device,
    memory,
    p_scale,
    fp8_scaling,
    incoherent,
    q,
    k,
    fp8_accum,
    fp8_flush,
    asked_what_if,
    paths,
    rescale_threshold,
    max_offset,
    example,
    budget,
    rows,
    exact,
):
    """The cells asked (--dtype/--method/--path) and the options they run with (block, order, accumulator, device,
    FP8 and FA4 settings, --budget/--rows): (Options, whether the grid was asked)."""
    options, grid_asked = cell_options(
        dtype,
        method,
        path,
        block=params.integer(block, "block", 1),
        reverse=Order(order).value == "reverse",
        accum=Accum(accum).value,
        device=params.device(device),
        chunk_elements=chunk_elements_for(memory),
        **fp8_options(
            dtype or DEFAULT_DTYPES,
            p_scale,
            fp8_scaling,
            incoherent,
            qk_given=q is not None or k is not None,
            fp8_accum=fp8_accum,
            fp8_flush=fp8_flush,
            path=path,
            what_if=asked_what_if,
            files=bool(paths) and q is None and k is None,
        ),
        **fa4_options(
            rescale_threshold,
            max_offset,
            path,
            asked_what_if,
            files=bool(paths) and q is None and k is None,
            example=example,
            dtype=dtype or DEFAULT_DTYPES,
        ),
    )
    options = with_bounded(options, budget, rows, exact)
    return options, grid_asked


def _qk_spec(
    paths,
    example,
    path,
    q,
    k,
    v,
    mask,
    scale,
    scale_order,
    causal,
    pad_left,
    pad_right,
    mask_value,
    mask_convention,
    grad_out,
    mask_op,
):
    """--q/--k/--v and the options of scores computed from them, checked: a QKSpec, or None without --q/--k (then
    none of those options may be given)."""
    # Every value is checked, whether or not it applies; then what does not apply is named.
    scales = params.scales(scale) if scale is not None else (params.Scale("auto"),)
    if len(scales) != 1:
        raise AttncheckError(f"give one scale for run, got {len(scales)}", param="scale")
    value = params.mask_value(mask_value) if mask_value is not None else None
    lefts, rights = tuple(params.lengths(pad_left, "pad_left")), tuple(params.lengths(pad_right, "pad_right"))
    qk = None
    if q is None and k is None and v is not None:
        raise AttncheckError(f"{param('v')} applies to attention computed from {param('q')} and {param('k')}")
    if grad_out is not None and v is None:
        raise AttncheckError(
            f"{param('grad_out')} needs {param('v')} (the backward of attention reads V)"
            + ("" if q is not None else f", {param('q')} and {param('k')}")
        )
    if mask_op is not None and grad_out is None:
        raise AttncheckError(f"{param('mask_op')} decides the eager path's backward: give {param('grad_out')} too")
    if example and path is not None:
        raise AttncheckError(
            f"{param('paths')} applies to attention calls (a capture, q/k files) and to "
            f"{param('q')}/{param('k')}, not to the built-in example's scores"
        )
    if q is not None or k is not None:
        if q is None or k is None:
            raise AttncheckError(f"{param('q')} and {param('k')} go together: give both")
        qk = QKSpec(
            q,
            k,
            mask,
            v,
            scales[0],
            ScaleOrder(scale_order).value if scale_order else "scores",
            causal,
            lefts,
            rights,
            value,
            MaskConvention(mask_convention).value if mask_convention else None,
            grad_out,
            MaskOp(mask_op).value if mask_op else None,
        )
    else:
        given = [
            name
            for name, val in (
                ("mask", mask),
                ("causal", causal or None),
                ("pad_left", pad_left or None),
                ("pad_right", pad_right or None),
                ("scale", scale),
                ("scale_order", scale_order),
                ("mask_value", mask_value),
                ("mask_convention", mask_convention),
            )
            if val is not None
        ]
        if given:
            named = ", ".join(param(n) for n in given)
            # a file holding q and k given as a path: the flags take it by key (PATH:KEY)
            hint = (
                f" (a file holding q, k and v: {param('q')} FILE:q {param('k')} FILE:k {param('v')} FILE:v)"
                if paths
                else ""
            )
            raise AttncheckError(
                f"{named} {'applies' if len(given) == 1 else 'apply'} to scores computed from {param('q')} and "
                f"{param('k')}, which are not given{hint}"
            )
    return qk


def _check_what_if(asked_what_if, example, qk, paths, rope_what_if=()) -> None:
    """--what-if kv:... and the cell what-ifs refused where they do not apply (the example, --q/--k)."""
    if rope_what_if and (example or qk is not None):
        raise AttncheckError(
            f"{param('what_if')} rope:DTYPE recomputes the rotary tables a capture recorded; "
            f"{param('example') + ' carries' if example else param('q') + '/' + param('k') + ' carry'} no rotary table"
        )
    if params.kv_what_ifs(asked_what_if) and (example or (qk is not None and qk.v is None)):
        raise AttncheckError(
            f"{param('what_if')} kv:... replays attention from a quantised KV cache: give a capture, or "
            f"{param('q')}, {param('k')} and {param('v')}"
        )
    cell_what_if = params.cell_what_ifs(asked_what_if)  # the KV cache's are asked of --q/--k/--v too
    sweeps_only = all(w in params.setting_sweeps() for w in cell_what_if)  # --what-if fa4: any Q/K input
    if cell_what_if and (example or (qk is not None and (not sweeps_only or paths))):
        raise AttncheckError(
            f"{param('what_if')} asks about a captured model's calls; with {param('q')}/{param('k')} or "
            f"{param('example')} every cell is computed already (choose them with {param('dtypes')}, "
            f"{param('methods')}, {param('paths')}"
            + "".join(
                f"; {param('what_if')} {w} sweeps a kernel's settings on {param('q')}/{param('k')} without score files"
                for w in params.setting_sweeps()
            )
            + ")"
        )


def _run(request, job, quiet, conditions, ignored, json_out, brief, full, detail, summary) -> None:
    """The request run (split over the ranks under torchrun, a progress bar on a terminal) and its report emitted:
    rank 0 alone reports."""
    # these import torch: not for --help or a bad argument
    from attncheck.pipelines.ranks import joined
    from attncheck.pipelines.run import run as run_pipeline

    silent = job is not None and job.rank != 0  # the other ranks say nothing but errors, and exit as rank 0 does
    with joined(job):
        try:
            show, forced = progress_shown(quiet or silent)
            with Progress(show, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
                result = run_pipeline(request, progress.track, notices(quiet or silent))
        except AttncheckError as e:
            raise fail(e) from None
        emit(
            result, conditions, ignored, json_out, brief=brief, full=full, detail=detail, summary=summary, silent=silent
        )


def with_bounded(options, budget: str | None, rows: str | None, exact: bool):
    """--budget/--rows as the options' ``Bounded``; --exact (or neither): every row, as without them."""
    sample = params.integer(rows, "rows", 1) if rows is not None else None
    seconds = params.number(budget, "budget", positive=True) if budget is not None else None
    if exact and (sample is not None or seconds is not None):
        raise AttncheckError(
            f"{param('exact')} computes every row; give it without {param('budget')} and {param('rows')}"
        )
    if sample is not None and seconds is not None:
        raise AttncheckError(f"give {param('budget')} or {param('rows')}, not both")
    if sample is None and seconds is None:
        return options
    return replace(options, bounded=Bounded(rows=sample, budget=seconds))
