"""Budgets over diagnoses: one CaseResult per input x method x dtype, each budget's
limit, measured value and verdict, and where it broke.

Every number comes from ``diagnose``; the only tensor work here is building
the synthetic inputs and, for an error budget that failed, finding the row
with the largest error (``locate_worst_row``), which ``diagnose`` does not keep.
No printing, no files written, no typer or rich. The config side (TOML, keys,
globs) lives in the torch-free ``check_config``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from attncheck.check_config import (
    BUDGET_NAMES,
    COUNT_BUDGETS,
    RELATIVE_BUDGET,
    Budget,
    CheckConfig,
    SyntheticInput,
)
from attncheck.diagnose import Cell, Options, diagnose, resolve_device, rows_per_chunk
from attncheck.errors import AttncheckError
from attncheck.precision import dtype_from_name
from attncheck.softmax import reference_softmax, run_method
from attncheck.synthetic import make_scores

# Which Cell field each budget reads, and which of its example labels say where it happened.
BUDGET_FIELD = {
    "nan": "nan_rows",
    "overflow": "overflow_rows",
    "zero_rows": "zero_rows",
    "argmax_flips": "argmax_flips",
    "max_abs_err": "max_abs_err",
    "max_abs_err_algo": "max_abs_err_algo",
    "rmse": "rmse",
    "kl_max": "kl_max",
    RELATIVE_BUDGET: "max_abs_err_algo",
}
EXAMPLE_PREFIX = {"nan": "nan:", "overflow": "overflow", "zero_rows": "zero:", "argmax_flips": "flip"}
LOCATABLE = {"max_abs_err": False, "max_abs_err_algo": True, RELATIVE_BUDGET: True}  # budget -> against the cast scores?


def num(x: float | int | None) -> str:
    """Short form for messages: 28, 0.0312, 1e-05, n/a."""
    if x is None:
        return "n/a"
    if isinstance(x, int):
        return str(x)
    return f"{x:.3g}"


def row_text(row: tuple[int, ...]) -> str:
    """(0, 3, 17) -> '(0, 3, 17)'; a 2-D input's row (5,) -> '5'."""
    return str(row[0]) if len(row) == 1 else "(" + ", ".join(map(str, row)) + ")"


@dataclass
class BudgetCheck:
    """One budget applied to one cell."""

    budget: str  # 'nan', 'max_abs_err', 'relative_to_torch', ...
    limit: float | int  # as configured (for relative_to_torch: the factor N)
    measured: float | int | None  # the cell's value; None: nothing to measure (see note)
    bound: float | None  # what measured is compared to: limit, or N x torch + atol
    passed: bool
    reference: float | None = None  # relative_to_torch: torch's max_abs_err_algo in the same dtype
    atol: float = 0.0  # relative_to_torch_atol
    rows: list[tuple[int, ...]] = field(default_factory=list)  # where it happened (first rows), or the worst row
    note: str = ""  # why measured is None

    @property
    def is_count(self) -> bool:
        return self.budget in COUNT_BUDGETS

    @property
    def worst_row(self) -> tuple[int, ...] | None:
        return self.rows[0] if self.rows else None

    @property
    def ratio(self) -> float | None:
        """relative_to_torch: measured / torch's error (None when torch's is 0 or missing)."""
        if self.reference and self.measured is not None:
            return self.measured / self.reference
        return None

    def describe(self) -> str:
        """'max_abs_err 0.0312 > budget 0.01 (worst row (0, 3, 17))' or 'nan 0 <= budget 0'."""
        op = "<=" if self.passed else ">"
        if self.measured is None:
            text = f"{self.budget} not measured: {self.note} (budget {num(self.limit)})"
        elif self.budget == RELATIVE_BUDGET:
            atol = f" + {num(self.atol)}" if self.atol else ""
            ratio = f" ({self.ratio:.2f}x torch)" if self.ratio is not None else ""
            text = (
                f"relative_to_torch: max_abs_err_algo {num(self.measured)} {op} "
                f"{num(self.limit)} x torch {num(self.reference)}{atol} = {num(self.bound)}{ratio}"
            )
        else:
            text = f"{self.budget} {num(self.measured)} {op} budget {num(self.limit)}"
        if self.rows and not self.passed:
            if self.is_count:
                shown = ", ".join(row_text(r) for r in self.rows[:3])
                text += f" (row{'s' if len(self.rows) > 1 else ''} {shown}{', ...' if len(self.rows) > 3 else ''})"
            else:
                text += f" (worst row {row_text(self.rows[0])})"
        return text


