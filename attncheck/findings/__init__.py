"""Results -> findings: every problem gets a stable code, a severity and a one-line fix. No tensors, no torch, no
printing.

One module per group of codes holds the codes' entries (``Code``: severity, meaning, threshold, example, fix), the
thresholds their prose quotes, and their detectors: ``inputs`` (the scores as given), ``masking`` (Q@K^T and mask
sentinels), ``scale``, ``overflow`` (casts and the softmax), ``hazards`` (the kernels' own: fused max, P
saturation, padded tiles, the FP8 accumulator), ``accuracy`` (and the output), ``fp8``, ``distribution``,
``backward``, ``capture`` and ``watch`` (whose detectors are attncheck.watcher.trends). ``base`` holds what they
share, ``registry`` joins their entries in the reference page's order (``attncheck.codes`` re-exports it),
``diagnosis`` runs the detectors over a diagnosis, and ``policy`` applies --ignore and --fail-on.
"""

from __future__ import annotations

from attncheck.findings.accuracy import FLUSH_INFO_FRAC, TIED_BIAS_MIN_ROWS, TIED_BIAS_Z
from attncheck.findings.backward import GRAD_UNDERFLOW_WARN_FRAC, backward_findings
from attncheck.findings.base import SEVERITIES
from attncheck.findings.capture import capture_findings, unrecorded_text
from attncheck.findings.diagnosis import findings_for
from attncheck.findings.distribution import COLLAPSE_WARN_FRAC
from attncheck.findings.fp8 import FP8_UNSCALED_FRAC
from attncheck.findings.hazards import (
    CUDNN_KEY_TILE,
    CUDNN_Q_TILE,
    FP8_ACCUM_RULE,
    LOG2E,
    VLLM_NIAH,
    fused_max_threshold,
)
from attncheck.findings.masking import softcap_findings
from attncheck.findings.policy import (
    OVERFLOW_CODES,
    apply_ignore,
    counted_grad_rows,
    counted_rows,
    counted_verdict,
    failed_by_findings,
    failed_conditions,
    ignored_causes,
)
from attncheck.findings.registry import CAUSES_OF, FIX, SEVERITY
from attncheck.findings.scale import CHOSEN_SCALES
from attncheck.findings.sinks import SINK_NO_EFFECT_ROUNDINGS, sink_findings

__all__ = [
    "CAUSES_OF",
    "CHOSEN_SCALES",
    "COLLAPSE_WARN_FRAC",
    "SINK_NO_EFFECT_ROUNDINGS",
    "CUDNN_KEY_TILE",
    "CUDNN_Q_TILE",
    "FIX",
    "FLUSH_INFO_FRAC",
    "FP8_ACCUM_RULE",
    "FP8_UNSCALED_FRAC",
    "GRAD_UNDERFLOW_WARN_FRAC",
    "LOG2E",
    "OVERFLOW_CODES",
    "SEVERITIES",
    "SEVERITY",
    "TIED_BIAS_MIN_ROWS",
    "TIED_BIAS_Z",
    "VLLM_NIAH",
    "apply_ignore",
    "backward_findings",
    "capture_findings",
    "counted_grad_rows",
    "counted_rows",
    "counted_verdict",
    "failed_by_findings",
    "failed_conditions",
    "findings_for",
    "fused_max_threshold",
    "ignored_causes",
    "sink_findings",
    "softcap_findings",
    "unrecorded_text",
]
