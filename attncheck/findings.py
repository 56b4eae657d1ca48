"""Results -> findings: every problem gets a stable code, a severity and a one-line fix.

Pure logic over the numbers in a ``TensorDiagnosis``; no tensors, no torch, no printing.
"""

from __future__ import annotations

import math

from attncheck.codes import CAUSES_OF, FIX, SEVERITIES, SEVERITY
from attncheck.format import num, pct
from attncheck.registry import METHODS, PATHS, eager_path, fp8_what_if_path
from attncheck.results import (
    FLASH_RULE_FACTOR,
    REAL_BOUND_TOLERANCE,
    UNEXPLAINED,
    Cell,
    DtypeLimits,
    Finding,
    TensorDiagnosis,
    flash_rule_bound,
)

# Where a captured call's scale came from, when it is the model's own choice (AttentionAudit.scale_source).
CHOSEN_SCALES = {
    "argument": "the scale= argument the model passed to SDPA",
    "traced": "the scale the model's code applies, as the capture traced it",
    "module": "the scaling attribute of the model's attention module",
}

FLUSH_INFO_FRAC = 0.01
FP8_UNSCALED_FRAC = 0.01  # share of q/k/v values left subnormal or flushed by an unscaled cast
TIED_BIAS_Z = 4.0  # a mean signed error this many standard errors from 0 is a bias, not noise
TIED_BIAS_MIN_ROWS = 16  # fewer tied rows do not make a mean to test
COLLAPSE_WARN_FRAC = 0.5
# Overflow codes: ignoring one of them judges a cell's overflow rows expected (its verdict, --fail-on overflow)
OVERFLOW_CODES = frozenset({"exp_overflow", "sum_overflow", "fused_max"})
LOG2E = 1 / math.log(2)  # exp(x) = exp2(x log2 e): the kernels fold it into the scale
# cuDNN's key and query tiles as attncheck.numerics.paths.cudnn assumes them (KEY_TILE, Q_TILE; the judgement layer
# imports no numerics, tests/test_kernel_hazards.py holds them equal): which tile a padded_tile row's call pads
CUDNN_KEY_TILE, CUDNN_Q_TILE = 128, 64


def _kernel_of(method: str) -> str | None:
    """The kernel a registered method reproduces (registry ``MethodSpec.kernel``), or for a
    path cell of a fused kernel (flash, flash-fp8, sage: its method is the path's name) the
    kernel itself; else None."""
    if method in METHODS:
        return METHODS.get(method).kernel
    if method in PATHS:
        return PATHS.get(method).kernel
    return None


def _names(cells: list[Cell]) -> list[str]:
    return [c.name for c in cells]


def _cell_list(cells: list[Cell], diag: TensorDiagnosis) -> str:
    """'naive, stable (all dtypes), tiled/fp16' - cells grouped by method; 'all dtypes': every dtype
    the diagnosis computed in."""
    dtypes = list(dict.fromkeys(c.dtype for c in diag.cells))
    parts = []
    for method in dict.fromkeys(c.method for c in cells):
        have = [c.dtype for c in cells if c.method == method]
        parts.append(
            method if set(have) == set(dtypes) and len(dtypes) > 1 else ", ".join(f"{method}/{d}" for d in have)
        )
    whole = [p for p in parts if "/" not in p]
    if len(whole) == len(parts):
        return ", ".join(parts) + (" (all dtypes)" if len(dtypes) > 1 else f" ({dtypes[0]})")
    return ", ".join(p + (" (all dtypes)" if "/" not in p else "") for p in parts)


def _first_examples(cells: list[Cell], label: str, limit: int = 5) -> list[tuple[int, ...]]:
    seen: list[tuple[int, ...]] = []
    for c in cells:
        for e in c.examples.get(label, []):
            if e not in seen:
                seen.append(e)
    return seen[:limit]


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


def _values(values: list[float]) -> str:
    return " and ".join(f"{v:.6g}" for v in values)


def findings_for(diag: TensorDiagnosis) -> list[Finding]:
    out: list[Finding] = []
    census, cells = diag.census, diag.cells

    def add(
        code: str, message: str, cells_hit: list[Cell] = (), rows: int = 0, examples=(), severity: str | None = None
    ) -> None:
        out.append(
            Finding(code, severity or SEVERITY[code], message, FIX[code], _names(list(cells_hit)), rows, list(examples))
        )

    def cells_with(kind: str, cause: str) -> list[Cell]:
        return [c for c in cells if getattr(c, f"{kind}_causes").get(cause, 0)]

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

    if diag.attention is not None:
        _attention_findings(diag, add, cells_with)

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
        sentinels = [v for v in h.cast_overflow_examples if v <= -1e4]
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
        n_fused = c.events.get("fused_max", 0)
        if n_fused:
            add("fused_max", _fused_max_message(diag, c, n_fused), [c], n_fused, c.examples.get("event:fused_max", []))
        n_sat = c.events.get("p_saturation", 0)
        if n_sat:
            add(
                "p_saturation",
                _p_saturation_message(diag, c, n_sat),
                [c],
                n_sat,
                c.examples.get("event:p_saturation", []),
                severity="error" if c.nan_causes.get("p_saturation") else None,
            )
        n_pad = c.events.get("padded_tile", 0)
        if n_pad:
            add(
                "padded_tile", _padded_tile_message(diag, c, n_pad), [c], n_pad, c.examples.get("event:padded_tile", [])
            )
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
    _output_findings(diag, add)
    _fp8_findings(diag, add)
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

    dist = diag.distribution
    if dist.collapsed_frac is not None and dist.collapsed_frac >= COLLAPSE_WARN_FRAC:
        add(
            "entropy_collapse",
            f"{dist.collapsed_frac:.0%} of rows put >= {dist.collapse_threshold:g} of their probability on one key "
            f"(mean entropy {num(dist.entropy_mean, 4)} nats, normalised {num(dist.entropy_norm_mean, 4)})",
            rows=dist.collapsed_rows,
        )
    order = {s: i for i, s in enumerate(SEVERITIES)}
    out.sort(key=lambda f: order[f.severity])
    return out


