"""``attncheck sweep`` as a library call: a checked ``SweepConfig`` in, a ``SweepResult`` out."""

from __future__ import annotations

import time
from typing import Callable

from attncheck.config.sweep import SweepConfig
from attncheck.results import SweepResult


def run_sweep(config: SweepConfig, progress: Callable[[int, int], None] | None = None) -> SweepResult:
    """Every grid point of ``config``, timed; ``progress(done, total)`` after each point."""
    from attncheck.numerics.sweep import run_sweep as measure

    start = time.perf_counter()
    result = measure(config, progress)
    result.seconds = time.perf_counter() - start
    return result
