"""Casts and the softmax: the NaN and zero rows' causes inside the softmax (the cast overflowing, exp or the row
sum overflowing, every exp flushing to 0), and the rows no known cause explains."""

from __future__ import annotations

from attncheck.findings.base import Code, Example, _cell_list, _first_examples, _scores
from attncheck.findings.hazards import hazard_findings
from attncheck.format import num
from attncheck.params import MASK_SENTINEL_LIMIT
from attncheck.results import UNEXPLAINED, TensorDiagnosis

CODES: tuple[Code, ...] = (
    Code(
        "cast_overflow",
        "error",
        "softmax",
        "casting the scores to the dtype turns finite values into +-inf",
        "Finite scores beyond the dtype's range become +-inf when cast: +inf makes its row NaN (inf - inf), "
        "-inf masks a key that was not masked. The cast rounds once to the nearest value of the dtype (float64 "
        "scores too).",
        "|x| >= the dtype's rounding limit: fp16 65520; bf16 and fp32 about 3.40e38.",
        "upcast to fp32 before the softmax, or keep the logits in range (scale by 1/sqrt(d_k), clamp)",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[3, 0] = 70000.0  # finite in fp32, beyond fp16's 65504
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method torch --brief --fail-on cast_overflow",
        ),
        causes=("cast_overflow",),
    ),
    Code(
        "exp_overflow",
        "error",
        "softmax",
        "exp of a finite score overflows to inf",
        "A softmax that takes exp(x) without subtracting the row max (the textbook `naive` one) overflows once "
        "a score passes ln(max): inf / inf makes the row NaN, or the other keys' probabilities 0. Methods that "
        "subtract the max never see an exp above 1.",
        "x > ln(rounding limit): fp16 11.09; bf16 and fp32 88.72 (in bf16 x itself rounds first: 88.5 stays, "
        "88.75 and above become 89 and overflow). Taken from torch.finfo, never typed in.",
        "subtract the row max before exp (stable softmax, torch.softmax), or upcast to fp32 before the softmax",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[0, 0] = 12.0  # exp(12) = 162755 > 65504
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method naive --brief --fail-on exp_overflow",
        ),
        causes=("exp_overflow",),
    ),
    Code(
        "sum_overflow",
        "error",
        "softmax",
        "every exp is finite but the row sum overflows",
        "Each exp fits the dtype but their sum does not: dividing by inf gives an all-zero row (or NaN where an "
        "exp is inf too). With the row max subtracted the sum is at most the number of keys, so it overflows "
        "only with more keys than the dtype's max (fp16: 65520 keys).",
        "sum_j exp(x_j) >= the rounding limit with every exp(x_j) finite: fp16 65520, e.g. 100 keys of 7.0 "
        "(100 x 1097 = 109663).",
        "the row sum exceeds the dtype's range: subtract the row max before exp (the sum is then at most the number of "
        "keys), or keep the sum and the division in fp32 (torch.softmax does)",
        Example(
            _scores("""\
np.save("scores.npy", np.full((4, 100), 7.0, dtype=np.float32))  # 100 x exp(7) = 109663 > 65504
"""),
            "attncheck run scores.npy --dtype fp16 --method naive --brief --fail-on sum_overflow",
        ),
        causes=("sum_overflow",),
    ),
    Code(
        "underflow",
        "error",
        "softmax",
        "every exp of a row flushes to 0, so the row is 0/0",
        "Without the row max subtracted, a row whose scores are all very negative has every exp round to 0: "
        "0/0 = NaN. Subtracting the max makes the largest term exp(0) = 1.",
        "Every score of the row below ln(smallest subnormal / 2): fp16 -17.33, bf16 -92.9, fp32 -103.97 "
        "(half the smallest subnormal rounds to even, i.e. to 0).",
        "subtract the row max before exp: then the largest term is exp(0) = 1 and the sum cannot be 0",
        Example(
            _scores("""\
np.save("scores.npy", np.full((4, 8), -20.0, dtype=np.float32))  # exp(-20) = 2e-9 flushes to 0 in fp16
"""),
            "attncheck run scores.npy --dtype fp16 --method naive --brief --fail-on underflow",
        ),
        causes=("underflow",),
    ),
    Code(
        "zero_rows",
        "error",
        "softmax",
        "rows come out all zero with no known cause",
        "A cell returned rows whose every probability is 0, and none of the known causes explains them (a "
        "fully masked row, a cast overflow, an exp or sum overflow; those are reported under their own codes). "
        "All-zero rows lose all attention: the layer passes zeros on.",
        "Rows of the cell whose every probability is exactly 0, less those attributed to fully_masked, "
        "cast_overflow, exp_overflow or sum_overflow.",
        "these rows lost all probability mass: subtract the row max and accumulate in fp32",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def drops_last_row(x, params):  # a kernel that never writes the last row of its tile
    p = torch.softmax(x.float(), dim=-1)
    p[..., -1, :] = 0
    return MethodOutput(p.to(x.dtype))


METHODS.register(MethodSpec("drops_last_row", "softmax whose last row stays 0", drops_last_row))
result = diagnose("scores", torch.randn(4, 8), Options(dtypes=("fp32",), methods=("drops_last_row",)))
print([f.code for f in result.findings])
"""),
    ),
    Code(
        "unexplained_nan",
        "error",
        "softmax",
        "NaN rows that no known cause explains",
        "A cell returned NaN rows, and none of the causes attncheck traces (NaN or +inf in the input, Q@K^T or "
        "cast overflow, a mask sentinel, a fully masked row, exp or sum overflow, underflow) holds for them. "
        "With the built-in methods this points at attncheck itself; with a method of your own, at that method.",
        "NaN rows of the cell left after attributing every known cause in pipeline order.",
        "NaN with no cause attributable by attncheck: please report it with the dump",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def bad_reciprocal(x, params):  # e / (sum - sum): a NaN no input explains
    e = torch.exp(x - x.amax(-1, keepdim=True))
    s = e.sum(-1, keepdim=True)
    return MethodOutput(e * (s - s) / (s - s))


METHODS.register(MethodSpec("bad_reciprocal", "softmax with a broken reciprocal", bad_reciprocal))
result = diagnose("scores", torch.randn(4, 8), Options(dtypes=("fp32",), methods=("bad_reciprocal",)))
print([f.code for f in result.findings])
"""),
        causes=(UNEXPLAINED,),
    ),
)