def fused_max_threshold(fp32: DtypeLimits, p_dtype: DtypeLimits) -> int:
    """The least e such that a row max m with |m scale log2e| >= 2^e can break the fused exponent
    ``exp2f(fma(x, scale_log2, -round(m scale_log2)))`` (FlashAttention-2 without UNFUSE_FMA): at the row max
    the exponent is the rounding residue of m scale log2e to fp32, up to half an fp32 ulp there, 2^e x eps / 2
    (eps: fp32's ulp of one); exp2 of it overflows once 2^residue reaches fp32's rounding limit, and P once it
    reaches the P dtype's. fp32 and bf16: 2^31 (residue 128); fp16: 2^28 (residue 16 > log2 65520)."""
    room = _exp2_room(fp32, p_dtype)
    return math.ceil(math.log2(2 * room / fp32.eps))


def _exp2_room(fp32: DtypeLimits, p_dtype: DtypeLimits) -> float:
    """log2 of the least value that overflows exp2's fp32 result or P's dtype: the largest safe exponent."""
    return min(math.log2(fp32.rounding_limit), math.log2(p_dtype.rounding_limit))


def _fused_max_message(diag: TensorDiagnosis, c: Cell, rows: int) -> str:
    """The rows, the kernel, the largest score and the threshold, from the limits (torch.finfo)."""
    spec = PATHS.get(c.path) if c.path in PATHS else None
    kernel = spec.kernel if spec is not None else c.method
    nan = c.nan_causes.get("fused_max", 0)
    census = diag.census
    top = None if census.max is None or census.min is None else max(abs(census.max), abs(census.min))
    fp32, own = diag.limits.get("fp32"), diag.limits.get(c.dtype)
    parts = [
        f"{c.name}: {kernel} computes exp2f(fma(x, scale*log2e, -round(m*scale*log2e))): at the row max m the "
        f"exponent is the rounding residue of m*scale*log2e to fp32, not 0, and exp2 of it overflows in {rows} "
        f"row(s) -> {nan} NaN row(s)"
    ]
    if top is not None and fp32 is not None and top > 0:
        scaled = top * LOG2E
        half_ulp = 2.0 ** (math.floor(math.log2(scaled)) - 1) * fp32.eps  # half an fp32 ulp of m*scale*log2e
        parts.append(
            f"largest score |S*scale| {top:.4g}, times log2e {scaled:.4g}, where half an fp32 ulp is {half_ulp:.6g}"
        )
    if fp32 is not None and own is not None:
        e = fused_max_threshold(fp32, own)
        where = c.dtype if own.rounding_limit < fp32.rounding_limit else "fp32"
        parts.append(
            f"exp2 of the residue overflows {where} above {_exp2_room(fp32, own):.6g} (log2 of its rounding "
            f"limit), which half an ulp can reach once |S*scale*log2e| >= 2^{e}, i.e. |S*scale| >= "
            f"{2.0**e / LOG2E:.4g}"
        )
    safe = [o.name for o in diag.cells if o.dtype == c.dtype and o is not c and o.path and not o.nan_rows]
    if safe:
        parts.append("finite in " + ", ".join(safe))
    if "FlashAttention-2" not in (kernel or ""):  # FlashAttention-4: fma(S, scale*log2e, max_offset - m*scale*log2e)
        parts.append(f"{kernel} computes every exponent this way (with its max offset added), and has no unfused build")
    else:
        parts.append(
            "the flash-attn package builds FlashAttention-2 this way; PyTorch's flash backend builds it with "
            "UNFUSE_FMA (PyTorch issue 121558), whose exponent is <= 0 at every score"
        )
    return "; ".join(parts)


