"""``attncheck sweep``: parse and check the options, run the grid, render.

Numeric options are taken as text and checked here, so every bad value gets
one clear line and exit 2. Nothing heavy is imported at module level: torch,
rich tables and matplotlib come in only once the options are known to be good.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from attncheck.cliutil import EXIT_OK, check_output_path, fail, parse_choices, write_json
from attncheck.errors import AttncheckError
from attncheck.names import DTYPE_ALIASES, DTYPE_NAMES, METHOD_ALIASES, METHOD_NAMES
from attncheck.sweep_config import (
    DEFAULT_BLOCK,
    DEFAULT_DKS,
    DEFAULT_ROWS,
    DEFAULT_SEQ,
    DEVICE_NAMES,
    DIST_NAMES,
    SCALE_NAMES,
    SweepConfig,
    parse_float_list,
    parse_int,
    parse_int_list,
    parse_name,
    parse_scales,
)


def build_config(
    dk: str, scale: str, dtype: str, method: str, seq: str, rows: str, std: str, dist: str, seed: str, block: str, device: str
) -> SweepConfig:
    """Command-line text -> a checked SweepConfig (torch-free)."""
    return SweepConfig(
        dks=parse_int_list(dk, "--dk", 1, "d_k"),
        scales=parse_scales(scale),
        dtypes=parse_choices(dtype, DTYPE_NAMES, DTYPE_ALIASES, "--dtype"),
        methods=parse_choices(method, METHOD_NAMES, METHOD_ALIASES, "--method"),
        seqs=parse_int_list(seq, "--seq", 2, "keys per row"),
        stds=parse_float_list(std, "--std", "the standard deviation"),
        rows=parse_int(rows, "--rows", 2, "the number of rows"),
        dist=parse_name(dist, DIST_NAMES, "--dist"),
        seed=parse_int(seed, "--seed", 0, "the seed"),
        block=parse_int(block, "--block", 1, "the key block size"),
        device=parse_name(device, DEVICE_NAMES, "--device"),
    )


def sweep(
    dk: str = typer.Option(",".join(map(str, DEFAULT_DKS)), "--dk", metavar="D,...", help="Comma-separated head dimensions d_k."),
    scale: str = typer.Option(
        ",".join(SCALE_NAMES), "--scale", "-s", metavar="SCALE,...",
        help="Comma-separated factors applied to q.k: none, sqrt = 1/sqrt(d_k), dk = 1/d_k, dk2 = 1/d_k^2, or a positive number.",
    ),
    dtype: str = typer.Option(",".join(DTYPE_NAMES), "--dtype", "-d", metavar="DTYPE,...", help="Comma-separated dtypes to compute the softmax in: fp16, bf16, fp32 (or 'all')."),
    method: str = typer.Option(",".join(METHOD_NAMES), "--method", "-m", metavar="METHOD,...", help="Comma-separated methods: naive, stable, tiled (alias online), torch (or 'all')."),
    seq: str = typer.Option(str(DEFAULT_SEQ), "--seq", metavar="N,...", help="Keys per row (comma-separated for several)."),
    rows: str = typer.Option(str(DEFAULT_ROWS), "--rows", metavar="N", help="Rows (queries) per grid point; heads of up to --seq queries share their keys."),
    std: str = typer.Option("1", "--std", metavar="X,...", help="Standard deviation of the entries of q and k (comma-separated for several)."),
    dist: str = typer.Option("normal", "--dist", metavar="NAME", help="Entries of q and k: normal, or outliers = N(0,1) + N(0,100) on a 0.1% mask (FlashAttention-3's test inputs)."),
    seed: str = typer.Option("0", "--seed", metavar="N", help="Seed of the generator; the same seed gives the same numbers."),
    block: str = typer.Option(str(DEFAULT_BLOCK), "--block", metavar="N", help="Key block size of the tiled method."),
    device: str = typer.Option("cpu", "--device", metavar="NAME", help="Where to compute: cpu, auto (cuda if available), cuda."),
    json_out: Optional[str] = typer.Option(None, "--json", metavar="FILE", help="Write the results as JSON to FILE ('-' for stdout: tables are then not printed)."),
    plot: Optional[str] = typer.Option(None, "--plot", metavar="FILE.png", help="Draw variance, max probability, entropy and Jacobian norm vs d_k to FILE.png (needs the 'plot' extra: matplotlib)."),
) -> None:
    """Sweep synthetic Q and K over d_k x scale; measure next to the theory.

    Var(q.k) grows as d_k; 1/sqrt(d_k) brings it back to 1, 1/d_k to 1/d_k,
    1/d_k^2 to 1/d_k^3. Unscaled logits collapse attention onto one key and
    kill the softmax gradient; too much scaling flattens it to uniform.
    Per method x dtype: exp overflow (with its Gaussian-tail prediction),
    NaN rows and max error against float64.
    Exit codes: 0 ran, 2 usage or input error.
    """
    try:
        config = build_config(dk, scale, dtype, method, seq, rows, std, dist, seed, block, device)
        check_output_path(json_out, "--json")
        check_output_path(plot, "--plot")
        if plot is not None:
            from attncheck.sweep_report import require_matplotlib

            require_matplotlib()
        from attncheck.sweep import run_sweep
        from attncheck.sweep_report import plot_sweep, print_sweep, sweep_json

        start = time.perf_counter()
        result = run_sweep(config)
        seconds = time.perf_counter() - start
        if json_out is not None:
            write_json(json.dumps(sweep_json(result), indent=2, allow_nan=False), json_out)
        if plot is not None:
            plot_sweep(result, plot)
    except AttncheckError as e:
        raise fail(str(e)) from None

    if json_out != "-":
        from rich.console import Console

        print_sweep(Console(), result, seconds)
    raise typer.Exit(EXIT_OK)