def cast_findings(diag: TensorDiagnosis, add) -> None:
    """sentinel_not_representable and cast_overflow: what the cast of the scores to each dtype does."""
    census, cells = diag.census, diag.cells
    # What the cast to each dtype does.
    for h in census.headroom:
        dtype_cells = [c for c in cells if c.dtype == h.dtype]
        broken = [c for c in dtype_cells if c.nan_causes.get("cast_overflow") or c.zero_causes.get("cast_overflow")]
        rows_broken = max(
            (c.nan_causes.get("cast_overflow", 0) + c.zero_causes.get("cast_overflow", 0) for c in broken), default=0
        )
        examples = _first_examples(broken, "nan:cast_overflow") or _first_examples(broken, "zero:cast_overflow")
        if broken:
            effect = (
                f"; {rows_broken} row(s) become all -inf or hold +inf -> NaN or zeros in {_cell_list(broken, diag)}"
            )
        elif census.fully_masked_rows > census.neginf_rows:
            effect = "; rows masked only by it become all -inf (NaN in naive, stable and torch)"
        else:
            effect = "; partly masked rows still see -inf for those keys, so they stay masked"
        sentinels = [v for v in h.cast_overflow_examples if v <= MASK_SENTINEL_LIMIT]
        if h.cast_neginf_values and sentinels:
            vals = ", ".join(f"{v:.4g}" for v in sentinels)
            add(
                "sentinel_not_representable",
                f"mask value {vals} is not representable in {h.dtype} (max {h.max_finite:.6g}): {h.cast_neginf_values} "
                f"value(s) become -inf{effect}",
                broken,
                rows_broken,
                examples,
                severity="error" if broken else "warning",
            )
        other_pos = h.cast_posinf_values
        other_neg = h.cast_neginf_values if not sentinels else 0
        if other_pos or other_neg:
            add(
                "cast_overflow",
                f"casting to {h.dtype} turns {other_pos + other_neg} finite score(s) into +-inf (|x| beyond "
                f"{h.max_finite:.6g}; e.g. {num(h.cast_overflow_examples[0] if h.cast_overflow_examples else None, 4)})"
                f"{effect if other_pos else ''}",
                broken,
                rows_broken,
                examples,
            )


