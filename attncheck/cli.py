"""Command line: parse, call the library, render, map errors to exit codes.

torch is imported inside the commands only, so ``attncheck --help`` and argument
errors stay fast.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

import typer

from attncheck import __version__
from attncheck.cliutil import EXIT_FAILED, EXIT_OK, OneLineErrorsGroup, check_output_path, fail, parse_choices, reuse_freed_memory, write_json
from attncheck.errors import AttncheckError
from attncheck.findings import FAIL_ON_WORDS, valid_fail_on
from attncheck.names import (
    DTYPE_ALIASES,
    DTYPE_NAMES,
    METHOD_ALIASES,
    METHOD_NAMES,
    parse_lengths,
    parse_mask_value,
    parse_scale_text,
    parse_size,
)
from attncheck.check_cli import check
from attncheck.sweep_cli import sweep


app = typer.Typer(
    name="attncheck",
    cls=OneLineErrorsGroup,
    help="Numerical diagnostics for the softmax inside attention: overflow, underflow, "
    "NaN rows and their causes, and the error of naive, stable, tiled (FlashAttention-style) "
    "and torch softmax in fp16, bf16 and fp32 against a float64 reference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Order(str, Enum):
    forward = "forward"
    reverse = "reverse"


class ScaleOrder(str, Enum):
    scores = "scores"
    q = "q"


class MaskConvention(str, Enum):
    attend = "attend"
    ignore = "ignore"


@dataclass(frozen=True)
class QKRequest:
    """What the user asked for with --q/--k, checked but not loaded."""

    q: str
    k: str
    mask: str | None
    scale: str
    scale_order: str
    causal: bool
    pad_left: list[int]
    pad_right: list[int]
    mask_value: str
    mask_convention: str


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Accum(str, Enum):
    fp32 = "fp32"
    dtype = "dtype"


def parse_fail_on(value: str) -> list[str]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    for item in items:
        if not valid_fail_on(item):
            raise AttncheckError(f"--fail-on: unknown condition {item!r} (use {', '.join(FAIL_ON_WORDS)} or a finding code)")
    return items


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"attncheck {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=version_callback, is_eager=True),
) -> None:
    """Numerical diagnostics for the softmax inside attention."""
    reuse_freed_memory()


@app.command()
def run(
    paths: Optional[List[str]] = typer.Argument(None, help="Score files (.pt .pth .npy .npz .safetensors) or directories. Softmax runs over the last axis.", show_default=False),
    example: bool = typer.Option(False, "--example", help="Diagnose a built-in example (unscaled head, -1e9 causal mask, left padding) instead of files."),
    dtype: str = typer.Option(",".join(DTYPE_NAMES), "--dtype", "-d", help="Comma-separated dtypes to compute in: fp16, bf16, fp32 (or 'all')."),
    method: str = typer.Option(",".join(METHOD_NAMES), "--method", "-m", help="Comma-separated methods: naive, stable, tiled (alias online), torch (or 'all')."),
    block: int = typer.Option(128, "--block", min=1, help="Key block size of the tiled method."),
    order: Order = typer.Option(Order.forward, "--order", help="Order in which the tiled method visits key blocks."),
    accum: Accum = typer.Option(Accum.fp32, "--accum", help="Row sums of naive/stable: fp32 inside as torch does, or pairwise in the dtype."),
    device: Device = typer.Option(Device.auto, "--device", help="Where to compute: auto (cuda if available), cpu, cuda."),
    key: List[str] = typer.Option([], "--key", help="Glob selecting tensors inside files (repeatable), e.g. 'layers.*.scores'."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the JSON report to FILE ('-' for stdout: tables are then not printed)."),
    fail_on: str = typer.Option("", "--fail-on", help=f"Exit 1 when a condition holds: {', '.join(FAIL_ON_WORDS)} or a finding code (comma-separated)."),
    brief: bool = typer.Option(False, "--brief", help="Leave out the per-cell detail table."),
    max_memory: str = typer.Option("1GiB", "--max-memory", help="Working memory for the diagnosis: inputs are read and processed in row chunks that fit (.npy, .safetensors, .npz stream; .pt is loaded whole)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar (it only shows on a terminal, for runs longer than a second)."),
    q: Optional[str] = typer.Option(None, "--q", help="Queries (..., heads, tokens, d) as PATH or PATH:KEY. With --k, the scores are computed in each dtype as models do.", rich_help_panel="Q/K inputs"),
    k: Optional[str] = typer.Option(None, "--k", help="Keys (..., kv_heads, tokens, d) as PATH or PATH:KEY; kv_heads may divide the query heads (GQA).", rich_help_panel="Q/K inputs"),
    mask: Optional[str] = typer.Option(None, "--mask", help="Mask as PATH or PATH:KEY, boolean (see --mask-convention) or additive float, broadcast to (batch, heads, queries, keys).", rich_help_panel="Q/K inputs"),
    scale: str = typer.Option("auto", "--scale", help="Scale of q.k: auto or sqrt (1/sqrt(d)), none, dk (1/d), or a number.", rich_help_panel="Q/K inputs"),
    scale_order: ScaleOrder = typer.Option(ScaleOrder.scores, "--scale-order", help="Scale the scores after Q@K^T, or q before it.", rich_help_panel="Q/K inputs"),
    causal: bool = typer.Option(False, "--causal", help="Add a causal mask, aligned as PyTorch's is_causal (top left).", rich_help_panel="Q/K inputs"),
    pad_left: str = typer.Option("", "--pad-left", help="Left padding per batch element, e.g. 3,0: those keys are masked.", rich_help_panel="Q/K inputs"),
    pad_right: str = typer.Option("", "--pad-right", help="Right padding per batch element.", rich_help_panel="Q/K inputs"),
    mask_value: str = typer.Option("-inf", "--mask-value", help="What a masked key becomes: -inf, min (finfo(dtype).min) or a number such as -1e4.", rich_help_panel="Q/K inputs"),
    mask_convention: MaskConvention = typer.Option(MaskConvention.attend, "--mask-convention", help="Boolean masks: True = attend (SDPA) or True = masked.", rich_help_panel="Q/K inputs"),
) -> None:
    """Diagnose saved attention scores (pre-softmax logits), or the scores Q and K produce.

    Every method x dtype cell is judged against a float64 softmax of the scores as given
    (with --q/--k: of Q@K^T, scale and mask computed in float64). With scores files and
    --q/--k together, the scale that maps q.k onto the scores is fitted and checked.
    Exit codes: 0 ran and nothing failed, 1 a --fail-on condition held, 2 usage or input error.
    """
    try:
        dtypes = parse_choices(dtype, DTYPE_NAMES, DTYPE_ALIASES, "--dtype")
        methods = parse_choices(method, METHOD_NAMES, METHOD_ALIASES, "--method")
        conditions = parse_fail_on(fail_on)
        memory = parse_size(max_memory, "--max-memory")
        check_output_path(json_out, "--json")
        qk = None
        if q is not None or k is not None:
            if q is None or k is None:
                raise AttncheckError("--q and --k go together: give both")
            qk = QKRequest(q, k, mask, parse_scale_text(scale), scale_order.value, causal, parse_lengths(pad_left, "--pad-left"), parse_lengths(pad_right, "--pad-right"), parse_mask_value(mask_value), mask_convention.value)
        elif mask is not None or causal or pad_left or pad_right:
            raise AttncheckError("--mask, --causal and --pad-left/--pad-right apply to scores computed from --q and --k")
        if example and (paths or qk):
            raise AttncheckError("give files or --example, not both")
        if not example and not paths and not qk:
            raise AttncheckError("no input: give score files or directories, --q and --k, or --example for a built-in one")
        forced = os.environ.get("ATTNCHECK_PROGRESS") == "always"  # for tests and CI logs that want it
        show = not quiet and (forced or sys.stderr.isatty())
        diags, device_name = _run(paths or [], example, dtypes, methods, block, order, accum, device, key, qk, memory, show)
    except AttncheckError as e:
        raise fail(str(e)) from None

    from attncheck.findings import failed_conditions
    from attncheck.report import print_report, run_json

    failed = failed_conditions(diags, conditions)
    if json_out is not None:
        try:
            write_json(json.dumps(run_json(diags, device_name, failed), indent=2, allow_nan=False), json_out)
        except AttncheckError as e:
            raise fail(str(e)) from None
    if json_out != "-":
        from rich.console import Console

        print_report(Console(), diags, device_name, verbose=not brief)
    for reason in failed:
        typer.echo(f"attncheck: --fail-on {reason}", err=True)
    raise typer.Exit(EXIT_FAILED if failed else EXIT_OK)


def _run(paths, example, dtypes, methods, block, order, accum, device, keys, qk, memory, show_progress):
    import torch

    from attncheck.diagnose import Options, chunk_elements_for, diagnose, diagnose_chunks, resolve_device, rows_per_chunk
    from attncheck.report import RowProgress

    dev = resolve_device(device.value)
    options = Options(
        dtypes=dtypes, methods=methods, block=block, reverse=order is Order.reverse, accum=accum.value,
        device=str(dev), chunk_elements=chunk_elements_for(memory),
    )
    if example and keys:
        raise AttncheckError("--key selects tensors inside files; it does not apply to --example")
    forced = os.environ.get("ATTNCHECK_PROGRESS") == "always"
    with RowProgress(show_progress, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
        if qk is not None:
            from attncheck.loaders import load_tensors

            named = [(t.name, t.tensor) for t in load_tensors(paths, keys)] if paths else []
            diags = _run_qk(qk, named, options, progress)
        elif example:
            from attncheck.demo import EXAMPLE_NAME, example_scores

            x = example_scores()
            diags = [diagnose(EXAMPLE_NAME, x, options, progress.track(EXAMPLE_NAME, x.numel() // x.shape[-1]))]
        else:
            from attncheck.stream import open_sources

            diags = []
            for src in open_sources(paths, keys):  # headers only: each tensor streams in row chunks
                blocks = src.row_blocks(rows_per_chunk(src.shape[-1], options))
                diags.append(diagnose_chunks(src.name, src.shape, src.dtype, blocks, options, progress.track(src.name, src.rows)))
    label = str(dev)
    if dev.type == "cuda":
        label += f" ({torch.cuda.get_device_name(dev)})"
    return diags, label


def _load_one(spec: str, option: str, any_dtype: bool = False):
    """PATH or PATH:KEY -> (name, tensor); the file must hold exactly one selected tensor."""
    from attncheck.loaders import load_tensors

    path, key = spec, None
    if not os.path.exists(spec) and ":" in spec:
        path, key = spec.rsplit(":", 1)
    found = load_tensors([path], [key] if key else [], any_dtype=any_dtype)
    if len(found) != 1:
        names = ", ".join(t.name for t in found[:6])
        raise AttncheckError(f"{option} {spec} selects {len(found)} tensors ({names}); pick one with {option} PATH:KEY")
    return found[0].name, found[0].tensor


def _run_qk(qk: QKRequest, named, options, progress):
    from attncheck.diagnose import diagnose_attention
    from attncheck.scores import prepare_inputs

    q_name, q = _load_one(qk.q, "--q")
    k_name, k = _load_one(qk.k, "--k")
    mask = _load_one(qk.mask, "--mask", any_dtype=True)[1] if qk.mask else None
    inputs = prepare_inputs(
        q, k, mask,
        scale=qk.scale, scale_order=qk.scale_order, causal=qk.causal,
        pad_left=qk.pad_left, pad_right=qk.pad_right,
        mask_value=qk.mask_value, mask_convention=qk.mask_convention,
    )
    if named:  # scores given too: diagnose them and fit the scale they carry
        return [diagnose_attention(name, inputs, options, progress.track(name, tensor.numel() // tensor.shape[-1]), scores=tensor) for name, tensor in named]
    name = f"{q_name} @ {k_name}"
    return [diagnose_attention(name, inputs, options, progress.track(name, inputs.rows))]


app.command()(sweep)
app.command()(check)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
