"""What ``attncheck check`` judges and returns: the budgets a cell must stay within (their names and kinds), each
budget applied to a cell, each case, and the whole check."""

from __future__ import annotations

from dataclasses import dataclass, field

PROB_COUNT_BUDGETS = ("nan", "overflow", "zero_rows", "argmax_flips")
COUNT_BUDGETS = (*PROB_COUNT_BUDGETS, "out_nan")
ERROR_BUDGETS = ("max_abs_err", "max_abs_err_algo", "rmse", "kl_max")
RELATIVE_BUDGET = "relative_to_torch"
# On O = P@V (cells that have V): NaN rows, errors against float64 P64 @ V64, the
# smallest cosine similarity of a row (a lower bound: measured >= limit), and
# FlashAttention's rule on O's max error against the eager torch.softmax cell.
OUTPUT_BUDGETS = ("out_nan", "out_max_abs_err", "out_rmse", "out_rel_l1", "out_cos_min", "out_relative_to_torch")
# FlashAttention's rule: budget -> the Cell field compared with the torch cell's in the same dtype.
RELATIVE_BUDGETS = {RELATIVE_BUDGET: "max_abs_err_algo", "out_relative_to_torch": "out_max_abs_err"}
LOWER_BUDGETS = ("out_cos_min",)
BUDGET_NAMES = (*PROB_COUNT_BUDGETS, *ERROR_BUDGETS, RELATIVE_BUDGET, *OUTPUT_BUDGETS)


@dataclass(frozen=True)
class Budget:
    """Limits one method x dtype cell must stay within; None means not checked.

    Counts are rows of the cell; errors are measured against float64 by
    ``diagnose`` (``max_abs_err``, ``rmse``: against the scores as given;
    ``max_abs_err_algo``: against the scores after the cast to the dtype).
    ``relative_to_torch`` is FlashAttention's rule: the cell's ``max_abs_err_algo``
    at most N x torch.softmax's in the same dtype, plus ``relative_to_torch_atol``.
    The ``out_*`` budgets judge O = P@V against float64 P64 @ V64 in cells that have V
    (synthetic entries with ``paths``); ``out_cos_min`` is a lower bound.
    """

    def output_budgets(self) -> list[str]:
        return [name for name in OUTPUT_BUDGETS if getattr(self, name) is not None]

    nan: int | None = 0
    overflow: int | None = 0
    zero_rows: int | None = None
    argmax_flips: int | None = None
    max_abs_err: float | None = None
    max_abs_err_algo: float | None = None
    rmse: float | None = None
    kl_max: float | None = None
    relative_to_torch: float | None = None
    relative_to_torch_atol: float = 0.0
    out_nan: int | None = None
    out_max_abs_err: float | None = None
    out_rmse: float | None = None
    out_rel_l1: float | None = None
    out_cos_min: float | None = None
    out_relative_to_torch: float | None = None

    def active(self) -> list[tuple[str, float]]:
        """(name, limit) of every budget that is checked, in report order."""
        return [(name, getattr(self, name)) for name in BUDGET_NAMES if getattr(self, name) is not None]


@dataclass
class BudgetCheck:
    """One budget applied to one cell."""

    budget: str  # 'nan', 'max_abs_err', 'relative_to_torch', ...
    limit: float | int  # as configured (for relative_to_torch: the factor N)
    measured: float | int | None  # the cell's value; None: nothing to measure (see note)
    bound: float | None  # what measured is compared to: limit, or N x torch + atol
    passed: bool
    reference: float | None = (
        None  # relative budgets: torch's value in the same dtype (max_abs_err_algo, out_max_abs_err)
    )
    atol: float = 0.0  # relative_to_torch_atol
    rows: list[tuple[int, ...]] = field(default_factory=list)  # where it happened (first rows), or the worst row
    note: str = ""  # why measured is None

    @property
    def is_count(self) -> bool:
        return self.budget in COUNT_BUDGETS

    @property
    def op(self) -> str:
        """How measured compares to the bound in words: '<=' when it holds ('>=' for a lower bound), else '>' ('<')."""
        lower = self.budget in LOWER_BUDGETS
        if self.passed:
            return ">=" if lower else "<="
        return "<" if lower else ">"

    @property
    def worst_row(self) -> tuple[int, ...] | None:
        return self.rows[0] if self.rows else None

    @property
    def is_relative(self) -> bool:
        return self.budget in RELATIVE_BUDGETS

    @property
    def ratio(self) -> float | None:
        """relative budgets: measured / torch's error (None when torch's is 0 or missing)."""
        if self.reference and self.measured is not None:
            return self.measured / self.reference
        return None


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
    ignore: tuple[str, ...] = ()  # finding codes whose rows the count budgets left out

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]
