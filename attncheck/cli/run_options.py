"""``attncheck run``'s own options, declared once (the options it shares with other commands are in
``attncheck.cli.options``)."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from attncheck.cli.run_checks import Accum, MaskConvention, MaskOp, Order, ScaleOrder

QK = "Q/K inputs"
FP8 = "FP8 attention"

PathsArg = Annotated[
    Optional[List[str]],
    typer.Argument(
        metavar="PATH",
        help="Score files (.pt .pth .npy .npz .safetensors) or directories. Softmax runs over the last axis.",
        show_default=False,
    ),
]

ExampleOpt = Annotated[
    bool,
    typer.Option(
        "--example",
        help="Diagnose a built-in example (unscaled head, -1e9 causal mask, left padding) instead of files.",
    ),
]

OrderOpt = Annotated[
    Order,
    typer.Option("--order", help="Order in which the tiled method visits key blocks."),
]

AccumOpt = Annotated[
    Accum,
    typer.Option("--accum", help="Row sums of naive/stable: fp32 inside as torch does, or pairwise in the dtype."),
]

AccumulateOpt = Annotated[
    Optional[str],
    typer.Option(
        "--accumulate",
        metavar="SUM,...",
        help=(
            "Also keep the softmax denominator (and with V, P@V) in 16 bits as CPU engines do, against float64: "
            "fp16-seq or bf16-seq (one rounding per key), fp16-pairwise (a tree), fp16-block:64 (fp32 inside blocks "
            "of 64 keys, fp16 between), fp16-online (llama.cpp's CPU flash attention: f16 P@V rescaled at each new "
            "max). Score files, --q/--k, and a capture's calls (per call and layer: a what-if there, failing only "
            "--fail-on what-if:COND); findings lowsum_error, accumulator_overflow."
        ),
    ),
]

KeyOpt = Annotated[
    List[str],
    typer.Option(
        "--key",
        metavar="GLOB",
        help=(
            "Glob selecting tensors inside files (repeatable), e.g. 'layers.*.scores'; a key written out in full "
            "selects that key alone."
        ),
    ),
]

QOpt = Annotated[
    Optional[str],
    typer.Option(
        "--q",
        metavar="PATH[:KEY]",
        help="Queries (..., heads, tokens, d). With --k, the scores are computed in each dtype as models do.",
        rich_help_panel=QK,
    ),
]

KOpt = Annotated[
    Optional[str],
    typer.Option(
        "--k",
        metavar="PATH[:KEY]",
        help="Keys (..., kv_heads, tokens, d); kv_heads may divide the query heads (GQA).",
        rich_help_panel=QK,
    ),
]

VOpt = Annotated[
    Optional[str],
    typer.Option(
        "--v",
        metavar="PATH[:KEY]",
        help=(
            "Values (..., kv_heads, tokens, dv): every cell then also computes the output O = P@V and its error "
            "against float64."
        ),
        rich_help_panel=QK,
    ),
]

MaskOpt = Annotated[
    Optional[str],
    typer.Option(
        "--mask",
        metavar="PATH[:KEY]",
        help="Mask, boolean (see --mask-convention) or additive float, broadcast to (batch, heads, queries, keys).",
        rich_help_panel=QK,
    ),
]

ScaleOrderOpt = Annotated[
    Optional[ScaleOrder],
    typer.Option(
        "--scale-order",
        help="Scale the scores after Q@K^T (default), or q before it.",
        rich_help_panel=QK,
        show_default=False,
    ),
]

CausalOpt = Annotated[
    bool,
    typer.Option("--causal", help="Add a causal mask, aligned as PyTorch's is_causal (top left).", rich_help_panel=QK),
]

PadLeftOpt = Annotated[
    str,
    typer.Option(
        "--pad-left",
        metavar="N,...",
        help="Left padding per batch element, e.g. 3,0: those keys are masked.",
        rich_help_panel=QK,
    ),
]

PadRightOpt = Annotated[
    str,
    typer.Option("--pad-right", metavar="N,...", help="Right padding per batch element.", rich_help_panel=QK),
]

MaskValueOpt = Annotated[
    Optional[str],
    typer.Option(
        "--mask-value",
        metavar="VALUE",
        help=(
            "What a key masked by a boolean mask, --causal or padding becomes: -inf (default), min "
            "(finfo(dtype).min) or a number such as -1e4."
        ),
        rich_help_panel=QK,
        show_default=False,
    ),
]

MaskConventionOpt = Annotated[
    Optional[MaskConvention],
    typer.Option(
        "--mask-convention",
        help="Boolean masks: True = attend (SDPA, the default) or True = masked.",
        rich_help_panel=QK,
        show_default=False,
    ),
]

GradOutOpt = Annotated[
    Optional[str],
    typer.Option(
        "--grad-out",
        metavar="PATH[:KEY]",
        help=(
            "The output gradient dO (..., heads, tokens, dv), with --v: each path's backward (dQ, dK, dV) is judged "
            "too, against float64 autograd: NaN rows and their first cause, loss-scale headroom, flushed gradients, "
            "FlashAttention's 2x rule."
        ),
        rich_help_panel=QK,
    ),
]

MaskOpOpt = Annotated[
    Optional[MaskOp],
    typer.Option(
        "--mask-op",
        help=(
            "How the eager path's code applies a boolean mask, which decides where a fully masked row's NaN goes in "
            "the backward: added to the scores (add, the default: dQ, dK and dV) or masked_fill (fill: dV only)."
        ),
        rich_help_panel=QK,
        show_default=False,
    ),
]

PScaleOpt = Annotated[
    Optional[str],
    typer.Option(
        "--p-scale",
        metavar="S",
        help=(
            "FP8 dtypes (--dtype e4m3, e5m2, ...): P is multiplied by S before the cast to FP8: 1, 256 "
            "(FlashAttention-3, the default), 448 (SageAttention) or another number."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
]

Fp8ScalingOpt = Annotated[
    Optional[str],
    typer.Option(
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
]

IncoherentOpt = Annotated[
    bool,
    typer.Option(
        "--incoherent",
        help=(
            "FP8 dtypes with --q/--k: rotate Q and K by a seeded +-1 diagonal times Hadamard matrix before "
            "quantising (FlashAttention-3's incoherent processing; head dim a power of two)."
        ),
        rich_help_panel=FP8,
    ),
]

Fp8AccumOpt = Annotated[
    Optional[str],
    typer.Option(
        "--fp8-accum",
        metavar="BITS",
        help=(
            "FP8 dtypes with --q/--k: the tensor cores' accumulator for P@V and FP8 Q@K^T: fp32, or the mantissa "
            "bits kept after each 32-element MMA step, 1..23 (default: the kernel's, 13 on Hopper, truncated)."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
]

Fp8FlushOpt = Annotated[
    Optional[str],
    typer.Option(
        "--fp8-flush",
        metavar="N",
        help=(
            "FP8 dtypes with --q/--k: add P@V's reduced accumulator to an fp32 one every N key blocks (vLLM's "
            "two-level accumulation; default: the kernel's, none for flash-fp8, every block for sage)."
        ),
        rich_help_panel=FP8,
        show_default=False,
    ),
]


BudgetOpt = Annotated[
    Optional[str],
    typer.Option(
        "--budget",
        metavar="SECONDS",
        help=(
            "Diagnose each Q/K call whose whole diagnosis would take longer (timed on a few rows) in about this time: "
            "rows a bound (scale |q| max|k| + the mask) cannot certify free of overflow and NaN are computed in full, "
            "the error and distribution figures come from a uniform sample of the rest, with 95% intervals. "
            "Default: every row."
        ),
    ),
]

RowsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--rows",
        metavar="N",
        help="As --budget, with a sample of N score rows per Q/K call (whole query positions: every head of each).",
    ),
]

ExactOpt = Annotated[
    bool,
    typer.Option("--exact", help="Compute every row of every call (the default; refuses --budget and --rows)."),
]
