"""The registry of finding codes: every group's entries (attncheck.findings.<group>.CODES) joined in the order of
the reference page, and the views every layer reads (findings, the model report, ``--ignore`` and ``--fail-on``,
``attncheck explain``, the JSON's ``doc`` links; ``docs/reference/findings.md`` is generated from it). Free of
torch. ``attncheck.codes`` re-exports it."""

from __future__ import annotations

import difflib

from attncheck.findings import (
    accuracy,
    activations,
    backward,
    capture,
    distribution,
    fp8,
    hazards,
    inputs,
    kvcache,
    lowsum,
    masking,
    overflow,
    rope,
    scale,
)
from attncheck.findings import sinks as sink_codes
from attncheck.findings import watch as watch_codes
from attncheck.findings.base import Code

GROUP_MODULES = (
    inputs,
    masking,
    scale,
    overflow,
    hazards,
    accuracy,
    sink_codes,
    lowsum,
    fp8,
    distribution,
    activations,
    backward,
    rope,
    capture,
    watch_codes,
    kvcache,
)

# The order of the reference page (and of every view below): by section, in pipeline order within one. A group
# module's codes need not be adjacent here (fused_max is a kernel hazard shown among the softmax's causes).
ORDER = (
    # the scores as given
    "input_nan",
    "inf_input",
    "fully_masked_rows",
    # masks and scale
    "qk_overflow",
    "softcap_overflow",
    "sentinel_overflow_on_add",
    "summed_mask_planes",
    "mask_leak",
    "float_mask_looks_boolean",
    "missing_scale",
    "double_scale",
    "model_scale",
    "scale_mismatch",
    # casts and the softmax
    "sentinel_not_representable",
    "cast_overflow",
    "exp_overflow",
    "fused_max",
    "sum_overflow",
    "underflow",
    "zero_rows",
    "unexplained_nan",
    # accuracy
    "argmax_flip",
    "worse_than_torch",
    # the output
    "output_nan",
    "output_error",
    "tied_max_bias",
    "probability_flush",
    "sinks_ignored",
    "sink_no_effect",
    "lowsum_error",
    "accumulator_overflow",
    # FP8
    "p_cast_underflow",
    "fp8_overflow",
    "fp8_accumulator",
    "fp8_unscaled",
    "p_saturation",
    # distribution
    "entropy_collapse",
    # activations and attention sinks (serving)
    "attention_sink",
    "outlier_channel",
    "massive_activation",
    # backward
    "grad_nan_masked_row",
    "grad_nan_input",
    "grad_nan_forward",
    "grad_overflow",
    "grad_underflow",
    "grad_error",
    "padded_tile",
    "grad_emulation_mismatch",
    # rotary position embeddings
    "rope_precision",
    # capture
    "capture_incomplete",
    # watch
    "logit_growth",
    "headroom_low",
    "nonfinite",
    "rank_divergence",
    "no_attention",
    # serving: the KV cache
    "kv_cache_saturation",
    "kv_cache_error",
)


def _in_order() -> tuple[Code, ...]:
    by_name = {c.name: c for m in GROUP_MODULES for c in m.CODES}
    missing, unlisted = set(ORDER) - set(by_name), set(by_name) - set(ORDER)
    if missing or unlisted or len(by_name) != sum(len(m.CODES) for m in GROUP_MODULES):
        raise RuntimeError(f"finding codes: ORDER lacks {sorted(unlisted)}, no group declares {sorted(missing)}")
    return tuple(by_name[n] for n in ORDER)


CODES: tuple[Code, ...] = _in_order()

REGISTRY: dict[str, Code] = {c.name: c for c in CODES}

# The views every layer reads.
SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}
# The NaN/zero-row causes each finding code stands for: rows whose cause a user ignores
# no longer count for --fail-on nan/zero, nor for a call's verdict.
CAUSES_OF = {c.name: c.causes for c in CODES if c.causes}
# The first causes of NaN/inf gradient rows (results.GRAD_CAUSES) each backward finding code stands for.
GRAD_CAUSES_OF = {c.name: c.grad_causes for c in CODES if c.grad_causes}


FAIL_ON_WORDS = ("nan", "overflow", "zero", "flip", "error", "warning")
WHAT_IF_PREFIX = "what-if:"  # a --fail-on condition on the what-if cells: what-if:nan, what-if:exp_overflow, ...


def valid_fail_on(token: str) -> bool:
    token = token.removeprefix(WHAT_IF_PREFIX)
    return token in FAIL_ON_WORDS or token in SEVERITY


def valid_code(token: str) -> bool:
    """A finding code (what --ignore takes)."""
    return token in SEVERITY


def doc_link(code: str) -> str | None:
    """Where a code's reference page is: 'docs/reference/findings.md#exp_overflow'."""
    entry = REGISTRY.get(code)
    return None if entry is None else entry.doc


def closest_codes(token: str, n: int = 3) -> list[str]:
    """The codes nearest a mistyped one ('exp_overflw' -> exp_overflow), and those that contain it."""
    near = difflib.get_close_matches(token, list(REGISTRY), n=n, cutoff=0.6)
    near += [c for c in REGISTRY if token and token in c and c not in near]
    return near[:n]
