"""What ``attncheck sweep`` is asked to compute: the grid, its distribution and its size.

Free of torch and numpy, so bad values fail in milliseconds, before the heavy
imports. The distributions, the head layout and the memory of a draw are defined in
``attncheck.draws``, below numerics (whose sweep draws with them), and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attncheck import params
from attncheck.draws import (  # noqa: F401  (defined below numerics; re-exported: config.sweep's API)
    DIST_NAMES,
    MEMORY_BUDGET_BYTES,
    OUTLIER_PROB,
    OUTLIER_VAR,
    OUTPUT_ROWS,
    gib,
    head_layout,
    qk_bytes,
)
from attncheck.errors import AttncheckError, param
from attncheck.params import SCALE_NAMES, Scale
from attncheck.registry import dtype_names, method_names, path_names

PRESET_NAMES = ("fa3", "pcast")  # numerics.presets: published figures reproduced


# float64 (rows, seq) tensors alive at once while one grid point is measured:
# unscaled scores, scaled logits, reference, a cell's probabilities in float64,
# their difference, a temporary, plus the low-precision copies (counted as two);
# for the outputs: the Q/K block's float64 scores and reference, a path's scores and P.
_LIVE_ROW_TENSORS = 12
_LIVE_OUT_TENSORS = 3  # float64 (rows, d_k): the reference output, an output, their difference

# The theory takes moments up to std^4 and scale^2 std^4 d_k in float64: within these ranges every
# one is finite and nonzero (std 1e200 overflowed, 1e-300 divided by zero, scale 5e-324 never ended).
STD_RANGE = (1e-30, 1e30)
SCALE_RANGE = (1e-30, 1e30)

DEFAULT_DKS = (16, 32, 64, 128, 256, 512)
DEFAULT_SEQ = 128
DEFAULT_ROWS = 4096
DEFAULT_BLOCK = 32  # a quarter of the default 128 keys, so the tiled method rescales across blocks


def point_bytes(rows: int, seq: int, dk: int, dist: str = "normal") -> int:
    """Peak memory of one grid point: drawing Q and K, then V, the (rows, seq) and the (rows, d_k) working sets."""
    heads, queries = head_layout(rows, seq)
    v = 8 * heads * seq * dk
    return (
        qk_bytes(heads, queries, seq, dk, dist)
        + v
        + 8 * _LIVE_ROW_TENSORS * rows * seq
        + 8 * _LIVE_OUT_TENSORS * rows * dk
    )


# The most score elements (rows x keys, once per cell) a sweep or check computes unless told more
# (--max-work, max_work): the default sweep computes 2.6e8 in a few seconds, this is 8 times that.
# Past it a grid or a synthetic input is refused up front with its estimate, rather than left to run
# for minutes or hours with nothing said.
DEFAULT_MAX_WORK = 2**31


def work_text(n: float) -> str:
    """Score elements for messages: 128, 999,999, 2.15e9."""
    return f"{n:,.0f}" if n < 1e6 else f"{n:.2e}".replace("e+0", "e").replace("e+", "e")


def max_work(value: Any, param_name: str = "max_work", from_text: bool = True) -> int:
    """A limit on score elements: a positive number, '2e9' or '2147483648'."""
    return max(1, int(params.number(value, param_name, positive=True, from_text=from_text)))


@dataclass(frozen=True)
class SweepConfig:
    """One sweep: the grid is dks x scales x seqs x stds, each point run for dtypes x methods.

    Every field is checked on construction (typed values; ``from_text`` parses
    the text a user typed), and errors name the field.
    """

    dks: tuple[int, ...] = DEFAULT_DKS
    scales: tuple[Scale, ...] = tuple(Scale(s) for s in SCALE_NAMES)
    dtypes: tuple[str, ...] = dtype_names()
    methods: tuple[str, ...] = method_names()
    seqs: tuple[int, ...] = (DEFAULT_SEQ,)
    stds: tuple[float, ...] = (1.0,)
    rows: int = DEFAULT_ROWS
    dist: str = "normal"
    seed: int = 0
    block: int = DEFAULT_BLOCK
    device: str = "cpu"
    # attention paths whose output O = P@V is measured (V drawn like q, k); the FP8 paths are --preset fa3's
    paths: tuple[str, ...] = path_names(lambda spec: spec.computes_in(False) and spec.default)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("dks", params.integers(list(self.dks), "dks", 1, from_text=False) if self.dks else _empty("dks"))
        set_("seqs", params.integers(list(self.seqs), "seqs", 2, from_text=False) if self.seqs else _empty("seqs"))
        set_("stds", params.numbers(list(self.stds), "stds", from_text=False) if self.stds else _empty("stds"))
        _in_range(self.stds, STD_RANGE, "stds")
        if not self.scales:
            _empty("scales")
        _in_range([float(s.name) for s in self.scales if s.name not in (*SCALE_NAMES, "auto")], SCALE_RANGE, "scales")
        set_("dtypes", params.dtypes(list(self.dtypes), fp8=False) if self.dtypes else _empty("dtypes"))
        set_("methods", params.methods(list(self.methods)) if self.methods else _empty("methods"))
        params.choice(self.dist, DIST_NAMES, "dist")
        params.integer(self.rows, "rows", 2, from_text=False)
        params.integer(self.seed, "seed", 0, from_text=False)
        params.integer(self.block, "block", 1, from_text=False)
        set_("device", params.device(self.device))
        if isinstance(self.paths, str):
            raise AttncheckError("paths is a tuple of names, e.g. ('flash',)")
        set_("paths", params.paths(list(self.paths), fp8=False) if self.paths else ())
        self.check_memory()

    @classmethod
    def from_text(cls, **text: Any) -> "SweepConfig":
        """A config from the text a user typed per field ('16,64', 'sqrt,0.05', ...);
        fields not given keep their defaults."""
        parse = {
            "dks": lambda v: params.integers(v, "dks", 1),
            "scales": lambda v: params.scales(v, "scales"),
            "dtypes": lambda v: params.dtypes(v, fp8=False),
            "methods": lambda v: params.methods(v),
            "seqs": lambda v: params.integers(v, "seqs", 2),
            "stds": lambda v: params.numbers(v, "stds"),
            "rows": lambda v: params.integer(v, "rows", 2),
            "dist": lambda v: params.choice(v, DIST_NAMES, "dist"),
            "seed": lambda v: params.integer(v, "seed", 0),
            "block": lambda v: params.integer(v, "block", 1),
            "device": lambda v: params.device(v),
            "paths": lambda v: () if v.strip().lower() == "none" else params.paths(v, fp8=False),
        }
        return cls(**{name: parse[name](value) for name, value in text.items() if value is not None})

    def check_memory(self, budget: int = MEMORY_BUDGET_BYTES) -> None:
        """Refuse a grid whose largest point would not fit in ``budget`` bytes."""
        seq, dk = max(self.seqs), max(self.dks)
        need = point_bytes(self.rows, seq, dk, self.dist)
        if need > budget:
            raise AttncheckError(
                f"a sweep point of {self.rows} rows x {seq} keys x d_k {dk} needs about {gib(need)} of memory, "
                f"over the {gib(budget)} budget: lower {param('rows')}, {param('seqs')} or {param('dks')}"
            )

    @property
    def points(self) -> int:
        return len(self.dks) * len(self.scales) * len(self.seqs) * len(self.stds)

    @property
    def cells(self) -> int:
        """Cells per grid point: every method x dtype on the scores, every path x dtype on Q, K and V."""
        return len(self.dtypes) * (len(self.methods) + len(self.paths))

    @property
    def work(self) -> int:
        """Score elements the grid computes: rows x keys at every point, once per cell."""
        return len(self.dks) * len(self.scales) * len(self.stds) * self.rows * sum(self.seqs) * self.cells

    def check_work(self, limit: int = DEFAULT_MAX_WORK) -> None:
        """Refuse, before anything is drawn, a grid of more than ``limit`` score elements."""
        if self.work > limit:
            mean_seq = sum(self.seqs) / len(self.seqs)
            keys = f"{self.seqs[0]} keys" if len(self.seqs) == 1 else f"{mean_seq:g} keys on average"
            raise AttncheckError(
                f"the sweep would compute {work_text(self.work)} score elements ({self.points:,} grid points x "
                f"{self.rows} rows x {keys} x {self.cells} cells), over {param('max_work')} {work_text(limit)}: "
                f"give fewer {param('dks')}, {param('scales')}, {param('seqs')} or {param('stds')} values "
                f"or fewer {param('rows')}, or raise {param('max_work')}"
            )


def _in_range(values, bounds: tuple[float, float], name: str) -> None:
    lo, hi = bounds
    for v in values:
        if not lo <= v <= hi:
            raise AttncheckError(f"must be from {lo:g} to {hi:g} for the sweep's theory, got {v:g}", param=name)


def _empty(name: str):
    raise AttncheckError("is empty", param=name)
