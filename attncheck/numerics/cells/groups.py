"""The random groups of a bounded diagnosis (``numerics.bounded``), fed by the diagnosis's one pass over its rows.

The rows computed are the exact ones and the sample, the sample ordered group by group; each block of rows lies in
one segment of the query axis (``inputs.scores.score_blocks`` with cuts). A block of a group's segment feeds that
group's cells and distribution beside the whole diagnosis's, with the same chunk: a sampled row is computed once.
The accumulators' sums are exact and their maxima order-free, so each group's figures are those of the group
diagnosed on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from attncheck.numerics.cells.accumulate import CellAcc, DistAcc
from attncheck.results import Cell, Distribution


@dataclass
class GroupFigures:
    """One group's cells (in the whole diagnosis's order) and the reference's distribution over its rows."""

    cells: list[Cell]
    distribution: Distribution


class GroupTaps:
    """Accumulators of ``count`` groups: the rows of query segment ``first + g`` are group g's; the segments before
    ``first`` (the rows computed because no bound certifies them) feed the whole diagnosis alone."""

    def __init__(self, count: int, first: int = 1) -> None:
        self.count, self.first = count, first
        self.accs: list[dict[object, CellAcc]] = []
        self.dists: list[DistAcc] = []
        self.figures: list[GroupFigures] = []

    def start(self, make_accs: Callable[[], dict], make_dist: Callable[[], DistAcc]) -> None:
        self.accs = [make_accs() for _ in range(self.count)]
        self.dists = [make_dist() for _ in range(self.count)]

    def of(self, block) -> tuple[dict, DistAcc] | None:
        """The accumulators the block's rows also feed: its group's, or None."""
        g = getattr(block, "segment", None)
        if g is None or not self.first <= g < self.first + self.count:
            return None
        return self.accs[g - self.first], self.dists[g - self.first]

    def finish(self, plan, lead: tuple[int, ...]) -> None:
        """Each group's figures (``figures``), its cells named as the whole diagnosis's (a setting's variant)."""
        self.figures = []
        for accs, dist in zip(self.accs, self.dists):
            cells = []
            for key in plan:
                cell = accs[key].finish(lead)
                cell.variant = key.setting.label if key.setting is not None else cell.variant
                cells.append(cell)
            self.figures.append(GroupFigures(cells, dist.finish()))
