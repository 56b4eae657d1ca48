"""What every group of finding codes shares: the ``Code`` entry each group module declares for its codes (its
severity, the NaN/zero-row causes it stands for, and the text of its reference page: what it means, the threshold
or formula behind it, a minimal example that triggers it (tests run every example) and its fix), the sections of
the reference page, the examples' preambles, and the helpers the detectors use to name cells and example rows.
Free of torch; imports nothing of the package but the results and params."""

from __future__ import annotations

from dataclasses import dataclass

from attncheck.params import MASK_SENTINEL_LIMIT
from attncheck.results import Cell, TensorDiagnosis

SEVERITIES = ("error", "warning", "info")

# Where each code's reference page is, relative to the project; the site serves it at
# reference/findings/#CODE.
REFERENCE_PAGE = "docs/reference/findings.md"

# The sentinel limit as the prose writes it: -1e4
SENTINEL_LIMIT_TEXT = f"{MASK_SENTINEL_LIMIT:.0e}".replace("e+0", "e")


@dataclass(frozen=True)
class Example:
    """A minimal input that triggers a code. ``python`` writes input files into the current
    directory and ``command`` diagnoses them (its ``--fail-on CODE`` exits 1 because the code is
    reported); or, without a command, ``python`` runs attncheck as a library and leaves the
    diagnosis in ``result``."""

    python: str
    command: str = ""


@dataclass(frozen=True)
class Code:
    name: str
    severity: str  # the usual severity; ``severity_note`` says when it differs
    group: str  # the section of the reference page
    summary: str  # one line
    meaning: str
    threshold: str
    fix: str
    example: Example
    severity_note: str = ""  # when it takes the other severity, ``also``
    also: str = ""
    causes: tuple[str, ...] = ()  # first causes of NaN/zero rows it stands for (--ignore leaves those rows out)
    grad_causes: tuple[str, ...] = ()  # first causes of NaN/inf gradient rows it stands for

    @property
    def severities(self) -> str:
        """'error', or 'error or warning' for a code whose severity follows its effect."""
        return f"{self.severity} or {self.also}" if self.also else self.severity

    @property
    def doc(self) -> str:
        return f"{REFERENCE_PAGE}#{self.name}"


GROUPS = {
    "input": "The scores as given",
    "mask": "Masks and scale (from Q and K)",
    "softmax": "Casts and the softmax",
    "accuracy": "Accuracy",
    "output": "The output O = P@V",
    "fp8": "FP8",
    "distribution": "The distribution",
    "activations": "Activations and attention sinks",
    "backward": "The backward pass",
    "rope": "Rotary position embeddings (RoPE)",
    "watch": "Watching a training run (attncheck watch)",
    "capture": "The capture itself",
    "serving": "Serving: the KV cache (what-ifs)",
}

_TORCH = "import torch\n\n"
_SEEDED = _TORCH + "g = torch.Generator().manual_seed(0)\n"


def _scores(body: str) -> str:
    return "import numpy as np\n\n" + body


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


def out_nan_rows(c: Cell, ignore=()) -> int:
    """A cell's NaN/inf output rows whose P is finite (the softmax's NaN rows count as ``nan_rows``), 0 where
    output_nan is ignored."""
    if "output_nan" in ignore:
        return 0
    return sum(n for cause, n in c.out_nan_causes.items() if cause != "softmax")
