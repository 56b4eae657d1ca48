"""The finding codes: each one's severity, its fix, and the NaN/zero-row causes it stands for.

The one registry of codes every layer reads (findings, the model report, ``--ignore`` and
``--fail-on``); free of torch, importing nothing of the package but the results' constants.
"""

from __future__ import annotations

from attncheck.results import UNEXPLAINED

SEVERITIES = ("error", "warning", "info")

FIX = {
    "input_nan": "the NaN is already in the scores: trace it upstream (Q, K, the mask, an earlier layer); no softmax can repair it",
    "inf_input": "the scores hold +inf (softmax gives inf - inf = NaN): find where they overflow, e.g. Q@K^T in fp16 without 1/sqrt(d_k); scale q first or compute scores in fp32",
    "fully_masked_rows": "a query that may attend to nothing has no softmax: zero such rows (torch.where(keep.any(-1, keepdim=True), p, 0)) and drop them from the loss, or use a kernel that returns zeros (FlashAttention, SDPA >= 2.5); even then their backward pass can poison gradients if a NaN reaches it",
    "qk_overflow": "scale q by 1/sqrt(d) before the matmul (--scale-order q shows the effect), compute Q@K^T in fp32, or find why q/k grew (no normalisation, exploding activations)",
    "sentinel_overflow_on_add": "finfo(dtype).min plus a negative score overflows to -inf: use masked_fill / torch.where with the sentinel instead of adding it, or a boolean mask",
    "summed_mask_planes": "two sentinel planes added together overflow: combine masks with logical and/or (or torch.where), then apply one sentinel once",
    "mask_leak": "the masked keys still receive probability: use -inf, finfo(dtype).min or a boolean mask instead of this small sentinel",
    "float_mask_looks_boolean": "a float mask of 0 and 1 is added to the scores, not applied: pass mask.bool() (True = attend) or an additive mask of 0 and -inf",
    "missing_scale": "the scores are not scaled by 1/sqrt(d_k): divide by sqrt(d_k) (SDPA's default scale), or check the scale your model applies",
    "double_scale": "the scores are scaled about twice by 1/sqrt(d_k): apply it once (SDPA scales by default; don't pre-scale q as well)",
    "scale_mismatch": "the scale your scores carry is not 1/sqrt(d_head): check which dimension the model divides by",
    "sentinel_not_representable": "use a boolean mask (masked_fill(~keep, torch.finfo(dtype).min) or SDPA's bool attn_mask) instead of a constant the dtype cannot hold",
    "cast_overflow": "upcast to fp32 before the softmax, or keep the logits in range (scale by 1/sqrt(d_k), clamp)",
    "exp_overflow": "subtract the row max before exp (stable softmax, torch.softmax), or upcast to fp32 before the softmax",
    "sum_overflow": "the row sum exceeds the dtype's range: subtract the row max before exp (the sum is then at most the number of keys), or keep the sum and the division in fp32 (torch.softmax does)",
    "underflow": "subtract the row max before exp: then the largest term is exp(0) = 1 and the sum cannot be 0",
    "zero_rows": "these rows lost all probability mass: subtract the row max and accumulate in fp32",
    "unexplained_nan": "NaN with no cause attributable by attncheck: please report it with the dump",
    "argmax_flip": "the most likely key changes against float64: upcast the softmax to fp32 where decisions depend on the top key",
    "worse_than_torch": "this kernel loses more accuracy than torch.softmax in the same dtype: keep the max and sum in fp32 and round only the result (smaller key blocks keep P_j closer to the final max)",
    "output_error": "this attention path's output is further from float64 than FlashAttention's test allows (2x the same-dtype PyTorch attention): keep S and the softmax in fp32 and round P only for P@V, or use SDPA",
    "tied_max_bias": "a bias does not average out over steps (Qiu and Yao 2025, arXiv 2510.04212): when the row max repeats, subtract a slightly larger max (their fix: m = beta * max for a positive max) so that no exp(s - m) is exactly 1, or keep O in fp32 where the next layer reads it",
    "probability_flush": "small probabilities round to 0 in this dtype; harmless for most models, upcast if those keys matter",
    "p_cast_underflow": "scale P by S = 256 before the cast (FlashAttention-3's max offset of 8; 448 for SageAttention) and visit the key blocks in reverse order (--order reverse, as FlashAttention-3 does), so that an attention sink in the first block sets the running max last (arXiv 2606.06521)",
    "fp8_overflow": "scale before the FP8 cast: x8 = fp8(x / descale) with descale = amax / max_fp8 per tensor or per (batch, kv head) (--fp8-scaling; FlashAttention-3's q_descale/k_descale/v_descale), or clamp; a kernel's satfinite cast clips silently and a non-saturating cast (older torch, the fnuz formats) gives NaN",
    "fp8_unscaled": "quantise with a descale (amax / max_fp8) per tensor or per (batch, kv head) and pass it to the kernel (FlashAttention-3: q_descale, k_descale, v_descale; vLLM: the layer's k_scale/v_scale); --fp8-scaling tensor or head shows the effect",
    "entropy_collapse": "attention is near one-hot: check the scores are scaled by 1/sqrt(d_k); ignore if the head is meant to be sharp",
    "grad_nan_masked_row": "a query row with every key masked by -inf has a NaN softmax, and its backward is NaN even when the row's output is zeroed or left out of the loss: use SDPA (its kernels and _safe_softmax give such rows zeros and zero gradients), mask with a finite value (torch.finfo(dtype).min), or let padded queries attend to one key (e.g. themselves)",
    "grad_nan_input": "the NaN or inf is already in the output gradient dO: it comes from a later layer or the loss; trace it downstream (a loss scale that overflows, a NaN loss)",
    "grad_nan_forward": "the forward pass already gave NaN probabilities in these rows; fix the forward finding (its cause is named) and the gradients follow",
    "grad_overflow": "lower the loss scale (GradScaler's init_scale, or let it back off), hold dP and dS in fp32 (SDPA's math path, FlashAttention) instead of fp16 eager attention, or train in bf16",
    "grad_underflow": "gradient entries flush to zero in this dtype: use a loss scale (torch.amp.GradScaler) or bf16; if the softmax is collapsed (near one-hot rows), its Jacobian vanishes: check the scale and the logit growth",
    "grad_error": "this path's gradients are further from float64 than FlashAttention's test allows (2x plain attention in the same dtype): keep dP and dS in fp32 and round only for the products, as FlashAttention does",
    "grad_emulation_mismatch": "attncheck's emulation of this kernel's backward does not reproduce the gradients the model really produced: the backward numbers of this call cannot be trusted; please report it with the capture",
    "logit_growth": "the attention logits grow geometrically, as before divergence at a high learning rate: normalise q and k (qk-layernorm, Dehghani et al. 2023; Wortsman et al. 2023), lower the learning rate or clip the logits (QK-clip, soft-capping)",
    "entropy_collapse": "most rows of this head put nearly all their weight on one key: its softmax Jacobian vanishes and so does the gradient through it; check the logit growth, the scale, qk-layernorm",
    "headroom_low": "at this growth the head's logits reach the first failure of its dtype within the horizon: act on the growth (qk-layernorm, learning rate, clipping) or hold the scores in a wider dtype",
    "nonfinite": "NaN or inf in the attention output or its gradients: capture the step (attncheck capture, or attncheck.capture around it) to find the call, the head and the cause",
}

