"""``attncheck run``: parse the options, call ``pipelines.run``, render, exit 0 / 1 / 2.

torch is imported inside the command only, so ``--help`` and argument errors stay fast.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, List, Optional

import typer

from attncheck import params
from attncheck.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    check_output_path,
    fail,
    report_console,
    require_stdout,
    say,
    write_json,
)
from attncheck.cli.options import (
    DEFAULT_DTYPES,
    DEFAULT_METHODS,
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
from attncheck.codes import FAIL_ON_WORDS, WHAT_IF_PREFIX, valid_fail_on
from attncheck.config.run import Options, QKSpec, RunRequest, chunk_elements_for, ignore_codes
from attncheck.errors import AttncheckError, param

Order = Enum("Order", {name: name for name in params.ORDERS}, type=str)
Accum = Enum("Accum", {name: name for name in params.ACCUMULATIONS}, type=str)
ScaleOrder = Enum("ScaleOrder", {name: name for name in params.SCALE_ORDERS}, type=str)
MaskConvention = Enum("MaskConvention", {name: name for name in params.MASK_CONVENTIONS}, type=str)
MaskOp = Enum("MaskOp", {name: name for name in params.MASK_OPS}, type=str)
QK = "Q/K inputs"
FP8 = "FP8 attention"


def parse_fail_on(value: str) -> list[str]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    for item in items:
        if not valid_fail_on(item):
            raise AttncheckError(
                f"unknown condition {item!r} (use {', '.join(FAIL_ON_WORDS)} or a finding code, or what-if:CONDITION)",
                param="fail_on",
            )
    return items


def cell_options(dtype: str | None, method: str | None, path: str | None, **how) -> tuple[Options, bool]:
    """The Options of --dtype/--method/--path (their defaults when not given) and whether any was
    given: on a capture, given ones are computed as what-ifs beside the model's cells."""
    options = Options(
        dtypes=params.dtypes(dtype if dtype is not None else DEFAULT_DTYPES),
        methods=params.methods(method if method is not None else DEFAULT_METHODS),
        paths=params.paths(path) if path is not None else (),
        **how,
    )
    return options, any(v is not None for v in (dtype, method, path))


def _fp8_options(
    dtype: str,
    p_scale: str | None,
    fp8_scaling: str | None,
    incoherent: bool,
    qk_given: bool,
    fp8_accum: str | None = None,
    fp8_flush: str | None = None,
    path: str | None = None,
    what_if: tuple[str, ...] = (),
    files: bool = False,
) -> dict:
    """--p-scale, --fp8-scaling, --incoherent, --fp8-accum, --fp8-flush: checked, and refused where they would
    change nothing."""
    from attncheck.registry import fp8_names

    out: dict = {"incoherent": incoherent}
    if fp8_accum is not None:
        out["fp8_accum"] = params.fp8_accum(fp8_accum, "fp8_accum")
    if fp8_flush is not None:
        out["fp8_flush"] = params.integer(fp8_flush, "fp8_flush", 1)
    given = [
        name
        for name, value in (
            ("p_scale", p_scale),
            ("fp8_scaling", fp8_scaling),
            ("incoherent", incoherent or None),
            ("fp8_accum", fp8_accum),
            ("fp8_flush", fp8_flush),
        )
        if value is not None
    ]
    # FP8 cells: in --dtype, or (a capture's what-if) in --what-if
    asked_fp8 = set(params.dtypes(dtype)) | ({d for d in what_if if d in fp8_names()} if files else set())
    if files and params.WHAT_IF_ALL in what_if:
        asked_fp8.add(params.WHAT_IF_FP8)
    if given and not asked_fp8 & set(fp8_names()):
        flags = ", ".join(param(g) for g in given)
        raise AttncheckError(
            f"{flags} appl{'y' if len(given) > 1 else 'ies'} to FP8 cells: add an FP8 dtype "
            f"({', '.join(fp8_names())}) to {param('dtypes')}"
            + (f" (on a capture: to {param('what_if')})" if files else "")
        )
    if not qk_given and (fp8_scaling is not None or incoherent):
        raise AttncheckError(
            f"{param('fp8_scaling')} and {param('incoherent')} apply to attention computed from {param('q')} and "
            f"{param('k')}"
        )
    if not qk_given and not files and (fp8_accum is not None or fp8_flush is not None):
        raise AttncheckError(
            f"{param('fp8_accum')} and {param('fp8_flush')} apply to attention computed from {param('q')} and "
            f"{param('k')} or a capture (the FP8 kernels' tensor-core products)"
        )
    if (fp8_accum is not None or fp8_flush is not None) and path is not None:
        from attncheck.registry import PATHS

        accumulating = PATHS.names(lambda spec: spec.fp8_accumulator)
        if not set(params.paths(path)) & set(accumulating):
            raise AttncheckError(
                f"{param('fp8_accum')} and {param('fp8_flush')} set the accumulator of the FP8 paths that model "
                f"Hopper's FP8 tensor cores ({', '.join(accumulating)}): none is in {param('paths')}"
            )
    if out.get("fp8_flush") is not None and out.get("fp8_accum") == "fp32":
        raise AttncheckError(
            f"{param('fp8_flush')} flushes the reduced FP8 accumulator into fp32; with {param('fp8_accum')} fp32 "
            "there is nothing to flush"
        )
    if p_scale is not None:
        out["p_scale"] = params.number(p_scale, "p_scale", positive=True)
    if fp8_scaling is not None:
        out["fp8_scaling"] = params.choice(fp8_scaling, params.FP8_SCALINGS, "fp8_scaling")
    return out


