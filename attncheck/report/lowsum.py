"""The sums kept in 16 bits of ``attncheck run --accumulate`` as a table (numbers from results.lowsum)."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from attncheck.format import fmt
from attncheck.results import SumOverflow, TensorDiagnosis


def _at(first: SumOverflow | None, rows: int) -> str:
    if first is None:
        return "0"
    dim = "" if first.dim is None else f" d{first.dim}"
    return f"{rows:,} (row {first.row:,}{dim}: after {first.key + 1:,} keys)"


def lowsum_table(d: TensorDiagnosis) -> Table | None:
    """Per accumulation asked: the denominator's and the output's relative error against float64, and the rows
    whose accumulator overflowed (the first of them: its row, head dim and key)."""
    if not d.lowsum:
        return None
    t = Table(
        title="Sums kept in 16 bits (--accumulate) against float64: relative error, overflowed rows",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("sum", "keys", "denom err max", "denom err mean", "denom overflow", "out err max", "out overflow"):
        t.add_column(name, justify="left" if name == "sum" else "right", no_wrap=True)
    for st in d.lowsum:
        bad = st.denom_overflow_rows or st.out_overflow_rows
        t.add_row(
            Text(st.label, style="bold red" if bad else ""),
            f"{st.keys:,}",
            fmt(st.denom_err_max, ".2e"),
            fmt(st.denom_err_mean, ".2e"),
            _at(st.denom_first, st.denom_overflow_rows),
            fmt(st.out_err_max, ".2e") if st.out_rows else "-",
            _at(st.out_first, st.out_overflow_rows) if st.out_rows else "-",
        )
    return t
