"""Masks and Q@K^T (from Q and K): the product overflowing before the softmax or before a soft cap, mask
sentinels that overflow when cast, added to a score or to another mask plane, masks that leak, and a float mask of
0 and 1."""

from __future__ import annotations

import math

from attncheck.findings.base import (
    _SEEDED,
    _TORCH,
    SENTINEL_LIMIT_TEXT,
    Code,
    Example,
    _cell_list,
    _first_examples,
    _scores,
)
from attncheck.registry import PATHS
from attncheck.results import Cell, Finding, TensorDiagnosis

CODES: tuple[Code, ...] = (
    Code(
        "qk_overflow",
        "error",
        "mask",
        "S = Q@K^T rounds to inf in the dtype before the softmax",
        "The eager path (hand-written attention, Hugging Face's `eager`) holds S = Q@K^T in the dtype: the "
        "matmul accumulates in fp32 and rounds its result to the dtype, and a score beyond the dtype's range "
        "becomes inf. Its row is NaN in every softmax. The message gives max|q|, max|k|, max|q.k|, whether "
        "scaling q by the scale first (`--scale-order q`) would keep the scores in range, and, with paths, which "
        "implementations overflow (SDPA's math path and FlashAttention hold S in fp32).",
        "|q.k| >= the dtype's rounding limit, max + half an ulp (fp16: 65504 + 16 = 65520), for the product "
        "the path holds in the dtype: q.k before the scale, or (scale q).k with `--scale-order q`.",
        "scale q by 1/sqrt(d) before the matmul (--scale-order q shows the effect), compute Q@K^T in fp32, or find why "
        "q/k grew (no normalisation, exploding activations)",
        Example(
            _TORCH
            + """\
q = torch.full((1, 1, 4, 64), 40.0)  # q.k = 64 x 40 x 40 = 102400 > 65504
k = torch.full((1, 1, 4, 64), 40.0)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --dtype fp16 --method torch --brief --fail-on qk_overflow",
        ),
        causes=("qk_overflow",),
    ),
    Code(
        "softcap_overflow",
        "info",
        "mask",
        "S = Q@K^T rounds to inf before a soft cap, which hides it",
        "Soft-capped attention (Gemma-2's eager attention) computes cap x tanh(S x scale / cap) with every step "
        "in the scores' dtype, after S = Q@K^T is rounded to it. A score beyond the dtype's range is inf "
        "before the cap, and the cap turns it into exactly the cap: the logits stay finite, the softmax "
        "breaks nothing, and only S's headroom (the model report's `room`, measured before the cap) shows it. "
        "The severity is what the overflow does, asked of torch itself: info where tanh already rounds to 1 at "
        "the dtype's largest finite S, so the inf gives the same logit, and torch's backward through the cap "
        "gives 1 - tanh^2 = 0 there, the gradient of that saturated finite score (harmless forward and "
        "backward); warning where the cap does not saturate there (those logits become the cap instead of "
        "their true value); error where the backward through the cap gives NaN.",
        "|q.k| >= the dtype's rounding limit before the cap (fp16: 65520), on a call whose capture traced a "
        "tanh between Q@K^T and the softmax; saturation: cap x tanh(finfo.max x scale / cap) == cap in the dtype.",
        "harmless where it is info; else (or to keep the headroom) find why q/k grew so large, or compute Q@K^T "
        "in fp32 "
        "(bf16 or fp32 weights, or upcast q and k before the matmul)",
        Example(
            _SEEDED
            + """\
import attncheck


class SoftCapped(torch.nn.Module):  # as Gemma-2's eager attention
    def forward(self, q, k, v, cap=50.0):
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.0625
        s = torch.tanh(s / cap) * cap
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


q = torch.full((1, 1, 4, 32), 60.0, dtype=torch.float16)  # q.k = 32 x 60 x 60 = 115200 > 65504
k, v = q.clone(), torch.randn(1, 1, 4, 32, generator=g).half()
with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
    SoftCapped()(q, k, v)
result = cap.calls[0].diagnosis
"""
        ),
        severity_note="warning where the cap does not saturate at the dtype's largest S (the logits change); "
        "error where the backward through the cap gives NaN",
        also="warning",
    ),
    Code(
        "sentinel_overflow_on_add",
        "error",
        "mask",
        "adding the mask value to a negative score overflows to -inf",
        "A mask of finfo(dtype).min added to the scores leaves no room below it: a negative score plus the "
        "sentinel is beyond the dtype and rounds to -inf. Where that makes a whole row -inf, the row is NaN; "
        "where keys stay masked either way, nothing breaks yet, and the finding is a warning.",
        "sentinel + s rounds to -inf: sentinel + s <= -(rounding limit). With fp16's finfo.min (-65504), any "
        "score s <= -16.",
        "finfo(dtype).min plus a negative score overflows to -inf: use masked_fill / torch.where with the sentinel "
        "instead of adding it, or a boolean mask",
        Example(
            _TORCH
            + """\
q = torch.ones(1, 1, 4, 64)
k = torch.full((1, 1, 4, 64), -3.0)  # every score is -3 x 64 / sqrt(64) = -24
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value min --dtype fp16 --method torch --brief "
            "--fail-on sentinel_overflow_on_add",
        ),
        severity_note="error where rows became all -inf (NaN); warning where the keys stay masked",
        also="warning",
        causes=("mask_sentinel",),
    ),
    Code(
        "summed_mask_planes",
        "error",
        "mask",
        "two finfo.min mask planes were added together and overflowed",
        "Combining a causal mask and a padding mask by adding two planes of finfo(dtype).min gives -inf where "
        "both mask a key (-65504 + -65504 overflows fp16). A row that both planes mask everywhere is all -inf "
        "and NaN; otherwise the keys stay masked and the finding is a warning. Found in the Q/K pipeline, or "
        "in a float mask that holds -inf next to finite sentinels beyond half its dtype's range.",
        "sentinel_1 + sentinel_2 <= -(rounding limit), e.g. 2 x finfo(fp16).min = -131008 in fp16.",
        "two sentinel planes added together overflow: combine masks with logical and/or (or torch.where), then apply "
        "one sentinel once",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
low = torch.finfo(torch.float16).min
causal = torch.triu(torch.full((4, 4), low), diagonal=1)  # future keys
padding = torch.zeros(4, 4)
padding[:, :2] = low  # two padded keys
torch.save({"q": q, "k": k, "mask": (causal + padding).half()}, "qk.pt")  # -65504 + -65504 = -inf
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --mask qk.pt:mask --dtype fp16 --method torch --brief --fail-on "
            "summed_mask_planes",
        ),
        severity_note="error where rows became all -inf (NaN); warning where the keys stay masked",
        also="warning",
        causes=("mask_sentinel",),
    ),
    Code(
        "mask_leak",
        "warning",
        "mask",
        "masked keys still receive probability",
        "The mask value is too small in magnitude to mask: exp(sentinel - max) is not negligible, so the "
        "float64 softmax itself (no rounding involved) puts probability on keys that should get none.",
        "In float64, the probability on a row's masked keys exceeds 1e-6 (rows where not every key is masked).",
        "the masked keys still receive probability: use -inf, finfo(dtype).min or a boolean mask instead of this small "
        "sentinel",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --causal --mask-value -10 --dtype fp32 --method torch --brief "
            "--fail-on mask_leak",
        ),
    ),
    Code(
        "float_mask_looks_boolean",
        "error",
        "mask",
        "a float mask of 0 and 1 is added to the scores",
        "The mask is a float tensor that holds only 0 and 1: a boolean mask converted with `.float()`. An "
        "additive mask adds +1 to the kept keys and masks nothing.",
        "A float mask whose every value is 0 or 1.",
        "a float mask of 0 and 1 is added to the scores, not applied: pass mask.bool() (True = attend) or an additive "
        "mask of 0 and -inf",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
keep = torch.ones(4, 4).tril()  # 1 = attend, as a float
torch.save({"q": q, "k": k, "mask": keep}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --mask qk.pt:mask --dtype fp32 --method torch --brief --fail-on "
            "float_mask_looks_boolean",
        ),
    ),
    Code(
        "sentinel_not_representable",
        "warning",
        "softmax",
        "a mask value cannot be held by the dtype and becomes -inf",
        "A mask constant such as -1e9 (or finfo(fp32).min) is beyond the dtype's range: cast to fp16 or bf16 it "
        "becomes -inf. Partly masked rows stay masked; rows masked only by it become all -inf, which is NaN in naive, "
        f"stable and torch.softmax. From scores alone, any value <= {SENTINEL_LIMIT_TEXT} that the cast turns into "
        "-inf is read as a sentinel; from Q and K, the mask's values and `--mask-value`.",
        "|sentinel| >= the dtype's rounding limit (fp16: 65520, so -1e9 and -65520 become -inf; -65504 stays).",
        "use a boolean mask (masked_fill(~keep, torch.finfo(dtype).min) or SDPA's bool attn_mask) instead of a "
        "constant the dtype cannot hold",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[:, 4:] = -1e9  # keys masked by adding -1e9
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp16 --method torch --brief --fail-on sentinel_not_representable",
        ),
        severity_note="error where rows became all -inf or NaN; warning where the keys stay masked",
        also="error",
        causes=("mask_sentinel",),
    ),
)

# This group's views of its codes (attncheck.findings.registry joins every group's, and imports this module)
SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}


def attention_findings(diag: TensorDiagnosis, add, cells_with) -> None:
    """Findings of the Q/K -> scores pipeline: overflow of Q@K^T, mask sentinels, leaks (the scale:
    attncheck.findings.scale)."""
    a = diag.attention
    for d, audit in a.dtypes.items():
        dtype_cells = [c for c in diag.cells if c.dtype == d]
        _qk_overflow(diag, d, audit, dtype_cells, add)
        _sentinel_findings(diag, d, audit, dtype_cells, add)
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


def _qk_overflow(diag: TensorDiagnosis, d: str, audit, dtype_cells: list[Cell], add) -> None:
    """qk_overflow in one dtype, with whether scaling q first avoids it and which paths overflow."""
    a = diag.attention
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


def _sentinel_findings(diag: TensorDiagnosis, d: str, audit, dtype_cells: list[Cell], add) -> None:
    """sentinel_not_representable, sentinel_overflow_on_add, summed_mask_planes in one dtype; their severity
    follows the rows the mask broke."""
    a = diag.attention
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


def _values(values: list[float]) -> str:
    return " and ".join(f"{v:.6g}" for v in values)


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
