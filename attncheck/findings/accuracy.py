"""Accuracy and the output: the top key against float64, a kernel's error against torch.softmax's and its output's
against PyTorch attention's (FlashAttention's 2x rule), biased rounding of O on tied maxima, and probabilities
that flush to 0."""

from __future__ import annotations

from attncheck.findings.base import _SEEDED, Code, Example, _first_examples, _scores, out_nan_rows
from attncheck.format import num
from attncheck.registry import METHODS, PATHS, eager_path
from attncheck.results import FLASH_RULE_FACTOR, OUT_CAUSES, UNEXPLAINED, TensorDiagnosis, flash_rule_bound

FLUSH_INFO_FRAC = 0.01
TIED_BIAS_Z = 4.0  # a mean signed error this many standard errors from 0 is a bias, not noise
TIED_BIAS_MIN_ROWS = 16  # fewer tied rows do not make a mean to test

CODES: tuple[Code, ...] = (
    Code(
        "argmax_flip",
        "warning",
        "accuracy",
        "the most likely key differs from float64's beyond what rounding explains",
        "In some rows the cell's top key is not float64's, and the two keys' scores are further apart than the "
        "cell's own rounding can account for. Near-ties within rounding are counted apart "
        "(`argmax_flips_near_tie`) and are not findings. The built-in methods round every probability of a row "
        "the same way, so a counted flip points at an implementation that reorders or corrupts keys, as in "
        "the example.",
        "With a the float64 top key and b the cell's (the first of ties), s the float64 scores and s' the "
        "scores as the cell computed them: s_a - s_b > |s'_a - s_a| + |s'_b - s_b| + 4u, u the unit roundoff "
        "of the cell's dtype.",
        "the most likely key changes against float64: upcast the softmax to fp32 where decisions depend on the top key",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def swapped(x, params):  # a softmax with a bug: keys 0 and 1 trade places
    p = torch.softmax(x.float(), dim=-1)
    return MethodOutput(p[..., [1, 0, *range(2, x.shape[-1])]].to(x.dtype))


METHODS.register(MethodSpec("swapped", "softmax with keys 0 and 1 swapped", swapped))
scores = torch.zeros(4, 8)
scores[:, 0] = 3.0  # key 0 first by a clear margin
result = diagnose("scores", scores, Options(dtypes=("fp32",), methods=("swapped",)))
print([f.code for f in result.findings])
"""),
    ),
    Code(
        "worse_than_torch",
        "info",
        "accuracy",
        f"a kernel's error is above {FLASH_RULE_FACTOR:g}x torch.softmax's in the same dtype",
        f"FlashAttention's tests hold a kernel to at most {FLASH_RULE_FACTOR:g}x the error of a plain PyTorch "
        "implementation in the same dtype. attncheck applies that rule to the methods that reproduce a kernel models "
        "run (`tiled`, and with `--q/--k` the `flash`, `flash-fp8` and `sage` paths against `eager:torch`, and any "
        "method registered with `kernel=`), comparing algorithmic errors: against float64 of the scores after the "
        "cast, so that the input's rounding does not hide the implementation's. A hand-written naive or stable "
        "softmax rounds three times where torch.softmax rounds once, so it is not held to the rule.",
        f"max_abs_err_algo > {FLASH_RULE_FACTOR:g} x torch's max_abs_err_algo in the same dtype, for cells whose "
        "verdict is ok.",
        "this kernel loses more accuracy than torch.softmax in the same dtype: keep the max and sum in fp32 and round "
        "only the result (smaller key blocks keep P_j closer to the final max)",
        Example("""\
import torch

from attncheck import METHODS, MethodSpec, Options, diagnose
from attncheck.numerics.methods.softmax import MethodOutput


def bf16_inside(x, params):  # a kernel that rounds P through bf16 inside an fp16 cell
    p = torch.softmax(x.float(), dim=-1).bfloat16()
    return MethodOutput(p.to(x.dtype))


METHODS.register(MethodSpec("bf16_inside", "softmax rounded through bf16", bf16_inside, kernel="a fused kernel"))
scores = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
result = diagnose("scores", scores, Options(dtypes=("fp16",), methods=("bf16_inside", "torch")))
print([f.code for f in result.findings])
"""),
    ),
    Code(
        "output_nan",
        "error",
        "output",
        "rows of the output O = P@V are NaN or inf while their softmax is finite",
        "With `--v` (or a captured call's V), every cell computes O = P@V. A row of O can be NaN or inf although its "
        "probabilities are finite, and no softmax finding covers it. Its first cause (`out_nan_causes` per cell): "
        "`v_nonfinite`, V holds NaN or inf in the row's head (0 x NaN is NaN, so a path that multiplies a masked "
        "key's zero by it is hit too); `v_cast_overflow`, V is finite but beyond the dtype's range, and its cast "
        "is +-inf; `pv_overflow`, P and V are finite in the dtype and P@V passes its max; else `unexplained`. "
        "Rows whose P is itself NaN are the softmax's (`nan_rows`, its findings) and are not counted here.",
        "Any row of O holding NaN or inf whose P row is finite (`out_nan_rows` less `out_nan_causes.softmax`); "
        "the message names the V entries (batch, kv head, key, dim) or the largest float64 |P@V|.",
        "a NaN or inf in V, or a V beyond the dtype's range, reaches every row that multiplies it: find where V "
        "goes bad (the layer before v_proj, a value that overflows on the cast), clamp or scale V, or keep P@V in "
        "fp32",
        Example(
            _SEEDED
            + """\
q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
v[0, 0, 17, 3] = float("nan")  # one bad value in V, from an earlier layer
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype fp16 --method torch --path eager --brief "
            "--fail-on output_nan",
        ),
    ),
    Code(
        "output_error",
        "warning",
        "output",
        f"an attention path's output is further from float64 than {FLASH_RULE_FACTOR:g}x PyTorch attention's",
        "With `--v`, every cell computes O = P@V. FlashAttention's test rule applied to O: a path's max error against "
        f"float64 (P64 @ V64) may be at most {FLASH_RULE_FACTOR:g}x that of hand-written PyTorch attention with "
        "torch.softmax in the same dtype (`eager:torch`).",
        f"max |O - O_float64| > {FLASH_RULE_FACTOR:g} x eager:torch's in the same dtype, over rows where both are "
        "finite.",
        "this attention path's output is further from float64 than FlashAttention's test allows "
        f"({FLASH_RULE_FACTOR:g}x the same-dtype PyTorch attention): keep S and the softmax in fp32 and round P only "
        "for P@V, or use SDPA",
        Example(
            _SEEDED
            + """\
q = torch.randn(1, 1, 32, 64, generator=g) * 0.1
k = torch.randn(1, 1, 4096, 64, generator=g) * 0.1  # long rows: 4096 keys
v = torch.randn(1, 1, 4096, 64, generator=g) + 3
torch.save({"q": q, "k": k, "v": v}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype fp16 --method stable,torch --accum dtype "
            "--path eager --brief --fail-on output_error",
        ),
    ),
    Code(
        "tied_max_bias",
        "warning",
        "output",
        "the rounding of O is biased in rows whose maximum is tied",
        "Where several keys share a row's largest score, exp(s - max) is exactly 1 at each of them and the "
        "rounding of O = P@V is biased, and a bias does not average out over steps (Qiu and Yao 2025, arXiv "
        "2510.04212: similar low-rank keys in bf16). attncheck counts such rows per path and tests their mean "
        "signed error, with the rows as samples.",
        f"At least {TIED_BIAS_MIN_ROWS} tied rows, and their mean signed error of O (against float64 of the path's own "
        f"scores and V as the dtype holds it) more than {TIED_BIAS_Z:g} standard errors from 0.",
        "a bias does not average out over steps (Qiu and Yao 2025, arXiv 2510.04212): when the row max repeats, "
        "subtract a slightly larger max (their fix: m = beta * max for a positive max) so that no exp(s - m) is "
        "exactly 1, or keep O in fp32 where the next layer reads it",
        Example(
            _SEEDED
            + """\
q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
k[..., 1:8, :] = k[..., :1, :]  # eight identical keys
q = q + 2 * k[..., :1, :]  # that every query prefers: each row's max is tied eight times
torch.save({"q": q, "k": k, "v": v + 1}, "qkv.pt")
""",
            "attncheck run --q qkv.pt:q --k qkv.pt:k --v qkv.pt:v --dtype bf16 --method torch --brief --fail-on "
            "tied_max_bias",
        ),
    ),
    Code(
        "probability_flush",
        "info",
        "accuracy",
        "small probabilities round to 0 in the dtype",
        "Probabilities that float64 says are non-zero become exactly 0 in the cell: they are below half the "
        "dtype's smallest subnormal. Harmless for most models; it matters where those keys carry meaning (long "
        "contexts, retrieval).",
        f"{FLUSH_INFO_FRAC:.0%} or more of the probabilities float64 holds non-zero are exactly 0 in the cell "
        "(`flushed_frac`). FP8 cells whose P cast loses probability are reported as p_cast_underflow instead.",
        "small probabilities round to 0 in this dtype; harmless for most models, upcast if those keys matter",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[:, 0] = 20.0  # the other keys get exp(-20) = 2e-9: below fp16's smallest subnormal
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method torch --brief --fail-on probability_flush",
        ),
    ),
)


def accuracy_findings(diag: TensorDiagnosis, add) -> None:
    """argmax_flip and worse_than_torch: the top key against float64, and kernels against torch.softmax."""
    cells = diag.cells
    # Accuracy.
    flips = [c for c in cells if c.argmax_flips]
    if flips:
        worst = max(flips, key=lambda c: c.argmax_flips)
        add(
            "argmax_flip",
            "the top-1 key differs from float64 in " + ", ".join(f"{c.name} ({c.argmax_flips} row(s))" for c in flips),
            flips,
            worst.argmax_flips,
            _first_examples(flips, "flip"),
        )
    by_dtype_torch = {c.dtype: c for c in cells if c.method == "torch"}
    worse, hit = [], []
    for c in cells:
        t = by_dtype_torch.get(c.dtype)
        kernel = _kernel_of(c.method)
        if (
            kernel is None
            or t is None
            or c is t
            or c.verdict != "ok"
            or c.max_abs_err_algo is None
            or not t.max_abs_err_algo
        ):
            continue
        if c.max_abs_err_algo > flash_rule_bound(t.max_abs_err_algo):
            worse.append(f"{c.name} ({kernel}) {c.max_abs_err_algo / t.max_abs_err_algo:.1f}x")
            hit.append(c)
    if worse:
        add(
            "worse_than_torch",
            f"a kernel's max error is above {FLASH_RULE_FACTOR:g}x torch.softmax's in the same dtype (FlashAttention's "
            "test budget, errors against float64 of the cast scores; only methods that reproduce a kernel models run "
            f"are judged): {', '.join(worse)}",
            hit,
        )


def flush_findings(diag: TensorDiagnosis, add) -> None:
    """probability_flush: non-zero reference probabilities that are exactly 0 in a cell."""
    cells = diag.cells
    # An FP8 cell whose P cast flushes is reported by p_cast_underflow, with the cause.
    flushed = [
        c for c in cells if c.flushed_frac is not None and c.flushed_frac >= FLUSH_INFO_FRAC and not c.pcast_mass_rows
    ]
    if flushed:
        add(
            "probability_flush",
            "non-zero reference probabilities become exactly 0 in "
            + ", ".join(f"{c.name} ({c.flushed_frac:.1%})" for c in flushed),
            flushed,
        )


def output_findings(diag: TensorDiagnosis, add) -> None:
    """With V: paths whose output error breaks FlashAttention's rule, and biased rounding on tied maxima."""
    with_out = [c for c in diag.cells if c.out_max_abs_err is not None]
    worse = []
    for c in with_out:
        ref = next((t for t in with_out if t.dtype == c.dtype and t.path == eager_path() and t.method == "torch"), None)
        if ref is None or c is ref or not ref.out_max_abs_err:
            continue
        if c.out_max_abs_err > flash_rule_bound(ref.out_max_abs_err):
            worse.append((c, c.out_max_abs_err / ref.out_max_abs_err))
    if worse:
        add(
            "output_error",
            "max |O - O_float64| above "
            + f"{FLASH_RULE_FACTOR:g}x the same-dtype PyTorch attention's (eager:torch): "
            + ", ".join(f"{c.name} {r:.1f}x ({c.out_max_abs_err:.3g})" for c, r in worse),
            [c for c, _ in worse],
        )
    biased = [
        c
        for c in with_out
        if c.tied_rows >= TIED_BIAS_MIN_ROWS and c.out_bias_tied_z is not None and abs(c.out_bias_tied_z) > TIED_BIAS_Z
    ]
    if biased:
        add(
            "tied_max_bias",
            "in rows whose largest score is shared by several keys, exp(s - max) is exactly 1 at each of them, and the "
            "rounding of O = P@V is biased there (mean signed error of O against float64 of the same scores and V, per "
            "row): "
            + ", ".join(
                f"{c.name} {c.tied_rows} tied row(s), mean error {c.out_bias_tied:.3g} ({abs(c.out_bias_tied_z):.1f} "
                "standard errors "
                f"from 0; all rows {num(c.out_bias, 3)})"
                for c in biased
            ),
            biased,
            max(c.tied_rows for c in biased),
        )


def output_nan_findings(diag: TensorDiagnosis, add) -> None:
    """output_nan: rows of O that are NaN or inf while their P is finite, by first cause, with V's entries."""
    hit = [c for c in diag.cells if out_nan_rows(c)]
    if not hit:
        return
    audit = diag.attention
    parts = []
    for cause in ("v_nonfinite", "v_cast_overflow", "pv_overflow", UNEXPLAINED):
        cells = [c for c in hit if c.out_nan_causes.get(cause)]
        if cells:
            rows = ", ".join(f"{c.name} {c.out_nan_causes[cause]} row(s)" for c in cells)
            parts.append(f"{_out_cause_text(cause, cells, audit)}: {rows}")
    examples = [e for cause in OUT_CAUSES[1:] + (UNEXPLAINED,) for e in _first_examples(hit, f"out:{cause}")]
    add(
        "output_nan",
        "rows of the output O = P@V are NaN or inf while their softmax is finite; " + "; ".join(parts),
        hit,
        max(out_nan_rows(c) for c in hit),
        examples[:5],
    )


def _out_cause_text(cause: str, cells, audit) -> str:
    if cause == "v_nonfinite":
        n = 0 if audit is None else audit.v_nonfinite
        return (
            f"V holds {n} NaN/inf value(s){_at(audit.v_nonfinite_at if audit else [])}, and P@V carries them into "
            "every row of the head that multiplies them (0 x NaN is NaN: masked keys count where the path multiplies)"
        )
    if cause == "v_cast_overflow":
        dtypes = list(dict.fromkeys(c.dtype for c in cells))
        over = [] if audit is None else [(d, audit.v_cast_overflow.get(d, 0)) for d in dtypes]
        at = [] if audit is None else [e for d in dtypes for e in audit.v_cast_overflow_at.get(d, [])]
        top = "" if audit is None or audit.v_max_abs is None else f", largest |v| {audit.v_max_abs:.6g}"
        counts = ", ".join(f"{n} in {d}" for d, n in over)
        return f"V holds finite values beyond the dtype's range ({counts}{top}){_at(at)}, and their cast is +-inf"
    if cause == "pv_overflow":
        top = max(c.out_pv_max for c in cells if c.out_pv_max is not None)
        return f"P and V are finite in the dtype, but P@V reaches {top:.6g} in float64, beyond the dtype's max"
    return "no known cause (P and V finite in the dtype, P@V within range)"


def _at(entries) -> str:
    """' at (b, h, key, dim) = value, ...' for V entries."""
    if not entries:
        return ""
    return " at " + ", ".join(f"(batch, kv head, key, dim) {tuple(i)} = {v:.6g}" for i, v in entries[:4])


def _kernel_of(method: str) -> str | None:
    """The kernel a registered method reproduces (registry ``MethodSpec.kernel``), or for a
    path cell of a fused kernel (flash, flash-fp8, sage: its method is the path's name) the
    kernel itself; else None."""
    if method in METHODS:
        return METHODS.get(method).kernel
    if method in PATHS:
        return PATHS.get(method).kernel
    return None