def _p_saturation_message(diag: TensorDiagnosis, c: Cell, rows: int) -> str:
    """The rows, the heads of the examples, the format's largest value and what it did to O (the cell's error)."""
    lim = diag.limits.get(c.dtype)
    top = f" {lim.max:.6g} (2^{math.log2(lim.max):.3f})" if lim is not None else ""
    spec = PATHS.get(c.path) if c.path in PATHS else None
    kernel = spec.kernel if spec is not None else c.name
    heads = sorted({e[-2] for e in c.examples.get("event:p_saturation", []) if len(e) >= 2})
    where = f" (heads {', '.join(map(str, heads))} among the examples)" if heads else ""
    nan = c.nan_causes.get("p_saturation", 0)
    if nan:
        effect = f"P overflows {c.dtype} to inf (no saturating cast): {nan} NaN row(s)"
    else:
        effect = (
            "the saturating cast clips those probabilities while the fp32 row sum counts them in full, so O shrinks"
        )
    why = "the max offset plus the lazy rescale's threshold passes log2 of it"
    if c.limit is not None and c.limit.kind == "p_saturation":  # the cell's own setting, as its limit states it
        why = c.limit.what.split(" (in |S scale| units")[0]
    hit = c.event_counts.get("p_saturation")
    values = f" ({hit} probabilit{'y' if hit == 1 else 'ies'})" if hit else ""
    parts = [
        f"{c.name}: {kernel} lets P exceed {c.dtype}'s largest value{top} before the cast in {rows} of {c.rows} "
        f"row(s){values}{where}: {why}; {effect}"
    ]
    if c.out_max_abs_err is not None:
        cos = f", cosine similarity down to {c.out_cos_min:.4g}" if c.out_cos_min is not None else ""
        rows_of = " on the rows that stayed finite" if nan else ""
        parts.append(f"O against float64{rows_of}: max abs error {c.out_max_abs_err:.3g}{cos}")
    if lim is not None and c.dtype in ("fp16", "bf16"):  # no FP8 offset in 16 bits: the threshold alone
        parts.append(f"in {c.dtype} keep the rescale threshold below log2({lim.max:.6g}) = {math.log2(lim.max):.4g}")
    else:
        parts.append("flash-attention issue 2716 (threshold 4, offset 8); PRs 2717, 2731 lowered them")
    return "; ".join(parts)


def _padded_tile_message(diag: TensorDiagnosis, c: Cell, rows: int) -> str:
    """The rows, the form (which tile is padded, which gradient breaks), the lowest LSE against -ln(FLT_MAX)."""
    tq, tk = (diag.shape[-2], diag.shape[-1]) if len(diag.shape) >= 2 else (None, None)
    fp32 = diag.limits.get("fp32")
    low = c.event_values.get("padded_tile")
    limit = f" -ln(FLT_MAX) = {-math.log(fp32.max):.2f}" if fp32 is not None else " -ln(FLT_MAX)"
    lse = f" (lowest LSE {low:.4g})" if low is not None else ""
    tile = CUDNN_KEY_TILE
    if tk is not None and tk % tile == tile // 2:
        form = (
            f"key tile: Tk = {tk} leaves the last {tile}-key tile half padding and the call has an explicit "
            "mask; the backward scores the padded keys 0 instead of -inf, exp(0 - LSE) overflows fp32 and inf x 0 "
            "(zero-filled K) gives NaN in dQ of these rows (PyTorch issue 196678: seen with cuDNN 9.20 on sm90, "
            "fixed in cuDNN 9.26)"
        )
    else:
        form = (
            f"query tile: Tq = {tq} is not a multiple of the {CUDNN_Q_TILE}-query tile (Tk = {tk}, whole "
            f"{tile}-key tiles); the zero-filled query rows score 0 against every key, exp(0 - LSE) overflows "
            "fp32 and dK and dV of the head's keys are NaN (cudnn-frontend issue 1072: cuDNN 9.25.1 and 9.26 on "
            "sm90, open: no cuDNN release fixes it, run another backend for this call)"
        )
    return (
        f"{c.name}: {rows} row(s) have a forward log-sum-exp below{limit}{lse}; the forward is finite, but "
        f"cuDNN's backward gives NaN gradients on this call (padded {form})"
    )


