"""The ``[tool.attncheck.budget]`` table and its per-dtype overrides: what a check allows each cell, and the
output budgets' need of V."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from attncheck import params
from attncheck.config.values import FP8_REFUSED, _count, _number, _reject_unknown, _table
from attncheck.errors import AttncheckError
from attncheck.registry import DTYPES, cell_dtype, dtype_names, eager_path
from attncheck.results import BUDGET_NAMES, COUNT_BUDGETS, LOWER_BUDGETS, RELATIVE_BUDGETS, Budget

if TYPE_CHECKING:
    from attncheck.config.check import CheckConfig

_AT = BUDGET_NAMES.index("relative_to_torch") + 1
BUDGET_KEYS = (*BUDGET_NAMES[:_AT], "relative_to_torch_atol", *BUDGET_NAMES[_AT:])


def parse_budget(table: dict[str, Any], prefix: str, display: str, base: Budget | None = None) -> Budget:
    """A budget table (no dtype subtables) -> Budget; keys missing keep ``base``'s values."""
    _reject_unknown(table, BUDGET_KEYS, prefix, display)
    values: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in COUNT_BUDGETS:
            values[name] = _count(value, key)
        elif name in LOWER_BUDGETS:
            values[name] = params.cosine(value, key, from_text=False)
        else:
            values[name] = _number(value, key, positive=name in RELATIVE_BUDGETS)
    budget = replace(base or Budget(), **values)
    if "relative_to_torch_atol" in table and budget.relative_to_torch is None:
        key = f"{prefix}.relative_to_torch_atol" if prefix else "relative_to_torch_atol"
        raise AttncheckError(f"{key} is set but relative_to_torch is not")
    return budget


def _parse_budgets(value: Any, prefix: str, display: str) -> tuple[Budget, dict[str, Budget]]:
    """[budget] and its [budget.<dtype>] overrides."""
    table = _table(value, prefix)
    cells = dtype_names()  # a [budget.<dtype>] table for any dtype a check computes in
    for name in table:
        if name in DTYPES.names(cell_dtype) and name not in cells:
            raise AttncheckError(
                f"{prefix}.{name}: {name!r} is an FP8 format; check computes in {', '.join(cells)} ({FP8_REFUSED})"
            )
    own = {k: v for k, v in table.items() if k not in cells}
    _reject_unknown(own, BUDGET_KEYS + cells, prefix, display)
    base = parse_budget(own, prefix, display)
    per_dtype = {}
    for dtype in cells:
        if dtype in table:
            key = f"{prefix}.{dtype}"
            per_dtype[dtype] = parse_budget(_table(table[dtype], key), key, display, base)
    return base, per_dtype


def _check_output_budgets(config: CheckConfig) -> None:
    """out_* budgets judge O = P@V: some input must have V (a synthetic entry with paths);
    relative_to_torch on paths compares with the eager path's torch.softmax cell."""
    budgets = (config.budget, *config.dtype_budgets.values())
    relative = [n for n in RELATIVE_BUDGETS if any(getattr(b, n) is not None for b in budgets)]
    if relative:
        for spec in config.synthetic:
            if spec.paths and eager_path() not in spec.paths:
                raise AttncheckError(
                    f"{config.key('budget.' + relative[0])} compares each cell with torch.softmax on the eager path: "
                    f'add "eager" to {config.key("synthetic")}[{spec.index}].paths'
                )
    if any(spec.paths for spec in config.synthetic):
        return
    for where, budget in (("budget", config.budget), *((f"budget.{d}", b) for d, b in config.dtype_budgets.items())):
        names = budget.output_budgets()
        if names:
            raise AttncheckError(
                f"{config.key(where + '.' + names[0])} judges the attention output O = P@V, which needs V: add "
                f'paths = ["eager", "flash"] to a [[{config.key("synthetic")}]] entry (saved score dumps have no V)'
            )