def softmax_findings(diag: TensorDiagnosis, add) -> None:
    """Per cell, what happens inside the softmax: exp or the row sum overflowing, every exp flushing, the
    kernels' own hazards (attncheck.findings.hazards), and zero or NaN rows no known cause explains."""
    census, cells = diag.census, diag.cells
    # What happens inside the softmax.
    for c in cells:
        h = next((h for h in census.headroom if h.dtype == c.dtype), None)
        n_exp = c.events.get("exp_overflow", 0)
        if n_exp:
            exp_nan, exp_zero = c.nan_causes.get("exp_overflow", 0), c.zero_causes.get("exp_overflow", 0)
            limit = f"exp(x) = inf for x > {h.exp_overflow_threshold:.4g}; " if h else ""
            add(
                "exp_overflow",
                f"{c.method} softmax in {c.dtype}: exp overflows to inf in {n_exp} row(s) ({limit}largest score "
                f"{num(census.max, 4)}) -> {exp_nan} NaN row(s){f', {exp_zero} all-zero row(s)' if exp_zero else ''}",
                [c],
                n_exp,
                c.examples.get("event:exp_overflow", []),
            )
        hazard_findings(diag, c, add)
        n_sum = c.events.get("sum_overflow", 0)
        if n_sum:
            sum_nan, sum_zero = c.nan_causes.get("sum_overflow", 0), c.zero_causes.get("sum_overflow", 0)
            top = f" (the largest {c.dtype} is {h.max_finite:.6g})" if h else ""
            add(
                "sum_overflow",
                f"{c.method} softmax in {c.dtype}: every exp is finite but the row sum overflows to inf in {n_sum} "
                f"row(s){top} -> {sum_zero} all-zero row(s){f', {sum_nan} NaN row(s)' if sum_nan else ''}",
                [c],
                n_sum,
                c.examples.get("event:sum_overflow", []),
            )
        if c.nan_causes.get("underflow") and h is not None:
            n = c.nan_causes["underflow"]
            add(
                "underflow",
                f"{c.method} softmax in {c.dtype}: every exp flushes to 0 in {n} row(s) (all scores below "
                f"{h.exp_underflow_threshold:.4g}), so the row is 0/0 = NaN",
                [c],
                n,
                c.examples.get("nan:underflow", []),
            )
        known = ("fully_masked", "cast_overflow", "exp_overflow", "fused_max", "sum_overflow")
        other_zero = c.zero_rows - sum(c.zero_causes.get(k, 0) for k in known)
        if other_zero > 0:
            add(
                "zero_rows",
                f"{c.method} softmax in {c.dtype}: {other_zero} row(s) come out all zero",
                [c],
                other_zero,
                c.examples.get(f"zero:{UNEXPLAINED}", []),
            )
        if c.nan_causes.get(UNEXPLAINED):
            n = c.nan_causes[UNEXPLAINED]
            add(
                "unexplained_nan",
                f"{c.method} softmax in {c.dtype}: {n} NaN row(s) with no known cause",
                [c],
                n,
                c.examples.get(f"nan:{UNEXPLAINED}", []),
            )