def _attention_findings(diag: TensorDiagnosis, add, cells_with) -> None:
    """Findings of the Q/K -> scores pipeline: overflow of Q@K^T, mask sentinels, leaks, scale."""
    a = diag.attention
    for d, audit in a.dtypes.items():
        dtype_cells = [c for c in diag.cells if c.dtype == d]
        hit = [c for c in dtype_cells if c.nan_causes.get("qk_overflow")]
        paths = {c.path for c in dtype_cells if c.path}
        # The audit describes the eager scores; with paths that hold S in fp32 only, nothing computed overflows.
        if audit.qk_overflow_values and (hit or not paths or any(PATHS.get(p).scores == "dtype" for p in paths)):
            limit = diag.limits[d].rounding_limit
            if a.scale_order == "q":
                verdict = "q is already scaled first"
            elif (
                a.raw_max_abs * a.scale < limit and a.q_max_abs * a.scale < limit
            ):  # scaling q first keeps every score in range
                verdict = "scaling q first (--scale-order q) would avoid it"
            else:
                verdict = "scaling q first would not avoid it: the scaled scores themselves exceed the range"
            add(
                "qk_overflow",
                f"Q@K^T overflows {d} in {audit.qk_overflow_rows} row(s) ({audit.qk_overflow_values} score(s) beyond "
                f"+-{diag.limits[d].max:.6g}; max|q| {a.q_max_abs:.4g}, max|k| {a.k_max_abs:.4g}, max|q.k| "
                f"{a.raw_max_abs:.4g}, scale {a.scale:.4g} applied to the {a.scale_order}); "
                f"{verdict}{_paths_verdict(dtype_cells, d)}",
                hit,
                audit.qk_overflow_rows,
                _first_examples(hit, "nan:qk_overflow"),
            )
        what = []
        if audit.mask_not_representable or audit.sentinel_not_representable:
            if audit.mask_not_representable:
                what.append(f"{audit.mask_not_representable} float-mask value(s)")
            if audit.sentinel_not_representable:
                what.append(f"the mask value {a.mask_value}")
        hit = [c for c in dtype_cells if c.nan_causes.get("mask_sentinel")]
        rows = max((c.nan_causes.get("mask_sentinel", 0) for c in hit), default=0)
        broke = (
            f"; {rows} row(s) become all -inf -> NaN in {_cell_list(hit, diag)}"
            if hit
            else "; no row became all -inf: the keys stay masked"
        )
        severity = "error" if hit else "warning"  # the severity follows the effect: rows the mask broke
        if audit.mask_not_representable or audit.sentinel_not_representable:
            add(
                "sentinel_not_representable",
                f"{' and '.join(what)} cannot be held by {d} (max {diag.limits[d].max:.6g}) and become -inf{broke}",
                hit,
                rows,
                _first_examples(hit, "nan:mask_sentinel"),
                severity=severity,
            )
        finite = [v for v in (audit.mask_values or [audit.sentinel_value]) if math.isfinite(v)]
        if audit.overflow_on_add:
            add(
                "sentinel_overflow_on_add",
                f"in {d}, adding the mask to the scores overflows to -inf at {audit.overflow_on_add} position(s) (mask "
                f"value {_values(finite) or 'finfo.min'} plus a negative score){broke}",
                hit,
                rows,
                _first_examples(hit, "nan:mask_sentinel"),
                severity=severity,
            )
        if audit.summed_planes_overflow:
            add(
                "summed_mask_planes",
                f"in {d}, two mask planes added together overflow to -inf at {audit.summed_planes_overflow} "
                f"position(s){broke}",
                hit,
                rows,
                _first_examples(hit, "nan:mask_sentinel"),
                severity=severity,
            )
    if a.mask_summed_neginf:
        hit = cells_with("nan", "fully_masked") + cells_with("zero", "fully_masked")
        add(
            "summed_mask_planes",
            f"the float mask holds -inf at {a.mask_summed_neginf} position(s) next to finite sentinels such as "
            f"{a.mask_deep_sentinel:.6g}: "
            "two finfo.min planes (e.g. causal and padding) were added and overflowed; a row masked by both everywhere "
            "is all -inf",
            hit,
            max((c.nan_causes.get("fully_masked", 0) + c.zero_causes.get("fully_masked", 0) for c in hit), default=0),
            severity="error" if any(c.nan_causes.get("fully_masked") for c in hit) else "warning",
        )
    if a.leak_rows:
        add(
            "mask_leak",
            f"the float64 softmax puts up to {a.leak_max:.3g} of a row's probability on masked keys in {a.leak_rows} "
            f"row(s) (mask value {a.mask_value}; tolerance 1e-6)",
            rows=a.leak_rows,
        )
    if a.float_mask_looks_boolean:
        add(
            "float_mask_looks_boolean",
            "the float mask holds only 0 and 1: it is added to the scores (+1 on some keys), so it masks nothing",
        )
    said = _scale_findings(a, add)
    if a.fitted_scale is not None and not said:  # missing_scale / double_scale already name the fitted scale
        candidates = {
            "1/sqrt(d_head)": 1 / math.sqrt(a.d),
            "1": 1.0,
            "1/sqrt(d_model)": 1 / math.sqrt(a.d * a.heads),
            "1/d_head": 1 / a.d,
        }
        name, value = min(
            candidates.items(), key=lambda kv: abs(math.log(a.fitted_scale / kv[1])) if a.fitted_scale > 0 else math.inf
        )
        if a.fitted_scale <= 0 or name != "1/sqrt(d_head)" or abs(math.log(a.fitted_scale / value)) > 0.05:
            add(
                "scale_mismatch",
                f"the scores are q.k times {a.fitted_scale:.4g} (least squares), closest to {name} = {value:.4g}; "
                f"1/sqrt(d_head) = {1 / math.sqrt(a.d):.4g} (d_head {a.d}, {a.heads} heads)",
            )


def _paths_verdict(dtype_cells: list[Cell], dtype: str) -> str:
    """'; by path: eager overflows (S in the dtype); sdpa-math does not (S in fp32 ...)' when cells name their paths."""
    paths = list(dict.fromkeys(c.path for c in dtype_cells if c.path))
    if not paths:
        return ""
    broken = [
        p
        for p in paths
        if any(c.nan_causes.get("qk_overflow") or c.zero_causes.get("qk_overflow") for c in dtype_cells if c.path == p)
    ]
    safe = [p for p in paths if p not in broken]

    def where(p: str) -> str:
        return "S in " + PATHS.get(p).scores_in.replace("the dtype", dtype) if p in PATHS else "?"

    parts = [f"{p} overflows ({where(p)})" for p in broken] + [f"{p} does not ({where(p)})" for p in safe]
    return "; by path: " + ", ".join(parts)


