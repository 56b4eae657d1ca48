"""The distribution: attention that collapses onto one key in most rows."""

from __future__ import annotations

from attncheck.findings.base import Code, Example, _scores
from attncheck.format import num
from attncheck.params import COLLAPSE_THRESHOLD
from attncheck.results import TensorDiagnosis

COLLAPSE_WARN_FRAC = 0.5  # the share of rows that must collapse (reach COLLAPSE_THRESHOLD) for entropy_collapse

CODES: tuple[Code, ...] = (
    Code(
        "entropy_collapse",
        "warning",
        "distribution",
        "attention is near one-hot in most rows",
        "Most rows of the float64 softmax put nearly all their probability on one key. Unscaled or growing "
        "logits do this; the softmax gradient then vanishes. A head meant to be sharp (a copy or induction "
        "head) is fine. `attncheck watch` raises the same code for a head whose sampled rows collapse during "
        "training.",
        f"At least {COLLAPSE_WARN_FRAC:.0%} of the rows put >= {COLLAPSE_THRESHOLD:g} of their probability on one key "
        "(the reference, float64); in a watch log, --collapse (half) of a head's sampled rows, at the first step it "
        "holds.",
        "attention is near one-hot: check the scores are scaled by 1/sqrt(d_k) and whether the logits grow during "
        "training (attncheck watch: logit_growth); ignore if the head is meant to be sharp",
        Example(
            _scores("""\
scores = np.zeros((4, 8), dtype=np.float32)
scores[:, 0] = 10.0  # every row puts 99.9% on key 0
np.save("scores.npy", scores)
"""),
            "attncheck run scores.npy --dtype fp32 --method torch --brief --fail-on entropy_collapse",
        ),
    ),
)


def collapse_findings(diag: TensorDiagnosis, add) -> None:
    """entropy_collapse: most rows put nearly all their probability on one key."""
    dist = diag.distribution
    if dist.collapsed_frac is not None and dist.collapsed_frac >= COLLAPSE_WARN_FRAC:
        add(
            "entropy_collapse",
            f"{dist.collapsed_frac:.0%} of rows put >= {dist.collapse_threshold:g} of their probability on one key "
            f"(mean entropy {num(dist.entropy_mean, 4)} nats, normalised {num(dist.entropy_norm_mean, 4)})",
            rows=dist.collapsed_rows,
        )
