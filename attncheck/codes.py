"""The finding codes, as every layer imports them: the registry (attncheck.findings.registry), whose entries live
beside their detectors and thresholds, one module per group (attncheck.findings.<group>). Each ``Code`` holds its
severity, the NaN/zero-row causes it stands for, and the text of its reference page: what it means, the threshold
or formula behind it, a minimal example that triggers it (tests run every example) and its fix;
``docs/reference/findings.md`` is generated from the registry. Free of torch."""

from __future__ import annotations

from attncheck.findings.base import GROUPS, REFERENCE_PAGE, SEVERITIES, Code, Example
from attncheck.findings.registry import (
    CAUSES_OF,
    CODES,
    FAIL_ON_WORDS,
    FIX,
    GRAD_CAUSES_OF,
    REGISTRY,
    SEVERITY,
    WHAT_IF_PREFIX,
    closest_codes,
    doc_link,
    valid_code,
    valid_fail_on,
)

__all__ = [
    "CAUSES_OF",
    "CODES",
    "FAIL_ON_WORDS",
    "FIX",
    "GRAD_CAUSES_OF",
    "GROUPS",
    "REFERENCE_PAGE",
    "REGISTRY",
    "SEVERITIES",
    "SEVERITY",
    "WHAT_IF_PREFIX",
    "Code",
    "Example",
    "closest_codes",
    "doc_link",
    "valid_code",
    "valid_fail_on",
]