def _output_findings(diag: TensorDiagnosis, add) -> None:
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


def _scale_findings(a, add) -> bool:
    """missing_scale / double_scale (True when one was added) from the scale the scores carry: q.k times the
    scale applied (the fitted one when the scores were given), against 1/sqrt(d). Not from
    the spread of the scores against that of q and k, which only i.i.d. entries tie to the
    scale: low-rank q/k, outlier channels, RoPE or many exact zeros move it far from 1."""
    if a.d < 4:
        return False
    given = a.fitted_scale is not None
    scale = a.fitted_scale if given else a.scale
    if scale is None or not scale > 0:
        return False
    ratio = scale * math.sqrt(a.d)  # 1 for 1/sqrt(d), sqrt(d) unscaled, 1/sqrt(d) for 1/d
    chosen = a.scale_source in CHOSEN_SCALES and not given
    if chosen:
        how = CHOSEN_SCALES[a.scale_source]
    elif given:
        how = "least squares against q.k, from the scores given"
    else:
        how = f"the scale applied, --scale {a.scale_name} on the {a.scale_order}"
    said = (
        f"the scores are q.k times {scale:.4g} ({how}): {ratio:.3g} x 1/sqrt(d_k) = 1/sqrt({a.d}) = "
        f"{1 / math.sqrt(a.d):.4g}"
    )
    if not (ratio > a.d**0.25 or ratio < a.d**-0.25):
        return False
    if chosen:  # the model's own scale is a fact, not a fault: it was trained with it (T5: 1/sqrt(d_k) in its init)
        equals = f"1/sqrt({1 / scale**2:.6g})" if scale < 1 else f"{scale:.4g}"
        add("model_scale", said + f" (= {equals}); the model's own choice, which it was trained with")
    elif ratio > a.d**0.25:
        add("missing_scale", said + " (the scores are unscaled)")
    else:
        add("double_scale", said + f" (the scores are scaled twice: ~1/d_k = {1 / a.d:.4g})")
    return True


def softcap_findings(diag: TensorDiagnosis) -> list[Finding]:
    """softcap_overflow: S = Q@K^T rounds to inf before a soft cap, which hides it (the capped logits stay
    finite). Its severity follows what the overflow does: nothing where the cap already saturates at the
    largest finite S (info), changed logits where it does not (warning), NaN gradients (error)."""
    cap = None if diag.attention is None else diag.attention.softcap
    if cap is None or not cap.overflow:
        return []
    out: list[Finding] = []

    def add(code: str, message: str, severity: str | None = None) -> None:
        out.append(Finding(code, severity or SEVERITY[code], message, FIX[code]))

    head = (
        f"S = Q@K^T overflows {cap.dtype} before the soft cap at {cap.overflow} score(s) (max|q.k| "
        f"{cap.max_qk:.4g}; {cap.dtype} rounds |S| >= {cap.limit:.6g} to inf); the cap {cap.cap:g} x "
        f"tanh(S x {cap.scale:.4g} / {cap.cap:g}) turns inf into {cap.cap:g}, so the logits stay finite"
    )
    if cap.saturated:
        forward = (
            f": harmless in the forward, since tanh already rounds to 1 in {cap.dtype} at the largest finite S "
            "(the same logit as the finite score)"
        )
    else:
        forward = (
            f", but not the one the finite score gives: the cap does not saturate in {cap.dtype} at the largest "
            "finite S, so those logits are wrong"
        )
    if cap.grad_finite:
        backward = (
            "; the backward is harmless too: torch's autograd gives 1 - tanh^2 = 0 there, as for a saturated "
            "finite score"
        )
    else:
        backward = "; the backward through the cap at inf gives NaN gradients"
    severity = "error" if not cap.grad_finite else ("info" if cap.saturated else "warning")
    add("softcap_overflow", head + forward + backward, severity=severity)
    return out


