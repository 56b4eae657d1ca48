"""The scale the scores carry against 1/sqrt(d_k): missing, applied twice, the model's own, or (from a scores
file) fitted to another choice."""

from __future__ import annotations

import math

from attncheck.findings.base import _SEEDED, Code, Example

SCALE_MIN_D = 4  # the scale codes judge head dims from this one up (where d_k^(1/4) >= 1.41)
SCALE_FIT_TOLERANCE = 0.05  # |ln(fitted / (1/sqrt(d_head)))| beyond this is another scale (5%), not noise

# Where a captured call's scale came from, when it is the model's own choice (AttentionAudit.scale_source).
CHOSEN_SCALES = {
    "argument": "the scale= argument the model passed to SDPA",
    "traced": "the scale the model's code applies, as the capture traced it",
    "module": "the scaling attribute of the model's attention module",
}

CODES: tuple[Code, ...] = (
    Code(
        "missing_scale",
        "warning",
        "mask",
        "the scores are not scaled by 1/sqrt(d_k)",
        "The scale the scores carry is far above 1/sqrt(d_k): Var(q.k) grows as d_k, so unscaled logits "
        "collapse attention onto one key, kill the softmax gradient and overflow fp16 sooner. The scale is the "
        "one applied (`--scale`), or with a scores file and `--q/--k` the one fitted by least squares. A scale "
        "the model chose itself is not this finding but `model_scale` (info).",
        f"ratio = scale x sqrt(d_k) > d_k^(1/4), i.e. scale > d_k^(-1/4) (d_k >= {SCALE_MIN_D}). Judged from the "
        "scale, not from the spread of the scores, which low-rank q/k, outlier channels or RoPE move.",
        "the scores are not scaled by 1/sqrt(d_k): divide by sqrt(d_k) (SDPA's default scale), or check the scale your "
        "model applies",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 16, 64, generator=g), torch.randn(1, 1, 16, 64, generator=g)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --scale none --dtype fp32 --method torch --brief --fail-on "
            "missing_scale",
        ),
    ),
    Code(
        "double_scale",
        "warning",
        "mask",
        "the scores are scaled about twice by 1/sqrt(d_k)",
        "The scale the scores carry is near 1/d_k: q was divided by sqrt(d_k) and the scores again (or SDPA's "
        "default scale on pre-scaled q). Attention flattens towards uniform. A scale the model chose itself is "
        "not this finding but `model_scale` (info).",
        f"ratio = scale x sqrt(d_k) < d_k^(-1/4), i.e. scale < d_k^(-3/4) (d_k >= {SCALE_MIN_D}).",
        "the scores are scaled about twice by 1/sqrt(d_k): apply it once (SDPA scales by default; don't pre-scale q as "
        "well)",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 1, 16, 64, generator=g), torch.randn(1, 1, 16, 64, generator=g)
torch.save({"q": q, "k": k}, "qk.pt")
""",
            "attncheck run --q qk.pt:q --k qk.pt:k --scale dk --dtype fp32 --method torch --brief --fail-on "
            "double_scale",
        ),
    ),
    Code(
        "model_scale",
        "info",
        "mask",
        "the model applies its own scale, not 1/sqrt(d_k)",
        "A captured call whose scale the model chose itself: SDPA's `scale=` argument, the factor its code "
        "applies (traced by `attncheck capture` through multiplications, divisions and a soft cap), or the "
        "`scaling` attribute of its attention module. The model was trained with that scale, so it is a fact, "
        "not a fault: T5 passes scale=1 because it folds 1/sqrt(d_k) into its weights' initialisation; Gemma-2 "
        "scales by 1/sqrt(query_pre_attn_scalar) whatever its head size.",
        "Said where missing_scale or double_scale would be: ratio = scale x sqrt(d_k) > d_k^(1/4) or < d_k^(-1/4) "
        f"(d_k >= {SCALE_MIN_D}), for a scale the model chose.",
        "nothing to change: the model was trained with this scale (dividing T5's scores by sqrt(d_k) would change "
        "the model); "
        "reproduce it exactly when porting the model to another kernel (SDPA's scale=)",
        Example(
            _SEEDED
            + """\
import torch.nn.functional as F

import attncheck


class T5Attention(torch.nn.Module):  # T5 folds 1/sqrt(d_k) into its weights' initialisation
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)


q, k, v = (torch.randn(1, 2, 8, 64, generator=g) / 8 for _ in range(3))
with attncheck.capture(diagnose=True) as cap:
    T5Attention()(q, k, v)
result = cap.calls[0].diagnosis
"""
        ),
    ),
    Code(
        "scale_mismatch",
        "warning",
        "mask",
        "the scale a scores file carries is not 1/sqrt(d_head)",
        "With a scores file and the q and k that made it, attncheck fits the scale that maps q.k onto the "
        "scores and names the closest usual choice: 1/sqrt(d_head), 1, 1/sqrt(d_model) = 1/sqrt(heads x "
        "d_head), 1/d_head. Dividing by sqrt(d_model) instead of sqrt(d_head) is the usual slip.",
        "The least-squares scale s; reported when the closest choice (in |ln(s / choice)|) is not 1/sqrt(d_head), or "
        f"|ln(s sqrt(d_head))| > {SCALE_FIT_TOLERANCE:g}. Not reported where missing_scale or double_scale already is.",
        "the scale your scores carry is not 1/sqrt(d_head): check which dimension the model divides by",
        Example(
            _SEEDED
            + """\
q, k = torch.randn(1, 4, 16, 64, generator=g), torch.randn(1, 4, 16, 64, generator=g)
scores = q @ k.transpose(-1, -2) / (4 * 64) ** 0.5  # divided by sqrt(d_model), not sqrt(d_head)
torch.save({"q": q, "k": k, "scores": scores}, "qk.pt")
""",
            "attncheck run qk.pt --key scores --q qk.pt:q --k qk.pt:k --dtype fp32 --method torch --brief --fail-on "
            "scale_mismatch",
        ),
    ),
)


def scale_findings(a, add) -> None:
    """missing_scale, double_scale, model_scale, and scale_mismatch where none of them is said."""
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
        if (
            a.fitted_scale <= 0
            or name != "1/sqrt(d_head)"
            or abs(math.log(a.fitted_scale / value)) > SCALE_FIT_TOLERANCE
        ):
            add(
                "scale_mismatch",
                f"the scores are q.k times {a.fitted_scale:.4g} (least squares), closest to {name} = {value:.4g}; "
                f"1/sqrt(d_head) = {1 / math.sqrt(a.d):.4g} (d_head {a.d}, {a.heads} heads)",
            )


def _scale_findings(a, add) -> bool:
    """missing_scale / double_scale (True when one was added) from the scale the scores carry: q.k times the
    scale applied (the fitted one when the scores were given), against 1/sqrt(d). Not from
    the spread of the scores against that of q and k, which only i.i.d. entries tie to the
    scale: low-rank q/k, outlier channels, RoPE or many exact zeros move it far from 1."""
    if a.d < SCALE_MIN_D:
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
