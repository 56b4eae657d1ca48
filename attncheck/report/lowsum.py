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
    return f"{rows:,} at {first.key + 1:,}"


def lowsum_table(d: TensorDiagnosis) -> Table | None:
    """Per accumulation asked: the denominator's and the output's largest relative error against float64 (and the
    denominator's mean) over rows whose sums stay finite, and the rows whose accumulator overflowed with the keys
    added when the first of them did ('2 at 65,536'; the finding names the row and head dim)."""
    if not d.lowsum:
        return None
    t = Table(
        title="Sums kept in 16 bits (--accumulate): relative error against float64, overflowed rows at keys",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("sum", "keys", "denom err", "mean", "denom ovf", "out err", "out ovf"):
        t.add_column(name, justify="left" if name == "sum" else "right", no_wrap=True)
    for st in d.lowsum:
        bad = st.denom_overflow_rows or st.out_overflow_rows
        t.add_row(
            Text(st.label, style="bold red" if bad else ""),
            f"{st.keys:,}",
            fmt(st.denom_err_max, ".2e") if st.rows > st.denom_overflow_rows else "-",  # no finite row: no error
            fmt(st.denom_err_mean, ".2e") if st.rows > st.denom_overflow_rows else "-",
            _at(st.denom_first, st.denom_overflow_rows),
            fmt(st.out_err_max, ".2e") if st.out_rows > st.out_nonfinite_rows else "-",  # no finite row: no error
            _at(st.out_first, st.out_overflow_rows) if st.out_rows else "-",
        )
    return t