def _fp8_findings(diag: TensorDiagnosis, add) -> None:
    """FP8 cells: the P cast flushing probabilities, and Q/K/V clipped or left unscaled by their quantisation."""
    hit = [c for c in diag.cells if c.pcast_mass_rows]
    for d in dict.fromkeys(c.dtype for c in hit):
        cells = [c for c in hit if c.dtype == d]
        lim = diag.limits.get(d)
        parts = []
        for c in cells:
            pos = ", ".join(
                f"{name.replace('_', ' ')} {share:.2%}"
                for name, share in (c.pcast_flushed_by_position or {}).items()
                if share is not None
            )
            thr = (
                f"; with S = {c.p_scale:.4g} it flushes a score more than "
                f"{math.log(c.p_scale) - lim.exp_underflow:.3g} = {-lim.exp_underflow:.3g} + ln S below the running max"
                if lim and c.p_scale
                else ""
            )
            parts.append(
                f"{c.name}: {c.pcast_mass_rows} row(s) lose at least 0.1% of their probability (up to "
                f"{c.pcast_mass_max:.3g}); "
                f"{c.pcast_flushed_frac:.2%} of the probabilities flushed (by key block against the row max's block, "
                f"in visiting order: {pos}){thr}"
            )
        add(
            "p_cast_underflow",
            f"the {d} P cast flushes probabilities to 0 that carry weight: " + "; ".join(parts),
            cells,
            max(c.pcast_mass_rows for c in cells),
        )
    _fp8_accumulator(diag, add)
    for d in dict.fromkeys(c.dtype for c in diag.cells if c.p_scale):
        lim = diag.limits.get(d)
        over = [c for c in diag.cells if c.dtype == d and c.p_scale and lim and c.p_scale >= lim.rounding_limit]
        if over:
            add(
                "fp8_overflow",
                f"P scaled by S = {over[0].p_scale:g} exceeds {d}'s largest value {lim.max:g}: the cast clips the "
                "largest probabilities of every row",
                over,
            )
    if diag.attention is None:
        return
    for d, a in diag.attention.dtypes.items():
        if not a.fp8_values:
            continue
        lim = diag.limits.get(d)
        top = f"{lim.max:g}" if lim else "the format's max"
        clipped = {k: n for k, n in a.fp8_clipped.items() if n}
        cells = [c for c in diag.cells if c.dtype == d and c.path == fp8_what_if_path()]
        if clipped:
            what = ", ".join(
                f"{n} of {a.fp8_values[k]} {k} value(s) (amax {a.fp8_amax[k]:.4g})" for k, n in clipped.items()
            )
            add(
                "fp8_overflow",
                f"quantising to {d} with scaling '{a.fp8_scaling}' puts {what} beyond +-{top}: the kernels' satfinite "
                f"cast clips them to +-{top}",
                cells,
            )
        small = {k: a.fp8_subnormal.get(k, 0) + a.fp8_flushed.get(k, 0) for k in a.fp8_values}
        lost = {k: n for k, n in small.items() if a.fp8_values[k] and n / a.fp8_values[k] >= FP8_UNSCALED_FRAC}
        if a.fp8_scaling and a.fp8_scaling.startswith("none") and (clipped or lost):
            why = []
            if clipped:
                why.append(f"{', '.join(clipped)} exceed {top}")
            if lost:
                why.append(
                    ", ".join(
                        f"{small[k] / a.fp8_values[k]:.1%} of {k} fall below {d}'s normal range (fewer bits, or 0)"
                        for k in lost
                    )
                )
            amax = ", ".join(f"{k} {v:.4g}" for k, v in a.fp8_amax.items())
            add(
                "fp8_unscaled",
                f"q, k, v are cast to {d} without a descale (amax: {amax}; {d} holds {top} at most): " + "; ".join(why),
                cells,
            )


FP8_ACCUM_RULE = 2.0  # FlashAttention's rule: a kernel's error may be at most twice that of its fp32-accumulating twin
VLLM_NIAH = "vLLM PR 122: needle-in-a-haystack at 128k 0.89 / 0.88 / 0.856 with a flush every 1 / 4 / 64 blocks"


def _fp8_accumulator(diag: TensorDiagnosis, add) -> None:
    """FP8 cells on the tensor cores' reduced accumulator whose output error passes twice that of the same
    kernel with fp32 accumulation, with the cheapest flush interval of the grid that holds it."""
    for c in diag.cells:
        rmse = c.fp8_accum_rmse or {}
        ref = rmse.get("fp32")
        if c.out_rmse is None or ref is None or not c.out_rmse > FP8_ACCUM_RULE * ref:
            continue
        holds = [
            (int(name.split()[1]), r)
            for name, r in rmse.items()
            if name.startswith("flush ") and r is not None and r <= FP8_ACCUM_RULE * ref
        ]
        if holds:
            n, r = max(holds)  # the longest interval that holds: the fewest fp32 adds
            cure = f"a flush to fp32 every {n} key block{'s' if n > 1 else ''} holds it (RMSE {r:.3g})"
        else:
            cure = "a flush to fp32 every key block (SageAttention 2's and vLLM PR 104's scheme) bounds it by one block"
        add(
            "fp8_accumulator",
            f"{c.name}: at {c.fp8_accum_keys} keys, P@V accumulated on the FP8 tensor cores ({c.fp8_accum}) gives O "
            f"an RMSE of {c.out_rmse:.3g} against float64, {c.out_rmse / ref:.1f}x the {ref:.3g} of the same kernel "
            f"with fp32 accumulation (more than {FP8_ACCUM_RULE:g}x); {cure} ({VLLM_NIAH})",
            [c],
        )


def ignored_causes(ignore) -> set[str]:
    return {cause for code in ignore for cause in CAUSES_OF.get(code, ())}


def counted_rows(total: int, causes: dict[str, int], ignore=()) -> int:
    """Rows of a cell (NaN or zero) less those whose first cause belongs to an ignored code."""
    skip = ignored_causes(ignore)
    return total - sum(n for cause, n in causes.items() if cause in skip)


def counted_grad_rows(b, ignore=()) -> int:
    """NaN/inf gradient rows of a cell's backward, less those whose first cause belongs to an ignored code."""
    from attncheck.codes import GRAD_CAUSES_OF

    skip = {cause for code in ignore for cause in GRAD_CAUSES_OF.get(code, ())}
    return sum(n for _, g in b.grads() for cause, n in g.causes.items() if cause not in skip)


