"""A progress bar on stderr for long runs: work done, rate, time left."""

from __future__ import annotations

import sys
import time

from rich.console import Console

from attncheck.format import visible


class _Stderr:
    """Standard error for the bar, as it was when the bar was made (Rich's live display then sends
    ``sys.stderr`` through itself). The bar only decorates a run, so a write that fails (stderr closed
    with ``2>&-``, a full device) drops the bar's text rather than end the run in a traceback."""

    def __init__(self) -> None:
        self.stream = sys.stderr

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError, AttributeError):
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError, AttributeError):
            return False


class Progress:
    """A progress bar on stderr (units done, rate, time left) that appears only once a
    task has taken longer than ``delay`` seconds, and never when disabled. A task that
    has finished is hidden, so many inputs in a row (run, check) show one bar at a time."""

    def __init__(self, enabled: bool, delay: float = 1.0, force_terminal: bool = False) -> None:
        self.enabled = enabled
        self.delay = delay
        self.force_terminal = force_terminal
        self._progress = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def track(self, name: str, total: int, unit: str = "rows"):
        """A callback that adds to the units done of one task (``diagnose_chunks(progress=...)``
        counts rows of one tensor); None when the bar is off."""
        if not self.enabled:
            return None
        # rich.progress (~21 ms): only when a bar is shown, not for --help or a bad argument
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        start = time.monotonic()
        state = {"done": 0, "task": None}

        def advance(rows: int) -> None:
            state["done"] += rows
            elapsed = time.monotonic() - start
            rate = f"{state['done'] / elapsed:,.{0 if unit == 'rows' else 2}f} {unit}/s" if elapsed > 0 else ""
            if state["task"] is None:
                if elapsed < self.delay:
                    return
                if self._progress is None:
                    self._progress = Progress(
                        TextColumn("{task.description}", markup=False),  # a tensor's name, from its file
                        BarColumn(),
                        MofNCompleteColumn(),
                        TextColumn("{task.fields[unit]}, {task.fields[rate]}"),
                        TimeRemainingColumn(),
                        console=Console(file=_Stderr(), force_terminal=self.force_terminal or None),
                        transient=True,
                    )
                    self._progress.start()
                state["task"] = self._progress.add_task(
                    visible(name), total=total, completed=state["done"], rate=rate, unit=unit
                )
            else:
                self._progress.update(state["task"], completed=state["done"], rate=rate)
            if (
                state["done"] >= total
            ):  # a finished input leaves the screen: one line per live task, however many inputs
                self._progress.update(state["task"], visible=False)

        return advance
