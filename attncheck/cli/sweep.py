"""``attncheck sweep``: parse and check the options, call ``pipelines.sweep``, render.

Numeric options are taken as text and checked by ``SweepConfig.from_text``, so every
bad value gets one clear line and exit 2. Nothing heavy is imported at module level:
torch, rich tables and matplotlib come in only once the options are known to be good.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from attncheck import params
from attncheck.cli.common import EXIT_OK, check_output_path, fail, report_console, require_stdout, write_json
from attncheck.cli.options import (
    DEFAULT_DTYPES,
    DEFAULT_METHODS,
    BlockOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MethodOpt,
    PathOpt,
    QuietOpt,
    ScaleOpt,
    progress_shown,
)
from attncheck.config.sweep import (
    DEFAULT_BLOCK,
    DEFAULT_DKS,
    DEFAULT_MAX_WORK,
    DEFAULT_ROWS,
    DEFAULT_SEQ,
    PRESET_NAMES,
    SweepConfig,
)
from attncheck.config.sweep import max_work as parse_max_work
from attncheck.errors import AttncheckError
from attncheck.params import SCALE_NAMES
from attncheck.pipelines.sweep import run_preset, run_sweep
from attncheck.registry import path_names
from attncheck.report.progress import Progress


def sweep(
    dk: str = typer.Option(
        ",".join(map(str, DEFAULT_DKS)), "--dk", metavar="D,...", help="Comma-separated head dimensions d_k."
    ),
    scale: ScaleOpt = ",".join(SCALE_NAMES),
    dtype: DtypeOpt = DEFAULT_DTYPES,
    method: MethodOpt = DEFAULT_METHODS,
    seq: str = typer.Option(
        str(DEFAULT_SEQ), "--seq", metavar="N,...", help="Keys per row (comma-separated for several)."
    ),
    rows: str = typer.Option(
        str(DEFAULT_ROWS),
        "--rows",
        metavar="N",
        help="Rows (queries) per grid point; heads of up to --seq queries share their keys.",
    ),
    std: str = typer.Option(
        "1",
        "--std",
        metavar="X,...",
        help="Standard deviation of the entries of q and k (comma-separated for several).",
    ),
    dist: str = typer.Option(
        "normal",
        "--dist",
        metavar="NAME",
        help=(
            "Entries of q and k: normal, or outliers = N(0,1) + N(0,100) on a 0.1% mask (FlashAttention-3's test "
            "inputs)."
        ),
    ),
    seed: str = typer.Option(
        "0", "--seed", metavar="N", help="Seed of the generator; the same seed gives the same numbers."
    ),
    block: BlockOpt = str(DEFAULT_BLOCK),
    device: DeviceOpt = "cpu",
    json_out: JsonOpt = None,
    plot: Optional[str] = typer.Option(
        None,
        "--plot",
        metavar="FILE.png",
        help=(
            "Draw variance, max probability, entropy and Jacobian norm vs d_k, and per dtype maps of overflowed "
            "rows and of the error against float64, to FILE.png (needs the 'plot' extra: matplotlib)."
        ),
    ),
    path: PathOpt = ",".join(path_names(lambda spec: spec.computes_in(False) and spec.default)),
    preset: Optional[str] = typer.Option(
        None,
        "--preset",
        metavar="NAME",
        help=(
            "Reproduce a published figure instead of the grid, printed beside the paper's: fa3 (FlashAttention-3's "
            "FP16 and FP8 RMSE of O), pcast (underflow of the FP8 P cast with an attention sink). Takes --seed and "
            "--device, --json."
        ),
    ),
    max_work: str = typer.Option(
        f"{DEFAULT_MAX_WORK:.3g}",
        "--max-work",
        metavar="N",
        help="Refuse, before any work, a grid that computes more score elements than N "
        "(grid points x rows x keys x cells; the default grid computes 2.6e8).",
    ),
    quiet: QuietOpt = False,
) -> None:
    """Sweep synthetic Q and K over d_k x scale; measure next to the theory.

    Var(q.k) grows as d_k; 1/sqrt(d_k) brings it back to 1, 1/d_k to 1/d_k, 1/d_k^2 to 1/d_k^3. Unscaled logits collapse attention onto one key and kill the softmax gradient; too much scaling flattens it to uniform. Per method x dtype: exp overflow (with its Gaussian-tail prediction), NaN rows and max error against float64.

    Exit codes: 0 ran, 2 usage or input error.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        require_stdout()  # every report ends on standard output: refuse a closed one before any work
        if preset is not None:
            _run_preset(
                preset,
                seed,
                device,
                json_out,
                plot,
                quiet,
                dict(
                    dk=dk,
                    scale=scale,
                    dtype=dtype,
                    method=method,
                    seq=seq,
                    rows=rows,
                    std=std,
                    dist=dist,
                    block=block,
                    path=path,
                ),
            )
        config = _config(
            dk, scale, dtype, method, seq, rows, std, dist, seed, block, device, path, max_work, json_out, plot
        )
        result = _run_grid(config, quiet)
        _write(result, json_out, plot)
    except AttncheckError as e:
        raise fail(e) from None

    if json_out != "-":
        from attncheck.report.sweep import print_sweep  # the report modules: not for --help

        print_sweep(report_console(), result)
    raise typer.Exit(EXIT_OK)


