"""``attncheck watch LOG...``: the report of watch logs (``attncheck.watch``): per head the trend of
its largest logit, its entropy and its headroom, and the alerts with the step each first held.
Exit codes as ``run``'s: 0, 1 when a --fail-on condition holds, 2 for bad input."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer
from rich.console import Console

from attncheck import params
from attncheck.cli.common import EXIT_FAILED, check_output_path, fail, say, write_json
from attncheck.cli.options import JsonOpt
from attncheck.codes import REGISTRY, WHAT_IF_PREFIX
from attncheck.config.run import ignore_codes
from attncheck.errors import AttncheckError
from attncheck.params import WHAT_IF_ALL
from attncheck.registry import dtype_names, fp8_names

ALERTS = "Alerts"
PLOT_SUFFIX = ".png"
WatchWhatIfOpt = typer.Option(
    None,
    "--what-if",
    metavar="DTYPE,...|all",
    show_default=False,
    help=(
        "headroom_low also for hand-written (eager) attention in these dtypes (fp16, bf16, fp32; all: the three): S "
        "= Q@K^T held in the dtype before the scale, so its limit is the dtype's rounding limit times the call's "
        "scale. Reported apart; counted by --fail-on what-if:headroom_low only. FP8 kernels hold S in fp32: no FP8 "
        "what-if here."
    ),
)


def parse_watch_fail_on(value: str) -> list[str]:
    words = ("error", "warning", "nan", *(c for c, code in REGISTRY.items() if code.group == "watch"))
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    for item in items:
        if item.removeprefix(WHAT_IF_PREFIX) not in words:
            raise AttncheckError(
                f"unknown condition {item!r} (use {', '.join(words)}, or what-if:CONDITION)", param="fail_on"
            )
    return items


def watch(
    logs: List[str] = typer.Argument(
        ...,
        metavar="LOG...",
        help="Watch logs (.jsonl) that attncheck.watch wrote; under torchrun, one per rank.",
        show_default=False,
    ),
    json_out: JsonOpt = None,
    fail_on: str = typer.Option(
        "",
        "--fail-on",
        metavar="LIST",
        help=(
            "Exit 1 when an alert holds: logit_growth, entropy_collapse, headroom_low, nonfinite, nan (= "
            "nonfinite), warning or error (an alert of that severity or worse), comma-separated; what-if:CONDITION "
            "judges the --what-if alerts."
        ),
    ),
    ignore: str = typer.Option(
        "",
        "--ignore",
        metavar="CODE,...",
        help="Alert codes you judged expected: left out of the report and of --fail-on.",
    ),
    plot: Optional[str] = typer.Option(
        None,
        "--plot",
        metavar="FILE.png",
        help=(
            "Draw step x call heatmaps of the largest logit and of the entropy, and the curves of the worst heads "
            "with the alert steps marked, to FILE.png (needs matplotlib: the 'plot' extra). Logs of several ranks: "
            "the heatmaps of one rank (the first alert's, else the first; named), the curves of every rank."
        ),
    ),
    window: str = typer.Option(
        "20",
        "--window",
        metavar="N",
        help=(
            "Records the growth of a head's largest logit is fitted over (least squares of its logarithm; at least 5)."
        ),
        rich_help_panel=ALERTS,
    ),
    level: str = typer.Option(
        "50",
        "--logit-level",
        metavar="X",
        help="logit_growth holds once a growing head's largest logit reaches X.",
        rich_help_panel=ALERTS,
    ),
    growth: str = typer.Option(
        "2",
        "--growth",
        metavar="G",
        help="logit_growth holds from a growth of G times per 100 steps.",
        rich_help_panel=ALERTS,
    ),
    horizon: str = typer.Option(
        "1000",
        "--horizon",
        metavar="STEPS",
        help="headroom_low holds when, at its growth, a head reaches its dtype's limit within STEPS steps.",
        rich_help_panel=ALERTS,
    ),
    collapse: str = typer.Option(
        "0.5",
        "--collapse",
        metavar="SHARE",
        help="entropy_collapse holds when SHARE of a head's sampled rows put over 0.99 of their weight on one key.",
        rich_help_panel=ALERTS,
    ),
    rank_factor: str = typer.Option(
        "10",
        "--rank-factor",
        metavar="F",
        help=(
            "rank_divergence holds when a head's largest logit on one rank is F times another rank's at the same "
            "step (magnitudes below 1 counted as 1)."
        ),
        rich_help_panel=ALERTS,
    ),
    what_if: Optional[str] = WatchWhatIfOpt,
    quiet: bool = typer.Option(
        False,
        "--quiet",
        "-q",
        help=(
            "Print less: no notice on stderr of the --plot file written (and of the calls and ranks it leaves out); "
            "the report and the --fail-on lines are printed."
        ),
    ),
) -> None:
    """Read watch logs: the trend of every head's largest attention logit, its entropy and its headroom, with alerts.

    attncheck.watch(model, log=...) writes one JSON line per recorded training step: per attention call and head, the largest unmasked logit, the entropy of the rows, max |q| and |k|, NaN or inf rows, and the largest logit the call's dtype allows. This command fits the growth of each head's largest logit over the last --window records and reports logit_growth (geometric growth past --logit-level), entropy_collapse, headroom_low (the dtype's limit within --horizon steps at that growth; with --what-if DTYPES also for hand-written attention in those dtypes), nonfinite, rank_divergence (logs of several ranks whose same head differs by --rank-factor) and no_attention (a log without any call: an error), each with the step it first held and the rank.

    Exit codes: 0 ran and nothing failed, 1 a --fail-on condition held, 2 usage or input error.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        conditions = parse_watch_fail_on(fail_on)
        ignored = ignore_codes(ignore)
        settings = _settings(window, level, growth, horizon, collapse, rank_factor)
        asked = _asked_what_if(what_if)
        check_output_path(json_out, "--json")
        if plot is not None:
            check_plot_path(plot)
            from attncheck.report.sweep_plot import require_matplotlib  # the report modules: not for --help

            require_matplotlib()
        report, held = _judge(logs, plot, asked, settings, ignored, conditions)
    except AttncheckError as e:
        raise fail(e) from None
    _emit(report, held, json_out, plot, quiet)


def _settings(window: str, level: str, growth: str, horizon: str, collapse: str, rank_factor: str) -> dict:
    """The alerts' settings, each checked: the keyword arguments of watcher.trends.analyse."""
    from attncheck.watcher.trends import MIN_POINTS  # trends imports numpy: not for --help

    settings = dict(
        window=params.integer(window, "window", 1),
        level=params.number(level, "logit_level", positive=True),
        growth=params.number(growth, "growth", positive=True),
        horizon=params.number(horizon, "horizon", positive=True),
        collapse=params.number(collapse, "collapse", positive=True),
        rank_factor=params.number(rank_factor, "rank_factor", positive=True),
    )
    if settings["window"] < MIN_POINTS:  # fewer records than a growth is fitted over: every growth alert would be off
        raise AttncheckError(
            f"must be at least {MIN_POINTS}, the fewest records a growth is fitted over; got {window}",
            param="window",
        )
    if settings["rank_factor"] <= 1:
        raise AttncheckError(f"is a factor between ranks, above 1; got {rank_factor}", param="rank_factor")
    if settings["collapse"] > 1:
        raise AttncheckError(f"is a share of rows, from 0 to 1; got {collapse}", param="collapse")
    if settings["growth"] <= 1:
        raise AttncheckError(f"is a growth factor per 100 steps, above 1; got {growth}", param="growth")
    return settings


def _asked_what_if(what_if: Optional[str]) -> tuple:
    """--what-if's dtypes; a kernel replay or a setting sweep is refused (the watch holds statistics, not tensors)."""
    asked = params.what_if(what_if) if what_if is not None else ()
    replays = [w for w in asked if w in (params.WHAT_IF_KERNELS, *params.setting_sweeps())]
    replays += list(params.kv_what_ifs(asked))  # the KV cache too: it recomputes attention from K and V
    if replays:
        raise AttncheckError(
            f"{replays[0]}: the watch judges logged statistics, not tensors, so it cannot replay a call under "
            "other kernels or through a KV cache; capture the step (attncheck capture) and run attncheck run DIR "
            f"--what-if {replays[0]}",
            param="what_if",
        )
    return asked


def _judge(logs: List[str], plot: Optional[str], asked: tuple, settings: dict, ignored, conditions: list[str]):
    """The logs read and analysed: (the watch report without the ignored alerts, the --fail-on conditions held)."""
    from attncheck.loaders.watchlog import read_watch_logs  # imports torch: not for --help or a bad argument
    from attncheck.watcher.trends import analyse, failed  # imports numpy (as above)

    read = read_watch_logs(logs)
    report = analyse(read, what_if=_what_if_limits(asked), **settings)
    report.alerts = [a for a in report.alerts if a.code not in ignored]
    held = failed(report, conditions, ignored)
    if plot is not None and not report.series:
        raise AttncheckError(
            f"--plot {plot}: the logs hold no attention call, nothing to draw (no attention recorded: "
            "run attncheck watch without --plot for the report)"
        )
    return report, held


def _emit(report, held: list[str], json_out: Optional[str], plot: Optional[str], quiet: bool) -> None:
    """The JSON, the table (unless the JSON goes to stdout), the plot and the --fail-on lines; exit 1 when one held."""
    from attncheck.report.watch import plot_watch, render_watch, watch_json  # the report modules: not for --help

    if json_out is not None:
        try:
            write_json(json.dumps(watch_json(report, held), indent=2, allow_nan=False), json_out)
        except AttncheckError as e:
            raise fail(e) from None
    if json_out != "-":
        Console(markup=False, highlight=False).print(render_watch(report))
    if plot is not None:
        try:
            drawn = plot_watch(report, plot)
        except AttncheckError as e:
            raise fail(e) from None
        if not quiet:
            say(f"attncheck: wrote {plot}" + (f" ({drawn})" if drawn else ""))
    for reason in held:
        say(f"attncheck: --fail-on {reason}")
    if held:
        raise typer.Exit(EXIT_FAILED)


def check_plot_path(plot: str) -> None:
    """--plot names a .png file that can be created (matplotlib picks the format by the suffix)."""
    if plot in ("", "-") or not plot.lower().endswith(PLOT_SUFFIX) or len(os.path.basename(plot)) <= len(PLOT_SUFFIX):
        raise AttncheckError(f"--plot takes a file name ending in {PLOT_SUFFIX}, got {params.show(plot)}")
    check_output_path(plot, "--plot", dash_ok=False)  # a folder, a missing folder, a name too long: before drawing


def _what_if_limits(asked) -> dict[str, float]:
    """--what-if DTYPES -> each dtype's rounding limit (hand-written attention holds S = Q@K^T in it).
    An FP8 dtype is refused: the FP8 kernels hold S in fp32, and no hand-written attention holds S in FP8."""
    if not asked:
        return {}
    from attncheck.numerics.precision import dtype_from_name, rounding_limit  # imports torch: not for --help

    fp8 = [d for d in asked if d in fp8_names()]
    if fp8:
        raise AttncheckError(
            f"{fp8[0]}: the watch's what-if is hand-written attention holding S = Q@K^T in a dtype; FP8 kernels "
            "hold S in fp32 (give fp16, bf16 or fp32)",
            param="what_if",
        )
    names = [d for d in dtype_names() if d not in fp8_names()] if asked == (WHAT_IF_ALL,) else list(asked)
    return {d: rounding_limit(dtype_from_name(d)) for d in names}