def counted_verdict(c: Cell, ignore=()) -> str:
    """The cell's verdict once rows with an ignored cause are left out."""
    if not ignore:
        return c.verdict
    if counted_rows(c.nan_rows, c.nan_causes, ignore):
        return "nan"
    if c.overflow_rows and not (OVERFLOW_CODES & set(ignore)):
        return "overflow"
    if counted_rows(c.zero_rows, c.zero_causes, (*ignore, "fully_masked_rows")) > 0:
        return "zero"
    if c.argmax_flips and "argmax_flip" not in ignore:
        return "flip"
    return "ok"


def apply_ignore(diag: TensorDiagnosis, ignore) -> None:
    """Drop the findings whose code the user has judged expected."""
    if ignore:
        diag.findings = [f for f in diag.findings if f.code not in ignore]


def failed_conditions(diags: list[TensorDiagnosis], conditions: list[str], ignore=()) -> list[str]:
    """The --fail-on conditions that hold, each with a short reason.

    Conditions: nan, overflow, zero, flip, error (any error finding), warning (any
    error or warning finding), or a finding code. Rows whose cause belongs to an
    ``ignore``d code do not count.
    """
    held = []
    for cond in conditions:
        for d in diags:
            if cond == "nan":
                bad = [c.name for c in d.cells if counted_rows(c.nan_rows, c.nan_causes, ignore)]
                bad += [
                    f"{c.name} backward"
                    for c in d.cells
                    if c.backward is not None and counted_grad_rows(c.backward, ignore)
                ]
            elif cond == "overflow":
                bad = [c.name for c in d.cells if c.overflow_rows and not (OVERFLOW_CODES & set(ignore))] + [
                    f"cast to {h.dtype}"
                    for h in d.census.headroom
                    if (h.cast_posinf_values or h.cast_neginf_values) and "cast_overflow" not in ignore
                ]
            elif cond == "zero":
                bad = [c.name for c in d.cells if counted_rows(c.zero_rows, c.zero_causes, ignore)]
            elif cond == "flip":
                bad = [c.name for c in d.cells if c.argmax_flips]
            elif cond in ("error", "warning"):
                allowed = SEVERITIES.index(cond)
                bad = [f.code for f in d.findings if SEVERITIES.index(f.severity) <= allowed and f.code not in ignore]
            else:
                bad = [f.code for f in d.findings if f.code == cond]
            if bad:
                held.append(f"{cond}: {d.name}: {', '.join(dict.fromkeys(bad))}")
    return held


# --------------------------------------------------------------------------- the capture itself


def unrecorded_text(first: dict | None) -> str | None:
    """'call 3 (sdpa in model.layers.3.self_attn)', 'the gradients of call 2 (...)'; None when unknown."""
    if not isinstance(first, dict) or not isinstance(first.get("index"), int):
        return None
    where = f"{first.get('kind') or 'call'} in {first.get('module') or 'global'}"
    text = f"call {first['index']} ({where})"
    return f"the gradients of {text}" if first.get("what") == "gradients" else text


def capture_findings(capture: dict | None, rank: int | None = None) -> list[Finding]:
    """A capture that did not record every call the script made: recording stopped (--max-bytes,
    --max-calls, a write that failed) or the script failed. Judging the calls recorded says nothing
    about those never recorded, so a CI gate must not pass it silently."""
    out: list[Finding] = []

    def add(code: str, message: str) -> None:
        out.append(Finding(code, SEVERITY[code], message, FIX[code]))

    if not capture or capture.get("complete") is True:
        return out
    stopped = capture.get("stopped")
    error = capture.get("error") or (capture.get("script") or {}).get("error")
    if not stopped and not error:
        return out
    on = "" if rank is None else f"rank {rank}: "
    first = unrecorded_text(capture.get("first_unrecorded"))
    if stopped:
        missed = (
            f"{first} and every call after it not recorded" if first else "calls not recorded (the first is not known)"
        )
        add("capture_incomplete", f"{on}capture incomplete: {missed} (recording stopped: {stopped})")
    else:
        add(
            "capture_incomplete",
            f"{on}capture incomplete: the script failed ({error}); the calls it would have made after that "
            "were never made",
        )
    return out


def failed_by_findings(findings: list[Finding], conditions: list[str], ignore=(), where: str = "capture") -> list[str]:
    """The --fail-on conditions that findings outside any call's diagnosis (the capture's) meet."""
    held = []
    for cond in conditions:
        if cond in ("error", "warning"):
            allowed = SEVERITIES.index(cond)
            bad = [f.code for f in findings if SEVERITIES.index(f.severity) <= allowed and f.code not in ignore]
        else:
            bad = [f.code for f in findings if f.code == cond and f.code not in ignore]
        if bad:
            held.append(f"{cond}: {where}: {', '.join(dict.fromkeys(bad))}")
    return held


# --------------------------------------------------------------------------- backward

GRAD_UNDERFLOW_WARN_FRAC = 0.01  # a gradient losing this share of its non-zero entries to 0 is a warning


