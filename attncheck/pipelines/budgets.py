"""Budgets over diagnoses: one CaseResult per input x method x dtype, each budget's
limit, measured value and verdict, and where it broke.

Every number comes from ``diagnose``; the only tensor work here is building the
synthetic inputs and, for an error budget that failed, finding the row with the
largest error (``locate_worst_row``, which reads its input again in row blocks).
No printing, no files written, no typer or rich.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from attncheck.config.check import Budget, SyntheticInput, synthetic_bytes
from attncheck.config.run import Options
from attncheck.config.sweep import head_layout
from attncheck.devices import resolve_device
from attncheck.errors import AttncheckError
from attncheck.findings import counted_rows
from attncheck.format import size_text
from attncheck.loaders import TensorSource, memory_source
from attncheck.numerics.cells.diagnose import check_scores, diagnose_attention, diagnose_chunks, rows_per_chunk
from attncheck.numerics.inputs.scores import prepare_inputs
from attncheck.numerics.methods.softmax import reference_softmax, run_method
from attncheck.numerics.precision import cast, dtype_from_name
from attncheck.numerics.reduce import unravel
from attncheck.numerics.sweep.synthetic import make_qk, make_scores
from attncheck.params import DEFAULT_BLOCK
from attncheck.registry import PATHS, eager_path
from attncheck.results import (
    COUNT_BUDGETS,
    LOWER_BUDGETS,
    OUTPUT_BUDGETS,
    RELATIVE_BUDGET,
    RELATIVE_BUDGETS,
    BudgetCheck,
    CaseResult,
    Cell,
    TensorDiagnosis,
    flash_rule_bound,
)

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
    "out_nan": "out_nan_rows",
    "out_max_abs_err": "out_max_abs_err",
    "out_rmse": "out_rmse",
    "out_rel_l1": "out_rel_l1",
    "out_cos_min": "out_cos_min",
    "out_relative_to_torch": "out_max_abs_err",
}
EXAMPLE_PREFIX = {"nan": "nan:", "overflow": "overflow", "zero_rows": "zero:", "argmax_flips": "flip"}
LOCATABLE = {
    "max_abs_err": False,
    "max_abs_err_algo": True,
    RELATIVE_BUDGET: True,
}  # budget -> against the cast scores?


def _examples(cell: Cell, budget: str) -> list[tuple[int, ...]]:
    prefix = EXAMPLE_PREFIX.get(budget)
    if prefix is None:
        return []
    rows: list[tuple[int, ...]] = []
    for label, found in cell.examples.items():
        if label == prefix or (prefix.endswith(":") and label.startswith(prefix)):
            rows.extend(r for r in found if r not in rows)
    return sorted(rows)


def _counted(cell: Cell, name: str, ignore) -> int:
    """A count budget's measure, less the rows whose cause belongs to an ignored finding code."""
    if name == "nan":
        return counted_rows(cell.nan_rows, cell.nan_causes, ignore)
    if name == "zero_rows":
        return counted_rows(cell.zero_rows, cell.zero_causes, ignore)
    if name == "overflow" and {"exp_overflow", "sum_overflow"} & set(ignore):
        return 0
    return getattr(cell, BUDGET_FIELD[name])


def budget_checks(cell: Cell, budget: Budget, torch_cell: Cell | None = None, ignore=()) -> list[BudgetCheck]:
    """Apply every active budget to ``cell``; ``torch_cell`` (same dtype) is needed for relative_to_torch.
    The out_* budgets apply to cells that computed O = P@V (with V), and only to them.
    ``ignore``: finding codes whose rows the count budgets leave out."""
    out = []
    for name, limit in budget.active():
        if name in OUTPUT_BUDGETS and not cell.out_rows:
            continue
        if name in RELATIVE_BUDGETS:
            if cell.method == "torch":
                continue  # torch against itself says nothing
            atol = budget.relative_to_torch_atol if name == RELATIVE_BUDGET else 0.0
            out.append(_relative_check(cell, name, limit, atol, torch_cell))
            continue
        measured = _counted(cell, name, ignore) if name in COUNT_BUDGETS else getattr(cell, BUDGET_FIELD[name])
        if name in COUNT_BUDGETS:
            passed = measured <= limit
            rows = [] if passed else _examples(cell, name)
            out.append(BudgetCheck(name, limit, measured, float(limit), passed, rows=rows))
        elif measured is None:
            out.append(
                BudgetCheck(
                    name,
                    limit,
                    None,
                    limit,
                    False,
                    note="no row where the cell and the float64 reference are both finite",
                )
            )
        else:
            passed = measured >= limit if name in LOWER_BUDGETS else measured <= limit
            out.append(BudgetCheck(name, limit, measured, limit, passed))
    return out