def fa4_options(
    threshold: str | None,
    offset: str | None,
    path: str | None,
    what_if: tuple[str, ...],
    files: bool,
    example: bool = False,
    dtype: str = "fp16,bf16,fp32",
) -> dict:
    """--rescale-threshold, --max-offset: checked (``params.fa4_settings``), and refused where no fa4 cell could
    take them: the fa4 path is not among --path, nor asked by --what-if (kernels, fa4), nor possibly a captured
    call's own kernel (``files``: inputs that may be a capture)."""
    given = [name for name, value in (("rescale_threshold", threshold), ("max_offset", offset)) if value is not None]
    if not given:
        return {}
    t, o = params.fa4_settings(threshold, offset)
    fa4 = params.setting_sweeps()
    asked = path is not None and any(p in fa4 for p in params.paths(path))
    flags = " and ".join(param(g) for g in given)
    if example:
        raise AttncheckError(
            f"{flags} {'set' if len(given) > 1 else 'sets'} FlashAttention-4's lazy rescale, which computes attention "
            f"from {param('q')}/{param('k')} or a capture, not the built-in example's scores"
        )
    if not (asked or files or any(w in (params.WHAT_IF_KERNELS, *fa4) for w in what_if)):
        raise AttncheckError(
            f"{flags} {'set' if len(given) > 1 else 'sets'} FlashAttention-4's lazy rescale: add fa4 to "
            f"{param('paths')} (or ask {param('what_if')} kernels)"
        )
    from attncheck.registry import fp8_names

    if offset is not None and not files and not (set(params.dtypes(dtype)) & set(fp8_names())):
        raise AttncheckError(
            f"{param('max_offset')} is FlashAttention-4's FP8 max offset (16-bit inputs run offset 0): add an FP8 "
            f"dtype ({', '.join(fp8_names())}) to {param('dtypes')}"
        )
    from attncheck.numerics.paths.fa4 import Fa4Setup  # torch-free

    return {"fa4": Fa4Setup(rescale_threshold=t, max_offset=o)}