@dataclass
class CaseResult:
    """One input x method x dtype cell and every budget checked on it."""

    input: str
    method: str
    dtype: str
    rows: int
    compared_rows: int  # rows where the cell and the float64 reference are both finite
    checks: list[BudgetCheck]
    shape: tuple[int, ...] = ()
    seconds: float = 0.0  # this case's share of the time spent on its input

    @property
    def name(self) -> str:
        return f"{self.method}/{self.dtype}"

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[BudgetCheck]:
        return [c for c in self.checks if not c.passed]

    def describe(self) -> str:
        """Failing budgets first, then the ones that hold."""
        parts = [c.describe() for c in self.failures]
        parts += [c.describe() + " ok" for c in self.checks if c.passed]
        return "; ".join(parts)


@dataclass
class CheckResult:
    config: str  # the config file as messages name it
    config_path: str | None
    device: str
    cases: list[CaseResult]
    inputs: list[str]
    budget: Budget
    dtype_budgets: dict[str, Budget] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]


# --------------------------------------------------------------------------- budgets


def _examples(cell: Cell, budget: str) -> list[tuple[int, ...]]:
    prefix = EXAMPLE_PREFIX[budget]
    rows: list[tuple[int, ...]] = []
    for label, found in cell.examples.items():
        if label == prefix or (prefix.endswith(":") and label.startswith(prefix)):
            rows.extend(r for r in found if r not in rows)
    return sorted(rows)


def budget_checks(cell: Cell, budget: Budget, torch_cell: Cell | None = None) -> list[BudgetCheck]:
    """Apply every active budget to ``cell``; ``torch_cell`` (same dtype) is needed for relative_to_torch."""
    out = []
    for name, limit in budget.active():
        if name == RELATIVE_BUDGET:
            if cell.method == "torch":
                continue  # torch against itself says nothing
            out.append(_relative_check(cell, limit, budget.relative_to_torch_atol, torch_cell))
            continue
        measured = getattr(cell, BUDGET_FIELD[name])
        if name in COUNT_BUDGETS:
            passed = measured <= limit
            rows = [] if passed else _examples(cell, name)
            out.append(BudgetCheck(name, limit, measured, float(limit), passed, rows=rows))
        elif measured is None:
            out.append(BudgetCheck(name, limit, None, limit, False, note="no row where the cell and the float64 reference are both finite"))
        else:
            out.append(BudgetCheck(name, limit, measured, limit, measured <= limit))
    return out


def _relative_check(cell: Cell, factor: float, atol: float, torch_cell: Cell | None) -> BudgetCheck:
    if torch_cell is None:
        raise AttncheckError(f"relative_to_torch needs the torch cell in {cell.dtype}")
    ref = torch_cell.max_abs_err_algo
    measured = cell.max_abs_err_algo
    if ref is None:
        note = f"torch/{cell.dtype} has no row where it and the float64 reference are both finite"
        return BudgetCheck(RELATIVE_BUDGET, factor, measured, None, False, atol=atol, note=note)
    bound = factor * ref + atol
    if measured is None:
        note = "no row where the cell and the float64 reference are both finite"
        return BudgetCheck(RELATIVE_BUDGET, factor, None, bound, False, reference=ref, atol=atol, note=note)
    return BudgetCheck(RELATIVE_BUDGET, factor, measured, bound, measured <= bound, reference=ref, atol=atol)


def locate_worst_row(
    scores: torch.Tensor,
    method: str,
    dtype: str,
    *,
    cast_reference: bool,
    block: int = 128,
    reverse: bool = False,
    accum: str = "fp32",
    device: str = "cpu",
) -> tuple[int, ...] | None:
    """The row with the largest |p - p_float64| of one cell (first on ties), or None.

    Errors as ``diagnose`` measures them: against float64 softmax of the scores as
    given, or of the scores cast to ``dtype`` (``cast_reference``); rows where either
    side is not finite do not count. Processed in row chunks, so memory stays bounded.
    """
    keys = scores.shape[-1]
    lead = tuple(scores.shape[:-1])
    flat = scores.reshape(-1, keys)  # (R, T)
    step = rows_per_chunk(keys, Options())
    dt = dtype_from_name(dtype)
    best, best_row = -1.0, None
    for start in range(0, flat.shape[0], step):  # loop over row chunks
        x = flat[start : start + step].to(device)  # (r, T)
        xc = x.to(dt)
        p = run_method(method, xc, block=block, reverse=reverse, accum=accum).probs.to(torch.float64)
        ref = reference_softmax(xc if cast_reference else x)  # (r, T) float64
        err = (p - ref).abs().amax(dim=-1)  # (r,); NaN where either side is undefined
        err = torch.where(torch.isfinite(err), err, -1.0)
        value, idx = err.max(dim=0)
        if float(value) > best:
            best, best_row = float(value), start + int(idx)
    if best_row is None or best < 0:
        return None
    return _unravel(best_row, lead)


