"""--accumulate on a capture: the calls folded per layer (pipelines.lowsum.layer_sums) against numbers written here,
and the per-layer table's first column cut to what the layers' names differ by."""

from __future__ import annotations

from rich.console import Console

from attncheck.pipelines.lowsum import layer_sums
from attncheck.report.lowsum import layer_affixes, sums_block
from attncheck.results import CallSums, CaptureSums, LowSumStats, SumOverflow

ATTN = "model.layers.{}.self_attn"


def _stats(rows: int, mean: float, top: float, over: int = 0, key: int = 0) -> LowSumStats:
    st = LowSumStats("fp16-seq", rows=rows, keys=64, dtype_max=65504.0, denom_err_max=top, denom_err_mean=mean)
    st.out_rows, st.out_err_max = rows, top / 2
    if over:
        st.out_overflow_rows, st.out_first = over, SumOverflow(3, key, 65472.0, float("inf"), 1)
    return st


def test_calls_fold_per_layer() -> None:
    calls = [
        CallSums(0, "c0", ATTN.format(0), None, [_stats(10, 0.01, 0.02)]),
        CallSums(1, "c1", ATTN.format(1), None, [_stats(4, 0.1, 0.5, over=2, key=40)]),
        CallSums(2, "c2", ATTN.format(0), None, [_stats(30, 0.03, 0.04)]),
        CallSums(3, "c3", ATTN.format(1), None, [_stats(4, 0.2, 0.3, over=1, key=20)]),
    ]
    first, second = layer_sums(calls)
    assert (first.module, first.calls, second.calls) == (ATTN.format(0), [0, 2], [1, 3])
    assert first.stats.rows == 40 and first.stats.denom_err_max == 0.04 and first.worst_call == 2
    assert abs(first.stats.denom_err_mean - (10 * 0.01 + 30 * 0.03) / 40) < 1e-15  # over every finite row
    assert first.first_call is None and first.stats.out_first is None
    # the first call that overflowed keeps its overflow (its key and row); the rows add up; the worst is call 1
    assert second.first_call == 1 and second.stats.out_first.key == 40 and second.stats.out_overflow_rows == 3
    assert second.worst_call == 1 and second.stats.denom_err_max == 0.5


def test_table_names_layers_by_what_differs() -> None:
    assert layer_affixes([ATTN.format(0), ATTN.format(1), ATTN.format(0)]) == ("model.layers.", ".self_attn")
    assert layer_affixes([ATTN.format(0)]) == ("", "")
    assert layer_affixes(["enc.attn", "dec.attn"]) == ("", ".attn")
    calls = [CallSums(i, f"c{i}", ATTN.format(i), None, [_stats(8, 0.01, 0.02)]) for i in range(2)]
    console = Console(width=100, record=True)
    console.print(sums_block(CaptureSums(["fp16-seq"], calls, layer_sums(calls))))
    text = console.export_text()
    assert "L: layer model.layers.L.self_attn" in text
    rows = [line.split() for line in text.splitlines() if "fp16-seq" in line and "16 bits" not in line]
    assert [r[0] for r in rows] == ["0", "1"], text
