"""The scores as given: NaN and +inf in the input, and query rows whose every key is masked."""

from __future__ import annotations

import math

from attncheck.findings.base import SENTINEL_LIMIT_TEXT, Code, Example, _cell_list, _first_examples, _scores
from attncheck.results import TensorDiagnosis

CODES: tuple[Code, ...] = (
    Code(
        "input_nan",
        "error",
        "input",
        "a row of the scores holds NaN before any softmax runs",
        "Some rows of the scores as given already hold NaN. Every softmax of such a row is NaN, whatever the "
        "method or dtype, so the NaN comes from upstream: Q or K, the mask, an earlier layer, or the loss scale "
        "of a previous step. Its rows are counted under this cause first (pipeline order), so the softmax "
        "findings below it are about the other rows.",
        "Any NaN value in a row (`census.nan`, `nan_causes.input_nan` per cell).",
        "the NaN is already in the scores: trace it upstream (Q, K, the mask, an earlier layer); no softmax can repair "
        "it",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[1, 3] = np.nan  # a NaN that came from upstream
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on input_nan",
        ),
        causes=("input_nan",),
    ),
    Code(
        "inf_input",
        "error",
        "input",
        "a row of the scores holds +inf",
        "Some rows hold +inf in the scores as given. The softmax subtracts the row max (inf - inf = NaN) or "
        "divides inf by inf, so the row is NaN in every method. +inf usually means the scores overflowed before "
        "they were saved: Q@K^T in fp16 without the 1/sqrt(d_k) scale, or a growing logit.",
        "Any +inf value in a row. (-inf is a masked key, not an input error.)",
        "the scores hold +inf (softmax gives inf - inf = NaN): find where they overflow, e.g. Q@K^T in fp16 without "
        "1/sqrt(d_k); scale q first or compute scores in fp32",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[2, 5] = np.inf  # Q@K^T overflowed upstream
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on inf_input",
        ),
        causes=("inf_input",),
    ),
    Code(
        "fully_masked_rows",
        "warning",
        "input",
        "a query row has every key masked",
        "Every key of these rows is masked, so the row has no softmax: -inf everywhere gives 0/0 = NaN in "
        "naive, stable and torch.softmax; a finite sentinel (e.g. -1e9) gives a uniform row over the masked "
        "keys, which is garbage rather than attention; FlashAttention and PyTorch SDPA (>= 2.5) return zeros. "
        "The message says which cells return what. Left padding makes such rows on purpose: `--ignore "
        "fully_masked_rows` judges them expected.",
        f"A key is masked when its score is -inf or at most {SENTINEL_LIMIT_TEXT}; from Q and K, when the mask says "
        "so. A row counts when every key is masked.",
        "a query that may attend to nothing has no softmax: zero such rows (torch.where(keep.any(-1, keepdim=True), p, "
        "0)) and drop them from the loss, or use a kernel that returns zeros (FlashAttention, SDPA >= 2.5); even then "
        "their backward pass can poison gradients if a NaN reaches it",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[0] = -np.inf  # a query that may attend to no key (left padding)
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on fully_masked_rows",
        ),
        severity_note=(
            "warning where a cell turns the rows into NaN, else info (every cell gives zeros or a finite row, as "
            "SDPA's kernels do)"
        ),
        also="info",
        causes=("fully_masked",),
    ),
)


def input_findings(diag: TensorDiagnosis, add, cells_with) -> None:
    """input_nan, inf_input, fully_masked_rows: the scores as given, before any softmax."""
    census, cells = diag.census, diag.cells
    # Input problems, in pipeline order.
    if census.nan_input_rows:
        hit = cells_with("nan", "input_nan")
        add(
            "input_nan",
            f"{census.nan_input_rows} row(s) hold NaN in the scores as given ({census.nan} value(s)); every method "
            "returns NaN there",
            hit,
            census.nan_input_rows,
            _first_examples(hit, "nan:input_nan"),
        )
    if census.posinf_input_rows:
        hit = cells_with("nan", "inf_input")
        add(
            "inf_input",
            f"{census.posinf_input_rows} row(s) hold +inf in the scores as given ({census.posinf} value(s)): softmax "
            "gives NaN",
            hit,
            census.posinf_input_rows,
            _first_examples(hit, "nan:inf_input"),
        )
    if census.fully_masked_rows:
        n, neginf = census.fully_masked_rows, census.neginf_rows
        how = []
        if neginf:
            how.append(f"{neginf} all -inf")
        if n - neginf:
            example = _finite_mask_value(diag)
            how.append(f"{n - neginf} with a finite sentinel" + (f", {example}" if example else ""))
        nan_hit = cells_with("nan", "fully_masked")
        zero_hit = cells_with("zero", "fully_masked")
        finite_hit = [
            c for c in cells if c.nan_causes.get("fully_masked", 0) + c.zero_causes.get("fully_masked", 0) < n
        ]
        parts = []
        if nan_hit:
            parts.append(f"NaN in {_cell_list(nan_hit, diag)}")
        if zero_hit:
            parts.append(f"zeros in {_cell_list(zero_hit, diag)}")
        if finite_hit and (n - neginf or diag.attention is not None):
            parts.append(
                f"a finite uniform row over the masked keys in {_cell_list(finite_hit, diag)} (a finite sentinel: "
                "garbage, not attention)"
            )
        parts.append("FlashAttention and PyTorch SDPA >= 2.5 return zeros for such rows")
        # true but harmless where no cell turns them into NaN (zeros, or a finite row the model ignores)
        add(
            "fully_masked_rows",
            f"{n} row(s) have every key masked ({', '.join(how) or 'by the mask'}): " + "; ".join(parts),
            nan_hit + zero_hit,
            n,
            _first_examples(nan_hit, "nan:fully_masked") or _first_examples(zero_hit, "zero:fully_masked"),
            severity="warning" if nan_hit else "info",
        )


def _finite_mask_value(diag: TensorDiagnosis) -> str | None:
    """The finite sentinel masked keys hold, as the mask holds it: 'e.g. -65504'. From Q/K
    inputs the mask itself says; from scores alone, the census's grouped row minima."""
    a = diag.attention
    if a is None:
        return f"e.g. {diag.census.sentinels[0][0]:.6g}" if diag.census.sentinels else None
    for v in (a.float_mask_value, _number(a.mask_value)):
        if v is not None and math.isfinite(v):
            return f"mask value {v:.6g}"
    return "mask value finfo(dtype).min" if a.mask_value == "min" else None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