def _unravel(flat: int, lead: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for dim in reversed(lead or (1,)):
        out.append(flat % dim)
        flat //= dim
    return tuple(reversed(out))


def check_tensor(
    name: str,
    scores: torch.Tensor,
    budget: Budget,
    *,
    dtypes: tuple[str, ...],
    methods: tuple[str, ...],
    block: int = 128,
    reverse: bool = False,
    accum: str = "fp32",
    device: str = "cpu",
    budgets: dict[str, Budget] | None = None,
) -> list[CaseResult]:
    """Diagnose one score tensor and apply the budget to every method x dtype cell.

    The torch cell is computed whenever a relative_to_torch budget needs it, and
    reported as a case only when ``methods`` lists it. ``budgets`` overrides
    ``budget`` per dtype.
    """
    options = Options(dtypes=dtypes, methods=methods, block=block, reverse=reverse, accum=accum, device=device)
    dtypes, methods = options.dtypes, options.methods  # canonical names: 'online' -> 'tiled', 'half' -> 'fp16'
    per_dtype = {d: (budgets or {}).get(d, budget) for d in dtypes}
    if any(b.relative_to_torch is not None for b in per_dtype.values()) and "torch" not in methods:
        options = replace(options, methods=(*methods, "torch"))
    start = time.perf_counter()
    diag = diagnose(name, scores, options)
    seconds = time.perf_counter() - start
    cases = []
    for m in methods:
        for d in dtypes:
            cell = diag.cell(m, d)
            b = per_dtype[d]
            torch_cell = diag.cell("torch", d) if b.relative_to_torch is not None else None
            checks = budget_checks(cell, b, torch_cell)
            for check in checks:
                if not check.passed and check.budget in LOCATABLE and check.measured is not None:
                    row = locate_worst_row(scores, m, d, cast_reference=LOCATABLE[check.budget], block=block, reverse=reverse, accum=accum, device=device)
                    check.rows = [row] if row is not None else []
            cases.append(CaseResult(name, m, d, cell.rows, cell.compared_rows, checks, tuple(diag.shape)))
    for case in cases:  # the input's time, shared out so that the cases add up to it
        case.seconds = seconds / len(cases)
    return cases


# --------------------------------------------------------------------------- inputs


def synthetic_scores(spec: SyntheticInput, device: str = "cpu") -> torch.Tensor:
    """scale * q.k from the sweep generator, float64: (rows, seq)."""
    s = make_scores(spec.rows, spec.seq, spec.d_k, dist=spec.dist, std=spec.std, seed=spec.seed, device=device)
    return s * spec.scale.value(spec.d_k)  # (R, S)


def iter_inputs(config: CheckConfig, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor, tuple[str, ...]]]:
    """(name, scores, dtypes) for every input: files first (named relative to the config's
    folder, so names do not depend on where the check runs), then synthetic entries."""
    if config.files:
        from attncheck.loaders import load_tensors

        try:
            named = load_tensors(list(config.files), list(config.keys))
        except AttncheckError as e:
            message = str(e)
            if message.startswith("--key "):  # the loader speaks of the command-line option
                message = f"{config.key('keys')}: " + message[len("--key ") :]
            raise AttncheckError(message) from None
        for t in named:
            yield _relative_name(t.name, config), t.tensor, config.dtypes
    for spec in config.synthetic:
        yield spec.name, synthetic_scores(spec, device), spec.dtypes or config.dtypes


def _relative_name(name: str, config: CheckConfig) -> str:
    for f in config.files:
        if name == f or name.startswith(f + ":"):
            try:
                rel = os.path.relpath(f, config.root).replace(os.sep, "/")
            except ValueError:  # another drive (Windows)
                rel = f
            return rel + name[len(f) :]
    return name


def run_check(config: CheckConfig, device: str | None = None, progress: Callable[[str], None] | None = None) -> CheckResult:
    """Every input of ``config`` against its budgets. ``device`` overrides the config's."""
    dev = resolve_device(device or config.device)
    label = str(dev)
    if dev.type == "cuda":
        label += f" ({torch.cuda.get_device_name(dev)})"
    start = time.perf_counter()
    cases: list[CaseResult] = []
    names: list[str] = []
    for name, scores, dtypes in iter_inputs(config, str(dev)):
        if progress is not None:
            progress(name)
        names.append(name)
        cases += check_tensor(
            name,
            scores,
            config.budget,
            dtypes=dtypes,
            methods=config.methods,
            block=config.block,
            reverse=config.order == "reverse",
            accum=config.accum,
            device=str(dev),
            budgets=config.dtype_budgets,
        )
    return CheckResult(
        config=config.display,
        config_path=config.path,
        device=label,
        cases=cases,
        inputs=names,
        budget=config.budget,
        dtype_budgets=dict(config.dtype_budgets),
        seconds=time.perf_counter() - start,
    )


__all__ = [
    "BUDGET_NAMES",
    "BudgetCheck",
    "CaseResult",
    "CheckResult",
    "budget_checks",
    "check_tensor",
    "iter_inputs",
    "locate_worst_row",
    "run_check",
    "synthetic_scores",
]