def _config(dk, scale, dtype, method, seq, rows, std, dist, seed, block, device, path, max_work, json_out, plot):
    """The grid's options checked into a SweepConfig, its work bounded, the --json and --plot paths checked."""
    config = SweepConfig.from_text(
        dks=dk,
        scales=scale,
        dtypes=dtype,
        methods=method,
        seqs=seq,
        rows=rows,
        stds=std,
        dist=dist,
        seed=seed,
        block=block,
        device=device,
        paths=path,
    )
    config.check_work(parse_max_work(max_work, "max_work"))
    check_output_path(json_out, "--json")
    check_output_path(plot, "--plot", dash_ok=False)
    if plot is not None:
        # the report modules: not for --help
        from attncheck.report.sweep_plot import check_plot_path, require_matplotlib

        require_matplotlib()
        check_plot_path(plot)
    return config


def _run_grid(config: SweepConfig, quiet: bool):
    """The grid computed, with a progress bar on a terminal: a SweepResult."""
    show, forced = progress_shown(quiet)
    with Progress(show, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
        tick = progress.track("sweep", config.points, "grid points")
        result = run_sweep(config, None if tick is None else lambda done, total: tick(1))
    return result


def _write(result, json_out: Optional[str], plot: Optional[str]) -> None:
    """The sweep's JSON and plot, where asked."""
    from attncheck.report.sweep import sweep_json  # the report modules: not for --help
    from attncheck.report.sweep_plot import plot_sweep  # (as above)

    if json_out is not None:
        write_json(json.dumps(sweep_json(result), indent=2, allow_nan=False), json_out)
    if plot is not None:
        plot_sweep(result, plot)


GRID_DEFAULTS = dict(
    dk=",".join(map(str, DEFAULT_DKS)),
    scale=",".join(SCALE_NAMES),
    dtype=DEFAULT_DTYPES,
    method=DEFAULT_METHODS,
    seq=str(DEFAULT_SEQ),
    rows=str(DEFAULT_ROWS),
    std="1",
    dist="normal",
    block=str(DEFAULT_BLOCK),
    path=",".join(path_names(lambda spec: spec.computes_in(False) and spec.default)),
)


def _run_preset(name: str, seed: str, device: str, json_out, plot, quiet: bool, grid: dict) -> None:
    """--preset: the published figures; the grid options do not apply (say so rather than ignore them)."""
    name = params.choice(name, PRESET_NAMES, "preset")
    given = [f"--{k}" for k, v in grid.items() if v != GRID_DEFAULTS[k]]
    if given or plot is not None:
        extra = given + (["--plot"] if plot else [])
        raise AttncheckError(
            f"--preset {name} sets its own inputs: {', '.join(extra)} {'does' if len(extra) == 1 else 'do'} not apply"
        )
    seed_n, device_n = params.integer(seed, "seed", 0), params.device(device)
    check_output_path(json_out, "--json")
    from attncheck.devices import resolve_device  # imports torch: not for --help or a bad argument
    from attncheck.numerics.sweep.presets import PRESET_STEPS  # (as above)
    from attncheck.report.sweep import preset_json, print_preset  # the report modules: not for --help

    show, forced = progress_shown(quiet)
    with Progress(show, delay=0.0 if forced else 1.0, force_terminal=forced) as progress:
        tick = progress.track(f"preset {name}", PRESET_STEPS[name], "steps")
        result = run_preset(name, seed_n, device_n, None if tick is None else lambda done, total: tick(1))
    if json_out is not None:
        write_json(json.dumps(preset_json(result, str(resolve_device(device_n))), indent=2, allow_nan=False), json_out)
    if json_out != "-":
        print_preset(report_console(), result)
    raise typer.Exit(EXIT_OK)