def _grad_rows(b) -> str:
    """'dq 3 row(s), dk 48, dv 48' for the gradients that hold NaN/inf rows."""
    parts = [f"{name} {g.nan_rows}" for name, g in b.grads() if g.nan_rows]
    return (parts[0] + " row(s)" + (", " + ", ".join(parts[1:]) if parts[1:] else "")) if parts else "none"


def _with_cause(b, causes: tuple[str, ...]) -> int:
    return sum(n for _, g in b.grads() for c, n in g.causes.items() if c in causes)


def _power_of_two(x: float) -> str:
    return f"2^{math.floor(math.log2(x))}" if x > 0 and math.isfinite(x) else "n/a"


def backward_findings(cells: list[Cell]) -> list[Finding]:
    """Findings of the backward of each cell that has one: NaN gradient rows by first cause, overflow
    under the loss scale, flushed gradients, FlashAttention's 2x rule, and the model's recorded
    gradients against the model's cell."""
    from attncheck.codes import GRAD_CAUSES_OF

    out: list[Finding] = []

    def add(code: str, cell: Cell, message: str, rows: int = 0, examples=(), severity: str | None = None) -> None:
        out.append(
            Finding(
                code,
                severity or SEVERITY[code],
                f"{cell.name} backward: {message}",
                FIX[code],
                [cell.name],
                rows,
                list(examples),
            )
        )

    for c in cells:
        b = c.backward
        if b is None:
            continue
        examples = next((g.examples for _, g in b.grads() if g.examples), [])
        masked = _with_cause(b, GRAD_CAUSES_OF["grad_nan_masked_row"])
        if masked:
            how = (
                "the mask is added to the scores, so the NaN dS reaches dQ of the row and dK of every key"
                if "added" in b.how
                else "masked_fill zeroes dS at the filled keys, so dQ and dK stay finite, but dV = P^T dO takes the "
                "NaN row"
            )
            add(
                "grad_nan_masked_row",
                c,
                "query rows with every key masked by -inf have a NaN softmax, and the backward spreads it: NaN in "
                f"{_grad_rows(b)} ({how})",
                masked,
                examples,
            )
        if _with_cause(b, GRAD_CAUSES_OF["grad_nan_input"]):
            add(
                "grad_nan_input",
                c,
                f"the output gradient dO already holds NaN or inf in {b.dout_nan_rows} row(s): NaN in {_grad_rows(b)}",
                b.dout_nan_rows,
                examples,
            )
        spread = _with_cause(b, GRAD_CAUSES_OF["grad_nan_forward"])
        if spread:
            which = sorted(
                {cause for _, g in b.grads() for cause in g.causes if cause in GRAD_CAUSES_OF["grad_nan_forward"]}
            )
            add(
                "grad_nan_forward",
                c,
                f"rows the forward pass already broke ({', '.join(which)}) make NaN gradients: {_grad_rows(b)}",
                spread,
                examples,
            )
        over = _with_cause(b, GRAD_CAUSES_OF["grad_overflow"])
        if over or (b.scale_headroom is not None and b.scale_headroom < 1):
            stage = b.headroom_at or "an intermediate"
            factor = b.scale_headroom
            safe = (
                (
                    f"; the backward stays finite for dO up to {num(factor)}x this one ({_power_of_two(factor)}): the "
                    "largest safe loss scale is "
                    f"{_power_of_two(factor)} times the one this dO carries"
                )
                if factor
                else ""
            )
            add("grad_overflow", c, f"{stage} overflows ({_grad_rows(b)} hold NaN or inf){safe}", over, examples)
        flushed = [
            (name, g.flushed_frac)
            for name, g in b.grads()
            if g.flushed_frac is not None and g.flushed_frac >= GRAD_UNDERFLOW_WARN_FRAC
        ]
        if flushed:
            add(
                "grad_underflow",
                c,
                "gradient entries that are non-zero in float64 are exactly 0 in "
                + (b.dtype or c.dtype)
                + ": "
                + ", ".join(f"{name} {pct(f)}" for name, f in flushed),
            )
        broken = [(name, g) for name, g in b.grads() if g.rule_holds is False]
        if broken:
            add(
                "grad_error",
                c,
                "max |g - g_float64| above 2x plain attention's in "
                + (b.dtype or c.dtype)
                + " (eager, softmax in the dtype): "
                + ", ".join(f"{name} {num(g.max_abs_err)} > {num(g.rule_bound)}" for name, g in broken),
            )
        disagree = [(name, g) for name, g in b.grads() if g.real_agrees is False]
        if disagree:
            near = all(g.real_near for _, g in disagree)
            add(
                "grad_emulation_mismatch",
                c,
                "the model's recorded gradients differ from this cell's beyond its rounding bound: "
                + ", ".join(
                    f"{name} max |real - cell| {num(g.real_max_diff)} ({num(g.real_bound_ratio)}x the bound"
                    + (
                        f", {g.real_nan_mismatch} entries finite in one and not the other"
                        if g.real_nan_mismatch
                        else ""
                    )
                    + ")"
                    for name, g in disagree
                )
                + (
                    f"; within {REAL_BOUND_TOLERANCE:g}x of it, which a kernel summing in another order can reach: "
                    "the numbers stand"
                    if near
                    else ""
                ),
                severity="info" if near else None,
            )
    return out
