"""Command line: parse, call the library, render, map errors to exit codes.

torch is imported inside the commands only, so ``attncheck --help`` and argument
errors stay fast.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import List, Optional

import typer

from attncheck import __version__
from attncheck.cliutil import EXIT_FAILED, EXIT_OK, OneLineErrorsGroup, fail, parse_choices, write_json
from attncheck.errors import AttncheckError
from attncheck.findings import FAIL_ON_WORDS, valid_fail_on
from attncheck.names import DTYPE_ALIASES, DTYPE_NAMES, METHOD_ALIASES, METHOD_NAMES
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
    key: List[str] = typer.Option([], "--key", "-k", help="Glob selecting tensors inside files (repeatable), e.g. 'layers.*.scores'."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the JSON report to FILE ('-' for stdout: tables are then not printed)."),
    fail_on: str = typer.Option("", "--fail-on", help=f"Exit 1 when a condition holds: {', '.join(FAIL_ON_WORDS)} or a finding code (comma-separated)."),
    brief: bool = typer.Option(False, "--brief", help="Leave out the per-cell detail table."),
) -> None:
    """Diagnose saved attention scores (pre-softmax logits).

    Every method x dtype cell is judged against a float64 softmax of the scores as given.
    Exit codes: 0 ran and nothing failed, 1 a --fail-on condition held, 2 usage or input error.
    """
    try:
        dtypes = parse_choices(dtype, DTYPE_NAMES, DTYPE_ALIASES, "--dtype")
        methods = parse_choices(method, METHOD_NAMES, METHOD_ALIASES, "--method")
        conditions = parse_fail_on(fail_on)
        if example and paths:
            raise AttncheckError("give files or --example, not both")
        if not example and not paths:
            raise AttncheckError("no input: give score files or directories, or --example for a built-in one")
        diags, device_name = _run(paths or [], example, dtypes, methods, block, order, accum, device, key)
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


def _run(paths, example, dtypes, methods, block, order, accum, device, keys):
    import torch

    from attncheck.diagnose import Options, diagnose, resolve_device

    dev = resolve_device(device.value)
    options = Options(dtypes=dtypes, methods=methods, block=block, reverse=order is Order.reverse, accum=accum.value, device=str(dev))
    if example:
        from attncheck.demo import EXAMPLE_NAME, example_scores

        if keys:
            raise AttncheckError("--key selects tensors inside files; it does not apply to --example")
        named = [(EXAMPLE_NAME, example_scores())]
    else:
        from attncheck.loaders import load_tensors

        named = [(t.name, t.tensor) for t in load_tensors(paths, keys)]
    diags = [diagnose(name, tensor, options) for name, tensor in named]
    label = str(dev)
    if dev.type == "cuda":
        label += f" ({torch.cuda.get_device_name(dev)})"
    return diags, label


app.command()(sweep)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
