"""``attncheck sweep`` as a library call: a checked ``SweepConfig`` in, a ``SweepResult`` out."""

from __future__ import annotations

import time
from typing import Callable

from attncheck.config.sweep import SweepConfig
from attncheck.results import PresetResult, SweepResult


def run_sweep(config: SweepConfig, progress: Callable[[int, int], None] | None = None) -> SweepResult:
    """Every grid point of ``config``, timed; ``progress(done, total)`` after each point."""
    # imports torch: pipelines.sweep is torch-free, so 'attncheck sweep' checks its config first
    from attncheck.numerics.sweep.grid import run_sweep as measure

    start = time.perf_counter()
    result = measure(config, progress)
    result.seconds = time.perf_counter() - start
    return result


def run_preset(
    name: str, seed: int = 0, device: str = "cpu", progress: Callable[[int, int], None] | None = None
) -> PresetResult:
    """A preset of ``numerics.presets``: published figures next to attncheck's own;
    ``progress(done, total)`` after each of its steps."""
    # imports torch: pipelines.sweep is torch-free, so 'attncheck sweep' checks its config first
    from attncheck.devices import resolve_device
    from attncheck.numerics.sweep.presets import PRESET_STEPS, PRESETS

    total, done = PRESET_STEPS[name], [0]

    def step() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    return PRESETS[name](seed=seed, device=resolve_device(device), step=step)