SEVERITY = {
    "input_nan": "error",
    "inf_input": "error",
    "fully_masked_rows": "warning",
    "qk_overflow": "error",
    "sentinel_overflow_on_add": "error",
    "summed_mask_planes": "error",
    "mask_leak": "warning",
    "float_mask_looks_boolean": "error",
    "missing_scale": "warning",
    "double_scale": "warning",
    "scale_mismatch": "warning",
    "sentinel_not_representable": "warning",
    "cast_overflow": "error",
    "exp_overflow": "error",
    "sum_overflow": "error",
    "underflow": "error",
    "zero_rows": "error",
    "unexplained_nan": "error",
    "argmax_flip": "warning",
    "worse_than_torch": "info",
    "output_error": "warning",
    "tied_max_bias": "warning",
    "probability_flush": "info",
    "p_cast_underflow": "warning",
    "fp8_overflow": "error",
    "fp8_unscaled": "warning",
    "entropy_collapse": "warning",
    "grad_nan_masked_row": "error",
    "grad_nan_input": "error",
    "grad_nan_forward": "error",
    "grad_overflow": "error",
    "grad_underflow": "warning",
    "grad_error": "warning",
    "grad_emulation_mismatch": "error",
    "logit_growth": "warning",
    "entropy_collapse": "warning",
    "headroom_low": "warning",
    "nonfinite": "error",
}


# The NaN/zero-row causes each finding code stands for: rows whose cause a user ignores
# no longer count for --fail-on nan/zero, nor for a call's verdict.
CAUSES_OF = {
    "input_nan": ("input_nan",),
    "inf_input": ("inf_input",),
    "fully_masked_rows": ("fully_masked",),
    "qk_overflow": ("qk_overflow",),
    "sentinel_overflow_on_add": ("mask_sentinel",),
    "summed_mask_planes": ("mask_sentinel",),
    "cast_overflow": ("cast_overflow",),
    "exp_overflow": ("exp_overflow",),
    "sum_overflow": ("sum_overflow",),
    "sentinel_not_representable": ("mask_sentinel",),
    "underflow": ("underflow",),
    "unexplained_nan": (UNEXPLAINED,),
}


# The first causes of NaN/inf gradient rows (results.GRAD_CAUSES) each backward finding code stands for.
GRAD_CAUSES_OF = {
    "grad_nan_masked_row": ("fully_masked",),
    "grad_nan_input": ("grad_out_nan",),
    "grad_nan_forward": ("input_nan", "inf_input", "qk_overflow", "forward_nan"),
    "grad_overflow": ("grad_out_overflow", "dp_overflow", "ds_nan", "ds_overflow", "grad_overflow"),
}


FAIL_ON_WORDS = ("nan", "overflow", "zero", "flip", "error", "warning")
WHAT_IF_PREFIX = "what-if:"  # a --fail-on condition on the what-if cells: what-if:nan, what-if:exp_overflow, ...


def valid_fail_on(token: str) -> bool:
    token = token.removeprefix(WHAT_IF_PREFIX)
    return token in FAIL_ON_WORDS or token in SEVERITY


def valid_code(token: str) -> bool:
    """A finding code (what --ignore takes)."""
    return token in SEVERITY