def _relative_check(cell: Cell, name: str, factor: float, atol: float, torch_cell: Cell | None) -> BudgetCheck:
    """FlashAttention's rule: the cell's value of RELATIVE_BUDGETS[name] <= factor x the torch cell's + atol."""
    field_name = RELATIVE_BUDGETS[name]
    if torch_cell is None:
        raise AttncheckError(f"{name} needs the torch cell in {cell.dtype}")
    ref = getattr(torch_cell, field_name)
    measured = getattr(cell, field_name)
    if ref is None:
        note = f"{torch_cell.label}/{cell.dtype} has no row where it and the float64 reference are both finite"
        return BudgetCheck(name, factor, measured, None, False, atol=atol, note=note)
    bound = flash_rule_bound(ref, factor, atol)
    if measured is None:
        note = "no row where the cell and the float64 reference are both finite"
        return BudgetCheck(name, factor, None, bound, False, reference=ref, atol=atol, note=note)
    return BudgetCheck(name, factor, measured, bound, measured <= bound, reference=ref, atol=atol)


def locate_worst_row(
    source: TensorSource,
    method: str,
    dtype: str,
    *,
    cast_reference: bool,
    block: int = DEFAULT_BLOCK,
    reverse: bool = False,
    accum: str = "fp32",
    device: str = "cpu",
    rows_per_block: int | None = None,
) -> tuple[int, ...] | None:
    """The row with the largest |p - p_float64| of one cell (first on ties), or None.

    Errors as ``diagnose`` measures them: against float64 softmax of the scores as
    given, or of the scores cast to ``dtype`` (``cast_reference``); rows where either
    side is not finite do not count. Reads ``source`` in row blocks, so memory stays bounded.
    """
    keys = source.shape[-1]
    step = rows_per_block or rows_per_chunk(keys, Options())
    dt = dtype_from_name(dtype)
    best, best_row, start = -1.0, None, 0
    for chunk in source.row_blocks(step):  # loop over row chunks
        x = chunk.to(device)  # (r, T)
        xc = cast(x, dt)
        p = run_method(method, xc, block=block, reverse=reverse, accum=accum).probs.to(torch.float64)
        ref = reference_softmax(xc if cast_reference else x)  # (r, T) float64
        err = (p - ref).abs().amax(dim=-1)  # (r,); NaN where either side is undefined
        err = torch.where(torch.isfinite(err), err, -1.0)
        value, idx = err.max(dim=0)
        if float(value) > best:
            best, best_row = float(value), start + int(idx)
        start += x.shape[0]
    if best_row is None or best < 0:
        return None
    return unravel(best_row, tuple(source.shape[:-1]) or (1,))


def check_source(
    source: TensorSource,
    budget: Budget,
    options: Options,
    budgets: dict[str, Budget] | None = None,
    name: str | None = None,
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
    ignore=(),
) -> list[CaseResult]:
    """Diagnose one score tensor (read in row blocks) and apply the budget to every cell.

    The torch cell is computed whenever a relative_to_torch budget needs it, and
    reported as a case only when ``options.methods`` lists it. ``budgets``
    overrides ``budget`` per dtype.
    """
    name = name or source.name
    dtypes, methods = options.dtypes, options.methods
    per_dtype = {d: (budgets or {}).get(d, budget) for d in dtypes}
    if any(b.relative_to_torch is not None for b in per_dtype.values()) and "torch" not in methods:
        options = replace(options, methods=(*methods, "torch"))
    step = rows_per_chunk(source.shape[-1], options)
    start = time.perf_counter()
    diag = diagnose_chunks(name, source.shape, source.dtype, source.row_blocks(step), options, progress, notice=notice)
    seconds = time.perf_counter() - start
    cases = []
    for m in methods:
        for d in dtypes:
            cell = diag.cell(m, d)
            b = per_dtype[d]
            torch_cell = diag.cell("torch", d) if b.relative_to_torch is not None else None
            checks = budget_checks(cell, b, torch_cell, ignore)
            for check in checks:
                if not check.passed and check.budget in LOCATABLE and check.measured is not None:
                    row = locate_worst_row(
                        source,
                        m,
                        d,
                        cast_reference=LOCATABLE[check.budget],
                        block=options.block,
                        reverse=options.reverse,
                        accum=options.accum,
                        device=str(resolve_device(options.device)),
                        rows_per_block=step,
                    )
                    check.rows = [row] if row is not None else []
            cases.append(CaseResult(name, m, d, cell.rows, cell.compared_rows, checks, tuple(diag.shape)))
    for case in cases:  # the input's time, shared out so that the cases add up to it
        case.seconds = seconds / len(cases)
    return cases


