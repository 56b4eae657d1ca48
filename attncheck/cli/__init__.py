"""Command line: one module per command (``run``, ``sweep``, ``check``, ``capture``, ``watch``, ``explain``), each
parsing its options, calling its pipeline, rendering and mapping errors to exit codes.

torch is imported inside the commands only, so ``attncheck --help`` and argument
errors stay fast.
"""

from __future__ import annotations

import typer

from attncheck import __version__
from attncheck.cli.capture import capture
from attncheck.cli.check import check
from attncheck.cli.common import Command, OneLineErrorsGroup, no_spin_waiting, reuse_freed_memory, write_stdout
from attncheck.cli.explain import explain
from attncheck.cli.rope import rope
from attncheck.cli.run import run
from attncheck.cli.sweep import sweep
from attncheck.cli.watch import watch

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


def version_callback(value: bool) -> None:
    if value:
        write_stdout(f"attncheck {__version__}\n")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=version_callback, is_eager=True
    ),
) -> None:
    """Numerical diagnostics for the softmax inside attention."""
    reuse_freed_memory()


app.command(cls=Command)(run)
app.command(cls=Command)(sweep)
app.command(cls=Command)(rope)
app.command(cls=Command)(check)
app.command(cls=Command, context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(capture)
app.command(cls=Command)(watch)
app.command(cls=Command)(explain)


def main() -> None:
    no_spin_waiting()  # before torch and numba load libgomp
    app()
