"""``attncheck check`` as a library call: a checked ``CheckConfig`` in, a ``CheckResult`` out.

Inputs are diagnosed one at a time, each read in row blocks (a file is opened only once
the one before it is done, so two ``.pt`` dumps are never resident together): files first (named
relative to the config's folder, so names do not depend on where the check runs),
then the synthetic entries.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from attncheck.config.check import CheckConfig
from attncheck.config.run import check_row_fits
from attncheck.config.sweep import head_layout
from attncheck.devices import resolve_device
from attncheck.errors import AttncheckError
from attncheck.loaders import iter_sources
from attncheck.pipelines.budgets import check_attention, check_source, synthetic_source
from attncheck.pipelines.run import device_label
from attncheck.results import CaseResult, CheckResult

Track = Callable[[str, int], "Callable[[int], None] | None"]  # (input name, rows) -> rows-done callback


def run_check(
    config: CheckConfig,
    device: str | None = None,
    track: Track | None = None,
    notice: Callable[[str], None] | None = None,
) -> CheckResult:
    """Every input of ``config`` against its budgets. ``device`` overrides the config's.
    Errors name the config's keys (``tool.attncheck.keys``), not library parameters."""
    try:
        return _run_check(config, device, track or (lambda name, rows: None), notice)
    except AttncheckError as e:
        raise AttncheckError(e.render(config.name_of)) from None


def _run_check(config: CheckConfig, device: str | None, track: Track, notice) -> CheckResult:
    dev = resolve_device(device or config.device)
    start = time.perf_counter()
    cases: list[CaseResult] = []
    names: list[str] = []
    budget = config.memory_budget
    options = config.options(device=str(dev))
    # One file open at a time (a .pt is loaded whole): file i+1 is opened once file i's tensors are diagnosed and
    # dropped.
    for src in iter_sources(list(config.files), list(config.keys), max_bytes=budget) if config.files else ():
        name = _relative_name(src.name, config)
        check_row_fits(name, src.shape[-1], budget)
        names.append(name)
        cases += check_source(
            src,
            config.budget,
            options,
            config.dtype_budgets,
            name=name,
            progress=track(name, src.rows),
            notice=notice,
            ignore=config.ignore,
        )
        del src
    for spec in config.synthetic:
        names.append(spec.name)
        if spec.paths:
            heads, queries = head_layout(spec.rows, spec.seq)
            cases += check_attention(
                spec,
                config.budget,
                config.options(spec.dtypes, str(dev)),
                config.dtype_budgets,
                progress=track(spec.name, heads * queries),
                notice=notice,
                ignore=config.ignore,
            )
            continue
        src = synthetic_source(spec, str(dev), budget)
        cases += check_source(
            src,
            config.budget,
            config.options(spec.dtypes, str(dev)),
            config.dtype_budgets,
            progress=track(spec.name, src.rows),
            notice=notice,
            ignore=config.ignore,
        )
    return CheckResult(
        config=config.display,
        config_path=config.path,
        device=device_label(dev),
        cases=cases,
        inputs=names,
        budget=config.budget,
        dtype_budgets=dict(config.dtype_budgets),
        seconds=time.perf_counter() - start,
        ignore=config.ignore,
    )


def _relative_name(name: str, config: CheckConfig) -> str:
    for f in config.files:
        if name == f or name.startswith(f + ":"):
            try:
                rel = os.path.relpath(f, config.root).replace(os.sep, "/")
            except ValueError:  # another drive (Windows)
                rel = f
            return rel + name[len(f) :]
    return name