def check_attention(
    spec: SyntheticInput,
    budget: Budget,
    options: Options,
    budgets: dict[str, Budget] | None = None,
    progress: Callable[[int], None] | None = None,
    notice: Callable[[str], None] | None = None,
    ignore: Sequence[str] = (),
) -> list[CaseResult]:
    """A synthetic entry with ``paths``: Q, K and V from the sweep generator, every path's P
    and O = P@V, each cell (path, method, dtype) against the budget."""
    per_dtype = {d: (budgets or {}).get(d, budget) for d in options.dtypes}
    shown = options.methods
    methods = shown
    if any(_relative(b) for b in per_dtype.values()) and "torch" not in methods:
        methods = (*methods, "torch")  # the eager:torch cell is the rule's reference
    options = replace(options, methods=methods, paths=spec.paths)
    q, k, v = synthetic_qkv(spec)
    inputs = prepare_inputs(q, k, v=v, scale=spec.scale)
    start = time.perf_counter()
    diag = diagnose_attention(spec.name, inputs, options, progress, notice=notice)
    seconds = time.perf_counter() - start
    cases = []
    for cell in diag.cells:
        if cell.path is not None and PATHS.get(cell.path).runs_methods and cell.method not in shown:
            continue
        b = per_dtype[cell.dtype]
        torch_cell = _eager_torch(diag, cell.dtype) if _relative(b) else None
        checks = budget_checks(cell, b, torch_cell, ignore)
        cases.append(
            CaseResult(spec.name, cell.label, cell.dtype, cell.rows, cell.compared_rows, checks, tuple(diag.shape))
        )
    for case in cases:  # the input's time, shared out so that the cases add up to it
        case.seconds = seconds / len(cases)
    return cases


def _relative(budget: Budget) -> bool:
    return any(getattr(budget, name) is not None for name in RELATIVE_BUDGETS)


def _eager_torch(diag: TensorDiagnosis, dtype: str) -> Cell | None:
    try:
        return diag.cell("torch", dtype, path=eager_path())
    except KeyError:
        return None


def synthetic_qkv(spec: SyntheticInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (1, H, Q, d), k and v (1, H, S, d) in float64 from the sweep generator: the entry's
    rows as whole heads of up to ``seq`` queries (rounded up to a whole head)."""
    heads, queries = head_layout(spec.rows, spec.seq)
    q, k, v = make_qk(heads, queries, spec.seq, spec.d_k, dist=spec.dist, std=spec.std, seed=spec.seed, with_v=True)
    return q[None], k[None], v[None]


def check_tensor(
    name: str, scores: torch.Tensor, budget: Budget, options: Options, budgets: dict[str, Budget] | None = None
) -> list[CaseResult]:
    """``check_source`` on a tensor in memory."""
    check_scores(name, scores)
    return check_source(memory_source(name, scores.detach()), budget, options, budgets)


def synthetic_scores(spec: SyntheticInput, device: str = "cpu") -> torch.Tensor:
    """scale * q.k from the sweep generator, float64: (rows, seq)."""
    s = make_scores(spec.rows, spec.seq, spec.d_k, dist=spec.dist, std=spec.std, seed=spec.seed, device=device)
    return s * spec.scale.value(spec.d_k)  # (R, S)


def synthetic_source(spec: SyntheticInput, device: str = "cpu", max_bytes: int | None = None) -> TensorSource:
    """``synthetic_scores`` as row blocks, bit for bit: q and k are drawn once, and each
    head's scores are computed (as the sweep's batched matmul computes them) only when its
    rows are read, so a large input holds q, k and about two heads' scores, never all rows.
    Sizes over ``max_bytes`` (``config.check.synthetic_bytes``) are refused before drawing."""
    need = synthetic_bytes(spec)
    if max_bytes is not None and need > max_bytes:
        raise AttncheckError(f"{spec.name}: needs {size_text(need)}, over max_memory {size_text(max_bytes)}")
    heads, queries = head_layout(spec.rows, spec.seq)
    q, k = make_qk(heads, queries, spec.seq, spec.d_k, dist=spec.dist, std=spec.std, seed=spec.seed, budget=need)
    q, k = q.to(device), k.to(device)
    scale = spec.scale.value(spec.d_k)

    def head_rows():
        for h in range(heads):  # a loop over heads: each is one matmul, as in make_scores
            rows = min(queries, spec.rows - h * queries)
            yield (q[h] @ k[h].transpose(-1, -2))[:rows].mul_(scale)  # (Q, S)

    def blocks(rows_per_block: int):
        pending, have = [], 0
        for part in head_rows():
            start = 0
            while start < part.shape[0]:
                take = min(rows_per_block - have, part.shape[0] - start)
                pending.append(part[start : start + take])
                have, start = have + take, start + take
                if have == rows_per_block:
                    yield torch.cat(pending) if len(pending) > 1 else pending[0].clone()
                    pending, have = [], 0
        if have:
            yield torch.cat(pending) if len(pending) > 1 else pending[0].clone()

    return TensorSource(spec.name, (spec.rows, spec.seq), torch.float64, False, blocks)
