"""The capture itself: a capture that did not record every attention call the script made."""

from __future__ import annotations

from attncheck.findings.base import Code, Example
from attncheck.results import Finding

CODES: tuple[Code, ...] = (
    Code(
        "capture_incomplete",
        "warning",
        "capture",
        "the capture did not record every attention call the script made",
        "Recording stopped before the script ended (--max-bytes or --max-calls would have been passed, or a "
        "call could not be written), or the script failed: the calls judged are only those recorded, and "
        "nothing is known of the rest, where the problem may sit. The finding names the first call not "
        "recorded and why.",
        "Any call (or a call's gradients) not recorded once recording stopped, or a script that failed while "
        "captured; reported once per capture (per rank under torchrun).",
        "raise --max-bytes or --max-calls, or record fewer calls (--module, --forward, --no-grads); "
        "--ignore capture_incomplete where the first calls are enough",
        Example(
            """\
import torch
import torch.nn.functional as F

import attncheck

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))  # 12 KiB per call
with attncheck.capture("cap", max_bytes=40_000):  # room for three calls of four
    for layer in range(4):
        F.scaled_dot_product_attention(q, k, v)
""",
            "attncheck run cap --brief --fail-on capture_incomplete",
        ),
    ),
)

# This group's views of its codes (attncheck.findings.registry joins every group's, and imports this module)
SEVERITY = {c.name: c.severity for c in CODES}
FIX = {c.name: c.fix for c in CODES}


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