def run(
    paths: Optional[List[str]] = typer.Argument(
        None,
        metavar="PATH",
        help="Score files (.pt .pth .npy .npz .safetensors) or directories. Softmax runs over the last axis.",
        show_default=False,
    ),
    example: bool = typer.Option(
        False,
        "--example",
        help="Diagnose a built-in example (unscaled head, -1e9 causal mask, left padding) instead of files.",
    ),
    dtype: CellDtypeOpt = None,
    method: CellMethodOpt = None,
    what_if: WhatIfOpt = None,
    block: BlockOpt = str(params.DEFAULT_BLOCK),
    order: Order = typer.Option("forward", "--order", help="Order in which the tiled method visits key blocks."),
    accum: Accum = typer.Option(
        "fp32", "--accum", help="Row sums of naive/stable: fp32 inside as torch does, or pairwise in the dtype."
    ),
    device: DeviceOpt = "auto",
    key: List[str] = typer.Option(
        [],
        "--key",
        metavar="GLOB",
        help=(
            "Glob selecting tensors inside files (repeatable), e.g. 'layers.*.scores'; a key written out in full "
            "selects that key alone."
        ),
    ),
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
    q: Optional[str] = typer.Option(
        None,
        "--q",
        metavar="PATH[:KEY]",
        help="Queries (..., heads, tokens, d). With --k, the scores are computed in each dtype as models do.",
        rich_help_panel=QK,
    ),
    k: Optional[str] = typer.Option(
        None,
        "--k",
        metavar="PATH[:KEY]",
        help="Keys (..., kv_heads, tokens, d); kv_heads may divide the query heads (GQA).",
        rich_help_panel=QK,
    ),
    v: Optional[str] = typer.Option(
        None,
        "--v",
        metavar="PATH[:KEY]",
        help=(
            "Values (..., kv_heads, tokens, dv): every cell then also computes the output O = P@V and its error "
            "against float64."
        ),
        rich_help_panel=QK,
    ),
    path: PathOpt = None,
    mask: Optional[str] = typer.Option(
        None,
        "--mask",
        metavar="PATH[:KEY]",
        help="Mask, boolean (see --mask-convention) or additive float, broadcast to (batch, heads, queries, keys).",
        rich_help_panel=QK,
    ),
    scale: Annotated[Optional[str], ScaleOpt.__metadata__[0]] = None,
    scale_order: Optional[ScaleOrder] = typer.Option(
        None,
        "--scale-order",
        help="Scale the scores after Q@K^T (default), or q before it.",
        rich_help_panel=QK,
        show_default=False,
    ),
    causal: bool = typer.Option(
        False, "--causal", help="Add a causal mask, aligned as PyTorch's is_causal (top left).", rich_help_panel=QK
    ),
    pad_left: str = typer.Option(
        "",
        "--pad-left",
        metavar="N,...",
        help="Left padding per batch element, e.g. 3,0: those keys are masked.",
        rich_help_panel=QK,
    ),
    pad_right: str = typer.Option(
        "", "--pad-right", metavar="N,...", help="Right padding per batch element.", rich_help_panel=QK
    ),
    mask_value: Optional[str] = typer.Option(
        None,
        "--mask-value",
        metavar="VALUE",
        help=(
            "What a key masked by a boolean mask, --causal or padding becomes: -inf (default), min "
            "(finfo(dtype).min) or a number such as -1e4."
        ),
        rich_help_panel=QK,
        show_default=False,
    ),
    mask_convention: Optional[MaskConvention] = typer.Option(
        None,
        "--mask-convention",
        help="Boolean masks: True = attend (SDPA, the default) or True = masked.",
        rich_help_panel=QK,
        show_default=False,
    ),
    grad_out: Optional[str] = typer.Option(
        None,
        "--grad-out",
        metavar="PATH[:KEY]",
        help=(
            "The output gradient dO (..., heads, tokens, dv), with --v: each path's backward (dQ, dK, dV) is judged "
            "too, against float64 autograd: NaN rows and their first cause, loss-scale headroom, flushed gradients, "
            "FlashAttention's 2x rule."
        ),
        rich_help_panel=QK,
    ),
    mask_op: Optional[MaskOp] = typer.Option(
        None,
        "--mask-op",
        help=(
            "How the eager path's code applies a boolean mask, which decides where a fully masked row's NaN goes in "
            "the backward: added to the scores (add, the default: dQ, dK and dV) or masked_fill (fill: dV only)."
        ),
        rich_help_panel=QK,
        show_default=False,
    ),
    p_scale: Optional[str] = typer.Option(
        None,
        "--p-scale",
        metavar="S",
        help=(
            "FP8 dtypes (--dtype e4m3, e5m2, ...): P is multiplied by S before the cast to FP8: 1, 256 "
            "(FlashAttention-3, the default), 448 (SageAttention) or another number."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
    fp8_scaling: Optional[str] = typer.Option(
        None,
        "--fp8-scaling",
        metavar="HOW",
        help=(
            "FP8 dtypes with --q/--k: how Q, K, V are quantised for flash-fp8: none, tensor, head (per batch and kv "
            "head, FlashAttention-3's descales; default) or block (per query and key tile of FlashAttention-3's FP8 "
            "kernel: 192 queries for d <= 96, 128 above)."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
    incoherent: bool = typer.Option(
        False,
        "--incoherent",
        help=(
            "FP8 dtypes with --q/--k: rotate Q and K by a seeded +-1 diagonal times Hadamard matrix before "
            "quantising (FlashAttention-3's incoherent processing; head dim a power of two)."
        ),
        rich_help_panel=FP8,
    ),
    fp8_accum: Optional[str] = typer.Option(
        None,
        "--fp8-accum",
        metavar="BITS",
        help=(
            "FP8 dtypes with --q/--k: the tensor cores' accumulator for P@V and FP8 Q@K^T: fp32, or the mantissa "
            "bits kept after each 32-element MMA step, 1..23 (default: the kernel's, 13 on Hopper, truncated)."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
    fp8_flush: Optional[str] = typer.Option(
        None,
        "--fp8-flush",
        metavar="N",
        help=(
            "FP8 dtypes with --q/--k: add P@V's reduced accumulator to an fp32 one every N key blocks (vLLM's "
            "two-level accumulation; default: the kernel's, none for flash-fp8, every block for sage)."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
    rescale_threshold: RescaleThresholdOpt = None,
    max_offset: MaxOffsetOpt = None,
) -> None:
    """Diagnose saved attention scores (pre-softmax logits), the scores Q and K produce, or a capture.

    Every method x dtype cell is judged against a float64 softmax of the scores as given. With --q/--k, every attention path (eager, sdpa-math, flash) x dtype is judged against float64 softmax of Q@K^T, scale and mask, with --v its output O = P@V against P64 @ V64, and with --grad-out its backward (dQ, dK, dV) against float64 autograd. With scores files and --q/--k together, the scale that maps q.k onto the scores is fitted and checked.

    A capture directory (attncheck capture) or a call file is read as attention calls, and each call is judged by the cell its model ran (softmax: torch.softmax in its dtype; SDPA: the path of the backend PyTorch chose, in the call's dtype): that cell alone decides the verdict, the findings and --fail-on. --what-if DTYPES (or all), and --dtype/--method/--path when given, ask other cells as what-ifs, reported apart. A file of q/k/v/mask tensors is read as a call of unknown implementation: every cell is asked. More than one call gets the model report (--full for every table).

    Exit codes: 0 ran and nothing failed, 1 a --fail-on condition held, 2 usage or input error.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        require_stdout()  # every report ends on standard output: refuse a closed one before any work
        conditions = parse_fail_on(fail_on)
        ignored = ignore_codes(ignore)
        memory = params.memory(max_memory, "max_memory")
        check_output_path(json_out, "--json")
        check_summary(summary, full)
        asked_what_if = params.what_if(what_if) if what_if is not None else ()
        options, grid_asked = cell_options(
            dtype,
            method,
            path,
            block=params.integer(block, "block", 1),
            reverse=Order(order).value == "reverse",
            accum=Accum(accum).value,
            device=params.device(device),
            chunk_elements=chunk_elements_for(memory),
            **_fp8_options(
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
                raise AttncheckError(
                    f"{named} {'applies' if len(given) == 1 else 'apply'} to scores computed from {param('q')} and "
                    f"{param('k')}, which are not given"
                )
        sweeps_only = all(w in params.setting_sweeps() for w in asked_what_if)  # --what-if fa4: any Q/K input
        if asked_what_if and (example or (qk is not None and (not sweeps_only or paths))):
            raise AttncheckError(
                f"{param('what_if')} asks about a captured model's calls; with {param('q')}/{param('k')} or "
                f"{param('example')} every cell is computed already (choose them with {param('dtypes')}, "
                f"{param('methods')}, {param('paths')}"
                + "".join(
                    f"; {param('what_if')} {w} sweeps a kernel's settings on {param('q')}/{param('k')} without score "
                    "files"
                    for w in params.setting_sweeps()
                )
                + ")"
            )
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
        )

        from attncheck.pipelines.run import run as run_pipeline
        from attncheck.report.progress import Progress

        show, forced = progress_shown(quiet)
        with Progress(show, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
            result = run_pipeline(request, progress.track, notices(quiet))
    except AttncheckError as e:
        raise fail(e) from None

    emit(result, conditions, ignored, json_out, brief=brief, full=full, detail=detail, summary=summary)


def check_summary(summary: bool, full: bool) -> None:
    """--summary and --full ask for two different reports."""
    if summary and full:
        raise AttncheckError(f"{param('summary')} and {param('full')} ask for two different reports; give one")


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
) -> None:
    """Print the report (the model report for several calls, else the per-tensor one; with ``summary``
    the one-screen answer), write the JSON, and exit 0, or 1 when a --fail-on condition holds, or 2
    when calls were skipped. ``summary_only``: a label; only the closing line is said, on stderr, under it
    (one rank of several)."""
    import fnmatch

    from attncheck.findings import failed_conditions
    from attncheck.model import INHERITED
    from attncheck.report.model import run_json
    from attncheck.report.run import print_report, render_diagnosis

    failed = failed_conditions(result.tensors, [c for c in conditions if not c.startswith(WHAT_IF_PREFIX)], ignored)
    what_ifs = [c.what_if for c in result.calls if c.what_if is not None]
    asked = [c.removeprefix(WHAT_IF_PREFIX) for c in conditions if c.startswith(WHAT_IF_PREFIX)]
    failed += [
        WHAT_IF_PREFIX + f for f in failed_conditions(what_ifs, asked, (*ignored, *INHERITED))
    ]  # inherited NaN is the model's
    if result.model is not None and result.model.findings:  # the capture's own (capture_incomplete)
        from attncheck.findings import failed_by_findings

        own = [c for c in conditions if not c.startswith(WHAT_IF_PREFIX)]
        failed += failed_by_findings(result.model.findings, own, ignored)
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
    if json_out is not None:
        try:
            write_json(
                json.dumps(
                    run_json(result.tensors, result.device, failed, result.model, result.calls),
                    indent=2,
                    allow_nan=False,
                ),
                json_out,
            )
        except AttncheckError as e:
            raise fail(e) from None
    if summary_only is not None and result.model is not None:  # one process of several (torchrun): its closing line
        from attncheck.report.model import closing_line

        say(f"attncheck: {summary_only}: {closing_line(result.model, result.calls, result.device).plain}")
    elif json_out != "-":
        console = report_console()
        if summary:
            from attncheck.report.summary import model_summary, tensors_summary

            if result.model is not None and result.model.known:  # a capture: judged by the model's cells
                console.print(model_summary(result.model, result.calls, result.device))
            else:
                console.print(tensors_summary(result.tensors, result.device, what_ifs))
            for c in chosen:
                console.print()
                console.print(render_diagnosis(c.diagnosis, verbose=not brief))
        elif full or result.model is None or (len(result.calls) <= 1 and not result.model.what_if):
            print_report(console, result.tensors, result.device, verbose=not brief, what_ifs=what_ifs)
            if result.model is not None and result.model.findings:
                from attncheck.report.model import capture_block

                console.print(capture_block(result.model))
            if result.model is not None:
                from attncheck.report.model import path_notes

                notes = path_notes(result.model, result.calls)
                if notes is not None:
                    console.print(notes)
        else:
            from attncheck.report.model import print_model

            print_model(console, result.model, result.calls, result.device)
            for c in chosen:
                console.print()
                console.print(render_diagnosis(c.diagnosis, verbose=not brief))
                if c.what_if is not None:
                    console.print(render_diagnosis(c.what_if, verbose=not brief))
    for reason in failed:
        say(f"attncheck: --fail-on {reason}")
    if result.model is not None and result.model.skipped:
        for name, why in result.model.skipped:
            say(f"attncheck: error: {why}")
        raise typer.Exit(2)
    raise typer.Exit(EXIT_FAILED if failed else EXIT_OK)
