"""Options shared by the commands, declared once: the same flag means the same in every
command, is taken as text and checked by ``attncheck.params`` (one clear line, exit 2).

Also the two things every command prints on stderr besides errors: a progress bar
(terminal only, after a second) and one-line notices, both off with ``--quiet``.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Callable, List, Optional

import typer

from attncheck.cli.common import say
from attncheck.params import DEFAULT_BLOCK, SCALE_NAMES
from attncheck.registry import DTYPES, METHODS, PATHS, cell_dtype, choices_help, dtype_names, method_names

DEFAULT_DTYPES = ",".join(dtype_names())
DEFAULT_METHODS = ",".join(method_names())

DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        "-d",
        metavar="DTYPE,...",
        help=f"Comma-separated dtypes to compute in: {choices_help(DTYPES, cell_dtype)} (or 'all').",
    ),
]
MethodOpt = Annotated[
    str,
    typer.Option(
        "--method",
        "-m",
        metavar="METHOD,...",
        help=f"Comma-separated softmax methods: {choices_help(METHODS)} (or 'all').",
    ),
]
# run and capture: a captured call computes the cell its model ran; these, when given, ask for more as what-ifs
CellDtypeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--dtype",
        "-d",
        metavar="DTYPE,...",
        show_default=False,
        help=(
            f"Comma-separated dtypes to compute in: {choices_help(DTYPES, cell_dtype)} (or 'all'); default "
            f"{DEFAULT_DTYPES}. A captured call computes the cell its model ran; given, these cells are computed as "
            "what-ifs beside it."
        ),
    ),
]
CellMethodOpt = Annotated[
    Optional[str],
    typer.Option(
        "--method",
        "-m",
        metavar="METHOD,...",
        show_default=False,
        help=(
            f"Comma-separated softmax methods: {choices_help(METHODS)} (or 'all'); default all. "
            "On a capture, given, they are computed as what-ifs."
        ),
    ),
]
WhatIfOpt = Annotated[
    Optional[str],
    typer.Option(
        "--what-if",
        metavar="DTYPE,...|kernels|nosinks|fa4|kv:FORMAT[:SCALING][:fa3]|kv:int4[:gN][:rN]|all",
        show_default=False,
        help=(
            "Captured calls: what would break if the model ran in these dtypes (fp16, bf16, fp32, fp8 = e4m3, ...) "
            "with its own implementation and with eager attention; 'kernels' replays each call under every kernel "
            "that could have run it (sdpa-math, flash, fa2, fa2-fma, fa3, mem-efficient, cudnn, fa4; flex for flex "
            "calls) in its dtype, and says which break it (combine: kernels,fp16); 'nosinks' (also part of "
            "'kernels') computes each call with learned sinks (gpt-oss) as a kernel that drops them would, in its "
            "dtype, and gives its output error against float64 and against the model's cell; 'fa4' computes "
            "FlashAttention-4 "
            "for a small grid of its lazy rescale thresholds and FP8 max offsets, in the call's dtype and in e4m3 "
            "(with --q/--k too: in each --dtype), and names the setting with the least output error against float64; "
            "'all' adds "
            "every other implementation (naive, stable, tiled, the SDPA paths, FP8) in fp16, bf16, fp32 and e4m3. "
            "'kv:FORMAT[:SCALING]' (with a capture, or --q/--k/--v) writes K and V to a quantised KV cache as vLLM "
            "does (FORMAT fp8_e4m3 or fp8_e5m2; SCALING unit = 1.0, tensor = amax/max per layer, head = per kv "
            "head, dynamic = the first call's, as vLLM's calculate_kv_scales; none: all four side by side) and "
            "computes attention from it, per layer and kv head (FlashAttention-2 on the values read back; ':fa3' "
            "after SCALING: FlashAttention-3's FP8 path, Q quantised too, FP8 products, e4m3 only); "
            "'kv:int4[:gN][:rM]': quanto's per-group quantiser (transformers' quanto cache's) on each call's K and V "
            "(min-max per group of N values, default 64; the last M tokens of each call kept in the model's dtype; "
            "the cache's prefill and flush timing on generate() not modelled). "
            "'rope:DTYPE' recomputes the rotary tables a capture recorded (run and capture; every rank's under "
            "torchrun; RoPE types default, linear, llama3, yarn and longrope) with their positions and inverse "
            "frequencies held in DTYPE. Reported apart; never the model's verdict unless --fail-on what-if:COND."
        ),
    ),
]
FA4 = "FlashAttention-4"
RescaleThresholdOpt = Annotated[
    Optional[str],
    typer.Option(
        "--rescale-threshold",
        metavar="T",
        show_default=False,
        help=(
            "The fa4 path (--path fa4, --what-if kernels; with --what-if fa4 it joins the grid): FlashAttention-4's "
            "lazy rescale threshold in log2 units: the row max is kept until it has grown by more than T (default: "
            "the kernel's, 8 for fp16/bf16, 0 for FP8)."
        ),
        rich_help_panel=FA4,
    ),
]
MaxOffsetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--max-offset",
        metavar="O",
        show_default=False,
        help=(
            "The fa4 path in FP8: the max offset added to the exponent before P's cast, P up to 2^O (default 8); "
            "with --rescale-threshold T, P may reach 2^(T + O), saturating above the format's max."
        ),
        rich_help_panel=FA4,
    ),
]
BlockOpt = Annotated[
    str,
    typer.Option(
        "--block",
        metavar="N",
        help=f"Key block size of the tiled method (FlashAttention's is {DEFAULT_BLOCK} for d <= 128).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option("--device", metavar="NAME", help="Where to compute: auto (cuda if available), cpu, cuda or cuda:N."),
]
ScaleOpt = Annotated[
    str,
    typer.Option(
        "--scale",
        "-s",
        metavar="SCALE[,...]",
        help=(
            f"Scale of q.k: {', '.join(SCALE_NAMES)} (sqrt = 1/sqrt(d_k), auto = sqrt, dk = 1/d_k, dk2 = 1/d_k^2) or "
            "a positive number; sweep takes several, comma-separated."
        ),
    ),
]
PathOpt = Annotated[
    Optional[str],
    typer.Option(
        "--path",
        metavar="PATH,...",
        help=(
            f"Attention paths computed from Q, K and V: {choices_help(PATHS)} (default: all); the eager path runs "
            "the --method softmax (torch in sweep)."
        ),
    ),
]
JsonOpt = Annotated[
    Optional[str],
    typer.Option(
        "--json", metavar="FILE", help="Write the report as JSON to FILE ('-' for stdout: tables are then not printed)."
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print less: no progress bar and no notices on stderr (check: only the broken budgets and the verdict).",
    ),
]
FailOnOpt = Annotated[
    str,
    typer.Option(
        "--fail-on",
        metavar="LIST",
        help=(
            "Exit 1 when a condition holds: nan, overflow, zero, flip, error, warning or a finding code "
            "(comma-separated); on a capture they judge the cells the model runs, and what-if:COND (e.g. "
            "what-if:nan) judges the --what-if cells."
        ),
    ),
]
IgnoreOpt = Annotated[
    str,
    typer.Option(
        "--ignore",
        metavar="CODE,...",
        help=(
            "Finding codes you judged expected (e.g. fully_masked_rows from left padding): left out of the report, "
            "and their rows do not count for --fail-on or a call's verdict."
        ),
    ),
]
BriefOpt = Annotated[
    bool,
    typer.Option(
        "--brief",
        help=(
            "Leave out the per-cell detail table of per-tensor reports (one tensor, --detail, --full); --summary is "
            "the short answer."
        ),
    ),
]
SummaryOpt = Annotated[
    bool,
    typer.Option(
        "--summary",
        help=(
            "The short answer on one screen instead of the report: the verdict, the first call (or tensor) that "
            "goes wrong, its cause and the fix, about ten lines; a healthy model in one to three. The JSON report "
            "is unchanged."
        ),
    ),
]
FullOpt = Annotated[
    bool, typer.Option("--full", help="The full per-tensor report of every call instead of the model report.")
]
DetailOpt = Annotated[
    List[str],
    typer.Option(
        "--detail",
        metavar="NAME_GLOB",
        help=(
            "After the model report, the full report of the calls whose module or name matches (repeatable), e.g. "
            "'*.h.1.*'."
        ),
    ),
]
PartialOpt = Annotated[
    bool,
    typer.Option(
        "--partial",
        help=(
            "Diagnose the calls that can be and list the others, instead of stopping at the first bad one (exit 2 "
            "still)."
        ),
    ),
]
MaxMemoryOpt = Annotated[
    str,
    typer.Option(
        "--max-memory",
        metavar="SIZE",
        help=(
            "Working memory for the diagnosis: inputs are read and processed in row chunks that fit (.npy, "
            ".safetensors, .npz stream); what must be held whole (.pt files, attention calls, --q, --k, --v, "
            "--mask) is refused when larger."
        ),
    ),
]


def notices(quiet: bool) -> Callable[[str], None] | None:
    """A callback that prints a library notice as one line on stderr, or None with --quiet."""
    if quiet:
        return None
    return lambda line: say(f"attncheck: {line}")


def progress_shown(quiet: bool) -> tuple[bool, bool]:
    """(show a progress bar, force it): only on a terminal, or always with
    ATTNCHECK_PROGRESS=always (for tests and CI logs that want it); never with --quiet."""
    forced = os.environ.get("ATTNCHECK_PROGRESS") == "always"
    return (not quiet and (forced or sys.stderr.isatty())), forced
