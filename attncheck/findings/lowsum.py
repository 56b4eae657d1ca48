"""Sums kept in 16 bits (``attncheck run --accumulate``): the softmax denominator or P@V drifting from float64
when accumulated in fp16/bf16, and an accumulator passing the dtype's range (numerics.methods.lowsum)."""

from __future__ import annotations

import math

from attncheck.findings.base import _TORCH, Code, Example, _scores
from attncheck.results import CaptureSums, LowSumStats, SumOverflow, TensorDiagnosis

# A row's denominator (or output) further than this from float64, relatively: twenty times fp16's unit roundoff
# (2^-11), where an fp32 accumulation stays within one or two; tract measured 0.2% to 2% at 1,024 keys and 9% to
# 15% at 4,096 for an f16 running total (sonos/tract PR 2586).
LOWSUM_ERROR_REL = 1e-2

CODES: tuple[Code, ...] = (
    Code(
        "lowsum_error",
        "warning",
        "output",
        "a sum kept in 16 bits drifts from float64",
        "With `--accumulate`, the softmax denominator sum_j exp(s_j - m) (and with V the output's sum_j "
        "exp(s_j - m) v_j) is accumulated as a CPU engine keeps it: in fp16 or bf16, one rounding per key "
        "(`seq`, tract's f16 softmax before PR 2586 and llama.cpp's f16 V accumulator), per node of a balanced "
        "tree (`pairwise`), between blocks of fp32 sums (`block:B`), or as llama.cpp's CPU flash attention runs "
        "(`online`: the f16 P@V rescaled at each new running max, the row sum in fp32). Once the running total "
        "outgrows its "
        "terms, additions round away: 4,096 equal logits sum to 2,048 in fp16 (its spacing is 2 there), and the "
        "row's probabilities sum to 2. The error of a sequential sum grows as n u, of a tree as log2(n) u.",
        f"max over rows of |S - S64| / S64 (or max_d |O - O64| / max_d |O64|) > {LOWSUM_ERROR_REL:g} "
        "(`LOWSUM_ERROR_REL`), in rows whose accumulators stay finite.",
        "accumulate the row sum and P@V in fp32 and round once at the end (tract PR 2586, llama.cpp's f32 S); "
        "where 16-bit partial sums must stay, sum pairwise or in fp32 blocks (`--accumulate fp16-pairwise`)",
        Example(
            _scores("""\
np.save("scores.npy", np.zeros((4, 4096), dtype=np.float32))  # equal logits: every term is 1
"""),
            "attncheck run scores.npy --dtype fp16 --method stable --accumulate fp16-seq --brief --fail-on "
            "lowsum_error",
        ),
    ),
    Code(
        "accumulator_overflow",
        "error",
        "output",
        "a 16-bit accumulator of the denominator or of P@V passes the dtype's range",
        "The kernels that keep P@V in fp16 accumulate sum_j exp(s_j - m) v_j unnormalised and divide by the "
        "row sum at the end (llama.cpp's `VKQ16`). That sum grows with the keys that carry weight near 1 times "
        "|V|: past fp16's rounding limit 65,520 (65,504 + half its ulp) it is inf, and the output inf or NaN "
        "(ik_llama.cpp PR 1196: NaN at a 64k-token context). The message names the row, the key at which the "
        "accumulator went (after how many keys), the head dim and the partial sum before it. On a capture it names "
        "the layer and the call. An online kernel's partial sums are taken against the running max, never smaller "
        "than the final max's: it can overflow where a two-pass sum stays finite.",
        "an accumulator's partial sum rounds to inf or NaN in the dtype: for fp16, an exact partial sum >= "
        "65,520; with equal logits and V = c in blocks of B keys, at key B ceil(65,520 / (B c)) once B c > 16 "
        "(smaller block sums stall below the limit).",
        "accumulate O in fp32 (llama.cpp's Metal kernels since PR 13975), or offset the running max by Delta so "
        "the accumulator holds e^-Delta times the sum (ik_llama.cpp PR 1196: ln 4; llama.cpp: ln 8)",
        Example(
            _TORCH
            + """\
q = torch.zeros(1, 1, 4, 8)  # equal logits: every key weighs exp(0) = 1 before the division
k = torch.zeros(1, 1, 32, 8)
v = torch.full((1, 1, 32, 4), 4096.0)  # 16 keys of 4,096 reach 65,536 >= 65,520
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --accumulate fp16-seq --brief --fail-on "
            "accumulator_overflow",
        ),
    ),
)


def _value(x: float) -> str:
    """65,472 as 65,472; inf, nan and fractions as Python writes them (6 digits)."""
    return f"{x:,.0f}" if math.isfinite(x) and x == int(x) else f"{x:.6g}"


def _where(first: SumOverflow, what: str, dtype: str, limit: str) -> str:
    dim = "" if first.dim is None else f", head dim {first.dim}"
    return (
        f"the {dtype} {what} passed {limit} after {first.key + 1:,} keys in row {first.row:,}{dim} (partial sum "
        f"{_value(first.partial)} became {_value(first.value)})"
    )


def lowsum_findings(diag: TensorDiagnosis, add) -> None:
    """--accumulate: an accumulator past its range (error), else a sum drifting beyond LOWSUM_ERROR_REL."""
    for st in diag.lowsum:
        stats_findings(st, add)


def stats_findings(st: LowSumStats, add, where: str = "", drift: str | None = None) -> None:
    """One sum's findings; ``where``: what the messages start with (a capture: the layer and the call that
    overflowed), ``drift``: what lowsum_error's starts with instead (the call that drifted most)."""
    dtype = st.label.split("-")[0]
    limit = f"its max {_value(st.dtype_max)}" if st.dtype_max < 1e6 else f"its max {st.dtype_max:.3g}"
    parts, rows = [], 0
    if st.denom_first is not None:
        parts.append(
            f"{st.denom_overflow_rows:,} of {st.rows:,} row(s): "
            + _where(st.denom_first, "denominator sum_j exp(s_j - m)", dtype, limit)
        )
        rows += st.denom_overflow_rows
    if st.out_first is not None:
        parts.append(
            f"{st.out_overflow_rows:,} of {st.out_rows:,} row(s): "
            + _where(st.out_first, "sum of V x P", dtype, limit)
            + f"; the largest exact sum is {_value(st.out_peak)}"
        )
        rows = max(rows, st.out_overflow_rows)
    if parts:
        add("accumulator_overflow", f"{where}{st.label} over {st.keys:,} keys: " + "; ".join(parts), rows=rows)
    worst = max(st.denom_err_max, st.out_err_max or 0.0)
    if worst > LOWSUM_ERROR_REL:
        head = where if drift is None else drift
        add(
            "lowsum_error",
            f"{head}{st.label} over {st.keys:,} keys: {_denominator_text(st)}{_output_text(st)}; the threshold is "
            f"{LOWSUM_ERROR_REL:g}",
            rows=st.rows,
        )


def _denominator_text(st) -> str:
    """The denominator's error, over the rows whose sum stayed finite (those that overflowed are said apart)."""
    finite = st.rows - st.denom_overflow_rows
    if not finite:
        return f"the denominator overflowed in every row ({st.rows:,})"
    tail = f" over the {finite:,} row(s) whose sum stayed finite" if st.denom_overflow_rows else ""
    return (
        f"the denominator's relative error against float64 is up to {st.denom_err_max:.3g} (mean "
        f"{st.denom_err_mean:.3g}){tail}"
    )


def _output_text(st) -> str:
    """The output's error over its finite rows, and how many rows are inf or NaN (an error of 0 over no row is none)."""
    if not st.out_rows:
        return ""
    bad = st.out_nonfinite_rows
    if bad == st.out_rows:
        return f"; the output is inf or NaN in all {bad:,} row(s)"
    text = f"; the output's up to {st.out_err_max:.3g}"
    return text + (f" over its {st.out_rows - bad:,} finite row(s), and inf or NaN in {bad:,} row(s)" if bad else "")


def capture_sums_findings(report: CaptureSums, add) -> None:
    """--accumulate on a capture: each layer's findings per sum, naming the layer and the call (the first whose
    accumulator overflowed, else the one that drifted most)."""
    for layer in report.layers:
        on = "" if layer.rank is None else f"rank {layer.rank} "
        calls = f"{len(layer.calls)} calls, " if len(layer.calls) > 1 else ""
        name = layer.module or "global"
        worst = f"{on}{name} ({calls}call #{layer.worst_call}): "
        first = worst if layer.first_call is None else f"{on}{name} ({calls}call #{layer.first_call}): "
        stats_findings(layer.stats, add, first, worst)
